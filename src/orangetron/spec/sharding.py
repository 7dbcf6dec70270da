"""How a flat buffer, a bucket, a token range or a sequence splits over ranks: the formulas the runtime and the
planner share."""

from __future__ import annotations

import functools

import numpy as np

from orangetron.spec import rules
from orangetron.spec.layout import LayoutError


def shard_numel(numel: int, shards: int) -> int:
    """Elements each rank owns: the buffer is padded so that every rank owns the same count."""
    return -(-numel // shards)


def padded_numel(numel: int, shards: int) -> int:
    """Length of the flat buffer once padded to a multiple of `shards`."""
    return shard_numel(numel, shards) * shards


def bucket_layout(numel: int, bucket_numel: int, shards: int) -> tuple[int, int]:
    """(count, elements each) of the equal gradient buckets a sharded flat buffer is cut into.

    Every bucket is a multiple of `shards` (each rank owns one equal slice of each) and at most `bucket_numel`
    rounded up to one. The padding (under `shards` elements per bucket) lies at the end of the last bucket, so
    the parameters stay one contiguous run. With `bucket_numel` 0 the whole buffer is one bucket.
    """
    if bucket_numel <= 0 or numel == 0:
        return 1, padded_numel(numel, shards)
    count = -(-numel // padded_numel(bucket_numel, shards))
    return count, padded_numel(-(-numel // count), shards)


def sequence_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """The multiple a sequence must be: 2*cp head-tail chunks under context parallelism, each split over tp
    under SP."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel and tp > 1 else 1)


def cp_padded_len(seq_len: int, cp: int, tp: int, sequence_parallel: bool) -> int:
    """The length a sequence runs at: under context parallelism padded at its end to `sequence_multiple`
    (ignored labels), as the trainer pads it; without it as given (train refuses what SP cannot split)."""
    if cp == 1:
        return seq_len
    multiple = sequence_multiple(cp, tp, sequence_parallel)
    return -(-seq_len // multiple) * multiple


def token_chunks(tokens: int, chunks: int) -> list[int]:
    """Tokens per overlap chunk: `chunks` contiguous ranges, the first `tokens % chunks` one token longer."""
    base, extra = divmod(tokens, chunks)
    return [base + (c < extra) for c in range(chunks)]


def head_tail_runs(seq_len: int, cp: int, rank: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of cp rank `rank`'s head-tail shard (`orangetron/parallel/context/sharding.py`): chunk r,
    then 2*cp-1-r."""
    if not 0 <= rank < cp:
        raise LayoutError(f"cp_rank={rank}: must lie in [0, cp={cp})")
    if cp == 1:
        return ((0, seq_len),)
    rules.cp_splits_sequence(cp, seq_len)
    chunk = seq_len // (2 * cp)
    head, tail = rank * chunk, (2 * cp - 1 - rank) * chunk
    return ((head, head + chunk), (tail, tail + chunk))


def document_runs(seq_len: int, cp: int, rank: int, cuts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Runs of cp rank `rank` under the balanced sharding of packed documents: every segment between
    consecutive `cuts` (the increasing global positions where some row's document begins, 0 first) is cut
    into 2*cp slots, and rank r keeps slots cp-1-r and cp+r of each, in increasing order (`balanced_runs`)."""
    if not 0 <= rank < cp:
        raise LayoutError(f"cp_rank={rank}: must lie in [0, cp={cp})")
    start, stop, rank_of = balanced_runs(seq_len, cp, cuts)
    mine = rank_of == rank
    return tuple(zip(start[mine].tolist(), stop[mine].tolist(), strict=True))


@functools.lru_cache(maxsize=64)  # each rank's `document_runs`, and each ring member's, read one batch's at once
def balanced_runs(seq_len: int, cp: int, cuts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every cp rank's runs under the balanced sharding of packed documents (`document_runs`), rank by rank,
    each rank's in increasing order, as arrays: (start, stop, rank) of each run.

    Head-tail within each document gives every rank the same visible pairs of that document, wherever it
    lies. The slots are mirrored (rank 0 holds the middle ones) so that a ring block, which visits ranks
    r+1, r+2, ... first, meets first the ranks that see its tail slots, and can leave them behind once they
    are served (`orangetron/parallel/context/ring.py`). A segment not divisible by 2*cp gives its remainder
    tokens one each to the slots after the previous segment's last; the sequence is divisible by 2*cp, so
    every slot ends with the same total and every rank with seq_len / cp tokens. A rank's two slots of a
    segment that touch (nothing between them) are one run; runs of two segments never are: a ring trims by
    document."""
    if cp == 1:
        return np.array([0]), np.array([seq_len]), np.array([0])  # rank 0 holds everything
    rules.cp_splits_sequence(cp, seq_len)
    increasing = all(a < b for a, b in zip(cuts, cuts[1:], strict=False))
    if not cuts or cuts[0] != 0 or not increasing or cuts[-1] >= seq_len:
        raise LayoutError(f"cuts {cuts[:8]}{'...' if len(cuts) > 8 else ''}: must start at 0 and increase "
                          f"below seq_len={seq_len}")
    bounds = _slot_bounds(seq_len, cp, np.asarray(cuts, dtype=np.int64))  # [segments, 2*cp + 1]
    ranks = np.arange(cp)
    head, tail = cp - 1 - ranks, cp + ranks
    head_start, head_stop = bounds[:, head].T, bounds[:, head + 1].T  # each [ranks, segments]
    tail_start, tail_stop = bounds[:, tail].T, bounds[:, tail + 1].T
    touching = head_stop == tail_start
    # Per rank and segment, a first run and a second one: (head, tail), or (head and tail joined, nothing)
    start = np.stack((head_start, np.where(touching, tail_stop, tail_start)), axis=-1)
    stop = np.stack((np.where(touching, tail_stop, head_stop), tail_stop), axis=-1)
    rank_of = np.broadcast_to(ranks[:, None, None], start.shape)
    kept = stop > start
    runs = start[kept], stop[kept], rank_of[kept]
    for array in runs:
        array.flags.writeable = False  # cached: shared by every caller
    return runs


def _slot_bounds(seq_len: int, cp: int, cuts: np.ndarray) -> np.ndarray:
    """[segments, 2*cp + 1]: where each slot of each segment begins, and the segment's end last. A segment's
    remainder tokens go one each to the slots after those the previous segments' remainders ended at."""
    slots = 2 * cp
    base, extra = np.divmod(np.diff(cuts, append=seq_len), slots)
    first = np.concatenate(([0], np.cumsum(extra)[:-1])) % slots  # the slot this segment's remainder starts at
    sizes = base[:, None] + ((np.arange(slots) - first[:, None]) % slots < extra[:, None])
    return cuts[:, None] + np.concatenate((np.zeros((cuts.size, 1), dtype=np.int64), sizes.cumsum(axis=1)), axis=1)


def shard_runs(seq_len: int, cp: int, rank: int, cuts: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """Runs of cp rank `rank`: its head-tail shard (`cuts` None, one sequence) or its balanced share of packed
    documents cut at `cuts` (`document_runs`)."""
    if cuts is None:
        return head_tail_runs(seq_len, cp, rank)
    return document_runs(seq_len, cp, rank, cuts)
