"""Replay point-to-point calls under the rules of a backend that matches them in posting order.

NCCL ignores tags: between two ranks, the k-th send one posts meets the k-th receive the other posts. A rank's
calls run in posting order, one batch (`dist.batch_isend_irecv`) at a time; a call posted alone is a batch of
one, and blocks its rank until its peer reaches the matching call. Within a batch every call is under way at
once, and the batch is done when each call has met its match. `replay` runs every rank's batches under these
rules and reports where they stall; `orangetron.comm.trace_p2p` records what a run posted
(`tests/test_pipeline_p2p.py` replays the pipeline executor's transfers).

Pure Python: calls are any objects with `batch`, `op` ("send"/"recv"), `peer`, `tag` and `nbytes`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any


class RendezvousError(RuntimeError):
    """The calls cannot all complete in posting order, or a send meets a receive it does not match."""


def _batches(calls: Sequence[Any]) -> list[list[Any]]:
    batches: dict[int, list[Any]] = defaultdict(list)
    for call in calls:
        batches[call.batch].append(call)
    return [batches[b] for b in sorted(batches)]


def _numbered(ranks: list[list[list[Any]]]) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, id of a call) -> (ordinal among that rank's calls to the same peer in the same direction, batch)."""
    seen: dict[tuple[int, str, int], int] = defaultdict(int)
    where = {}
    for rank, batches in enumerate(ranks):
        for b, batch in enumerate(batches):
            for call in batch:
                key = (rank, call.op, call.peer)
                where[(rank, id(call))] = (seen[key], b)
                seen[key] += 1
    return where


def replay(calls_by_rank: Sequence[Sequence[Any]]) -> None:
    """Run every rank's recorded calls to the end; RendezvousError names the stalled calls or the mismatch."""
    ranks = [_batches(calls) for calls in calls_by_rank]
    where = _numbered(ranks)
    matches = {}  # (rank, op, peer, ordinal) -> the call
    for rank, batches in enumerate(ranks):
        for batch in batches:
            for call in batch:
                matches[(rank, call.op, call.peer, where[(rank, id(call))][0])] = call
    current = [0] * len(ranks)
    while True:
        done = [r for r in range(len(ranks)) if current[r] < len(ranks[r])
                and all(_met(r, c, ranks, current, where, matches) for c in ranks[r][current[r]])]
        if not done:
            break
        for r in done:
            current[r] += 1
    stalled = [(r, ranks[r][current[r]]) for r in range(len(ranks)) if current[r] < len(ranks[r])]
    if stalled:
        raise RendezvousError("stalled: " + "; ".join(
            f"rank {r} batch {current[r]}: " + ", ".join(f"{c.op} peer {c.peer} tag {c.tag}" for c in batch)
            for r, batch in stalled))


def _met(rank: int, call: Any, ranks: list, current: list[int], where: dict, matches: dict) -> bool:
    """Whether `call` meets its match: the peer's call of the same ordinal, posted in the peer's batch now under
    way or in one the peer has finished (their batches then ran together)."""
    ordinal, _batch = where[(rank, id(call))]
    other_op = "recv" if call.op == "send" else "send"
    peer = call.peer
    match = matches.get((peer, other_op, rank, ordinal))
    if match is None:
        raise RendezvousError(f"rank {rank}'s {call.op} #{ordinal} to peer {peer} (tag {call.tag}) has no match")
    if (match.tag, match.nbytes) != (call.tag, call.nbytes):
        raise RendezvousError(f"rank {rank}'s {call.op} #{ordinal} with peer {peer} meets tag {match.tag} of "
                              f"{match.nbytes} bytes, posted as tag {call.tag} of {call.nbytes} bytes")
    peer_batch = where[(peer, id(match))][1]
    return peer_batch <= current[peer]
