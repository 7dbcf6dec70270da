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
from orangetron.plan.timing import DEFAULT_EFFICIENCY, _fwd_bwd, layer_cost, step_time
from orangetron.spec.hardware import load_gpu, make_cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, replayable_modules, validate

S = 128  # tokens per micro-batch


def mla_moe() -> ModelSpec:
    return ModelSpec(name="mla-moe", hidden_size=64, num_layers=4, num_heads=4, head_dim=16, v_head_dim=16,
                     qk_rope_head_dim=8, q_lora_rank=32, kv_lora_rank=16, ffn_hidden_size=128, mlp="swiglu",
                     vocab_size=100, num_experts=4, top_k=2, moe_ffn_hidden_size=32, first_dense_layers=1)


def saved(modules: tuple[str, ...], moe: bool, fp8: bool = False, model: ModelSpec | None = None,
          deg: Degrees | None = None) -> int:
    """Bytes one layer stops keeping under `modules` (FP8: the blockwise recipe, one fp32 scale per 128)."""
    m, deg = model or mla_moe(), deg or Degrees()
    recipe = dict(sequence_parallel=deg.tp > 1, **(dict(fp8=True, fp8_recipe="blockwise") if fp8 else {}))
    plain, replayed = Job(seq_len=S, **recipe), Job(seq_len=S, recompute_modules=modules, **recipe)
    return layer_activation_bytes(m, deg, plain, moe) - layer_activation_bytes(m, deg, replayed, moe)


def test_each_module_by_hand():
    # Q, K, V: 4 heads x (24 + 24 + 16) = 256 per token; the up-projections' inputs (latents 32 + 16) go with
    # them, and the replay keeps the key's 8 rotary columns (the latents before their norms are kept anyway).
    assert saved(("mla_up_proj",), moe=True) == 2 * S * (256 + 48 - 8) == 75776
    # The norms that stand alone: MLA's input norm (the down-projections' input) and, in a MoE layer, the
    # pre-MLP norm (the router's input). A dense MLP's norm is fused into its first GEMM.
    assert saved(("layernorm",), moe=False) == 2 * S * 64
    assert saved(("layernorm",), moe=True) == 2 * (2 * S * 64)
    # A dense MLP whole: its input, gate, up and their product (its own input is the pre-norm residual).
    assert saved(("mlp",), moe=False) == 2 * S * 64 + 3 * 2 * S * 128
    assert saved(("mlp",), moe=True) == 0
    assert saved(("layernorm", "mlp"), moe=False) == 2 * S * 64 + 2 * S * 64 + 3 * 2 * S * 128
    # The experts' activation output: 2 copies of each token, 32 columns.
    assert saved(("moe_act",), moe=True) == 2 * (S * 2) * 32
    assert saved(("moe_act",), moe=False) == 0


def test_plain_attention_and_a_dense_mlp_fuse_their_norms():
    """Without MLA the attention's norm is fused into its QKV GEMM: only a MoE layer's pre-MLP norm frees."""
    gqa_moe = mla_moe().with_changes(q_lora_rank=0, kv_lora_rank=0, qk_rope_head_dim=0, head_dim=16)
    assert saved(("layernorm",), moe=False, model=gqa_moe) == 0
    assert saved(("layernorm",), moe=True, model=gqa_moe) == 2 * S * 64


