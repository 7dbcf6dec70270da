"""Which stages bound a pipeline (plan/stages.py `distinct_stages`): worked by hand, then checked against every
stage for time (`timing.step_time`) and memory (`memory.memory_per_gpu`)."""

from dataclasses import replace

import pytest

from orangetron.plan.memory import _stage_total, memory_per_gpu, stage_memory
from orangetron.plan.network import NetworkParams
from orangetron.plan.timing import DEFAULT_EFFICIENCY, _stage_time, step_time
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.stages import distinct_stages


def dense(layers: int) -> ModelSpec:
    return ModelSpec(name="dense", hidden_size=256, num_layers=layers, num_heads=4, vocab_size=1000,
                     ffn_hidden_size=1024)


def dense_first_moe(layers: int, first_dense: int = 1) -> ModelSpec:
    # A cheap dense layer before MoE layers of 8 experts, top 2 (DeepSeek's layout, in small).
    return ModelSpec(name="moe", hidden_size=256, num_layers=layers, num_heads=4, vocab_size=1000,
                     ffn_hidden_size=256, num_experts=8, top_k=2, moe_ffn_hidden_size=1024,
                     first_dense_layers=first_dense)


def test_distinct_stages_by_hand():
    # 10 layers over 4 stages: 3, 3, 2, 2. First (3), a middle stage of 3, a middle stage of 2, last (2).
    assert distinct_stages(dense(10), 4, 1) == (0, 1, 2, 3)
    # 12 over 6: 2 each; the four middle stages are alike.
    assert distinct_stages(dense(12), 6, 1) == (0, 1, 5)
    # 8 layers, the first dense, over 3 stages: (3, 2 MoE), (3, 3 MoE), (2, 2 MoE).
    assert distinct_stages(dense_first_moe(8), 3, 1) == (0, 1, 2)
    # Interleaved, 16 layers in 8 chunks of 2 over 4 stages: stage 0 holds layers 0-1 and 8-9 (3 MoE), the
    # others 4 MoE: first, one middle, last.
    assert distinct_stages(dense_first_moe(16), 4, 2) == (0, 1, 3)
    assert distinct_stages(dense(7), 1, 1) == (0,)
    # MoE every second layer (1, 3, 5, ...), 12 layers over 4 stages of 3: the middle stages hold 2 and 1 MoE
    # layers, two kinds although their layer counts are equal.
    alternating = ModelSpec(name="alt", hidden_size=256, num_layers=12, num_heads=4, vocab_size=1000,
                            ffn_hidden_size=1024, num_experts=8, top_k=2, moe_ffn_hidden_size=256,
                            moe_layer_freq=2)
    assert distinct_stages(alternating, 4, 1) == (0, 1, 2, 3)


def test_the_slowest_stage_sets_the_pace_even_in_the_middle():
    """Stage 1 (three MoE layers) is slower than stage 0 (a cheap dense layer and two MoE) and the last stage
    (two MoE layers and a small head): the step runs at its pace, not at the first or last stage's."""
    model, deg = dense_first_moe(8), Degrees(pp=3, dp=2, ep=2)
    job, cluster = Job(seq_len=512, global_batch=16), make_cluster("h100", 6)
    stages = [_stage_time(model, deg, job, cluster, s, NetworkParams(), DEFAULT_EFFICIENCY) for s in range(3)]
    slowest = max(range(3), key=lambda s: stages[s].total)
    assert slowest == 1
    m = job.replica_microbatches(deg)
    t = step_time(model, deg, job, cluster)
    assert t.compute_s == pytest.approx(m * stages[1].compute)
    assert t.bubble_s == pytest.approx(2 * stages[1].total)


