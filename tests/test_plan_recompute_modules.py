"""Module recompute (`Job.recompute_modules`, Megatron-Core's --recompute-modules): a replayed module keeps its
input instead of its outputs, and backward runs its forward again. Every figure is worked by hand for a small MLA
MoE model: hidden 64, 4 heads (q/k 16 + 8 rotary, v 16), query latent 32, key-value latent 16, a dense first
layer (SwiGLU 128) and 3 MoE layers (4 experts of width 32, top 2), 128 tokens of bf16 (2 bytes)."""

import json

import pytest

from orangetron.cli import main as run
from orangetron.cli.run_config import emit_config
from orangetron.plan import host
from orangetron.plan.activations import layer_activation_bytes, stage_activation_bytes
from orangetron.plan.compute import linear_parts
from orangetron.plan.estimate import estimate
from orangetron.plan.timing import _fwd_bwd, layer_cost, step_time
from orangetron.spec.hardware import load_gpu, make_cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, validate

S = 128  # tokens per micro-batch


def mla_moe() -> ModelSpec:
    return ModelSpec(name="mla-moe", hidden_size=64, num_layers=4, num_heads=4, head_dim=16, v_head_dim=16,
                     qk_rope_head_dim=8, q_lora_rank=32, kv_lora_rank=16, ffn_hidden_size=128, mlp="swiglu",
                     vocab_size=100, num_experts=4, top_k=2, moe_ffn_hidden_size=32, first_dense_layers=1)


def saved(modules: tuple[str, ...], moe: bool, fp8: bool = False) -> int:
    """Bytes one layer stops keeping under `modules`."""
    m, deg = mla_moe(), Degrees()
    plain, replayed = Job(seq_len=S, fp8=fp8), Job(seq_len=S, fp8=fp8, recompute_modules=modules)
    return layer_activation_bytes(m, deg, plain, moe) - layer_activation_bytes(m, deg, replayed, moe)


def test_each_module_by_hand():
    # Q, K, V: 4 heads x (24 + 24 + 16) = 256 per token; the up-projections' inputs (latents 32 + 16) go with
    # them, and the replay keeps the normed latents and the key's 8 rotary columns: 2 x 128 x (256 + 48 - 56).
    assert saved(("mla_up_proj",), moe=True) == 2 * S * (256 + 48 - 56) == 63488
    # The two norms' outputs (hidden 64): the attention's input and the router's (or the dense MLP's).
    assert saved(("layernorm",), moe=True) == saved(("layernorm",), moe=False) == 2 * (2 * S * 64)
    # A dense MLP keeps its input only: gate, up and their product go (3 x 128 columns).
    assert saved(("mlp",), moe=False) == 3 * 2 * S * 128
    assert saved(("mlp",), moe=True) == 0
    # With the whole MLP replayed, its input is the replay's: the norm frees only the attention's input.
    assert saved(("layernorm", "mlp"), moe=False) == 2 * S * 64 + 3 * 2 * S * 128
    # The experts' activation output: 2 copies of each token, 32 columns.
    assert saved(("moe_act",), moe=True) == 2 * (S * 2) * 32
    assert saved(("moe_act",), moe=False) == 0


def test_fp8_keeps_the_casts_the_gemms_read():
    # Under FP8 the GEMMs keep their 1-byte casts, which the norms' replay does not free; the router keeps its
    # 16-bit input, which it does.
    assert saved(("layernorm",), moe=False, fp8=True) == 0
    assert saved(("layernorm",), moe=True, fp8=True) == 2 * S * 64
    # A dense MLP: its cast input (1 byte) and gate, up (2 bytes) and product cast (1 byte), less the 16-bit
    # input the replay keeps.
    assert saved(("mlp",), moe=False, fp8=True) == S * 64 + (2 + 2 + 1) * S * 128 - 2 * S * 64
    # The up-projections' cast inputs (1 byte), against the replay's 16-bit latents.
    assert saved(("mla_up_proj",), moe=True, fp8=True) == 2 * S * 256 + S * 48 - 2 * S * 56


def test_latents_are_kept_without_recompute():
    """The latent norms' inputs and the up-projections' inputs, both 16-bit here."""
    m, deg, job = mla_moe(), Degrees(), Job(seq_len=S)
    # One latent width against another (Q, K and V do not change): 16 more key-value latent columns, kept twice.
    wider = m.with_changes(kv_lora_rank=32)
    assert layer_activation_bytes(wider, deg, job, True) - layer_activation_bytes(m, deg, job, True) == 2 * 2 * S * 16


def test_one_layer_replays_on_top_of_the_held_micro_batches():
    """Stage 0 of pp 2 under 1F1B holds 2 micro-batches of its layers (the dense layer 0 and the MoE layer 1);
    the first backward brings back the replayed outputs of one layer, the larger of the two kinds."""
    m, deg = mla_moe(), Degrees(pp=2)
    modules = ("layernorm", "mla_up_proj")
    plain = Job(seq_len=S, microbatches=4)
    replayed = Job(seq_len=S, microbatches=4, recompute_modules=modules)
    dense, moe = 2 * S * 64 * 2 + 63488, 2 * S * 64 * 2 + 63488
    assert saved(modules, moe=False) == dense and saved(modules, moe=True) == moe
    assert stage_activation_bytes(m, deg, plain, 0) - stage_activation_bytes(m, deg, replayed, 0) == \
        2 * (dense + moe) - max(dense, moe)


