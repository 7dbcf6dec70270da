"""Packed documents in the cost model: the attention work and the ring traffic of the busiest cp rank.

A job with `doc_lengths` packs those documents into sequences of its data's tokens, in order, repeated until they
fill a micro-batch; a document cut by a sequence's end starts again at 0 in the next, and a sequence padded under
cp ends with its padding, a document of its own. A micro-batch is `micro_batch` consecutive sequences, whose rows
have boundaries of their own. The runtime shards a micro-batch's
sequence in balance at every row's document starts (`orangetron/spec/sharding.py`, `balanced_runs`), and its
ring passes a run of keys on only while a member it has still to visit sees some of it in some row
(`orangetron/parallel/context/ring.py`). Both are priced here from the same sharding, each as the mean over the
micro-batches of the busiest rank. A job may instead name its micro-batches' documents (`Job.doc_batches`): the
end-of-run table prices a run's last step so, from the documents it trained on (`orangetron/train/accounting.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from orangetron.plan.compute import ATTN_BLOCK
from orangetron.spec.keys import hash_fields_once
from orangetron.spec.options import Job
from orangetron.spec.sharding import balanced_runs

Piece = tuple[int, int]
Row = tuple[Piece, ...]  # one sequence's document pieces, [start, stop) in order from 0 to its length
Batch = tuple[Row, ...]  # the rows of one micro-batch: the runtime shards them together
Transfer = tuple[float, float]  # tokens of K,V (sent, received)


@dataclass(frozen=True)
class Priced:
    """The micro-batches a packed job is priced on, each with how many there are (its weight). It keys the
    caches below, hashed once (`orangetron/spec/keys.py`): it holds every piece of every document."""

    batches: tuple[tuple[Batch, int], ...]

    __hash__ = hash_fields_once

    def __iter__(self) -> Iterator[tuple[Batch, int]]:
        return iter(self.batches)


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
def batches(doc_lengths: tuple[int, ...], seq: int, rows: int, padded: int = 0) -> Priced:
    """The distinct micro-batches of `rows` consecutive sequences the documents pack into, each with how many
    there are (a last one short of `rows` sequences left out): a micro-batch's rows have boundaries of their own,
    and the runtime shards them at all of them (`document_runs`). A sequence padded to `padded` tokens (under
    cp) ends with its padding, a document of its own (`train/step.py`, `padded_documents`)."""
    counts: dict[Batch, int] = {}
    current: list[Row] = []
    padding = ((seq, padded),) if padded > seq else ()
    for pieces, repeat in _window_runs(doc_lengths, seq, rows):
        row = pieces + padding
        take = min(repeat, rows - len(current)) if current else 0  # complete the open micro-batch first
        current += [row] * take
        if current and len(current) == rows:
            counts[tuple(current)] = counts.get(tuple(current), 0) + 1
            current = []
        whole, left = divmod(repeat - take, rows)
        if whole:
            counts[(row,) * rows] = counts.get((row,) * rows, 0) + whole
        current += [row] * left
    return Priced(tuple(counts.items()))


def priced_batches(job: Job, rows: int | None = None) -> Priced:
    """The micro-batches a packed job is priced on, each with its weight: the job's own (`doc_batches`), else its
    `doc_lengths` packed in order, `rows` (default `micro_batch`) consecutive sequences a micro-batch."""
    if job.doc_batches:
        return Priced(tuple((batch, 1) for batch in job.doc_batches))
    return batches(job.doc_lengths, job.data_tokens, job.micro_batch if rows is None else rows, job.seq_len)


@functools.lru_cache(maxsize=64)  # model FLOPs are counted again for each candidate the planner weighs
def document_square_keys(priced: Priced, seq: int) -> float:
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


@functools.lru_cache(maxsize=4096)  # document_keys and ring_steps shard each micro-batch alike
def _rank_runs(batch: Batch, seq: int, cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's runs, none across any row's document start (one rank: the segments between them), rank by
    rank in order, as arrays: (start, stop, rank) of each run."""
    if cp > 1:
        return balanced_runs(seq, cp, _cuts(batch))
    cuts = np.array(_cuts(batch), dtype=np.int64)
    runs = (cuts, np.append(cuts[1:], seq), np.zeros_like(cuts))
    for array in runs:
        array.flags.writeable = False  # cached: shared by every caller
    return runs


