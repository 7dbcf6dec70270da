"""The "deepep" dispatcher's pricing (plan.node_dispatch): fan-out, bytes and time worked out by hand, the
expectations checked by enumerating every expert choice, and the SM share hidden traffic costs."""

import itertools
import json
from dataclasses import replace

import pytest

from orangetron.cli import main as run
from orangetron.plan import node_dispatch as nd
from orangetron.plan.config import Degrees, Job
from orangetron.plan.hardware import make_cluster
from orangetron.plan.models import ModelSpec, load_model
from orangetron.plan.network import DEFAULT_PARAMS, Placement
from orangetron.plan.timing import step_time
from orangetron.plan.traffic import expert_parallel_records, step_records


def _moe(experts=8, top_k=2, hidden=64, **kw) -> ModelSpec:
    return ModelSpec(name="moe", hidden_size=hidden, num_layers=2, num_heads=4, vocab_size=128, num_experts=experts,
                     top_k=top_k, moe_ffn_hidden_size=32, **kw)


def _enumerated_reach(experts: int, top_k: int, bins: int, pool: int) -> float:
    """Average distinct bins over every set of top_k experts drawn from the first `pool` bins' experts."""
    per_bin = experts // bins
    picks = list(itertools.combinations(range(per_bin * pool), top_k))
    return sum(len({e // per_bin for e in pick}) for pick in picks) / len(picks)


@pytest.mark.parametrize("experts,top_k,bins,pool", [(8, 2, 4, 0), (8, 3, 4, 0), (12, 4, 6, 3), (16, 5, 8, 4),
                                                     (6, 6, 3, 0), (8, 1, 8, 2)])
def test_reach_equals_the_average_over_every_expert_choice(experts, top_k, bins, pool):
    assert nd.reach(experts, top_k, bins, pool) == pytest.approx(_enumerated_reach(experts, top_k, bins, pool or bins))


def test_fanout_by_hand():
    """8 experts, top 2, ep 8 on 4 nodes of 2 GPUs (one expert each). A bin is missed with probability
    C(6,2)/C(8,2) = 15/28: 4 * 13/28 = 13/7 nodes reached, 3/4 of them remote (39/28); a GPU is missed with
    probability C(7,2)/C(8,2) = 3/4, so 2 GPUs reached, the forwarding GPU's own half of them not over NVLink."""
    f = nd.fanout(_moe(), Placement(8, 2))
    assert f.remote_nodes == pytest.approx(39 / 28)
    assert f.nvlink_rows == pytest.approx(1.0)
    one_node = nd.fanout(_moe(), Placement(8, 8))
    assert one_node.remote_nodes == 0 and one_node.nvlink_rows == pytest.approx(2 * 7 / 8)


def _miss(pool_experts: int, per_bin: int, top_k: int) -> float:
    """Chance that a bin of `per_bin` experts gets none of top_k drawn from `pool_experts`."""
    miss = 1.0
    for i in range(top_k):
        miss *= (pool_experts - per_bin - i) / (pool_experts - i)
    return miss


def test_node_limited_routing_draws_from_the_allowed_nodes_only():
    """DeepSeek-V3 (256 experts, top 8, at most 4 of 8 groups). On ep 64 = 8 nodes a group is a node: a chosen
    node holds 32 of the 128 allowed experts. On ep 128 = 16 nodes a group is two nodes: 8 of 16 allowed, 16
    experts each. On ep 32 = 4 nodes a group is half a node: every node may be reached, but only 16 of the 32
    GPUs (8 experts each)."""
    v3 = load_model("deepseek-v3")
    assert nd.fanout(v3, Placement(64, 8)).remote_nodes == pytest.approx(4 * (1 - _miss(128, 32, 8)) * 7 / 8)
    assert nd.fanout(v3, Placement(128, 8)).remote_nodes == pytest.approx(8 * (1 - _miss(128, 16, 8)) * 15 / 16)
    four = nd.fanout(v3, Placement(32, 8))
    assert four.remote_nodes == pytest.approx(4 * (1 - _miss(256, 64, 8)) * 3 / 4)
    assert four.nvlink_rows == pytest.approx(16 * (1 - _miss(128, 8, 8)) * 7 / 8)
    unlimited = replace(v3, expert_groups=0, groups_per_token=0)
    assert nd.fanout(v3, Placement(64, 8)).remote_nodes < nd.fanout(unlimited, Placement(64, 8)).remote_nodes


def test_balanced_routing_reaches_the_allowed_ranks():
    """The ragged dispatcher's convention: each token on min(top_k, allowed ranks). DeepSeek-V2 (top 6, at most
    3 of 8 groups): 3 ranks at ep 8, 6 at ep 16 (each group two ranks), 4 at ep 4 (two groups per rank, no
    limit); Mixtral has no groups."""
    v2 = load_model("deepseek-v2")
    assert [v2.routed_ranks(e) for e in (4, 8, 16)] == [4, 3, 6]
    assert load_model("mixtral-8x7b").routed_ranks(8) == 2


def test_bytes_sent_by_hand():
    """28 tokens, 67/28 copies each (39/28 over RDMA, 1 over NVLink): bf16 rows of 64 values plus 2 ids (int64)
    and 2 weights (float32) dispatched, 128 B combined; backward sends the same two; full recompute once more.
    Under the blockwise FP8 recipe a 256-wide token dispatches as 256 B plus two float32 scales."""
    job = Job(seq_len=28)
    assert nd.bytes_sent(_moe(), Placement(8, 2), job, 28) == [67 * 152, 67 * 128] * 2
    assert nd.bytes_sent(_moe(), Placement(8, 2), replace(job, recompute="full"), 28) == [67 * 152, 67 * 128] * 3
    fp8 = replace(job, fp8=True, fp8_recipe="blockwise")
    assert nd.row_bytes(_moe(hidden=256), fp8) == (256 + 8 + 24, 512)
    assert nd.row_bytes(_moe(hidden=256), replace(fp8, fp8_recipe="delayed")) == (512 + 24, 512)


def test_layer_time_by_hand():
    """4096-wide bf16 rows on H100 nodes of 2 (NDR 400 Gb/s per GPU at 90%; NVLink 450 GB/s at 80%): each of the
    four transfers takes the slower of 28 * 39/28 rows over RDMA and 28 rows over NVLink."""
    model, cluster, p = _moe(hidden=4096), make_cluster("h100", 8, 2), DEFAULT_PARAMS
    dispatch, combine = 2 * 4096 + 24, 2 * 4096
    rdma_bw, nvlink_bw = 50e9 * p.inter_efficiency, 450e9 * p.intra_efficiency
    expected = 0.0
    for row in (dispatch, combine):
        rdma = p.inter_latency_s + 39 * row / rdma_bw
        nvlink = p.intra_latency_s + 28 * row / nvlink_bw
        expected += 2 * max(rdma, nvlink)
    assert nd.layer_time(model, Placement(8, 2), Job(seq_len=28), 28, cluster, p) == pytest.approx(expected)


def test_hidden_traffic_costs_the_sms_its_kernels_hold():
    """DeepSeek-V3's layout with paired micro-batches hides the dispatch entirely: what remains of it is the
    compute slowed by ep_comm_sms of 132 SMs, so the exposed EP time scales with ep_comm_sms."""
    model, deg = load_model("deepseek-v3"), Degrees(pp=16, dp=128, ep=64)
    job = Job(seq_len=4096, global_batch=15360, zero_stage=1, fp8=True, fp8_recipe="blockwise", dispatcher="deepep")
    cluster = make_cluster("h800", 2048)
    ep = {s: step_time(model, deg, replace(job, ep_comm_sms=s), cluster).ep_s for s in (0, 20, 40)}
    assert ep[0] == 0.0 and ep[20] > 0.0
    assert ep[40] == pytest.approx(2 * ep[20])
    with pytest.raises(ValueError, match="ep_comm_sms=132: the h800 has 132 SMs"):
        step_time(model, deg, replace(job, ep_comm_sms=132), cluster)


def test_deepseek_v3_sends_under_half_the_rows_over_infiniband():
    """Per MoE layer the ragged dispatcher sends each token to its 8 destination GPUs, 7/8 of them off node;
    the deepep dispatcher sends it to about 3.2 remote nodes: the exposed time falls by more than half."""
    model, deg = load_model("deepseek-v3"), Degrees(pp=16, dp=128, ep=64)
    job = Job(seq_len=4096, global_batch=15360, zero_stage=1, overlap_ep=False)
    cluster = make_cluster("h800", 2048)
    ragged, deepep = (step_time(model, deg, replace(job, dispatcher=d), cluster).ep_s for d in ("ragged", "deepep"))
    assert deepep < 0.5 * ragged


def test_traffic_records_need_the_placement_and_the_runtime_refuses_deepep():
    from orangetron.parallel.config import ParallelConfig, ParallelConfigError

    job = Job(seq_len=28, dispatcher="deepep")
    with pytest.raises(ValueError, match="deepep"):
        expert_parallel_records(_moe(), Degrees(dp=8, ep=8), job)
    records = expert_parallel_records(_moe(), Degrees(dp=8, ep=8), job, Placement(8, 2))
    assert [r.bytes_sent for r in records] == nd.bytes_sent(_moe(), Placement(8, 2), job, 28)
    with pytest.raises(ParallelConfigError, match="priced by the planner only"):
        ParallelConfig(dispatcher="deepep")


def test_estimate_reports_deepep_traffic(capsys):
    """DeepSeek-V3 on 2048 H800: every MoE layer (3 or 4 on a stage; stage 0 holds the 3 dense ones and 1 MoE)
    sends four transfers per micro-batch, 120 micro-batches, the bytes of `bytes_sent`."""
    args = ["estimate", "--model", "deepseek-v3", "--gpu", "h800", "--gpus", "2048", "--pp", "16", "--dp", "128",
            "--ep", "64", "--seq", "4096", "--global-batch", "15360", "--zero-stage", "1", "--fp8",
            "--fp8-recipe", "blockwise", "--dispatcher", "deepep", "--json"]
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ep = out["comm"]["all_to_all/ep"]
    job = Job(seq_len=4096, fp8=True, fp8_recipe="blockwise", dispatcher="deepep")
    per_layer = nd.bytes_sent(load_model("deepseek-v3"), Placement(64, 8), job, 4096)
    assert ep["calls"] == 120 * 4
    assert ep["sent"] == 120 * sum(per_layer)
    stage0 = step_records(load_model("deepseek-v3"), Degrees(pp=16, dp=128, ep=64),
                          replace(job, global_batch=15360, zero_stage=1), 0, Placement(64, 8))
    assert sum(r.bytes_sent for r in stage0 if r.key == "all_to_all/ep") == ep["sent"]


def test_plan_searches_with_the_chosen_dispatcher(capsys):
    """`plan --dispatcher deepep --ep-comm-sms 24` ranks layouts priced with that dispatcher and SM count; the best
    deepep layout is faster than the best ragged one at ep 64 across 8 nodes (the rows cross InfiniBand once per
    node), and its EP bytes equal the dispatcher's own count."""
    args = ["plan", "--model", "deepseek-v3", "--gpu", "h800", "--gpus", "2048", "--seq", "4096", "--global-batch",
            "15360", "--fp8", "--fp8-recipe", "blockwise", "--pp", "16", "--ep", "64", "--top", "1", "--json"]
    best = {}
    for dispatcher in ("ragged", "deepep"):
        assert run([*args, "--dispatcher", dispatcher, "--ep-comm-sms", "24"]) == 0
        best[dispatcher] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ranked"][0]
    deepep = best["deepep"]
    assert deepep["job"]["dispatcher"] == "deepep" and deepep["job"]["ep_comm_sms"] == 24
    assert deepep["step_time_s"] < best["ragged"]["step_time_s"]
    layout, job = deepep["layout"], Job(**deepep["job"])
    tokens = job.seq_len // layout["cp"] * job.micro_batch
    per_layer = nd.bytes_sent(load_model("deepseek-v3"), Placement(64, 8), job, tokens)
    microbatches = job.global_batch // (job.micro_batch * layout["dp"])
    assert deepep["comm_bytes"]["all_to_all/ep"] == microbatches * sum(per_layer)  # stage 0: one MoE layer


def test_group_limits_are_checked():
    with pytest.raises(ValueError, match="groups_per_token=5 needs"):
        _moe(expert_groups=4, groups_per_token=5)
    with pytest.raises(ValueError, match="groups_per_token=1 needs"):
        _moe(expert_groups=3, groups_per_token=1)  # 3 groups cannot split 8 experts
    with pytest.raises(ValueError, match="ep_comm_sms=-1"):
        Job(seq_len=8, ep_comm_sms=-1)
