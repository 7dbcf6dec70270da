"""Memory model: docs/planner.md section 3's model-state table, and Korthikanti et al. 2022's activation formulas.

Source for the activation checks: V. Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", MLSys 2023 (arXiv:2205.05198), section 4 (per-layer formulas and their summary
table), section 4.2.3 (pipeline in-flight factor), and the model configurations of their evaluation
(22B, 175B, 530B, 1T; sequence 2048, vocabulary 51200, micro-batch 1, tp 8). Our formulas are a
term-by-term generalization, so for GPT-style layers they must reproduce the paper's expressions exactly
(tolerance 0).
"""

from dataclasses import replace

import pytest

from orangetron.plan.activations import layer_activation_bytes, stage_activation_bytes
from orangetron.plan.memory import memory_per_gpu, model_state_bytes, stage_params
from orangetron.spec.model import ModelSpec, load_model
from orangetron.spec.options import Degrees, Job

# name: (heads, hidden, layers, tp, pp)
KORTHIKANTI = {
    "22B": (64, 6144, 48, 8, 1),
    "175B": (96, 12288, 96, 8, 8),
    "530B": (128, 20480, 105, 8, 35),
    "1T": (160, 25600, 128, 8, 64),
}
SEQ, BATCH = 2048, 1


def gpt(heads, hidden, layers):
    return ModelSpec(name="gpt", hidden_size=hidden, num_layers=layers, num_heads=heads, vocab_size=51200,
                     ffn_hidden_size=4 * hidden, mlp="gelu", dropout=0.1, bias=True, max_position_embeddings=2048)


def per_layer(model, t, sp, recompute):
    job = Job(seq_len=SEQ, micro_batch=BATCH, sequence_parallel=sp, recompute=recompute, attention_kernel="eager")
    return layer_activation_bytes(model, Degrees(tp=t), job, moe=False)


@pytest.mark.parametrize("name", list(KORTHIKANTI))
def test_korthikanti_per_layer_formulas(name):
    a, h, layers, t, _ = KORTHIKANTI[name]
    model, s, b = gpt(a, h, layers), SEQ, BATCH
    sbh = s * b * h
    assert per_layer(model, 1, False, "none") == sbh * 34 + 5 * a * s * s * b
    assert per_layer(model, t, False, "none") == sbh * 10 + sbh * 24 // t + 5 * a * s * s * b // t
    assert per_layer(model, t, True, "none") == (sbh * 34 + 5 * a * s * s * b) // t
    assert per_layer(model, t, False, "selective") == sbh * 10 + sbh * 24 // t
    assert per_layer(model, t, True, "selective") == sbh * 34 // t
    assert per_layer(model, t, False, "full") == 2 * sbh
    assert per_layer(model, t, True, "full") == 2 * sbh // t


@pytest.mark.parametrize("name", list(KORTHIKANTI))
def test_korthikanti_5x_reduction(name):
    """Abstract: sequence parallelism + selective recompute cut activation memory about 5x vs plain TP."""
    a, h, layers, t, _ = KORTHIKANTI[name]
    model = gpt(a, h, layers)
    ratio = per_layer(model, t, False, "none") / per_layer(model, t, True, "selective")
    assert 4.5 < ratio < 6.5  # 5.4x for 175B; the paper's figure 7 spans about 5-6x