@pytest.mark.parametrize("model,deg,job", [
    (dense_first_moe(8), Degrees(pp=3, dp=2, ep=2), Job(seq_len=512, global_batch=16)),
    (dense_first_moe(16, 3), Degrees(pp=4, dp=2, ep=2), Job(seq_len=512, global_batch=32, zero_stage=1)),
    (dense_first_moe(16), Degrees(pp=4, dp=2, ep=2),
     Job(seq_len=512, global_batch=32, virtual_stages=2, pp_schedule="interleaved")),
    (dense(10), Degrees(pp=4, tp=2), Job(seq_len=512, global_batch=16, sequence_parallel=True)),
])
def test_memory_is_that_of_the_busiest_of_all_stages(model, deg, job):
    busiest = max(range(deg.pp), key=lambda s: _stage_total(model, deg, job, s))
    assert memory_per_gpu(model, deg, job) == stage_memory(model, deg, job, busiest)


def _layouts():
    """Small layouts where stages differ: dense-first MoE, MoE every second or third layer, uneven splits,
    interleaving, full recompute, a middle stage that sends and receives both ways."""
    out = []
    for layers, first_dense, freq in ((8, 1, 1), (9, 1, 3), (10, 0, 2), (12, 2, 3), (8, 0, 3)):
        model = ModelSpec(name="mix", hidden_size=128, num_layers=layers, num_heads=4, vocab_size=512,
                          ffn_hidden_size=256, num_experts=4, top_k=2, moe_ffn_hidden_size=1024,
                          first_dense_layers=first_dense, moe_layer_freq=freq)
        for pp, v in ((3, 1), (4, 1), (5, 1), (4, 2), (2, 2)):
            if layers < pp * v:
                continue
            for recompute, replayed in (("none", 0), ("full", 0), ("full", 1)):  # 1: each chunk's first layer
                job = Job(seq_len=256, global_batch=8, virtual_stages=v, recompute=recompute,
                          recompute_layers=replayed, pp_schedule="interleaved" if v > 1 else "1f1b")
                out.append((model, Degrees(pp=pp, dp=2, ep=2), job))
    out.append((dense(12), Degrees(pp=4), Job(seq_len=256, global_batch=8)))  # middle stages pay both ways
    # Layouts: a heavy middle stage, a last stage of one layer, an empty chunk, interleaved and replayed.
    moe = dense_first_moe(12)
    for layout in ((2, 5, 4, 1), (4, 4, 4, 0), ()):  # with an MTP module on the last stage
        out.append((replace(moe, mtp_layers=1), Degrees(pp=4, dp=2, ep=2),
                    Job(seq_len=256, global_batch=16, pipeline_layout=layout)))
    for layout, v in (((2, 5, 4, 1), 1), ((4, 4, 4, 0), 1), ((1, 2, 2, 3, 1, 1, 1, 1), 2)):
        for recompute, replayed in (("none", 0), ("full", 0), ("full", 1)):
            out.append((moe, Degrees(pp=4, dp=2, ep=2),
                        Job(seq_len=256, global_batch=16, virtual_stages=v, recompute=recompute, pipeline_layout=layout,
                            recompute_layers=replayed, pp_schedule="interleaved" if v > 1 else "1f1b")))
    # 12 layers, the first dense, MoE every second after it, in 8 chunks over 4 stages: stages 1 and 2 have
    # alike first chunks (a MoE, then a dense layer) but different second ones.
    alternating = ModelSpec(name="alt", hidden_size=128, num_layers=12, num_heads=4, vocab_size=512,
                            ffn_hidden_size=256, num_experts=4, top_k=2, moe_ffn_hidden_size=1024,
                            first_dense_layers=1, moe_layer_freq=2)
    out.append((alternating, Degrees(pp=4, dp=2, ep=2),
                Job(seq_len=256, global_batch=16, virtual_stages=2, pp_schedule="interleaved")))
    return out


def test_time_and_memory_bound_every_stage():
    """Against every stage: the step's pace is the slowest stage's total (compute and exposed traffic), and the
    memory report is the fullest stage's."""
    cluster, net = make_cluster("h100", 16), NetworkParams()
    for model, deg, job in _layouts():
        stages = [_stage_time(model, deg, job, cluster, s, net, DEFAULT_EFFICIENCY) for s in range(deg.pp)]
        slowest = max(st.total for st in stages)
        v = job.virtual_stages
        assert step_time(model, deg, job, cluster).bubble_s == pytest.approx((deg.pp - 1) / v * slowest)
        fullest = max(range(deg.pp), key=lambda s: _stage_total(model, deg, job, s))
        assert memory_per_gpu(model, deg, job) == stage_memory(model, deg, job, fullest), (model, deg, job)


