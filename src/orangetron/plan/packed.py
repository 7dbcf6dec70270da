"""Packed documents in the cost model: the attention work and the ring traffic of the busiest cp rank.

A job with `doc_lengths` packs those documents into sequences of `seq` tokens, in order, repeated until they
fill one; a document cut by a sequence's end starts again at 0 in the next. The runtime shards each sequence in
balance (`orangetron/spec/sharding.py`, `document_runs`, cut at the documents' starts) and its ring passes a
run of keys on only while a member it has still to visit sees some of it
(`orangetron/parallel/context/ring.py`). Both are priced here from the same sharding, each as the mean over
the whole sequences of the busiest rank.
"""

from __future__ import annotations

import bisect
import functools

from orangetron.plan.compute import ATTN_BLOCK
from orangetron.spec.sharding import shard_runs

Piece = tuple[int, int]
Transfer = tuple[float, float]  # tokens of K,V (sent, received)


def windows(doc_lengths: tuple[int, ...], seq: int) -> list[tuple[tuple[Piece, ...], int]]:
    """The distinct lists of the documents' [start, stop) pieces in the whole sequences of `seq` tokens they pack
    into (at least one), each with how many sequences hold it, in order of first appearance. The sequences
    inside one long document are counted at once, so a length costs the same however long it is."""
    total = sum(doc_lengths)
    repeats = max(1, -(-seq // total))  # enough copies to fill one sequence
    counts: dict[tuple[Piece, ...], int] = {}
    current: list[Piece] = []
    at = 0
    for length in doc_lengths * repeats:
        while length:
            if at == 0 and length >= seq:  # whole sequences of this document alone
                counts[((0, seq),)] = counts.get(((0, seq),), 0) + length // seq
                length %= seq
                continue
            take = min(length, seq - at)
            current.append((at, at + take))
            at, length = at + take, length - take
            if at == seq:
                counts[tuple(current)] = counts.get(tuple(current), 0) + 1
                current, at = [], 0
    return list(counts.items())


def document_square_keys(doc_lengths: tuple[int, ...], seq: int) -> float:
    """Keys per query when each document piece counts all its own keys (the s x s convention of model FLOPs, per
    document): the mean over the tokens of the length of the piece that holds each."""
    squares = tokens = 0
    for window, count in windows(doc_lengths, seq):
        squares += count * sum((b - a) ** 2 for a, b in window)
        tokens += count * seq
    return squares / tokens


def _rank_runs(window: tuple[Piece, ...], seq: int, cp: int) -> list[tuple[tuple[int, int], ...]]:
    """Each rank's runs, none across a document's start (one rank: the pieces themselves)."""
    if cp == 1:
        return [tuple(window)]
    cuts = tuple(a for a, _ in window)
    return [shard_runs(seq, cp, r, cuts) for r in range(cp)]


def _piece_of(window: tuple[Piece, ...], position: int) -> Piece:
    return window[bisect.bisect_right([a for a, _ in window], position) - 1]


def piece_keys(a: int, b: int, lo: int, hi: int) -> float:
    """Keys the queries in [lo, hi) of a document piece [a, b) are computed against: each sees the piece's
    keys up to itself, and the diagonal block of at most ATTN_BLOCK keys is computed whole."""
    x, y = max(a, lo), min(b, hi)
    if x >= y:
        return 0.0
    n = y - x
    return n * (x - a) + n * (n + 1) / 2 + n * (min(b - a, ATTN_BLOCK) - 1) / 2


@functools.lru_cache(maxsize=64)  # the planner prices one job's documents again for each candidate it weighs
def document_keys(doc_lengths: tuple[int, ...], seq: int, cp: int) -> float:
    """Keys a query of the busiest cp rank is computed against on average, whole diagonal blocks included: a
    query sees the earlier keys of its own document, and the step waits for the rank with the most."""
    busiest, sequences = 0.0, 0
    for window, count in windows(doc_lengths, seq):
        per_rank = [sum(piece_keys(*_piece_of(window, lo), lo, hi) for lo, hi in runs)
                    for runs in _rank_runs(window, seq, cp)]
        busiest += count * max(per_rank)
        sequences += count
    return busiest / sequences / (seq // cp)


@functools.lru_cache(maxsize=64)
def ring_steps(doc_lengths: tuple[int, ...], seq: int, cp: int, u: int = 1) -> tuple[tuple[Transfer, ...], ...]:
    """Per ring member, per transfer of one ring pass (after steps 0 .. members-2): (tokens of K,V it sends,
    tokens it receives), mean over the sequences. A member is one cp rank, or under USP the `u` consecutive
    ranks of a Ulysses group, holding their tokens in rank order. Block j is at member j+s after s steps; a run
    of its keys goes on while a member it has still to visit sees some of it (holds a token of the run's
    document at or after its start)."""
    found, members = windows(doc_lengths, seq), cp // u
    sequences = sum(count for _, count in found)
    steps = [[(0.0, 0.0)] * (members - 1) for _ in range(members)]
    for window, count in found:
        reach, share = _reach(window, seq, cp, u), count / sequences
        for member in range(members):
            for step in range(members - 1):
                sent = sum(n for n, far in reach[(member - step) % members] if far > step)
                got = sum(n for n, far in reach[(member - 1 - step) % members] if far > step)
                before = steps[member][step]
                steps[member][step] = (before[0] + sent * share, before[1] + got * share)
    return tuple(tuple(member) for member in steps)


def _reach(window: tuple[Piece, ...], seq: int, cp: int, u: int) -> list[list[tuple[int, int]]]:
    """Per member, each of its runs as (tokens, how many hops its block carries it: the last member that sees
    it)."""
    ranks = _rank_runs(window, seq, cp)
    runs = [tuple(run for rank in ranks[m * u:(m + 1) * u] for run in rank) for m in range(cp // u)]
    last = [{} for _ in runs]  # per member: its last position in each piece it holds
    for member, held in enumerate(runs):
        for lo, hi in held:
            piece = _piece_of(window, lo)
            last[member][piece] = max(last[member].get(piece, -1), hi - 1)
    reach, members = [], len(runs)
    for owner, held in enumerate(runs):
        mine = []
        for lo, hi in held:
            piece = _piece_of(window, lo)
            seen = [hop for hop in range(1, members) if last[(owner + hop) % members].get(piece, -1) >= lo]
            mine.append((hi - lo, max(seen, default=0)))
        reach.append(mine)
    return reach


def ring_received_tokens(doc_lengths: tuple[int, ...], seq: int, cp: int, u: int = 1) -> list[float]:
    """Tokens of K,V each ring member receives in one pass of the ring (`ring_steps`)."""
    return [sum(got for _, got in member) for member in ring_steps(doc_lengths, seq, cp, u)]
