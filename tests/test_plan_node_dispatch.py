"""The "deepep" dispatcher's pricing (plan.node_dispatch) and group-limited routing: fan-out, bytes and time
worked out by hand, the expectations checked by enumerating every choice of groups and experts, the SMs hidden
traffic costs, and what the planner refuses."""

import itertools
import json
from dataclasses import replace
from math import comb

import pytest

from orangetron.cli import main as run
from orangetron.plan import node_dispatch as nd
from orangetron.plan.network import DEFAULT_PARAMS, Placement
from orangetron.plan.timing import step_time
from orangetron.plan.traffic import expert_parallel_records, step_records
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec, load_model
from orangetron.spec.options import Degrees, Job, validate

P = DEFAULT_PARAMS


def _moe(experts=8, top_k=2, hidden=64, **kw) -> ModelSpec:
    return ModelSpec(name="moe", hidden_size=hidden, num_layers=2, num_heads=4, vocab_size=128, num_experts=experts,
                     top_k=top_k, moe_ffn_hidden_size=32, **kw)


def _enumerated_reach(experts: int, top_k: int, bins: int, groups: int, per_token: int) -> float:
    """Average distinct bins over every choice of `per_token` groups and every set of top_k of their experts
    (all experts when there are no groups)."""
    group, width = (experts // groups, experts // bins) if groups else (experts, experts // bins)
    choices = list(itertools.combinations(range(groups), per_token)) if groups else [(0,)]
    total = count = 0
    for chosen in choices:
        pool = [e for g in chosen for e in range(g * group, (g + 1) * group)]
        for pick in itertools.combinations(pool, top_k):
            total += len({e // width for e in pick})
            count += 1
    return total / count


@pytest.mark.parametrize("experts,top_k,bins,groups,per_token", [
    (8, 2, 4, 0, 0), (8, 3, 4, 0, 0), (6, 6, 3, 0, 0),  # no limit
    (16, 3, 8, 4, 2), (16, 4, 8, 8, 4),  # groups span whole bins
    (16, 3, 4, 8, 2), (16, 4, 2, 8, 3),  # bins hold whole groups
    (24, 4, 4, 6, 2), (12, 2, 3, 4, 2), (24, 3, 8, 6, 3),  # groups straddle bins
])
def test_reach_equals_the_average_over_every_choice(experts, top_k, bins, groups, per_token):
    expected = _enumerated_reach(experts, top_k, bins, groups, per_token)
    assert nd.reach(experts, top_k, bins, groups, per_token) == pytest.approx(expected)


def test_fanout_by_hand():
    """8 experts, top 2, ep 8 on 4 nodes of 2 GPUs (one expert each). A bin is missed with probability
    C(6,2)/C(8,2) = 15/28: 4 * 13/28 = 13/7 nodes reached, 3/4 of them remote (39/28); a GPU is missed with
    probability C(7,2)/C(8,2) = 3/4, so 2 GPUs reached, the forwarding GPU's own half of them not over NVLink."""
    f = nd.fanout(_moe(), Placement(8, 2))
    assert f.remote_nodes == pytest.approx(39 / 28)
    assert f.nvlink_rows == pytest.approx(1.0)
    one_node = nd.fanout(_moe(), Placement(8, 8))
    assert one_node.remote_nodes == 0 and one_node.nvlink_rows == pytest.approx(2 * 7 / 8)


def test_group_limited_routing_by_hand():
    """DeepSeek-V3: 256 experts, top 8, 4 of 8 groups of 32. On ep 64 = 8 nodes a group is a node: a chosen node
    (probability 1/2) holds 32 of the 128 allowed experts. On ep 32 = 4 nodes a node holds two groups, of which
    0, 1 or 2 are chosen with probability 15/70, 40/70, 15/70, holding 0, 32 or 64 of the 128 allowed; a GPU
    (8 experts) lies in one group."""
    v3 = load_model("deepseek-v3")

    def hit(allowed_here: int) -> float:
        return 1 - comb(128 - allowed_here, 8) / comb(128, 8)

    assert nd.fanout(v3, Placement(64, 8)).remote_nodes == pytest.approx(8 * 0.5 * hit(32) * 7 / 8)
    four = nd.fanout(v3, Placement(32, 8))
    node_hit = 40 / 70 * hit(32) + 15 / 70 * hit(64)
    assert four.remote_nodes == pytest.approx(4 * node_hit * 3 / 4)
    assert four.nvlink_rows == pytest.approx(32 * 0.5 * hit(8) * 7 / 8)
    unlimited = replace(v3, expert_groups=0, groups_per_token=0)
    assert nd.fanout(v3, Placement(32, 8)).remote_nodes < nd.fanout(unlimited, Placement(32, 8)).remote_nodes


def test_balanced_routing_reaches_the_most_ranks_its_groups_allow():
    """The ragged dispatcher's convention: each token on min(top_k, the most ranks its groups can reach).
    DeepSeek-V2 (top 6, 3 of 8 groups of 20): 3 ranks at ep 4 (two groups per rank) and ep 8 (one), 6 at ep 16
    (each group two ranks), and at ep 10 a group of 20 experts straddles at most 3 ranks of 16, so 6 again;
    Mixtral has no groups. The runtime's router groups (`n_expert_groups`, `topk_groups`) reach the planner."""
    v2 = load_model("deepseek-v2")
    assert [v2.routed_ranks(e) for e in (4, 8, 10, 16)] == [3, 3, 6, 6]
    assert [v2.allowed_bins(e) for e in (4, 8, 10, 16)] == [3, 3, 6, 6]  # a group of 20 crosses 2 ranks of 16
    for experts, bins, groups in ((12, 3, 2), (12, 4, 3), (36, 9, 4), (20, 4, 5), (30, 6, 5), (60, 12, 5)):
        model = _moe(experts=experts, top_k=2, expert_groups=groups, groups_per_token=1)
        width = experts // bins
        most = max(len({e // width for e in range(g * experts // groups, (g + 1) * experts // groups)})
                   for g in range(groups))
        assert model.allowed_bins(bins) == most, (experts, bins, groups)
    assert load_model("mixtral-8x7b").routed_ranks(8) == 2
    from orangetron.model.config import ModelConfig

    def runtime_model(groups: int, per_token: int) -> ModelSpec:
        return ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=32, n_experts=8,
                           top_k=2, n_expert_groups=groups, topk_groups=per_token)

    spec = runtime_model(4, 1)  # the runtime's names set the schema's group limit
    assert (spec.expert_groups, spec.groups_per_token, spec.routed_ranks(4)) == (4, 1, 1)
    assert runtime_model(1, 1).routed_ranks(4) == 2  # one group: no limit


def test_bytes_sent_by_hand():
    """28 tokens, 67/28 copies each (39/28 over RDMA, 1 over NVLink). Forward dispatch: 64 bf16 values and 2
    indices and 2 weights of 4 bytes (144 B); combine 128 B; backward sends the output gradients the dispatch
    way (128 B) and the input gradients back (128 B); full recompute repeats the forward. Under the blockwise
    FP8 recipe a 256-wide token dispatches as 256 B plus two float32 scales."""
    job = Job(seq_len=28)
    assert nd.bytes_sent(_moe(), Placement(8, 2), job, 28) == [67 * 144, 67 * 128, 67 * 128, 67 * 128]
    full = nd.bytes_sent(_moe(), Placement(8, 2), replace(job, recompute="full"), 28)
    assert full == [67 * 144, 67 * 128] * 2 + [67 * 128, 67 * 128]
    fp8 = replace(job, fp8=True, fp8_recipe="blockwise")
    assert nd.row_bytes(_moe(hidden=256), fp8) == (256 + 8 + 16, 256 + 8, 512)
    assert nd.row_bytes(_moe(hidden=256), replace(fp8, fp8_recipe="delayed")) == (512 + 16, 512, 512)


def _two_legs(rows_rdma: float, rows_nvlink: float, row: int, cluster) -> float:
    rdma = P.inter_latency_s + rows_rdma * row / min(50e9 * P.inter_efficiency, row * P.proxy_msg_rate)
    nvlink = P.intra_latency_s + rows_nvlink * row / (cluster.gpu.intra_bw_gbs * 1e9 * P.intra_efficiency)
    return max(rdma, nvlink)


@pytest.mark.parametrize("hidden", [4096, 64])  # bandwidth bound, and message-rate bound (144-byte rows)
def test_layer_time_by_hand(hidden):
    """H100 nodes of 2 (NDR 400 Gb/s per GPU at 90%, NVLink 450 GB/s at 80%, a CPU proxy posting 22 M rows/s):
    each of the four transfers takes the slower of 28 * 39/28 rows over RDMA and 28 rows over NVLink; full
    recompute adds a forward dispatch and combine; inside one node only NVLink carries the 28 * 7/4 rows."""
    model, cluster = _moe(hidden=hidden), make_cluster("h100", 8, 2)
    forward, backward, combine = 2 * hidden + 16, 2 * hidden, 2 * hidden
    legs = {row: _two_legs(39, 28, row, cluster) for row in (forward, backward, combine)}
    none = legs[forward] + legs[backward] + 2 * legs[combine]
    assert nd.layer_time(model, Placement(8, 2), Job(seq_len=28), 28, cluster, P) == pytest.approx(none)
    full = nd.layer_time(model, Placement(8, 2), Job(seq_len=28, recompute="full"), 28, cluster, P)
    assert full == pytest.approx(none + legs[forward] + legs[combine])
    one_node = sum(P.intra_latency_s + 28 * 7 / 4 * row / (450e9 * P.intra_efficiency)
                   for row in (forward, combine, backward, combine))
    one_cluster = make_cluster("h100", 8)
    assert nd.layer_time(model, Placement(8, 8), Job(seq_len=28), 28, one_cluster, P) == pytest.approx(one_node)


def test_fewer_sms_than_saturate_the_links_slow_the_transfers():
    model, cluster, where = _moe(hidden=4096), make_cluster("h100", 8, 2), Placement(8, 2)
    time = {s: nd.layer_time(model, where, Job(seq_len=28, ep_comm_sms=s), 28, cluster, P) for s in (10, 20, 40)}
    assert time[10] == pytest.approx(2 * time[20])
    assert time[40] == time[20]


def _v3_job(**kw) -> Job:
    return Job(seq_len=4096, global_batch=15360, zero_stage=1, fp8=True, fp8_recipe="blockwise", dispatcher="deepep",
               **kw)


def test_v3_blockwise_recipe_prices_its_gemms_below_per_tensor_scaling():
    """DeepSeek-V3's recipe on H800: every linear GEMM of a layer at 4096 tokens is compute bound, so promoting
    the partial sums to FP32 every 128 elements of K shows whole: blockwise GEMMs take 0.70/0.65 of per-tensor
    (`delayed`) scaling's time (the preset's `gemm_efficiency` against its `fp8_blockwise_gemm_efficiency`),
    forward and backward, dense and MoE layers alike, the routed experts too; attention stays 16-bit."""
    from orangetron.plan.timing import layer_cost

    model, deg, cluster = load_model("deepseek-v3"), Degrees(pp=16, dp=128, ep=64), make_cluster("h800", 2048)
    per_tensor = replace(_v3_job(), fp8_recipe="delayed")
    ratio = cluster.gpu.gemm_efficiency / cluster.gpu.fp8_blockwise_gemm_efficiency
    assert ratio == pytest.approx(0.70 / 0.65)
    for moe in (False, True):
        blockwise = layer_cost(model, deg, _v3_job(), cluster, moe)
        delayed = layer_cost(model, deg, per_tensor, cluster, moe)
        assert blockwise.gemm_f == pytest.approx(ratio * delayed.gemm_f)
        assert blockwise.gemm_b == pytest.approx(ratio * delayed.gemm_b)
        assert blockwise.experts_f == pytest.approx(ratio * delayed.experts_f)
        assert blockwise.attention_f == delayed.attention_f
    assert step_time(model, deg, _v3_job(), cluster).step_s > step_time(model, deg, per_tensor, cluster).step_s


def test_hidden_traffic_costs_the_sms_its_kernels_hold():
    """DeepSeek-V3 on 2048 H800 (pp 16 split evenly: the last stage, 3 MoE layers, the MTP module's MoE layer and
    two passes through the head, is the slowest) with paired micro-batches hides every transfer: what remains of
    it is 120 micro-batches x 4 layers x the layer's traffic x 20/132, its kernels' share of the SMs (40 SMs:
    40/132 of a traffic twice as fast to hide)."""
    model, deg, cluster = load_model("deepseek-v3"), Degrees(pp=16, dp=128, ep=64), make_cluster("h800", 2048)
    for sms in (20, 40):
        job = _v3_job(ep_comm_sms=sms)
        traffic = nd.layer_time(model, Placement(64, 8), job, 4096, cluster, P)
        assert step_time(model, deg, job, cluster).ep_s == pytest.approx(120 * 4 * traffic * sms / 132)
    with pytest.raises(ValueError, match="ep_comm_sms=132: the h800 has 132 SMs"):
        step_time(model, deg, _v3_job(ep_comm_sms=132), cluster)


def test_sms_set_aside_for_the_step_slow_every_layers_compute_instead():
    """With DeepSeek-V3's 20 of 132 SMs reserved, its layers compute on an H800 of 112 SMs and 112/132 of each
    peak (built here by hand), the hidden traffic costs nothing more, and only its exposed part remains: none,
    behind paired micro-batches. The dense model is not touched."""
    from orangetron.spec.hardware import GPUSpec

    model, deg, cluster = load_model("deepseek-v3"), Degrees(pp=16, dp=128, ep=64), make_cluster("h800", 2048)
    h800 = cluster.gpu
    left = GPUSpec(**{**vars(h800), "sms": 112, "bf16_tflops": 989.4 * 112 / 132,
                      "fp32_tflops": 66.9 * 112 / 132, "fp8_tflops": 1978.9 * 112 / 132})
    assert h800.without_sms(20) == left
    reserved = step_time(model, deg, _v3_job(ep_comm_sms_reserved=True), cluster)
    by_hand = step_time(model, deg, _v3_job(), replace(cluster, gpu=left))
    assert reserved.compute_s == pytest.approx(by_hand.compute_s)
    assert reserved.ep_s == 0 < by_hand.ep_s
    dense, dp8 = load_model("llama3-8b"), Degrees(dp=8)
    job = Job(seq_len=4096, global_batch=8, dispatcher="deepep")
    assert step_time(dense, dp8, replace(job, ep_comm_sms_reserved=True), make_cluster("h800", 8)) == \
        step_time(dense, dp8, job, make_cluster("h800", 8))
    # Every layer computes on the SMs left, the dense ones too (stage 0: three dense layers and one MoE), and MFU
    # stays against the whole GPU's peak.
    from orangetron.plan.network import NetworkParams
    from orangetron.plan.timing import DEFAULT_EFFICIENCY, _stage_time

    first = _stage_time(model, deg, _v3_job(ep_comm_sms_reserved=True), cluster, 0, NetworkParams(), DEFAULT_EFFICIENCY)
    first_by_hand = _stage_time(model, deg, _v3_job(), replace(cluster, gpu=left), 0, NetworkParams(),
                                DEFAULT_EFFICIENCY)
    assert first.compute == pytest.approx(first_by_hand.compute)
    assert reserved.mfu == pytest.approx(reserved.model_flops / reserved.step_s / (2048 * 989.4e12))
    with pytest.raises(ValueError, match="ep_comm_sms_reserved needs dispatcher='deepep'"):
        Job(seq_len=64, ep_comm_sms_reserved=True)
    with pytest.raises(ValueError, match="132 reserved SMs: the h800 has 132"):
        h800.without_sms(132)


def test_exposed_traffic_follows_each_ranks_tokens():
    """Mixtral, tp 2 with SP, ep 4 inside one node, no overlap and no shared experts: all 32 layers' traffic is
    exposed, each rank routing its 2048-token half of the sequence."""
    model, deg, cluster = load_model("mixtral-8x7b"), Degrees(tp=2, dp=4, ep=4), make_cluster("h100", 8)
    job = Job(seq_len=4096, global_batch=4, sequence_parallel=True, overlap_ep=False, dispatcher="deepep")
    traffic = nd.layer_time(model, Placement(4, 4), job, 2048, cluster, P)
    assert step_time(model, deg, job, cluster).ep_s == pytest.approx(32 * traffic)


def test_deepseek_v3_sends_under_half_the_rows_over_infiniband():
    """Per MoE layer the ragged dispatcher sends each token to its 4 allowed destination GPUs (balanced
    convention), 7/8 of them off node; the deepep dispatcher sends it to about 3.2 remote nodes in FP8."""
    model, deg = load_model("deepseek-v3"), Degrees(pp=16, dp=128, ep=64)
    job = Job(seq_len=4096, global_batch=15360, zero_stage=1, overlap_ep=False)
    cluster = make_cluster("h800", 2048)
    ragged, deepep = (step_time(model, deg, replace(job, dispatcher=d), cluster).ep_s for d in ("ragged", "deepep"))
    assert deepep < ragged


def test_traffic_records_need_the_placement_and_the_runtime_refuses_deepep():
    from orangetron.parallel.config import ParallelConfig, check_runnable
    from orangetron.spec.rules import RuleError

    job = Job(seq_len=28, dispatcher="deepep")
    with pytest.raises(ValueError, match="deepep"):
        expert_parallel_records(_moe(), Degrees(dp=8, ep=8), job)
    records = expert_parallel_records(_moe(), Degrees(dp=8, ep=8), job, Placement(8, 2))
    assert [r.bytes_sent for r in records] == nd.bytes_sent(_moe(), Placement(8, 2), job, 28)
    with pytest.raises(RuleError, match="dispatcher='deepep': priced by the planner only; the runtime runs ragged"):
        check_runnable(ParallelConfig(dispatcher="deepep"))


def test_estimate_reports_deepep_traffic(capsys):
    """DeepSeek-V3 on 2048 H800: stage 0 holds the 3 dense layers and 1 MoE layer, whose four transfers per
    micro-batch over 120 micro-batches send the bytes of `bytes_sent`."""
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
    assert run([*args, "--ep-comm-sms-reserved"]) == 0
    reserved = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert reserved["job"]["ep_comm_sms_reserved"] and reserved["comm"] == out["comm"]
    assert reserved["time_breakdown_s"]["compute_s"] > out["time_breakdown_s"]["compute_s"]
    assert reserved["time_breakdown_s"]["ep_s"] == 0 < out["time_breakdown_s"]["ep_s"]


def test_plan_searches_with_the_chosen_dispatcher(capsys):
    """`plan --dispatcher deepep --ep-comm-sms 24` ranks layouts priced with that dispatcher and SM count; the best
    deepep layout is faster than the best ragged one at ep 64 across 8 nodes, and its EP bytes equal the
    dispatcher's own count for the tokens each rank routes."""
    args = ["plan", "--model", "deepseek-v3", "--gpu", "h800", "--gpus", "2048", "--seq", "4096", "--global-batch",
            "15360", "--fp8", "--fp8-recipe", "blockwise", "--pp", "16", "--ep", "64", "--top", "1", "--json"]
    best = {}
    for dispatcher in ("ragged", "deepep"):
        assert run([*args, "--dispatcher", dispatcher, "--ep-comm-sms", "24"]) == 0
        best[dispatcher] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ranked"][0]
    deepep = best["deepep"]
    assert deepep["job"]["dispatcher"] == "deepep" and deepep["job"]["ep_comm_sms"] == 24
    assert deepep["step_time_s"] < best["ragged"]["step_time_s"]
    layout, job = deepep["layout"], Job.from_json(deepep["job"])
    tokens = job.seq_len // layout["cp"] * job.micro_batch // (layout["tp"] if job.sequence_parallel else 1)
    per_layer = nd.bytes_sent(load_model("deepseek-v3"), Placement(64, 8), job, tokens)
    microbatches = job.global_batch // (job.micro_batch * layout["dp"])
    assert deepep["comm_bytes"]["all_to_all/ep"] == microbatches * sum(per_layer)  # stage 0: one MoE layer


def test_plan_keeps_the_sms_set_aside(capsys):
    """`plan --ep-comm-sms-reserved` prices what `estimate` does with the flag for the layout it ranks first."""
    args = ["--model", "deepseek-v3", "--gpu", "h800", "--gpus", "2048", "--seq", "4096", "--global-batch", "15360",
            "--fp8", "--fp8-recipe", "blockwise", "--dispatcher", "deepep", "--ep-comm-sms-reserved", "--json"]
    assert run(["plan", *args, "--pp", "16", "--ep", "64", "--top", "1"]) == 0
    best = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ranked"][0]
    assert best["job"]["ep_comm_sms_reserved"]
    job = Job.from_json(best["job"])
    deg = Degrees(**{k: v for k, v in best["layout"].items() if k != "edp"})
    assert best["step_time_s"] == pytest.approx(step_time(load_model("deepseek-v3"), deg, job,
                                                          make_cluster("h800", 2048)).step_s)
    assert best["step_time_s"] > step_time(load_model("deepseek-v3"), deg, replace(job, ep_comm_sms_reserved=False),
                                           make_cluster("h800", 2048)).step_s


def test_layouts_deepep_cannot_run_are_refused(capsys):
    """EP groups must be whole nodes or lie inside one. On nodes of 8: tp 2 x ep 8 puts 4 ranks of each group
    on each of two nodes (refused); tp 2 x ep 4 covers ranks 0-7 (accepted); ep 6 and ep 12 straddle nodes, ep
    16 is two whole nodes. Experts split over tp (etp > 1) and an SM count DeepEP does not take are refused."""
    args = ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "16", "--tp", "2", "--dp", "8", "--ep", "8",
            "--sequence-parallel", "--dispatcher", "deepep"]
    assert run(args) == 2
    assert "groups of 8 ranks span 16 consecutive ranks, 4 of them on a node of 8" in capsys.readouterr().err
    one_node = ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--tp", "2", "--dp", "4", "--ep", "4",
                "--sequence-parallel", "--dispatcher", "deepep"]
    assert run(one_node) == 0
    capsys.readouterr()
    model, cluster = _moe(experts=96, hidden=256), make_cluster("h100", 48)
    job = Job(seq_len=256, global_batch=48, dispatcher="deepep")
    for ep in (6, 12):
        with pytest.raises(ValueError, match=f"groups of {ep} ranks span {ep} consecutive ranks"):
            step_time(model, Degrees(dp=48, ep=ep), job, cluster)
    assert step_time(model, Degrees(dp=48, ep=16), job, cluster).ep_s > 0
    with pytest.raises(ValueError, match="etp=2 with dispatcher 'deepep'"):
        validate(load_model("qwen3-30b-a3b"), Degrees(tp=2, dp=8, ep=8, etp=2, expert_fold=True),
                 Job(seq_len=4096, sequence_parallel=True, dispatcher="deepep"))
    for sms in (0, 7):
        with pytest.raises(ValueError, match=f"ep_comm_sms={sms}: DeepEP takes an even number of SMs"):
            Job(seq_len=8, ep_comm_sms=sms)


def test_group_limits_are_checked():
    with pytest.raises(ValueError, match=r"expert_groups=4: requires num_experts > 0"):
        ModelSpec(name="dense", hidden_size=64, num_layers=2, num_heads=4, vocab_size=128, ffn_hidden_size=128,
                  expert_groups=4, groups_per_token=2)
    with pytest.raises(ValueError, match=r"groups_per_token=0: must be in 1..expert_groups=4"):
        _moe(expert_groups=4)
    with pytest.raises(ValueError, match=r"groups_per_token=5: must be in 1..expert_groups=4"):
        _moe(expert_groups=4, groups_per_token=5)
    with pytest.raises(ValueError, match=r"expert_groups=3: num_experts 8 is not divisible by expert_groups"):
        _moe(expert_groups=3, groups_per_token=1)  # 3 groups cannot split 8 experts
    with pytest.raises(ValueError, match=r"top_k=4: must be at most groups_per_token \* experts per group = 2"):
        _moe(top_k=4, expert_groups=8, groups_per_token=2)
