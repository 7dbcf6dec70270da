"""MoE parallel folding in the planner: experts on their own (etp, ep, edp) mesh over a stage's ranks.

Megatron-Core's folding lets the expert layers take a layout independent of attention's (tp, cp, dp): the
runtime refuses it (tests/test_comm.py); the planner places, sizes and prices it. Numbers are worked by hand.
"""

import pytest

from orangetron.plan.memory import stage_params
from orangetron.plan.timing import group_places, step_time
from orangetron.plan.traffic import data_parallel_records, expert_parallel_records, tensor_parallel_grad_records
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, validate

# 4 layers, every one MoE: 8 experts of width 128 (SwiGLU: 3 x 256 x 128 = 98304 weights each), top 2.
MOE = ModelSpec(name="moe", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8, vocab_size=512,
                ffn_hidden_size=512, num_experts=8, top_k=2, moe_ffn_hidden_size=128)
EXPERT = 3 * 256 * 128


def test_folded_ep_group_fills_the_node_that_tp_shares():
    """tp = 4 attention on 16 GPUs (nodes of 8): unfolded, ep can be at most dp x cp = 4, ranks 0, 4, 8, 12 (two
    per node, two nodes); folded, ep = 8 is ranks 0..7, one node, and edp = 2 spans both."""
    cluster = make_cluster("h100", 16)
    unfolded = group_places(Degrees(tp=4, dp=4, ep=4), cluster)
    assert (unfolded["ep"].size, unfolded["ep"].per_node) == (4, 2)
    folded = group_places(Degrees(tp=4, dp=4, ep=8, expert_fold=True), cluster)
    assert (folded["ep"].size, folded["ep"].per_node) == (8, 8)
    assert (folded["edp"].size, folded["edp"].per_node) == (2, 1)
    # etp = 2 fastest: the etp group is a rank pair, the ep group every other rank of a node.
    split = group_places(Degrees(tp=4, dp=4, ep=4, etp=2, expert_fold=True), cluster)
    assert (split["etp"].size, split["etp"].per_node) == (2, 2)
    assert (split["ep"].size, split["ep"].per_node) == (4, 4)
    assert (split["edp"].size, split["edp"].per_node) == (2, 1)


def test_folded_expert_params_and_their_reduction_group():
    """etp = 2, ep = 4 over tp = 2 x dp = 4: each rank holds 8 / 4 = 2 experts, half of each: 2 x 98304 / 2
    weights per layer, replicated over edp = 8 / (2 x 4) = 1, so no expert gradient reduction; with dp = 8 on
    16 GPUs, edp = 2 and the experts' records are over a 2-rank edp group."""
    deg = Degrees(tp=2, dp=4, ep=4, etp=2, expert_fold=True)
    assert stage_params(MOE, deg, 0).expert == 4 * 2 * EXPERT // 2
    job = Job(seq_len=64, sequence_parallel=True, distributed_optimizer=True)
    assert {r.dim for r in data_parallel_records(MOE, deg, job)} == {"dp_cp"}
    wide = Degrees(tp=2, dp=8, ep=4, etp=2, expert_fold=True)
    experts = [r for r in data_parallel_records(MOE, wide, job) if r.dim == "edp"]
    # Reduce-scatter and all-gather of 4 layers x 2 half experts over 2 ranks: half of each payload leaves.
    assert sorted(r.op for r in experts) == ["all_gather", "reduce_scatter"]
    assert all(r.bytes_sent * 2 == r.payload_bytes for r in experts)
    assert [r.payload_bytes for r in experts if r.op == "all_gather"] == [2 * 4 * 2 * EXPERT // 2]


def test_folded_experts_leave_the_tp_gradient_sum():
    """Unfolded with etp = 1 and SP, every tp rank holds its ep rank's experts whole and their gradients are
    summed over tp; folded, the replicas are the edp group, so the tp sum keeps norms and routers only:
    4 layers x (2 norms x 256 + router 8 x 256) + final norm 256 elements, bf16."""
    job = Job(seq_len=64, sequence_parallel=True)
    folded = tensor_parallel_grad_records(MOE, Degrees(tp=2, dp=4, ep=8, expert_fold=True), job)
    assert [r.payload_bytes for r in folded] == [2 * (4 * (2 * 256 + 8 * 256) + 256)]
    unfolded = tensor_parallel_grad_records(MOE, Degrees(tp=2, dp=4, ep=4), job)
    assert [r.payload_bytes for r in unfolded] == [2 * (4 * (2 * 256 + 8 * 256 + 2 * EXPERT) + 256)]


def test_folded_dispatch_has_the_same_rows_over_a_larger_group():
    """Each rank routes its SP shard (64 / 2 = 32 tokens, top 2 over 8 ep ranks: 2 rows each); the all-to-all
    now runs over 8 ranks of one node instead of 4."""
    job = Job(seq_len=64, sequence_parallel=True)
    records = expert_parallel_records(MOE, Degrees(tp=2, dp=4, ep=8, expert_fold=True), job)
    rows = [r for r in records if r.op == "all_to_all" and r.payload_bytes == 32 * 2 * 256 * 2]
    assert rows and all(r.bytes_sent * 8 == r.payload_bytes * 7 for r in rows)  # 7 of 8 ranks are peers


def test_folding_rules():
    job = Job(seq_len=64, sequence_parallel=True)
    validate(MOE, Degrees(tp=2, dp=4, ep=8, expert_fold=True), job)
    with pytest.raises(ValueError, match="needs sequence_parallel"):
        validate(MOE, Degrees(tp=2, dp=4, ep=8, expert_fold=True), Job(seq_len=64))
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=128 is not divisible by etp"):
        validate(MOE, Degrees(tp=1, dp=3, ep=1, etp=3, expert_fold=True), Job(seq_len=64))
    dense = ModelSpec(name="dense", hidden_size=256, num_layers=4, num_heads=8, vocab_size=512, ffn_hidden_size=512)
    with pytest.raises(ValueError, match="has no experts to fold"):
        validate(dense, Degrees(tp=2, dp=4, ep=8, expert_fold=True), job)


def test_folding_moves_mixtral_expert_traffic_into_the_node():
    """Mixtral 8x7B on 16 H100 with tp = 4: unfolded ep <= dp = 4 crosses nodes; folded ep = 8 stays inside
    one, so the exposed expert all-to-all time drops."""
    from orangetron.spec.model import load_model

    model, cluster = load_model("mixtral-8x7b"), make_cluster("h100", 16)
    job = Job(seq_len=4096, global_batch=16, sequence_parallel=True, overlap_ep=False, recompute="full")
    across = step_time(model, Degrees(tp=4, dp=4, ep=4), job, cluster)
    inside = step_time(model, Degrees(tp=4, dp=4, ep=8, expert_fold=True), job, cluster)
    assert inside.ep_s < across.ep_s