def test_pipeline_layout_by_hand():
    """A layout lists each virtual stage's layers in order; chunk g runs on rank g % pp."""
    from orangetron.spec.stages import chunk_layers, longest_chunk, stage_layers

    assert chunk_layers(10, 4, (4, 3, 2, 1)) == [range(0, 4), range(4, 7), range(7, 9), range(9, 10)]
    assert chunk_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    # pp 2, v 2: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3.
    assert stage_layers(10, 2, 2, 0, (1, 3, 3, 3)) == (0, 4, 5, 6)
    assert stage_layers(10, 2, 2, 1, (1, 3, 3, 3)) == (1, 2, 3, 7, 8, 9)
    assert longest_chunk(10, 2, 2, (1, 3, 5, 1)) == 5 and longest_chunk(10, 2, 2) == 3
    # A stage may hold no decoder layer (Megatron's layouts give the loss a stage of its own).
    assert stage_layers(4, 2, 1, 1, (4, 0)) == ()
    assert distinct_stages(dense(10), 4, 1, (4, 2, 2, 2)) == (0, 1, 3)


def test_pipeline_layout_is_checked():
    from orangetron.spec.options import validate

    with pytest.raises(ValueError, match=r"pipeline_layout has 3 virtual stages; pp\*virtual_stages is 4"):
        validate(dense(10), Degrees(pp=4), Job(seq_len=256, pipeline_layout=(4, 3, 3)))
    with pytest.raises(ValueError, match=r"pipeline_layout holds 11 layers; dense has 10"):
        validate(dense(10), Degrees(pp=4), Job(seq_len=256, pipeline_layout=(4, 3, 3, 1)))
    with pytest.raises(ValueError, match=r"layers per virtual stage must be integers >= 0"):
        Job(seq_len=256, pipeline_layout=(4, -1))
    assert Job(seq_len=256, pipeline_layout=[2, 2]).pipeline_layout == (2, 2)  # from JSON


def test_pipeline_layout_moves_parameters_not_their_sum():
    """Every layer's parameters sit on exactly one stage whatever the split; a last stage with one layer holds
    that layer, the final norm and the head."""
    from orangetron.plan.params import stage_params

    model, deg = dense_first_moe(10), Degrees(pp=4, dp=2, ep=2)
    even = [stage_params(model, deg, s).total for s in range(4)]
    uneven = [stage_params(model, deg, s, 1, (4, 3, 2, 1)).total for s in range(4)]
    assert sum(uneven) == sum(even) and uneven != even
    one_layer = stage_params(model, deg, 3, 1, (4, 3, 2, 1)).total
    two_layers = stage_params(model, deg, 3, 1, (4, 2, 2, 2)).total
    assert two_layers - one_layer == stage_params(model, deg, 1, 1, (4, 1, 3, 2)).total - \
        stage_params(model, deg, 1, 1, (4, 0, 4, 2)).total  # one MoE layer's share, on the last stage or not


def test_plan_cli_pipeline_layout(capsys):
    import json

    from orangetron.cli import main

    args = ["estimate", "--model", "llama3-8b", "--gpus", "4", "--pp", "4", "--seq", "2048", "--global-batch", "16",
            "--json"]
    assert main([*args, "--pipeline-layout", "10x3,2"]) == 0
    uneven = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert uneven["job"]["pipeline_layout"] == [10, 10, 10, 2]
    assert main(args) == 0
    even = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--pipeline-layout", "5x3,17"]) == 0
    heavy_last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The 128k-word head costs about two layers: 8 layers and the head on the last stage set the even split's
    # pace, 10 layers a little less; 17 layers and the head far more.
    assert uneven["step_time_s"] < even["step_time_s"] < heavy_last["step_time_s"]
    assert main([*args, "--pipeline-layout", "8x4,1"]) == 2
    assert "pipeline_layout (--pipeline-layout) has 5 virtual stages" in capsys.readouterr().err


