"""Partial full recompute (`Job.recompute_layers`, Megatron's block method): the first N layers of each pipeline
chunk replay their forward, the rest keep everything. Worked by hand from the two uniform cases: a replayed
layer saves and costs what it does under full recompute, any other layer what it does under none."""

import json

import pytest

from orangetron.cli import main as run
from orangetron.plan.activations import layer_activation_bytes, stage_activation_bytes
from orangetron.plan.timing import layer_cost, replayed_share, step_time
from orangetron.plan.traffic import step_records
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.stages import replayed_layers


def model(layers: int = 6) -> ModelSpec:
    return ModelSpec(name="six", hidden_size=256, num_layers=layers, num_heads=4, vocab_size=1000,
                     ffn_hidden_size=1024)


def test_replayed_layers_are_the_first_of_each_chunk():
    # 10 layers over 2 stages x 2 chunks: chunks (0-2), (3-5), (6-7), (8-9); stage 0 holds chunks 0 and 2.
    assert replayed_layers(10, 2, 2, 0, 2) == {0, 1, 6, 7}
    assert replayed_layers(10, 2, 2, 1, 2) == {3, 4, 8, 9}
    assert replayed_layers(10, 2, 2, 0, 0) == {0, 1, 2, 6, 7}  # 0: every layer
    assert replayed_layers(10, 2, 1, 1, 9) == {5, 6, 7, 8, 9}  # more than a chunk holds: all of it
    # Uneven chunks (3, 3, 2, 2 over pp 4), 3 per chunk: every layer of every stage.
    assert replayed_share(model(10), Degrees(pp=4), Job(seq_len=64, recompute="full", recompute_layers=3)) == 1.0
    deg = Degrees(pp=2)
    assert replayed_share(model(10), Degrees(pp=2), Job(seq_len=64, recompute="full", recompute_layers=2)) == 0.4
    assert replayed_share(model(10), deg, Job(seq_len=64, recompute="full")) == 1.0
    assert replayed_share(model(10), deg, Job(seq_len=64)) == 0.0


def head_bytes(m: ModelSpec, tokens: int) -> int:
    """The last stage's output-layer buffers for one micro-batch, by hand: the final norm's and the projection's
    bf16 inputs, and the fp32 logits' gradient."""
    return 2 * 2 * tokens * m.hidden_size + 4 * tokens * m.vocab_size


def test_activations_by_hand():
    """pp = 1, one micro-batch in flight: two of six layers keep only their input. Backward replays them after
    the four kept layers' backward freed their activations, so the replay adds nothing to the peak. Under full
    recompute (nothing freed first) the replayed layer's activations but its input (the kept tensor itself) exist
    on top; the loss's backward has freed the output layer's buffers by then, so the peak is the larger of the
    end of forward and the replay."""
    m, deg = model(), Degrees()
    none, full = Job(seq_len=512), Job(seq_len=512, recompute="full")
    whole, kept_input = layer_activation_bytes(m, deg, none, False), layer_activation_bytes(m, deg, full, False)
    partial = Job(seq_len=512, recompute="full", recompute_layers=2)
    assert stage_activation_bytes(m, deg, partial, 0) == \
        stage_activation_bytes(m, deg, none, 0) - 2 * (whole - kept_input)
    head = head_bytes(m, 512)
    assert whole - kept_input > head  # here the replay, not the end of forward, is the peak
    assert stage_activation_bytes(m, deg, full, 0) == \
        stage_activation_bytes(m, deg, none, 0) - 6 * (whole - kept_input) - head + (whole - kept_input)
    assert stage_activation_bytes(m, deg, Job(seq_len=512, recompute="full", recompute_layers=6), 0) == \
        stage_activation_bytes(m, deg, full, 0)


def test_full_recompute_replays_the_largest_layer_on_top():
    """A dense first layer before five MoE layers, all replayed: the transient is a MoE layer's activations
    (less its kept input), the largest of the stage, not the first layer's."""
    moe = ModelSpec(name="moe", hidden_size=256, num_layers=6, num_heads=4, vocab_size=1000, ffn_hidden_size=256,
                    num_experts=4, top_k=2, moe_ffn_hidden_size=1024, first_dense_layers=1)
    deg, none, full = Degrees(ep=2, dp=2), Job(seq_len=512), Job(seq_len=512, recompute="full")
    dense_in, moe_in = (layer_activation_bytes(moe, deg, full, k) for k in (False, True))
    moe_whole = layer_activation_bytes(moe, deg, none, True)
    assert moe_whole > layer_activation_bytes(moe, deg, none, False)
    buffers = stage_activation_bytes(moe, deg, none, 0) - 5 * moe_whole - layer_activation_bytes(moe, deg, none, False)
    head = head_bytes(moe, 512)
    assert moe_whole - moe_in > head
    assert stage_activation_bytes(moe, deg, full, 0) == buffers - head + dense_in + 5 * moe_in + moe_whole - moe_in


