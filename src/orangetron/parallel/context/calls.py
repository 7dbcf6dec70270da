"""Which fused-kernel calls a block of queries against a block of keys needs, from their global positions.

The fused kernels (`orangetron/model/attention.py`) know two masks: none, and causal over queries and keys
that hold the same contiguous increasing range. A cp block rarely looks like that: a head-tail shard holds
two distant chunks, tokens gathered in rank order (all-gather, Ulysses, USP's ring members) are not even
increasing. So a block's tokens are described as runs, [start, stop) ranges of global positions in tensor
order; both sides are put in increasing order (a permutation of whole runs) and the block is cut into calls
that are each honest: for every run of queries, the keys before it (no mask) and the keys of the same
range (causal); keys after it are never called. Adjacent unmasked calls over the same keys are joined, so
a head-tail ring step is one call and a whole sequence in order is one causal call.

With packed documents (`starts`, the global position where each document begins) a query sees only the keys
of its own document: each query run is cut further at document starts, its unmasked call reaches back only to
its document's start, and a piece that sees nothing is skipped, so no call computes a masked pair.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from orangetron.model.attention import Runs, coalesce_runs
from orangetron.model.documents import Documents
from orangetron.spec.sharding import document_runs, head_tail_runs, shard_runs

__all__ = ["Call", "cuts_of", "document_runs", "head_tail_runs", "plan", "shard_runs", "slice_runs", "sort_runs",
           "spec_runs", "take_rows", "total"]


@dataclass(frozen=True)
class Call:
    """One kernel call: query rows and key columns of the sorted block, and whether it is causal."""

    rows: slice
    cols: slice
    causal: bool


def cuts_of(documents: Documents | None) -> tuple[int, ...] | None:
    """The cuts of the sharding a batch with `documents` takes: None (head-tail) for unpacked rows."""
    return None if documents is None else documents.cuts


def spec_runs(spec: tuple) -> Runs:
    """Runs of (seq_len, cp, rank[, cuts]): that rank's shard (`shard_runs`), or every rank's in rank order
    (rank None)."""
    seq_len, cp, rank, *rest = spec
    cuts = rest[0] if rest else None
    ranks = range(cp) if rank is None else (rank,)
    return tuple(run for j in ranks for run in shard_runs(seq_len, cp, j, cuts))


def total(runs: Runs) -> int:
    return sum(stop - start for start, stop in runs)


def sort_runs(runs: Runs) -> tuple[Runs, tuple[tuple[int, int], ...] | None]:
    """(the runs in increasing order, touching ones joined; the tensor rows [start, stop) to take in that order,
    or None when they are in order already)."""
    offsets = [0]
    for start, stop in runs:
        offsets.append(offsets[-1] + stop - start)
    order = sorted(range(len(runs)), key=lambda i: runs[i][0])
    if order == list(range(len(runs))):
        return coalesce_runs(runs), None
    return coalesce_runs(tuple(runs[i] for i in order)), tuple((offsets[i], offsets[i + 1]) for i in order)


def take_rows(segments: tuple[tuple[int, int], ...] | None, device: torch.device) -> torch.Tensor | None:
    """The index of `sort_runs`'s row segments as one tensor on `device` (None stays None)."""
    if segments is None:
        return None
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in segments])


def slice_runs(runs: Runs, rows: slice) -> Runs:
    """Runs of the tensor rows [rows.start, rows.stop) of a tensor laid out as `runs`."""
    found, offset = [], 0
    for start, stop in runs:
        lo, hi = max(rows.start - offset, 0), min(rows.stop - offset, stop - start)
        if lo < hi:
            found.append((start + lo, start + hi))
        offset += stop - start
    return tuple(found)


def plan(q_runs: Runs, k_runs: Runs, causal: bool, starts: tuple[int, ...] | None = None) -> list[Call]:
    """Honest kernel calls covering every visible (query, key) pair once; both runs increasing. `starts`: the
    increasing global positions where packed documents begin (None: one document); needs `causal`."""
    everything = Call(slice(0, total(q_runs)), slice(0, total(k_runs)), False)
    if not causal:
        if starts is not None:
            raise ValueError("packed documents need causal attention")
        return [everything]
    calls, row = [], 0
    for start, stop, first in _pieces(q_runs, starts):
        rows = slice(row, row + stop - start)
        row = rows.stop
        # Sorted keys: those of the document before the piece are one range, those before `first` a prefix.
        lo, before = _keys_below(k_runs, first), _keys_below(k_runs, start)
        if before > lo:
            calls.append(Call(rows, slice(lo, before), False))
        inside = _keys_below(k_runs, stop) - before
        if inside == stop - start:  # distinct positions: exactly this run's range
            calls.append(Call(rows, slice(before, stop - start + before), True))
        elif inside:
            raise ValueError(f"keys {k_runs} hold part of the query run [{start}, {stop}): no kernel call fits")
    return _join(calls)


def _pieces(runs: Runs, starts: tuple[int, ...] | None) -> list[tuple[int, int, int]]:
    """The runs cut at document starts, as (start, stop, where the piece's document begins)."""
    if starts is None:
        return [(start, stop, 0) for start, stop in runs]
    pieces = []
    for start, stop in runs:
        at = bisect.bisect_right(starts, start) - 1  # the document holding `start`
        while start < stop:
            end = min(stop, starts[at + 1]) if at + 1 < len(starts) else stop
            pieces.append((start, end, starts[at]))
            start, at = end, at + 1
    return pieces


def _keys_below(runs: Runs, position: int) -> int:
    return sum(max(0, min(stop, position) - start) for start, stop in runs)


def _join(calls: list[Call]) -> list[Call]:
    joined: list[Call] = []
    for call in calls:
        last = joined[-1] if joined else None
        if last and not (last.causal or call.causal) and last.cols == call.cols and last.rows.stop == call.rows.start:
            joined[-1] = Call(slice(last.rows.start, call.rows.stop), call.cols, False)
        else:
            joined.append(call)
    return joined
