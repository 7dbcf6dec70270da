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


# ---- the balanced sharding of packed documents --------------------------------------------------------------


def test_balanced_sharding_by_hand():
    # cp 2, two documents of 8 and 4 tokens: each cut into 4 slots, rank 0 keeps slots 1 and 2 (the middle),
    # rank 1 slots 0 and 3. Document 1's slots are one token each.
    cuts = (0, 8)
    assert context.shard_indices(12, 2, 0, cuts).tolist() == [2, 3, 4, 5, 9, 10]
    assert context.shard_indices(12, 2, 1, cuts).tolist() == [0, 1, 6, 7, 8, 11]


def test_balanced_runs_join_a_ranks_touching_slots_within_a_document_only():
    """A rank's two slots of a document with nothing between them are one run (a ring carries it whole), an
    empty slot is no run, and runs of two documents stay apart however they touch. cp 2 over documents of 8,
    3 and 5 tokens: slots (2,2,2,2), (1,1,1,0) and (1,1,1,2)."""
    from orangetron.spec.sharding import balanced_runs, document_runs

    cuts = (0, 8, 11)
    assert document_runs(16, 2, 0, cuts) == ((2, 6), (9, 11), (12, 14))
    assert document_runs(16, 2, 1, cuts) == ((0, 2), (6, 8), (8, 9), (11, 12), (14, 16))
    start, stop, rank = balanced_runs(16, 2, cuts)
    assert list(zip(start.tolist(), stop.tolist(), rank.tolist(), strict=True)) == [
        (2, 6, 0), (9, 11, 0), (12, 14, 0), (0, 2, 1), (6, 8, 1), (8, 9, 1), (11, 12, 1), (14, 16, 1)]


def test_balanced_sharding_gives_remainders_round_the_slots():
    # cp 2 (4 slots), documents of 5, 6 and 5 tokens: remainders 1, 2, 1 go to slots 0; 1, 2; 3 in turn, so
    # slot sizes are (2,1,1,1), (1,2,2,1), (1,1,1,2) and each rank ends with 8 tokens.
    cuts = (0, 5, 11)
    assert context.shard_indices(16, 2, 0, cuts).tolist() == [2, 3, 6, 7, 8, 9, 12, 13]
    assert context.shard_indices(16, 2, 1, cuts).tolist() == [0, 1, 4, 5, 10, 11, 14, 15]


def visible_pairs(shard: torch.Tensor, ids: torch.Tensor) -> int:
    """Pairs a rank's queries see: each query its own position's offset in its document, plus one."""
    starts = torch.zeros_like(ids)
    for d in ids.unique():
        where = (ids == d).nonzero().flatten()
        starts[where] = where[0]
    return int((shard - starts[shard] + 1).sum())


@pytest.mark.parametrize("cp", (2, 3, 4, 8))
def test_balanced_sharding_splits_every_documents_pairs_evenly(cp):
    """Documents of random lengths that are multiples of 2*cp: every rank sees exactly the same visible pairs
    and holds the same tokens, in at most two spans per document. Head-tail over the whole row does not."""
    g = torch.Generator().manual_seed(cp)
    lengths = (torch.randint(1, 12, (9,), generator=g) * 2 * cp).tolist()
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seq, cuts = ids.numel(), tuple(torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist())
    shards = [context.shard_indices(seq, cp, r, cuts) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    pairs = [visible_pairs(s, ids) for s in shards]
    assert len(set(pairs)) == 1, pairs
    for shard in shards:
        assert shard.numel() == seq // cp
        for d in range(len(lengths)):
            held = shard[ids[shard] == d]
            assert int((held.diff() != 1).sum()) + 1 <= 2, (d, held.tolist())  # spans of this document
    head_tail = [visible_pairs(context.head_tail_indices(seq, cp, r), ids) for r in range(cp)]
    assert max(head_tail) > min(head_tail)


@pytest.mark.parametrize("cp", (2, 3, 4))
def test_balanced_sharding_keeps_ranks_equal_and_close_for_any_lengths(cp):
    """Uneven lengths (one token, shorter than 2*cp, long): equal tokens per rank, every position once, and the
    busiest rank within 10% of the mean visible pairs."""
    lengths = [1, 2 * cp - 1, 7 * cp + 3, 1, 40 * cp + 5, 3]
    lengths.append(-sum(lengths) % (2 * cp) + 2 * cp)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seq, cuts = ids.numel(), tuple(torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist())
    shards = [context.shard_indices(seq, cp, r, cuts) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    assert {s.numel() for s in shards} == {seq // cp}
    pairs = [visible_pairs(s, ids) for s in shards]
    assert max(pairs) / (sum(pairs) / cp) < 1.10, pairs


def test_balanced_sharding_refuses_cuts_that_are_not_document_starts():
    for cuts in ((), (3,), (0, 5, 5), (0, 7, 4), (0, 12)):
        with pytest.raises(LayoutError, match="must start at 0 and increase below seq_len=12"):
            context.shard_indices(12, 2, 0, cuts)