def _row_pieces(batch: Batch, position: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row, the (start, stop) of its piece holding each of `position` (each row's starts listed once)."""
    found = []
    for row in batch:
        starts, stops = (np.array(ends, dtype=np.int64) for ends in zip(*row, strict=True))
        at = np.searchsorted(starts, position, side="right") - 1
        found.append((starts[at], stops[at]))
    return found


def piece_keys(a: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Keys the queries in [lo, hi) of a document piece [a, b) are computed against, element by element: each
    sees the piece's keys up to itself, and the diagonal block of at most ATTN_BLOCK keys is computed whole."""
    x, y = np.maximum(a, lo), np.minimum(b, hi)
    n = np.maximum(y - x, 0)
    return n * (x - a) + n * (n + 1) / 2 + n * (np.minimum(b - a, ATTN_BLOCK) - 1) / 2


@functools.lru_cache(maxsize=64)  # the planner prices one job's documents again for each candidate it weighs
def document_keys(priced: Priced, seq: int, cp: int) -> float:
    """Keys a query of the busiest cp rank is computed against on average, whole diagonal blocks included: a
    query sees the earlier keys of its own document, and the step waits for the rank with the most."""
    busiest, sequences = 0.0, 0
    for batch, count in priced:
        lo, hi, rank_of = _rank_runs(batch, seq, cp)
        keys = sum(piece_keys(a, b, lo, hi) for a, b in _row_pieces(batch, lo))
        per_rank = np.bincount(rank_of, weights=keys, minlength=cp)
        busiest += count * float(max(per_rank))
        sequences += count * len(batch)
    return busiest / sequences / (seq // cp)


@functools.lru_cache(maxsize=64)
def ring_steps(priced: Priced, seq: int, cp: int,
               u: int = 1) -> tuple[tuple[Transfer, ...], ...]:
    """Per ring member, per transfer of one ring pass (after steps 0 .. members-2): (tokens of K,V it sends,
    tokens it receives) of every row of a micro-batch at once (a run travels for all of them), mean over the
    micro-batches. A member is one cp rank, or under USP the `u` consecutive ranks of a Ulysses group, holding
    their tokens in rank order. Block j is at member j+s after s steps; a run of its keys goes on while a member it
    has still to visit sees some of it (holds, in some row, a token of the run's document there at or after the
    run's start)."""
    members = cp // u
    batches_priced = sum(count for _, count in priced)
    member, step = np.arange(members)[:, None], np.arange(members - 1)[None, :]
    sent, got = np.zeros((members, members - 1)), np.zeros((members, members - 1))
    for batch, count in priced:
        tokens, owner, far = _reach(batch, seq, cp, u)
        carried = np.zeros((members, members))  # [owner, hops]: tokens of the runs carried that far
        np.add.at(carried, (owner, far), tokens)
        beyond = carried[:, ::-1].cumsum(axis=1)[:, ::-1]  # [owner, h]: tokens of the runs carried h hops or more
        share = count / batches_priced
        sent += beyond[(member - step) % members, step + 1] * share  # after step s, member m passes on block m - s
        got += beyond[(member - 1 - step) % members, step + 1] * share
    return tuple(tuple(zip(sent[m].tolist(), got[m].tolist(), strict=True)) for m in range(members))


def _reach(batch: Batch, seq: int, cp: int, u: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every run of the micro-batch as (tokens, its member, how many hops its block carries it: to the last
    member that sees it)."""
    lo, hi, rank_of = _rank_runs(batch, seq, cp)
    owner, members = rank_of // u, cp // u
    # Each row's piece of each run, numbered over the whole micro-batch: [rows, runs]
    where = np.stack([r * seq + a for r, (a, _) in enumerate(_row_pieces(batch, lo))])
    pieces, ids = np.unique(where, return_inverse=True)
    ids = ids.reshape(where.shape)
    last = np.full((members, pieces.size), -1)  # per member: its last position in each piece it holds
    for row_ids in ids:
        np.maximum.at(last, (owner, row_ids), hi - 1)
    seen = np.zeros((members, lo.size), dtype=bool)  # [member, run]: it holds the run's document at or after it
    for row_ids in ids:
        seen |= last[:, row_ids] >= lo
    hops = (np.arange(members)[:, None] - owner) % members
    return hi - lo, owner, np.where(seen, hops, 0).max(axis=0, initial=0)


def ring_received_tokens(priced: Priced, seq: int, cp: int, u: int = 1) -> list[float]:
    """Tokens of K,V each ring member receives in one pass of the ring (`ring_steps`)."""
    return [sum(got for _, got in member) for member in ring_steps(priced, seq, cp, u)]