def test_replays_cost_their_forward_and_their_flops():
    m, deg = mla_moe(), Degrees()
    cluster = make_cluster(load_gpu("h100"), 1)
    plain, replayed = Job(seq_len=S), Job(seq_len=S, recompute_modules=("mla_up_proj",))
    up = [linear_parts(S, 16, 4 * (16 + 16), cluster.gpu, "bfloat16", 2.0)[0],
          linear_parts(S, 32, 4 * 24, cluster.gpu, "bfloat16", 2.0)[0]]
    cost = layer_cost(m, deg, replayed, cluster, True)
    assert cost.replay == pytest.approx(sum(up), rel=1e-12)
    assert _fwd_bwd(cost, replayed)[0] - _fwd_bwd(layer_cost(m, deg, plain, cluster, True), plain)[0] == \
        pytest.approx(sum(up), rel=1e-12)
    # HFU counts the replayed up-projections: 2 x 4 heads x (16 x 32 + 32 x 24) FLOPs per token and layer; MFU
    # does not.
    a, b = step_time(m, deg, plain, cluster), step_time(m, deg, replayed, cluster)
    assert b.hardware_flops - a.hardware_flops == pytest.approx(S * 4 * 2 * 4 * (16 * 32 + 32 * 24), rel=1e-12)
    assert b.model_flops == a.model_flops
    # The dense layer's MLP: 2 x (3 x 64 x 128) FLOPs per token, one dense layer.
    c = step_time(m, deg, Job(seq_len=S, recompute_modules=("mlp",)), cluster)
    assert c.hardware_flops - a.hardware_flops == pytest.approx(S * 2 * 3 * 64 * 128, rel=1e-12)


def test_a_host_paced_layer_issues_the_replays_again():
    m, deg, op_s = mla_moe(), Degrees(), 1e-3
    plain = Job(seq_len=S)
    replayed = Job(seq_len=S, recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
    # No GPU time: the host sets the pace; two norms, MLA's six operations, one activation.
    gap = host.paced_seconds(0.0, 0.0, m, deg, replayed, op_s) - host.paced_seconds(0.0, 0.0, m, deg, plain, op_s)
    assert gap == pytest.approx((2 + 6 + 1) * op_s, rel=1e-12)


@pytest.mark.parametrize("job, model, match", [
    (dict(recompute_modules=("mla_up_proj",)), ModelSpec(name="gqa", hidden_size=64, num_layers=2, num_heads=4,
                                                          vocab_size=100, ffn_hidden_size=128),
     "has no multi-head latent attention"),
    (dict(recompute_modules=("moe_act",)), ModelSpec(name="dense", hidden_size=64, num_layers=2, num_heads=4,
                                                      vocab_size=100, ffn_hidden_size=128), "has no experts"),
    (dict(recompute_modules=("mlp",)), mla_moe().with_changes(first_dense_layers=0), "has no dense layer"),
])
def test_modules_the_model_lacks_are_refused(job, model, match):
    with pytest.raises(ValueError, match=match):
        validate(model, Degrees(), Job(seq_len=S, **job))


def test_bad_module_lists_are_refused():
    with pytest.raises(ValueError, match="must be one of"):
        Job(seq_len=S, recompute_modules=("attention",))
    with pytest.raises(ValueError, match="full recompute already replays"):
        Job(seq_len=S, recompute="full", recompute_modules=("layernorm",))
    # A list from JSON or TOML, in any order, is the same job.
    assert Job(seq_len=S, recompute_modules=["mla_up_proj", "layernorm"]) == \
        Job(seq_len=S, recompute_modules=("layernorm", "mla_up_proj"))


def test_estimate_prints_and_round_trips_the_modules(capsys):
    args = ["estimate", "--model", "deepseek-v3", "--gpu", "h800", "--pp", "16", "--dp", "8", "--ep", "8",
            "--seq", "4096", "--pipeline-layout", "4x15,1"]
    modules = ["--recompute-modules", "mla_up_proj,layernorm"]
    assert run(args + modules) == 0
    assert "recompute none+layernorm+mla_up_proj" in capsys.readouterr().out
    assert run(args + modules + ["--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["job"]["recompute_modules"] == ["layernorm", "mla_up_proj"]
    assert Job.from_json(replayed["job"]).recompute_modules == ("layernorm", "mla_up_proj")
    assert run(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["job"]["recompute_modules"] == []
    assert replayed["memory_bytes"]["activations"] < 0.8 * plain["memory_bytes"]["activations"]


def test_the_trainer_runs_no_module_recompute(tmp_path):
    m, deg = mla_moe(), Degrees()
    cluster = make_cluster(load_gpu("h100"), 1)
    row = estimate(m, deg, Job(seq_len=S, recompute_modules=("layernorm",)), cluster)
    with pytest.raises(ValueError, match="recompute_modules=\\('layernorm',\\): the trainer runs \\(\\) only"):
        emit_config([row], str(tmp_path / "plan.toml"))
