"""Bytes a bandwidth-optimal collective moves per rank: the one formula that both the runtime ledger
(`orangetron.comm`) and the planner use, so a measured step and a predicted step compare record by record.

The payload is the tensor a caller hands in or gets back. For all-gather and reduce-scatter it is the
full (gathered, pre-scatter) tensor. Nothing here models what a backend library does internally; each
function states the algorithm it models, and over a whole group the bytes sent equal the bytes received.

- all-gather, reduce-scatter: a ring; every rank moves (n-1)/n of the payload each way.
- all-reduce: a ring reduce-scatter followed by a ring all-gather, 2(n-1)/n of the payload each way.
- all-to-all: direct sends; the rows addressed to, and arriving from, other ranks.
- send/recv: the tensors themselves.
- broadcast, reduce: a pipelined chain over the members in order from the root (root, root+1, ...,
  wrapping around). Broadcast: every member but the last forwards the tensor once, every member but the
  root receives it once, so the busiest link carries T bytes whatever n is. Reduce is its mirror: partial
  sums flow down the chain towards the root.

Integer rule. Payloads need not divide by n (an all-reduce of 5 float32 over 3 ranks), and a real ring
then gives ranks chunks that differ by an element; the ledger records one per-rank figure, rounded down:
a ring phase moves `(n-1) * T // n` bytes, and an all-reduce moves twice that, `2 * ((n-1) * T // n)`,
not `2 * (n-1) * T // n`. Rounding each phase keeps docs/runtime.md's identity "an all-reduce moves exactly as
much as a reduce-scatter plus an all-gather" true to the byte, which the data-parallel tables (DDP against
ZeRO) compare; the other rule would make DDP cost up to one byte more than ZeRO for the same tensor.
Integer arithmetic keeps ledger and model bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv", "broadcast", "reduce")


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen from one rank."""

    op: str  # one of OPS
    dim: str  # mesh dimension name: tp, cp, pp, dp, ep, edp, dp_cp, tp_cp, ...
    payload_bytes: int
    bytes_sent: int
    bytes_received: int

    @property
    def key(self) -> str:
        return f"{self.op}/{self.dim}"


def _ring_share(full_bytes: int, group_size: int) -> int:
    # Rounded down (the module docstring's integer rule): one ring phase, (n-1)/n of the payload.
    return full_bytes * (group_size - 1) // group_size


def all_gather_bytes(full_bytes: int, group_size: int) -> tuple[int, int]:
    """(sent, received) for an all-gather whose gathered tensor has `full_bytes`."""
    share = _ring_share(full_bytes, group_size)
    return share, share


def reduce_scatter_bytes(full_bytes: int, group_size: int) -> tuple[int, int]:
    """(sent, received) for a reduce-scatter whose input (before scattering) has `full_bytes`."""
    share = _ring_share(full_bytes, group_size)
    return share, share


def all_reduce_bytes(full_bytes: int, group_size: int) -> tuple[int, int]:
    """(sent, received): reduce-scatter then all-gather, each phase rounded down: 2 * ((n-1) * T // n)."""
    share = 2 * _ring_share(full_bytes, group_size)
    return share, share


def all_to_all_bytes(send_bytes_per_rank: list[int], recv_bytes_per_rank: list[int], rank: int) -> tuple[int, int]:
    """(sent, received): the rows addressed to, and arriving from, ranks other than `rank`."""
    sent = sum(b for peer, b in enumerate(send_bytes_per_rank) if peer != rank)
    received = sum(b for peer, b in enumerate(recv_bytes_per_rank) if peer != rank)
    return sent, received


def send_recv_bytes(sent_tensor_bytes: int, received_tensor_bytes: int) -> tuple[int, int]:
    """(sent, received) for a point-to-point exchange: the tensors themselves."""
    return sent_tensor_bytes, received_tensor_bytes


def _chain_position(rank: int, root: int, group_size: int) -> int:
    if not (0 <= rank < group_size and 0 <= root < group_size):
        raise ValueError(f"rank={rank}, root={root}: both must be member indices in [0, {group_size})")
    return (rank - root) % group_size


def broadcast_bytes(tensor_bytes: int, group_size: int, rank: int, root: int) -> tuple[int, int]:
    """(sent, received) of member `rank` in a pipelined chain from `root`: root, root+1, ... (mod n).

    Every member but the last in the chain sends the tensor once; every member but the root receives it.
    """
    position = _chain_position(rank, root, group_size)
    sent = tensor_bytes if position < group_size - 1 else 0
    received = tensor_bytes if position > 0 else 0
    return sent, received


def reduce_bytes(tensor_bytes: int, group_size: int, rank: int, root: int) -> tuple[int, int]:
    """(sent, received): the mirror of `broadcast_bytes`; partial sums flow down the chain to `root`."""
    sent, received = broadcast_bytes(tensor_bytes, group_size, rank, root)
    return received, sent


# ---- records the cost model predicts -------------------------------------------------------------------
_GATHER_BYTES = {"all_gather": all_gather_bytes, "reduce_scatter": reduce_scatter_bytes,
                 "all_reduce": all_reduce_bytes}


def gather_record(op: str, dim: str, full: int, n: int) -> CommRecord:
    """The record of an all-gather, reduce-scatter or all-reduce of `full` bytes over `n` ranks."""
    return CommRecord(op, dim, full, *_GATHER_BYTES[op](full, n))


@lru_cache(maxsize=16384)
def all_to_all_record(dim: str, payload: int, n: int) -> CommRecord:
    """The record of a balanced all-to-all of `payload` bytes over `n` ranks: equal rows to every rank."""
    per_peer = payload // n
    sent, received = all_to_all_bytes([per_peer] * n, [per_peer] * n, 0)
    return CommRecord("all_to_all", dim, payload, sent, received)


def send_recv_records(dim: str, payload: int, count: int) -> list[CommRecord]:
    """`count` point-to-point hops of `payload` bytes each (one record object, repeated)."""
    return [CommRecord("send_recv", dim, payload, *send_recv_bytes(payload, payload))] * count