def test_fp8_frees_the_casts_the_gemms_read():
    # Blockwise FP8: a GEMM's input is 1 byte plus 4 bytes per 128 elements; the hidden width's cast is 66 S.
    cast = S * 64 + 4 * S * 64 // 128
    # The two down-projections each keep the 16-bit norm output instead of their cast, and free it: both casts go.
    assert saved(("layernorm",), moe=False, fp8=True) == 2 * cast
    # Without a query latent the query projection keeps its cast; the key-value down-projection's goes.
    no_query_latent = mla_moe().with_changes(q_lora_rank=0)
    assert saved(("layernorm",), moe=False, fp8=True, model=no_query_latent) == cast
    # The router's input is 16-bit whatever the recipe.
    assert saved(("layernorm",), moe=True, fp8=True) == 2 * cast + 2 * S * 64
    # Shared experts keep their own cast of the router's input: the norm's replay frees it too.
    shared = mla_moe().with_changes(num_shared_experts=1)
    assert saved(("layernorm",), moe=True, fp8=True, model=shared) == 3 * cast + 2 * S * 64
    # A dense MLP: its cast input, gate and up (2 bytes), the product's cast with its scales.
    assert saved(("mlp",), moe=False, fp8=True) == cast + (2 + 2 + 1) * S * 128 + 4 * S * 128 // 128
    # The up-projections' cast inputs (48 columns and their scales), Q, K, V 16-bit, less the rotary key.
    assert saved(("mla_up_proj",), moe=True, fp8=True) == 2 * S * 256 + S * 48 + 4 * S * 48 // 128 - 2 * S * 8
    # The experts' activation cast: 2 S rows of 32 and their scales.
    assert saved(("moe_act",), moe=True, fp8=True) == 2 * S * 32 + 4 * 2 * S * 32 // 128
    # Without a query latent the up-projections' replay runs the query projection: its cast goes (Q is 4 x 24
    # columns of the 256), and the replay keeps its 16-bit input, unless the norm replays too.
    up = 2 * S * 256 + S * 16 + 4 * S * 16 // 128 - 2 * S * 8
    assert saved(("mla_up_proj",), moe=True, fp8=True, model=no_query_latent) == up + cast - 2 * S * 64
    assert saved(("layernorm", "mla_up_proj"), moe=False, fp8=True, model=no_query_latent) == cast + up + cast


