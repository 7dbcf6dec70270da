"""Bytes a bandwidth-optimal collective moves per rank: the one formula that both the runtime ledger
(`orangetron.comm`) and the planner use, so a measured step and a predicted step compare record by record.

The payload is the tensor a caller hands in or gets back. For all-gather and reduce-scatter it is the
full (gathered, pre-scatter) tensor. Ring algorithms move (n-1)/n of it out of every rank; all-reduce is
a reduce-scatter followed by an all-gather. Nothing here models what a backend library does internally.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # Every rank owns exactly 1/n of the full tensor, so full_bytes is a multiple of n in practice;
    # integer arithmetic keeps ledger and model bit-identical.
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
    """(sent, received): reduce-scatter then all-gather, 2(n-1)/n of the tensor each way."""
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


def broadcast_bytes(tensor_bytes: int, group_size: int, is_root: bool) -> tuple[int, int]:
    """(sent, received): the root sends the tensor once (a pipelined chain); the others receive it."""
    if group_size == 1:
        return 0, 0
    return (tensor_bytes, 0) if is_root else (0, tensor_bytes)


def reduce_bytes(tensor_bytes: int, group_size: int, is_root: bool) -> tuple[int, int]:
    """(sent, received): the mirror of `broadcast_bytes`; each non-root forwards one partial sum."""
    if group_size == 1:
        return 0, 0
    return (0, tensor_bytes) if is_root else (tensor_bytes, 0)
