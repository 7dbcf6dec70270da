"""Packed documents in the cost model: the attention work and the ring traffic of the busiest cp rank.

A job with `doc_lengths` packs those documents into sequences of `seq` tokens, in order, repeated until they
fill a micro-batch; a document cut by a sequence's end starts again at 0 in the next. A micro-batch is
`micro_batch` consecutive sequences, whose rows have boundaries of their own. The runtime shards a micro-batch's
sequence in balance at every row's document starts (`orangetron/spec/sharding.py`, `document_runs`), and its
ring passes a run of keys on only while a member it has still to visit sees some of it in some row
(`orangetron/parallel/context/ring.py`). Both are priced here from the same sharding, each as the mean over the
micro-batches of the busiest rank. A job may instead name its micro-batches' documents (`Job.doc_batches`): the
end-of-run table prices a run's last step so, from the documents it trained on (`orangetron/train/accounting.py`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator

from orangetron.plan.compute import ATTN_BLOCK
from orangetron.spec.options import Job
from orangetron.spec.sharding import shard_runs

Piece = tuple[int, int]
Row = tuple[Piece, ...]  # one sequence's document pieces, [start, stop) in order from 0 to its length
Batch = tuple[Row, ...]  # the rows of one micro-batch: the runtime shards them together
Transfer = tuple[float, float]  # tokens of K,V (sent, received)


def _window_runs(doc_lengths: tuple[int, ...], seq: int, fill: int) -> Iterator[tuple[Row, int]]:
    """The whole sequences of `seq` tokens the documents pack into, in order, as (pieces, how many in a row),
    the lengths repeated until they fill `fill` sequences. The sequences inside one long document come at once,
    so a length costs the same however long it is."""
    repeats = max(1, -(-fill * seq // sum(doc_lengths)))
    current: list[Piece] = []
    at = 0
    for length in doc_lengths * repeats:
        while length:
            if at == 0 and length >= seq:  # whole sequences of this document alone
                yield ((0, seq),), length // seq
                length %= seq
                continue
            take = min(length, seq - at)
            current.append((at, at + take))
            at, length = at + take, length - take
            if at == seq:
                yield tuple(current), 1
                current, at = [], 0


def windows(doc_lengths: tuple[int, ...], seq: int) -> list[tuple[Row, int]]:
    """The distinct lists of the documents' [start, stop) pieces in the whole sequences of `seq` tokens they pack
    into (at least one), each with how many sequences hold it, in order of first appearance."""
    counts: dict[Row, int] = {}
    for row, repeat in _window_runs(doc_lengths, seq, 1):
        counts[row] = counts.get(row, 0) + repeat
    return list(counts.items())


@functools.lru_cache(maxsize=64)  # the planner prices one job's documents again for each candidate it weighs
def batches(doc_lengths: tuple[int, ...], seq: int, rows: int) -> tuple[tuple[Batch, int], ...]:
    """The distinct micro-batches of `rows` consecutive sequences the documents pack into, each with how many
    there are (a last one short of `rows` sequences left out): a micro-batch's rows have boundaries of their own,
    and the runtime shards them at all of them (`document_runs`)."""
    counts: dict[Batch, int] = {}
    current: list[Row] = []
    for row, repeat in _window_runs(doc_lengths, seq, rows):
        take = min(repeat, rows - len(current)) if current else 0  # complete the open micro-batch first
        current += [row] * take
        if current and len(current) == rows:
            counts[tuple(current)] = counts.get(tuple(current), 0) + 1
            current = []
        whole, left = divmod(repeat - take, rows)
        if whole:
            counts[(row,) * rows] = counts.get((row,) * rows, 0) + whole
        current += [row] * left
    return tuple(counts.items())


def priced_batches(job: Job, rows: int | None = None) -> tuple[tuple[Batch, int], ...]:
    """The micro-batches a packed job is priced on, each with its weight: the job's own (`doc_batches`), else its
    `doc_lengths` packed in order, `rows` (default `micro_batch`) consecutive sequences a micro-batch."""
    if job.doc_batches:
        return tuple((batch, 1) for batch in job.doc_batches)
    return batches(job.doc_lengths, job.seq_len, job.micro_batch if rows is None else rows)


@functools.lru_cache(maxsize=64)  # model FLOPs are counted again for each candidate the planner weighs
def document_square_keys(priced: tuple[tuple[Batch, int], ...], seq: int) -> float:
    """Keys per query when each document piece counts all its own keys (the s x s convention of model FLOPs, per
    document): the mean over the tokens of the length of the piece that holds each."""
    squares = tokens = 0
    for batch, count in priced:
        squares += count * sum((b - a) ** 2 for row in batch for a, b in row)
        tokens += count * seq * len(batch)
    return squares / tokens


def _cuts(batch: Batch) -> tuple[int, ...]:
    """Where a document of some row begins, increasing: where the runtime cuts the micro-batch's sequence."""
    return tuple(sorted({a for row in batch for a, _ in row}))