@pytest.mark.parametrize("name", ["175B", "530B", "1T"])
def test_korthikanti_first_stage_holds_all_layers(name):
    """Section 4.2.3: with 1F1B the first stage keeps pp micro-batches of L/pp layers = L layers' worth,
    plus the embedding-dropout mask s*b*h*p/t."""
    a, h, layers, t, p = KORTHIKANTI[name]
    model = gpt(a, h, layers)
    deg = Degrees(tp=t, pp=p)
    job = Job(seq_len=SEQ, micro_batch=1, global_batch=p * 4, sequence_parallel=True, recompute="selective",
              attention_kernel="eager")
    sbh = SEQ * h
    stage0 = stage_activation_bytes(model, deg, job, 0)
    layers_on_stage0 = -(-layers // p)  # ceil: the first stages take the remainder
    expected = layers_on_stage0 * p * (34 * sbh // t) + sbh * p // t
    assert stage0 == expected


def test_interleaved_in_flight_factor():
    """Section 4.2.3: interleaving with v chunks multiplies the first stage's memory by 1 + (p-1)/(p*v)."""
    a, h, layers, t, _ = KORTHIKANTI["1T"]
    model = gpt(a, h, layers)
    p, v = 8, 4
    base = Job(seq_len=SEQ, global_batch=64, sequence_parallel=True, recompute="selective", attention_kernel="eager")
    inter = Job(seq_len=SEQ, global_batch=64, sequence_parallel=True, recompute="selective",
                attention_kernel="eager", pp_schedule="interleaved", virtual_stages=v)
    deg = Degrees(tp=t, pp=p)
    mask = SEQ * h * p // t
    plain = stage_activation_bytes(model, deg, base, 0) - mask
    mixed = stage_activation_bytes(model, deg, inter, 0)
    per = 34 * SEQ * h // t
    assert plain == layers * per
    # The embedding-dropout mask lives with chunk 0's micro-batches. Rank 0 warms up with 2(p-1) + (v-1)p = 38
    # forwards (chunks 0-3 of micro-batches 0-7, then chunk 0 of 8-13) and one more (chunk 0 of 14) at its peak;
    # the next forward (chunk 0 of 15) replaces a chunk-3 backward, and chunk 0's first backward comes after
    # 24 more: 16 chunk-0 micro-batches at most while 39 chunk-micro-batches are held.
    mixed_mask = 16 * SEQ * h // t
    assert mixed - mixed_mask == pytest.approx(layers * per * (1 + (p - 1) / (p * v)), rel=1e-9)


def test_flash_attention_keeps_no_scores_and_cp_divides():
    model = load_model("llama3-8b")
    short = layer_activation_bytes(model, Degrees(), Job(seq_len=4096), moe=False)
    long = layer_activation_bytes(model, Degrees(), Job(seq_len=8192), moe=False)
    assert long == 2 * short  # linear in s: no [s, s] term
    eager = layer_activation_bytes(model, Degrees(), Job(seq_len=4096, attention_kernel="eager"), moe=False)
    assert eager - short > 2 * 32 * 4096 * 4096 - 4 * 32 * 4096 * 2
    cp4 = layer_activation_bytes(model, Degrees(cp=4), Job(seq_len=8192), moe=False)
    assert cp4 * 4 == long


def test_fp8_saves_one_byte_gemm_inputs_by_hand():
    """Llama-style layer, hidden 64, 4 heads of 16 (MHA), SwiGLU 96, s = 10, b = 1, bf16, flash attention.
    16-bit: norm inputs 2 x 2*10*64, QKV input 2*10*64, Q/K/V 3 x 2*10*64, output 2*10*64, lse 4*10*4,
    MLP input 2*10*64, gate/up/product 3 x 2*10*96. FP8: the QKV, projection, MLP and down inputs (64, 64,
    64 and 96 wide) take 1 byte, and the fused kernel keeps its own 16-bit output besides the FP8 copy."""
    model = ModelSpec(name="t", hidden_size=64, num_layers=1, num_heads=4, vocab_size=32, ffn_hidden_size=96)
    bf16 = 2 * 1280 + 1280 + 3 * 1280 + 1280 + 160 + 1280 + 3 * 1920
    fp8 = 2 * 1280 + 640 + 3 * 1280 + (640 + 1280) + 160 + 640 + (2 * 1920 + 960)
    got = {f: layer_activation_bytes(model, Degrees(), Job(seq_len=10, fp8=f), moe=False) for f in (False, True)}
    assert (got[False], got[True]) == (bf16, fp8)
    # Full recompute keeps the 16-bit layer input either way.
    assert layer_activation_bytes(model, Degrees(), Job(seq_len=10, fp8=True, recompute="full"), False) == 1280


# ---- docs/planner.md section 3: bytes per parameter on each GPU -------------------------------------
def _tiny():
    return ModelSpec(name="tiny", hidden_size=64, num_layers=2, num_heads=4, vocab_size=128, ffn_hidden_size=128,
                     num_experts=4, top_k=2, moe_ffn_hidden_size=32)


@pytest.mark.parametrize(("zero", "distopt", "per_param"), [
    # (params, grads, main_params, optimizer) bytes per param as multiples of 1 (full) or 1/d (sharded)
    (0, False, ((2, 0), (4, 0), (4, 0), (8, 0))),
    (1, False, ((2, 0), (4, 0), (0, 4), (0, 8))),
    (0, True, ((2, 0), (4, 0), (0, 4), (0, 8))),
    (2, False, ((2, 0), (0, 4), (0, 4), (0, 8))),
    (3, False, ((0, 2), (0, 4), (0, 4), (0, 8))),
])
def test_design_table_model_states(zero, distopt, per_param):
    model, deg = _tiny(), Degrees(dp=2, cp=2, ep=2)  # d = dp*cp = 4, edp = 2
    params = stage_params(model, deg, 0)
    job = Job(seq_len=64, zero_stage=zero, distributed_optimizer=distopt)
    got = model_state_bytes(params, deg, job)
    for cat, (full, sharded) in zip(("params", "grads", "main_params", "optimizer"), per_param, strict=True):
        want = full * params.total + sharded * (-(-params.dense // 4) + -(-params.expert // 2))
        assert got[cat] == want, cat


def test_fp32_params_have_no_main_copy():
    model, deg = _tiny(), Degrees(dp=2)
    got = model_state_bytes(stage_params(model, deg, 0), deg, Job(seq_len=64, param_dtype="float32"))
    n = stage_params(model, deg, 0).total
    assert got == {"params": 4 * n, "grads": 4 * n, "main_params": 0, "optimizer": 8 * n}


def test_params_shard_over_tp_pp_ep():
    model = load_model("mixtral-8x7b")
    full = sum(stage_params(model, Degrees(), 0).__dict__.values())
    assert full == model.total_params()
    deg = Degrees(tp=2, pp=4, dp=8, ep=8)
    per_gpu = [stage_params(model, deg, s).total for s in range(4)]
    # Experts split 8 ways by ep (etp=1, as the runtime), the rest 2 ways by tp; summed over the 4 stages.
    assert sum(per_gpu) == pytest.approx(model.expert_params() / 8 + (model.total_params()
                                                                         - model.expert_params()) / 2, rel=0.02)


def test_memory_per_gpu_total_is_sum():
    model = load_model("llama3-70b")
    mem = memory_per_gpu(model, Degrees(tp=8, pp=4, dp=4), Job(seq_len=8192, global_batch=64,
                                                                 sequence_parallel=True, distributed_optimizer=True))
    parts = ("params", "grads", "main_params", "optimizer", "activations", "buffers")
    assert mem["total"] == sum(mem[c] for c in parts)
    assert mem["gathered_params"] == 0  # only ZeRO-3 gathers full layers
    # One reduction after backward: a bf16 wire copy of the fp32 main gradients (padded to dp=4) and its slice;
    # until then every parameter's bf16 .grad, as many bytes as the bf16 parameters (no padding at dp=4 here).
    padded = mem["grads"] // 4
    assert padded % 4 == 0 and mem["grad_buckets"] == 2 * padded + 2 * padded // 4
    assert mem["param_grads"] == mem["params"] == 2 * padded
    assert mem["buffers"] == mem["grad_buckets"] + mem["param_grads"]


def test_per_parameter_gradient_shortcut_equals_the_schedule_replay():
    """With more micro-batches than stages the interleaved schedule gives every chunk a backward before any
    chunk's last one, so ZeRO-2's buckets and ZeRO-3's units hold every .grad: the planner's shortcut must equal a
    replay of the whole schedule, and with m <= pp the replay frees a chunk early (less than every tensor)."""
    from orangetron.plan.param_grads import _replayed_peak, _totals, param_grad_bytes
    from orangetron.spec.options import model_state_job

    model = load_model("llama3-8b")
    for pp, vs in ((2, 2), (4, 2), (4, 4)):
        deg = Degrees(pp=pp, dp=2)
        for job in (Job(seq_len=1, zero_stage=3, virtual_stages=vs, pp_schedule="interleaved"),
                    Job(seq_len=1, zero_stage=2, grad_bucket_numel=10**8, virtual_stages=vs,
                        pp_schedule="interleaved")):
            for m in (pp, 2 * pp, 3 * pp):
                for stage in range(pp):
                    replayed = _replayed_peak(model, deg, model_state_job(job), stage, m)
                    assert param_grad_bytes(model, deg, replace(job, microbatches=m), stage) == 2 * replayed
                    assert (replayed == _totals(model, deg, stage, vs)[0]) == (m > pp)
