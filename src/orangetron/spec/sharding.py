"""How a flat buffer, a bucket, a token range or a sequence splits over ranks: the formulas the runtime and the
planner share."""

from __future__ import annotations

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
    into 2*cp slots, and rank r keeps slots cp-1-r and cp+r of each, in increasing order.

    Head-tail within each document gives every rank the same visible pairs of that document, wherever it
    lies. The slots are mirrored (rank 0 holds the middle ones) so that a ring block, which visits ranks
    r+1, r+2, ... first, meets first the ranks that see its tail slots, and can leave them behind once they
    are served (`orangetron/parallel/context/ring.py`). A segment not divisible by 2*cp gives its remainder
    tokens one each to the slots after the previous segment's last; the sequence is divisible by 2*cp, so
    every slot ends with the same total and every rank with seq_len / cp tokens. One pass over the segments.
    """
    if not 0 <= rank < cp:
        raise LayoutError(f"cp_rank={rank}: must lie in [0, cp={cp})")
    if cp == 1:
        return ((0, seq_len),)
    rules.cp_splits_sequence(cp, seq_len)
    increasing = all(a < b for a, b in zip(cuts, cuts[1:], strict=False))
    if not cuts or cuts[0] != 0 or not increasing or cuts[-1] >= seq_len:
        raise LayoutError(f"cuts {cuts[:8]}{'...' if len(cuts) > 8 else ''}: must start at 0 and increase "
                          f"below seq_len={seq_len}")
    slots, first = 2 * cp, 0
    mine = (cp - 1 - rank, cp + rank)
    runs: list[tuple[int, int]] = []
    for start, stop in zip(cuts, (*cuts[1:], seq_len), strict=True):
        base, extra = divmod(stop - start, slots)
        pieces = []
        for slot in mine:
            begin = start + slot * base + _extras_before(slot, first, extra, slots)
            pieces.append((begin, begin + base + (1 if (slot - first) % slots < extra else 0)))
        runs.extend(_joined(pieces))  # within a document only: a ring trims by document
        first = (first + extra) % slots
    return tuple(runs)


def _extras_before(slot: int, first: int, extra: int, slots: int) -> int:
    """How many of the slots before `slot` take one of `extra` remainder tokens, given to slots first,
    first+1, ... (mod slots)."""
    end = first + extra
    if end <= slots:
        return max(0, min(slot, end) - first)
    return max(0, slot - first) + min(slot, end - slots)


def shard_runs(seq_len: int, cp: int, rank: int, cuts: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """Runs of cp rank `rank`: its head-tail shard (`cuts` None, one sequence) or its balanced share of packed
    documents cut at `cuts` (`document_runs`)."""
    if cuts is None:
        return head_tail_runs(seq_len, cp, rank)
    return document_runs(seq_len, cp, rank, cuts)


def _joined(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty pieces, in order, touching ones joined."""
    joined: list[tuple[int, int]] = []
    for start, stop in pieces:
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop)
        elif stop > start:
            joined.append((start, stop))
    return joined