def _rank_runs(batch: Batch, seq: int, cp: int) -> list[tuple[tuple[int, int], ...]]:
    """Each rank's runs, none across any row's document start (one rank: the segments between them)."""
    cuts = _cuts(batch)
    if cp == 1:
        return [tuple(zip(cuts, (*cuts[1:], seq), strict=True))]
    return [shard_runs(seq, cp, r, cuts) for r in range(cp)]


def _piece_finder(batch: Batch):
    """(row index, position) -> the piece of that row holding the position (each row's starts listed once)."""
    starts = [[a for a, _ in row] for row in batch]
    return lambda r, position: batch[r][bisect.bisect_right(starts[r], position) - 1]


def piece_keys(a: int, b: int, lo: int, hi: int) -> float:
    """Keys the queries in [lo, hi) of a document piece [a, b) are computed against: each sees the piece's
    keys up to itself, and the diagonal block of at most ATTN_BLOCK keys is computed whole."""
    x, y = max(a, lo), min(b, hi)
    if x >= y:
        return 0.0
    n = y - x
    return n * (x - a) + n * (n + 1) / 2 + n * (min(b - a, ATTN_BLOCK) - 1) / 2


@functools.lru_cache(maxsize=64)  # the planner prices one job's documents again for each candidate it weighs
def document_keys(priced: tuple[tuple[Batch, int], ...], seq: int, cp: int) -> float:
    """Keys a query of the busiest cp rank is computed against on average, whole diagonal blocks included: a
    query sees the earlier keys of its own document, and the step waits for the rank with the most."""
    busiest, sequences = 0.0, 0
    for batch, count in priced:
        piece_of = _piece_finder(batch)
        per_rank = [sum(piece_keys(*piece_of(r, lo), lo, hi) for r in range(len(batch)) for lo, hi in runs)
                    for runs in _rank_runs(batch, seq, cp)]
        busiest += count * max(per_rank)
        sequences += count * len(batch)
    return busiest / sequences / (seq // cp)


@functools.lru_cache(maxsize=64)
def ring_steps(priced: tuple[tuple[Batch, int], ...], seq: int, cp: int,
               u: int = 1) -> tuple[tuple[Transfer, ...], ...]:
    """Per ring member, per transfer of one ring pass (after steps 0 .. members-2): (tokens of K,V it sends,
    tokens it receives) of every row of a micro-batch at once (a run travels for all of them), mean over the
    micro-batches. A member is one cp rank, or under USP the `u` consecutive ranks of a Ulysses group, holding
    their tokens in rank order. Block j is at member j+s after s steps; a run of its keys goes on while a member it
    has still to visit sees some of it (holds, in some row, a token of the run's document there at or after the
    run's start)."""
    members = cp // u
    batches_priced = sum(count for _, count in priced)
    steps = [[(0.0, 0.0)] * (members - 1) for _ in range(members)]
    for batch, count in priced:
        reach, share = _reach(batch, seq, cp, u), count / batches_priced
        for member in range(members):
            for step in range(members - 1):
                sent = sum(n for n, far in reach[(member - step) % members] if far > step)
                got = sum(n for n, far in reach[(member - 1 - step) % members] if far > step)
                before = steps[member][step]
                steps[member][step] = (before[0] + sent * share, before[1] + got * share)
    return tuple(tuple(member) for member in steps)


def _reach(batch: Batch, seq: int, cp: int, u: int) -> list[list[tuple[int, int]]]:
    """Per member, each of its runs as (tokens, how many hops its block carries it: the last member that sees
    it)."""
    ranks = _rank_runs(batch, seq, cp)
    runs = [tuple(run for rank in ranks[m * u:(m + 1) * u] for run in rank) for m in range(cp // u)]
    piece_of, rows = _piece_finder(batch), range(len(batch))
    last = [{} for _ in runs]  # per member: its last position in each (row, piece) it holds
    for member, held in enumerate(runs):
        for lo, hi in held:
            for r in rows:
                piece = (r, piece_of(r, lo))
                last[member][piece] = max(last[member].get(piece, -1), hi - 1)
    reach, members = [], len(runs)
    for owner, held in enumerate(runs):
        mine = []
        for lo, hi in held:
            pieces = [(r, piece_of(r, lo)) for r in rows]
            seen = [hop for hop in range(1, members)
                    if any(last[(owner + hop) % members].get(piece, -1) >= lo for piece in pieces)]
            mine.append((hi - lo, max(seen, default=0)))
        reach.append(mine)
    return reach


def ring_received_tokens(priced: tuple[tuple[Batch, int], ...], seq: int, cp: int, u: int = 1) -> list[float]:
    """Tokens of K,V each ring member receives in one pass of the ring (`ring_steps`)."""
    return [sum(got for _, got in member) for member in ring_steps(priced, seq, cp, u)]
