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

from orangetron.plan.compute import ATTN_BLOCK
from orangetron.spec.sharding import shard_runs

Piece = tuple[int, int]


def windows(doc_lengths: tuple[int, ...], seq: int) -> list[list[Piece]]:
    """The documents' [start, stop) pieces in each whole sequence of `seq` tokens they pack into (at least one)."""
    total = sum(doc_lengths)
    repeats = max(1, -(-seq // total))  # enough copies to fill one sequence
    found, current, at = [], [], 0
    for length in doc_lengths * repeats:
        while length:
            take = min(length, seq - at)
            current.append((at, at + take))
            at, length = at + take, length - take
            if at == seq:
                found.append(current)
                current, at = [], 0
    return found


def _rank_runs(window: list[Piece], seq: int, cp: int) -> list[tuple[tuple[int, int], ...]]:
    """Each rank's runs, none across a document's start (one rank: the pieces themselves)."""
    if cp == 1:
        return [tuple(window)]
    cuts = tuple(a for a, _ in window)
    return [shard_runs(seq, cp, r, cuts) for r in range(cp)]


def _piece_of(window: list[Piece], position: int) -> Piece:
    return window[bisect.bisect_right([a for a, _ in window], position) - 1]


def piece_keys(a: int, b: int, lo: int, hi: int) -> float:
    """Keys the queries in [lo, hi) of a document piece [a, b) are computed against: each sees the piece's
    keys up to itself, and the diagonal block of at most ATTN_BLOCK keys is computed whole."""
    x, y = max(a, lo), min(b, hi)
    if x >= y:
        return 0.0
    n = y - x
    return n * (x - a) + n * (n + 1) / 2 + n * (min(b - a, ATTN_BLOCK) - 1) / 2


def document_keys(doc_lengths: tuple[int, ...], seq: int, cp: int) -> float:
    """Keys a query of the busiest cp rank is computed against on average, whole diagonal blocks included: a
    query sees the earlier keys of its own document, and the step waits for the rank with the most."""
    busiest = []
    for window in windows(doc_lengths, seq):
        per_rank = [sum(piece_keys(*_piece_of(window, lo), lo, hi) for lo, hi in runs)
                    for runs in _rank_runs(window, seq, cp)]
        busiest.append(max(per_rank))
    return sum(busiest) / len(busiest) / (seq // cp)


def ring_steps(doc_lengths: tuple[int, ...], seq: int, cp: int) -> list[list[tuple[float, float]]]:
    """Per cp rank, per transfer of one ring pass (after steps 0 .. cp-2): (tokens of K,V it sends, tokens it
    receives), mean over the sequences. Block j is at rank j+s after s steps; a run of its keys goes on while a
    rank it has still to visit sees some of it (holds a token of the run's document at or after its start)."""
    found = windows(doc_lengths, seq)
    steps = [[(0.0, 0.0)] * (cp - 1) for _ in range(cp)]
    for window in found:
        reach = _reach(window, seq, cp)
        for rank in range(cp):
            for step in range(cp - 1):
                sent = sum(n for n, far in reach[(rank - step) % cp] if far > step)
                got = sum(n for n, far in reach[(rank - 1 - step) % cp] if far > step)
                before = steps[rank][step]
                steps[rank][step] = (before[0] + sent / len(found), before[1] + got / len(found))
    return steps


def _reach(window: list[Piece], seq: int, cp: int) -> list[list[tuple[int, int]]]:
    """Per rank, each of its runs as (tokens, how many hops its block carries it: the last rank that sees it)."""
    runs = _rank_runs(window, seq, cp)
    last = [{} for _ in range(cp)]  # per rank: its last position in each piece it holds
    for rank, held in enumerate(runs):
        for lo, hi in held:
            last[rank][_piece_of(window, lo)] = hi - 1
    reach = []
    for owner, held in enumerate(runs):
        mine = []
        for lo, hi in held:
            piece = _piece_of(window, lo)
            seen = [hop for hop in range(1, cp) if last[(owner + hop) % cp].get(piece, -1) >= lo]
            mine.append((hi - lo, max(seen, default=0)))
        reach.append(mine)
    return reach


def ring_received_tokens(doc_lengths: tuple[int, ...], seq: int, cp: int) -> list[float]:
    """Tokens of K,V each cp rank receives in one pass of the ring (`ring_steps`)."""
    return [sum(got for _, got in rank) for rank in ring_steps(doc_lengths, seq, cp)]