def test_sequence_parallel_splits_what_the_rank_keeps():
    """tp 2 with sequence parallelism: 2 heads per rank; the norms' outputs and MLA's latents are the rank's
    half of the sequence; the key's rotary part is gathered whole."""
    deg = Degrees(tp=2)
    assert saved(("layernorm",), moe=True, deg=deg) == 2 * (2 * S * 64 // 2)
    assert saved(("mla_up_proj",), moe=True, deg=deg) == 2 * S * 2 * 64 + 2 * S * 48 // 2 - 2 * S * 8
    # Expert tensor parallelism: twice the rows (the tp group's tokens), half the width each.
    assert saved(("moe_act",), moe=True, deg=Degrees(tp=2, etp=2)) == 2 * (S // 2 * 2 * 2) * 16
    m, job = mla_moe(), Job(seq_len=S, sequence_parallel=True)
    wider = m.with_changes(kv_lora_rank=32)
    assert layer_activation_bytes(wider, deg, job, True) - layer_activation_bytes(m, deg, job, True) == \
        2 * 2 * S * 16 // 2


def test_latents_are_kept_without_recompute():
    """The latent norms' inputs and the up-projections' inputs, both 16-bit here."""
    m, deg, job = mla_moe(), Degrees(), Job(seq_len=S)
    # One latent width against another (Q, K and V do not change): 16 more key-value latent columns, kept twice.
    wider = m.with_changes(kv_lora_rank=32)
    assert layer_activation_bytes(wider, deg, job, True) - layer_activation_bytes(m, deg, job, True) == 2 * 2 * S * 16


def test_fp8_mla_attention_by_hand():
    """What MLA's attention keeps under blockwise FP8 (1 byte and 4 per 128 for a cast), 128 tokens: a cast of the
    hidden state (64) for each of its two down-projections; Q, K, V (256, 16-bit); the latents before their norms
    (48, 16-bit) and the up-projections' casts of them; the output's cast (64) and the kernel's 16-bit output; an
    fp32 log-sum-exp per head (4)."""
    from orangetron.plan.activations import attention_bytes, layer_shape

    job = Job(seq_len=S, fp8=True, fp8_recipe="blockwise")
    def cast(n: int) -> int:
        return S * n + 4 * S * n // 128

    expected = 2 * cast(64) + 2 * S * 256 + 2 * S * 48 + cast(48) + cast(64) + 2 * S * 64 + 4 * S * 4
    assert attention_bytes(mla_moe(), layer_shape(Degrees(), job), job) == expected


def test_shared_experts_share_the_router_input_only_in_16_bit():
    """One shared expert (width 32): in bf16 its gate, up and product (3 x 2 bytes x 32), its input being the
    router's; under blockwise FP8 its first GEMM keeps its own cast of the input (66 S) and the product's cast."""
    m, deg = mla_moe(), Degrees()
    shared = m.with_changes(num_shared_experts=1)
    for job, added in ((Job(seq_len=S), 3 * 2 * S * 32),
                       (Job(seq_len=S, fp8=True, fp8_recipe="blockwise"),
                        S * 64 + 4 * S * 64 // 128 + (2 + 2 + 1) * S * 32 + 4 * S * 32 // 128)):
        assert layer_activation_bytes(shared, deg, job, True) - layer_activation_bytes(m, deg, job, True) == added


def test_one_layer_replays_on_top_of_the_held_micro_batches():
    """Stage 0 of pp 2 under 1F1B holds 2 micro-batches of its layers (the dense layer 0 and the MoE layer 1);
    the first backward brings back the replayed outputs of one layer, the larger of the two kinds."""
    m, deg = mla_moe(), Degrees(pp=2)
    modules = ("layernorm", "mla_up_proj")
    plain = Job(seq_len=S, microbatches=4)
    replayed = Job(seq_len=S, microbatches=4, recompute_modules=modules)
    dense, moe = 2 * S * 64 + 75776, 2 * 2 * S * 64 + 75776
    assert saved(modules, moe=False) == dense and saved(modules, moe=True) == moe
    # The replay needs the kept rotary key (2 bytes x 8 columns) beside the Q, K, V it makes again.
    assert stage_activation_bytes(m, deg, plain, 0) - stage_activation_bytes(m, deg, replayed, 0) == \
        2 * (dense + moe) - (moe + 2 * S * 8)


def test_an_fp8_norm_replay_brings_back_its_16_bit_output():
    """MLA's input norm under blockwise FP8: each held micro-batch frees the two down-projections' casts; the
    replay makes the 16-bit output (2 bytes x 64 columns) again, and the casts with it."""
    m, deg = mla_moe().with_changes(first_dense_layers=2), Degrees(pp=2)  # stage 0: layers 0 and 1, both dense
    fp8 = dict(fp8=True, fp8_recipe="blockwise", microbatches=4)
    plain, replayed = Job(seq_len=S, **fp8), Job(seq_len=S, recompute_modules=("layernorm",), **fp8)
    casts = 2 * (S * 64 + 4 * S * 64 // 128)
    assert stage_activation_bytes(m, deg, plain, 0) - stage_activation_bytes(m, deg, replayed, 0) == \
        2 * 2 * casts - (casts + 2 * S * 64)


def test_an_fp8_replay_brings_back_the_16_bit_output_and_its_cast():
    """The experts' activation replays in 16-bit (2 bytes x 2 S rows x 32) and is cast again for the down
    projection, beside everything the 2 micro-batches in flight hold."""
    m, deg = mla_moe(), Degrees(pp=2)
    fp8 = dict(fp8=True, fp8_recipe="blockwise", microbatches=4)
    plain, replayed = Job(seq_len=S, **fp8), Job(seq_len=S, recompute_modules=("moe_act",), **fp8)
    cast = 2 * S * 32 + 4 * 2 * S * 32 // 128
    assert stage_activation_bytes(m, deg, plain, 0) - stage_activation_bytes(m, deg, replayed, 0) == \
        2 * cast - (cast + 2 * 2 * S * 32)


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
    # An MTP module's layer (a MoE one) replays its up-projections too: 5 layers.
    mtp = m.with_changes(mtp_layers=1)
    d, e = step_time(mtp, deg, plain, cluster), step_time(mtp, deg, replayed, cluster)
    assert e.hardware_flops - d.hardware_flops == pytest.approx(S * 5 * 2 * 4 * (16 * 32 + 32 * 24), rel=1e-12)


def test_without_a_query_latent_the_query_projection_replays():
    m, deg, cluster = mla_moe().with_changes(q_lora_rank=0), Degrees(), make_cluster(load_gpu("h100"), 1)
    replayed = Job(seq_len=S, recompute_modules=("mla_up_proj",))
    up = [linear_parts(S, 16, 4 * (16 + 16), cluster.gpu, "bfloat16", 2.0)[0],
          linear_parts(S, 64, 4 * 24, cluster.gpu, "bfloat16", 2.0)[0]]
    assert layer_cost(m, deg, replayed, cluster, True).replay == pytest.approx(sum(up), rel=1e-12)
    a, b = step_time(m, deg, Job(seq_len=S), cluster), step_time(m, deg, replayed, cluster)
    assert b.hardware_flops - a.hardware_flops == pytest.approx(S * 4 * 2 * 4 * (16 * 32 + 64 * 24), rel=1e-12)
    # Q (4 heads x 24) is replayed and freed with K and V.
    assert saved(("mla_up_proj",), moe=True, model=m) == 2 * S * (256 + 16 - 8)


def test_norms_and_the_experts_activation_replay_as_memory_traffic():
    m, deg, cluster = mla_moe(), Degrees(), make_cluster(load_gpu("h100"), 1)
    bandwidth = cluster.gpu.memory_bw_gbs * 1e9 * DEFAULT_EFFICIENCY.elementwise_bw

    def replay(modules: tuple[str, ...], moe: bool, model: ModelSpec = m) -> float:
        return layer_cost(model, deg, Job(seq_len=S, recompute_modules=modules), cluster, moe).replay

    # Each norm reads its 2-byte input and writes its output: MLA's input norm, and the pre-MLP one in MoE.
    assert replay(("layernorm",), False) == pytest.approx(2 * 2 * S * 64 / bandwidth, rel=1e-12)
    assert replay(("layernorm",), True) == pytest.approx(2 * 2 * 2 * S * 64 / bandwidth, rel=1e-12)
    # The activation reads gate and up and writes their product: 2 S copies of 32 columns.
    assert replay(("moe_act",), True) == pytest.approx(3 * 2 * 2 * S * 32 / bandwidth, rel=1e-12)
    assert replay(("moe_act",), False) == 0 and replay(("mlp",), True) == 0
    # Under sequence parallelism at tp 2 a norm runs on the rank's half of the sequence.
    sp = Job(seq_len=S, sequence_parallel=True, recompute_modules=("layernorm",))
    assert layer_cost(m, Degrees(tp=2), sp, cluster, True).replay == \
        pytest.approx(2 * 2 * 2 * S // 2 * 64 / bandwidth, rel=1e-12)
    # The dense MLP's two GEMMs: gate and up (64 -> 256), down (128 -> 64).
    mlp = [linear_parts(S, 64, 256, cluster.gpu, "bfloat16", 2.0)[0],
           linear_parts(S, 128, 64, cluster.gpu, "bfloat16", 2.0)[0]]
    assert replay(("mlp",), False) == pytest.approx(sum(mlp), rel=1e-12)


def test_a_host_paced_layer_issues_the_replays_again():
    m, deg, op_s = mla_moe(), Degrees(), 1e-3
    plain = Job(seq_len=S)
    replayed = Job(seq_len=S, recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
    # No GPU time: the host sets the pace; two norms, MLA's eight operations, one activation.
    gap = host.paced_seconds(0.0, 0.0, m, deg, replayed, op_s) - host.paced_seconds(0.0, 0.0, m, deg, plain, op_s)
    assert gap == pytest.approx((2 + 8 + 1) * op_s, rel=1e-12)
    # Without MLA the attention's norm is fused into its GEMM: the pre-MLP norm alone replays.
    gqa_moe = m.with_changes(q_lora_rank=0, kv_lora_rank=0, qk_rope_head_dim=0, head_dim=16)
    norm = Job(seq_len=S, recompute_modules=("layernorm",))
    gap = host.paced_seconds(0.0, 0.0, gqa_moe, deg, norm, op_s) - \
        host.paced_seconds(0.0, 0.0, gqa_moe, deg, plain, op_s)
    assert gap == pytest.approx(op_s, rel=1e-12)


@pytest.mark.parametrize("job, model, match", [
    (dict(recompute_modules=("mla_up_proj",)), ModelSpec(name="gqa", hidden_size=64, num_layers=2, num_heads=4,
                                                          vocab_size=100, ffn_hidden_size=128),
     "has no multi-head latent attention"),
    (dict(recompute_modules=("moe_act",)), ModelSpec(name="dense", hidden_size=64, num_layers=2, num_heads=4,
                                                      vocab_size=100, ffn_hidden_size=128), "has no experts"),
    (dict(recompute_modules=("mlp",)), mla_moe().with_changes(first_dense_layers=0), "has no dense layer"),
    (dict(recompute_modules=("layernorm",)), ModelSpec(name="dense", hidden_size=64, num_layers=2, num_heads=4,
                                                        vocab_size=100, ffn_hidden_size=128),
     "has no norm outside a fused GEMM"),
    # Under delayed scaling a GEMM cannot keep the 16-bit input in place of its cast, so these free nothing.
    (dict(recompute_modules=("moe_act",), fp8=True), mla_moe(), "under fp8_recipe='delayed'"),
    (dict(recompute_modules=("layernorm", "mla_up_proj"), fp8=True), mla_moe(),
     r"\['layernorm'\] under fp8_recipe='delayed'"),
])
def test_modules_the_model_lacks_are_refused(job, model, match):
    with pytest.raises(ValueError, match=match):
        validate(model, Degrees(), Job(seq_len=S, **job))


def test_what_delayed_fp8_can_replay_passes():
    # The up-projections' outputs go to the 16-bit attention kernel; a dense MLP replays whole.
    validate(mla_moe(), Degrees(), Job(seq_len=S, fp8=True, recompute_modules=("mla_up_proj", "mlp")))
    validate(mla_moe(), Degrees(), Job(seq_len=S, fp8=True, fp8_recipe="blockwise",
                                       recompute_modules=("layernorm", "moe_act")))
    # Megatron-Core refuses the norms' replay under delayed FP8 whatever reads their output.
    gqa_moe = mla_moe().with_changes(q_lora_rank=0, kv_lora_rank=0, qk_rope_head_dim=0, head_dim=16)
    with pytest.raises(ValueError, match="under fp8_recipe='delayed'"):
        validate(gqa_moe, Degrees(), Job(seq_len=S, fp8=True, recompute_modules=("layernorm",)))


def test_fit_advice_offers_only_what_the_recipe_can_replay():
    m = mla_moe()
    assert replayable_modules(m) == ("layernorm", "mla_up_proj", "mlp", "moe_act")
    assert replayable_modules(m, Job(seq_len=S, fp8=True)) == ("mla_up_proj", "mlp")
    assert replayable_modules(m, Job(seq_len=S, fp8=True, fp8_recipe="blockwise")) == replayable_modules(m)


def test_bad_module_lists_are_refused():
    with pytest.raises(ValueError, match="must be one of"):
        Job(seq_len=S, recompute_modules=("attention",))
    with pytest.raises(ValueError, match="must be one of"):
        Job(seq_len=S, recompute_modules=("layernorm", 3))
    with pytest.raises(ValueError, match="a list of module names, not a string"):
        Job(seq_len=S, recompute_modules="layernorm")
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
    # Megatron's own spelling, space-separated, is the same job.
    assert run(args + ["--recompute-modules", "mla_up_proj", "layernorm", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == replayed
    assert run(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["job"]["recompute_modules"] == []
    # One micro-batch per replica; the busiest stage holds 4 MoE layers, each of which frees per token its two
    # norms' outputs (7168 each), Q, K, V (128 heads x 192 + 192 + 128), the up-projections' inputs (1536 + 512)
    # less the rotary key (64), 2 bytes each; the first backward's replay brings one layer's back, beside the
    # rotary key it reads.
    per_token = 2 * (2 * 7168 + 128 * (192 + 192 + 128) + 1536 + 512 - 64)
    freed = plain["memory_bytes"]["activations"] - replayed["memory_bytes"]["activations"]
    assert freed == 4096 * ((4 - 1) * per_token - 2 * 64)


def test_the_trainer_runs_no_module_recompute(tmp_path):
    m, deg = mla_moe(), Degrees()
    cluster = make_cluster(load_gpu("h100"), 1)
    row = estimate(m, deg, Job(seq_len=S, recompute_modules=("layernorm",)), cluster)
    with pytest.raises(ValueError, match="recompute_modules=\\('layernorm',\\): the trainer runs \\(\\) only"):
        emit_config([row], str(tmp_path / "plan.toml"))
