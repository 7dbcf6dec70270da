"""Head-tail sequence sharding: which chunks each cp rank keeps, global positions, and the round trip."""

import pytest
import torch

from orangetron import comm
from orangetron.mesh import init_mesh
from orangetron.parallel import context
from orangetron.spec.layout import Layout, LayoutError
from orangetron.testing import run_distributed


def test_head_tail_indices_by_hand():
    # seq 16, cp 2: chunks of 4; rank 0 keeps chunks 0 and 3, rank 1 keeps chunks 1 and 2.
    assert context.head_tail_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context.head_tail_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # cp 3: rank 1 keeps chunks 1 and 4 of six.
    assert context.head_tail_indices(12, 3, 1).tolist() == [2, 3, 8, 9]


def test_one_cp_rank_keeps_any_sequence_in_order():
    assert context.head_tail_indices(7, 1, 0).tolist() == list(range(7))


def test_every_token_is_kept_by_exactly_one_rank():
    kept = torch.cat([context.head_tail_indices(24, 4, r) for r in range(4)])
    assert sorted(kept.tolist()) == list(range(24))


def test_bad_sequence_and_rank():
    with pytest.raises(LayoutError, match=r"cp=3: seq_len 1000 is not divisible by 2\*cp=6"):
        context.head_tail_indices(1000, 3, 0)
    with pytest.raises(LayoutError, match=r"cp_rank=2: must lie in \[0, cp=2\)"):
        context.head_tail_indices(8, 2, 2)


def round_trip(layout: Layout):
    mesh = init_mesh(layout)
    full = torch.arange(2 * 16 * 3, dtype=torch.float64).reshape(2, 16, 3)  # [B, S, H], same on every rank
    local = context.shard(full, mesh, seq_dim=1).requires_grad_()
    pos = context.position_ids(16, mesh)
    torch.testing.assert_close(local.detach(), full[:, pos], rtol=0, atol=0)
    back = context.unshard(local, mesh, seq_dim=1)
    torch.testing.assert_close(back, full, rtol=0, atol=0)
    weights = torch.arange(16, dtype=torch.float64).reshape(1, 16, 1)
    (back * weights).sum().backward()  # every rank's copy feeds the sum: cp copies of each gradient
    torch.testing.assert_close(local.grad, mesh["cp"].size * weights[:, pos].expand_as(local), rtol=0, atol=0)
    return pos.tolist(), [(r.op, r.dim, r.payload_bytes) for r in comm.ledger()]


def test_shard_unshard_round_trip_on_four_cp_ranks():
    results = run_distributed(round_trip, 4, args=(Layout(cp=4),))
    assert [pos for pos, _ in results] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    full_bytes = 2 * 16 * 3 * 8
    for _, records in results:
        assert records == [("all_gather", "cp", full_bytes), ("reduce_scatter", "cp", full_bytes)]