def test_pipeline_layout_reaches_replay_fp8_copies_and_the_optimizer():
    """Partial recompute replays the first layers of each of the layout's chunks; FP8 weight copies and the
    optimizer step follow the parameters a stage holds (here most of them on the last stage)."""
    from orangetron.plan.memory import stage_memory
    from orangetron.plan.timing import _optimizer_time
    from orangetron.spec.stages import replayed_layers

    # Chunks [0], [1-3], [4-6], [7-9]; stage 1 holds chunks 1 and 3.
    assert replayed_layers(10, 2, 2, 1, 1, (1, 3, 3, 3)) == {1, 7}
    assert replayed_layers(10, 2, 2, 0, 2, (1, 3, 3, 3)) == {0, 4, 5}
    model, deg = dense(8), Degrees(pp=2)

    def fp8(layout: tuple[int, ...], stage: int) -> int:
        return stage_memory(model, deg, Job(seq_len=256, fp8=True, pipeline_layout=layout), stage)["fp8"]

    from orangetron.plan.fp8 import AMAX_HISTORY, GEMMS_PER_LAYER

    # Per layer: an FP8 copy and its transpose of every weight, and each GEMM's three scales with their history.
    per_layer = 2 * model.layer_params(0) + GEMMS_PER_LAYER * 3 * (2 + AMAX_HISTORY) * 4
    assert fp8((2, 6), 1) - fp8((4, 4), 1) == 2 * per_layer and fp8((5, 3), 0) - fp8((4, 4), 0) == per_layer
    cluster, heavy = make_cluster("h100", 2), Job(seq_len=256, global_batch=4, pipeline_layout=(1, 7))
    step = step_time(model, deg, heavy, cluster)
    last = _optimizer_time(model, deg, heavy, cluster, DEFAULT_EFFICIENCY, 1)
    assert step.optimizer_s == last > _optimizer_time(model, deg, heavy, cluster, DEFAULT_EFFICIENCY, 0)


def test_replay_transient_of_every_chunk_of_an_interleaved_stage(monkeypatch):
    """An interleaved stage replays each of its chunks in turn: its peak takes the largest chunk's transient,
    here chunk 2's three layers where chunk 0 holds none (a transient of the first chunk alone would be 0)."""
    from orangetron.plan import activations

    seen = []
    original = activations._stage_replay_transient
    monkeypatch.setattr(activations, "_stage_replay_transient",
                        lambda m, deg, job, stage, layers: seen.append(tuple(layers)) or original(m, deg, job, stage,
                                                                                                  layers))
    job = Job(seq_len=256, global_batch=4, virtual_stages=2, pp_schedule="interleaved", recompute="full",
              pipeline_layout=(0, 4, 3, 1))
    activations._stage_activation_bytes.cache_clear()
    activations.stage_activation_bytes(dense(8), Degrees(pp=2), job, 0)
    assert seen == [(), (4, 5, 6)]
    whole = activations.layer_activation_bytes(dense(8), Degrees(pp=2), Job(seq_len=256), False)
    kept_input = activations.layer_activation_bytes(dense(8), Degrees(pp=2), job, False)
    assert original(dense(8), Degrees(pp=2), job, 0, (4, 5, 6)) == whole - kept_input  # the replay reuses it


def test_plan_cli_refuses_a_malformed_layout(capsys):
    from orangetron.cli import main

    args = ["estimate", "--model", "llama3-8b", "--gpus", "4", "--pp", "4", "--seq", "2048"]
    for bad in ("4x-1,32", "2x,3", "a,b"):
        with pytest.raises(SystemExit):
            main([*args, "--pipeline-layout", bad])
        assert "each item must be N or NxK" in capsys.readouterr().err