def test_interleaved_activations_replay_the_first_layer_of_every_chunk():
    """pp 2 x 2 chunks of 3 layers, one replayed per chunk: each (chunk, micro-batch) the schedule holds keeps
    one input and two whole layers, where none keeps three whole layers and full three inputs; so a stage's
    peak is none's less (none - full) / 3 of its layer bytes (the replay comes after two layers' backward).
    Full recompute's transient is a layer less its input; on the last stage the head is freed before it."""
    m, deg = model(12), Degrees(pp=2)
    kw = dict(seq_len=512, global_batch=8, virtual_stages=2, pp_schedule="interleaved")
    none, full = Job(**kw), Job(**kw, recompute="full")
    partial = Job(**kw, recompute="full", recompute_layers=1)
    replay = layer_activation_bytes(m, deg, none, False) - layer_activation_bytes(m, deg, full, False)
    head = head_bytes(m, 512)
    for stage in (0, 1):
        a_none, a_full = stage_activation_bytes(m, deg, none, stage), stage_activation_bytes(m, deg, full, stage)
        held = a_full - replay if stage == 0 else a_full + head - max(head, replay)  # full without its transient
        layer_share = (a_none - held) // 3
        assert stage_activation_bytes(m, deg, partial, stage) == a_none - layer_share


def test_moe_layers_replayed_by_position():
    """MoE every second layer (1, 3, 5, 7), pp 2 of 4 layers, one replayed per stage: stage 0 replays dense
    layer 0 and keeps MoE 1 and 3 whole; stage 1 replays dense layer 4. HFU counts the replayed layers' FLOPs:
    two dense layers of eight, not a quarter of all layers' FLOPs."""
    from orangetron.plan.timing import _layer_forward_flops

    alt = ModelSpec(name="alt", hidden_size=256, num_layers=8, num_heads=4, vocab_size=1000, ffn_hidden_size=1024,
                    num_experts=4, top_k=2, moe_ffn_hidden_size=1024, moe_layer_freq=2)
    deg, none = Degrees(pp=2), Job(seq_len=512, global_batch=2)
    partial = Job(seq_len=512, global_batch=2, recompute="full", recompute_layers=1)
    whole = {k: layer_activation_bytes(alt, deg, none, k) for k in (False, True)}
    kept_input = layer_activation_bytes(alt, deg, Job(seq_len=512, recompute="full"), False)
    assert stage_activation_bytes(alt, deg, partial, 0) == \
        stage_activation_bytes(alt, deg, none, 0) - 2 * (whole[False] - kept_input)  # two micro-batches in flight
    dense, moe = _layer_forward_flops(alt, 0, 512), _layer_forward_flops(alt, 1, 512)
    assert moe > dense
    assert replayed_share(alt, deg, partial) == pytest.approx(2 * dense / (4 * dense + 4 * moe))


def test_compute_and_hardware_flops_by_hand():
    """Four micro-batches of six layers, two replayed: compute is none's plus 4 x 2 forwards of a layer, and
    HFU counts a third of full recompute's extra FLOPs."""
    m, deg, cluster = model(), Degrees(), make_cluster("h100", 1)
    kw = dict(seq_len=512, global_batch=4)
    none, full = step_time(m, deg, Job(**kw), cluster), step_time(m, deg, Job(**kw, recompute="full"), cluster)
    partial = step_time(m, deg, Job(**kw, recompute="full", recompute_layers=2), cluster)
    forward = layer_cost(m, deg, Job(**kw), cluster, False).forward
    assert partial.compute_s == pytest.approx(none.compute_s + 4 * 2 * forward)
    extra = full.hardware_flops - none.hardware_flops
    assert partial.hardware_flops - none.hardware_flops == pytest.approx(extra / 3)
    assert partial.model_flops == none.model_flops


def test_only_replayed_layers_repeat_their_forward_traffic():
    """tp 2: full recompute repeats every layer's forward TP collectives; replaying 2 of 6 layers repeats a
    third of them."""
    m, deg = model(), Degrees(tp=2)
    kw = dict(seq_len=512)

    def tp_calls(job):
        return sum(1 for r in step_records(m, deg, job) if r.dim == "tp")

    none, full = tp_calls(Job(**kw)), tp_calls(Job(**kw, recompute="full"))
    assert full > none
    assert tp_calls(Job(**kw, recompute="full", recompute_layers=2)) * 3 == 2 * none + full


def test_recompute_layers_is_refused_without_full_recompute():
    with pytest.raises(ValueError, match="recompute_layers=2 needs recompute='full'"):
        Job(seq_len=64, recompute="selective", recompute_layers=2)
    with pytest.raises(ValueError, match="recompute_layers=-1"):
        Job(seq_len=64, recompute="full", recompute_layers=-1)


def test_cli_recompute_layers(capsys):
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--tp", "8", "--seq", "4096",
            "--recompute", "full", "--json"]
    assert run(args) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert run([*args, "--recompute-layers", "8"]) == 0
    partial = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert partial["job"]["recompute_layers"] == 8
    assert partial["memory_bytes"]["activations"] > full["memory_bytes"]["activations"]
    assert partial["step_time_s"] < full["step_time_s"]
    assert run(["estimate", "--model", "llama3-8b", "--gpus", "8", "--recompute-layers", "4"]) == 2
    assert "recompute_layers=4 (--recompute-layers) needs recompute='full'" in capsys.readouterr().err
