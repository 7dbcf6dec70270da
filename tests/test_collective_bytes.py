"""The shared byte formulas (`orangetron.spec.collectives`) against numbers worked out by hand.

Payloads are chosen not to divide by the group size, where the integer rule shows: one ring phase moves
(n-1) * T // n bytes (rounded down), an all-reduce twice that. Every expected number is written out.
"""

import itertools

import pytest

from orangetron.spec import collectives as cf


def test_all_gather_and_reduce_scatter_round_down():
    # T=10, n=3: 2 * 10 / 3 = 6.67 -> 6 (rounding up would give 7)
    assert cf.all_gather_bytes(10, 3) == (6, 6)
    assert cf.reduce_scatter_bytes(10, 3) == (6, 6)
    # T=7, n=4: 3 * 7 / 4 = 5.25 -> 5
    assert cf.all_gather_bytes(7, 4) == (5, 5)
    assert cf.reduce_scatter_bytes(7, 4) == (5, 5)
    # T=1, n=2: 1 / 2 = 0.5 -> 0
    assert cf.all_gather_bytes(1, 2) == (0, 0)
    # divisible payloads are exact: T=12, n=4: 3 * 12 / 4 = 9
    assert cf.all_gather_bytes(12, 4) == (9, 9)


def test_all_reduce_rounds_each_phase_down():
    # T=10, n=3: each phase 20 // 3 = 6, so 2 * 6 = 12 (not 40 // 3 = 13; rounding up would give 14)
    assert cf.all_reduce_bytes(10, 3) == (12, 12)
    # T=1, n=3: each phase 2 // 3 = 0 (the other rule gives 4 // 3 = 1)
    assert cf.all_reduce_bytes(1, 3) == (0, 0)
    # T=20 (5 float32), n=3: each phase 40 // 3 = 13, so 26
    assert cf.all_reduce_bytes(20, 3) == (26, 26)
    # T=7, n=2: each phase 7 // 2 = 3, so 6
    assert cf.all_reduce_bytes(7, 2) == (6, 6)


@pytest.mark.parametrize("payload, n", [(10, 3), (7, 4), (1, 3), (13, 5), (20, 3)])
def test_all_reduce_moves_exactly_reduce_scatter_plus_all_gather(payload, n):
    rs, ag, ar = cf.reduce_scatter_bytes(payload, n), cf.all_gather_bytes(payload, n), cf.all_reduce_bytes(payload, n)
    assert ar == (rs[0] + ag[0], rs[1] + ag[1])


def test_all_to_all_counts_rows_to_other_ranks():
    # Bytes rank i sends to j on 3 ranks, rows of 12 B: [[1, 2, 0], [3, 0, 1], [2, 2, 2]] rows.
    assert cf.all_to_all_bytes([12, 24, 0], [12, 36, 24], 0) == (24, 60)  # sends 2 rows out, gets 3 + 2
    assert cf.all_to_all_bytes([36, 0, 12], [24, 0, 24], 1) == (48, 48)
    assert cf.all_to_all_bytes([24, 24, 24], [0, 12, 24], 2) == (48, 12)


def test_send_recv_is_the_tensors():
    assert cf.send_recv_bytes(7, 5) == (7, 5)


# Pipelined chain from root 1 with a 7-byte tensor: (sent, received) for ranks 0..n-1, by hand.
# Chain order root, root+1, ..., wrapping: n=3 is 1 -> 2 -> 0, so rank 0 is last (receives only).
BROADCAST_FROM_1 = {
    2: [(0, 7), (7, 0)],
    3: [(0, 7), (7, 0), (7, 7)],
    4: [(0, 7), (7, 0), (7, 7), (7, 7)],
    5: [(0, 7), (7, 0), (7, 7), (7, 7), (7, 7)],
}
REDUCE_TO_1 = {  # the mirror: partial sums flow 0 -> ... -> 2 -> 1
    2: [(7, 0), (0, 7)],
    3: [(7, 0), (0, 7), (7, 7)],
    4: [(7, 0), (0, 7), (7, 7), (7, 7)],
    5: [(7, 0), (0, 7), (7, 7), (7, 7), (7, 7)],
}


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_broadcast_and_reduce_as_a_chain(n):
    assert [cf.broadcast_bytes(7, n, rank, 1) for rank in range(n)] == BROADCAST_FROM_1[n]
    assert [cf.reduce_bytes(7, n, rank, 1) for rank in range(n)] == REDUCE_TO_1[n]


def test_broadcast_root_zero_and_group_of_one():
    assert [cf.broadcast_bytes(9, 3, rank, 0) for rank in range(3)] == [(9, 0), (9, 9), (0, 9)]
    assert cf.broadcast_bytes(9, 1, 0, 0) == (0, 0)
    assert cf.reduce_bytes(9, 1, 0, 0) == (0, 0)
    with pytest.raises(ValueError, match="root=3"):
        cf.broadcast_bytes(9, 3, 0, 3)


# Expected ring-phase bytes for a 7-byte payload ((n-1) * 7 // n) and the all-reduce (twice that).
RING_7 = {2: 3, 3: 4, 4: 5, 5: 5}
ALL_REDUCE_7 = {2: 6, 3: 8, 4: 10, 5: 10}


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_rank_of_symmetric_collectives(n):
    for rank in range(n):  # every member of a ring moves the same share
        assert cf.all_gather_bytes(7, n) == (RING_7[n], RING_7[n]), rank
        assert cf.reduce_scatter_bytes(7, n) == (RING_7[n], RING_7[n]), rank
        assert cf.all_reduce_bytes(7, n) == (ALL_REDUCE_7[n], ALL_REDUCE_7[n]), rank


def _group_totals(per_rank: list[tuple[int, int]]) -> tuple[int, int]:
    return sum(s for s, _ in per_rank), sum(r for _, r in per_rank)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("payload", [7, 10, 24])
def test_group_sends_what_it_receives(n, payload):
    """Over a group, every byte sent is a byte received, for every op and every root."""
    per_op = {
        "all_gather": [cf.all_gather_bytes(payload, n) for _ in range(n)],
        "reduce_scatter": [cf.reduce_scatter_bytes(payload, n) for _ in range(n)],
        "all_reduce": [cf.all_reduce_bytes(payload, n) for _ in range(n)],
        "send_recv": [cf.send_recv_bytes(payload, payload) for _ in range(n)],  # a ring shift
    }
    for root in range(n):
        per_op[f"broadcast from {root}"] = [cf.broadcast_bytes(payload, n, rank, root) for rank in range(n)]
        per_op[f"reduce to {root}"] = [cf.reduce_bytes(payload, n, rank, root) for rank in range(n)]
    # all-to-all: a full matrix of bytes i -> j, uneven and with zeros; rank j receives column j.
    matrix = [[(payload * (3 * i + 5 * j + 1)) % 11 for j in range(n)] for i in range(n)]
    per_op["all_to_all"] = [cf.all_to_all_bytes(matrix[r], [matrix[i][r] for i in range(n)], r) for r in range(n)]
    for op, per_rank in per_op.items():
        sent, received = _group_totals(per_rank)
        assert sent == received, f"{op} over {n} ranks: {per_rank}"


def test_group_sum_of_the_chain_is_n_minus_one_tensors():
    for n, root in itertools.product([2, 3, 4, 5], range(5)):
        if root < n:
            assert _group_totals([cf.broadcast_bytes(7, n, r, root) for r in range(n)]) == (7 * (n - 1), 7 * (n - 1))
