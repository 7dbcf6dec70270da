"""FP8 memory (plan/fp8.py): FP8 weight copies and transposes plus scale tensors, worked by hand."""

from dataclasses import replace

from orangetron.plan.fp8 import fp8_memory_bytes
from orangetron.plan.memory import memory_per_gpu, stage_memory
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job


def tiny():
    # 2 layers, hidden 64, 4 heads (MHA), SwiGLU ffn 128, vocab 100, untied, no biases.
    return ModelSpec(name="tiny", hidden_size=64, num_layers=2, num_heads=4, vocab_size=100, ffn_hidden_size=128)


def test_fp8_weight_copies_and_scales_by_hand():
    # Per layer: attention 4 * 64 * 64 = 16384, MLP 3 * 64 * 128 = 24576, two RMSNorm weights 128 -> 41088.
    # One GPU holds 2 layers (82176), the embedding 6400 (excluded: a lookup), final norm 64 and the head 6400
    # (excluded: it stays 16-bit); the norm weights ride along with the linear ones (under 1% of a layer; FP8
    # copies are per parameter buffer).
    linear_like = 82176 + 64
    scales = 2 * 4 * 3 * (2 + 1024) * 4  # layers x GEMMs x operands x (scale, scale_inv, amax history) x fp32
    assert fp8_memory_bytes(tiny(), Degrees(), Job(seq_len=64, fp8=True)) == 2 * linear_like + scales


def test_current_scaling_keeps_one_amax_per_operand_and_no_history():
    # As above, with per operand a scale, a scale inverse and the one amax taken before each cast.
    linear_like = 82176 + 64
    scales = 2 * 4 * 3 * 3 * 4
    job = Job(seq_len=64, fp8=True, fp8_recipe="current")
    assert fp8_memory_bytes(tiny(), Degrees(), job) == 2 * linear_like + scales


def test_current_scaling_reads_each_cast_input_once_more_for_its_amax():
    """128 tokens of the tiny dense layer: the casts' inputs are QKV's and the up projection's (64 columns each),
    the output projection's (4 heads x 16 = 64) and the down projection's (128); current scaling reads each once
    more (2 bytes) for its amax before the cast, at the elementwise share of HBM bandwidth. Saved activations
    are the same casts as under delayed scaling."""
    import pytest

    from orangetron.plan.activations import layer_activation_bytes
    from orangetron.plan.timing import DEFAULT_EFFICIENCY, layer_cost
    from orangetron.spec.hardware import load_gpu, make_cluster

    cluster = make_cluster(load_gpu("h100"), 1)
    delayed, current = Job(seq_len=128, fp8=True), Job(seq_len=128, fp8=True, fp8_recipe="current")
    extra = layer_cost(tiny(), Degrees(), current, cluster, False).elementwise - \
        layer_cost(tiny(), Degrees(), delayed, cluster, False).elementwise
    bandwidth = cluster.gpu.memory_bw_gbs * 1e9 * DEFAULT_EFFICIENCY.elementwise_bw
    assert extra == pytest.approx(2 * 128 * (64 + 64 + 64 + 128) / bandwidth, rel=1e-12)
    assert layer_activation_bytes(tiny(), Degrees(), current, False) == \
        layer_activation_bytes(tiny(), Degrees(), delayed, False)


def test_fp8_head_stays_16_bit_on_the_last_stage_only():
    # pp = 2: stage 0 holds layer 0 (41088) and the embedding (a lookup, excluded); stage 1 holds layer 1, the
    # final norm (64) and the head (6400, excluded). Untied, the head is its own weight; tied on a separate
    # last stage, Megatron's copy of the embedding is the head, excluded the same way.
    deg, job = Degrees(pp=2), Job(seq_len=64, fp8=True, fp8_recipe="blockwise")
    assert fp8_memory_bytes(tiny(), deg, job, stage=0) == 2 * 41088 + 2 * 4 * 3
    assert fp8_memory_bytes(tiny(), deg, job, stage=1) == 2 * (41088 + 64) + 2 * 4 * 3
    tied = ModelSpec(name="tied", hidden_size=64, num_layers=2, num_heads=4, vocab_size=100, ffn_hidden_size=128,
                     tied_embeddings=True)
    assert fp8_memory_bytes(tied, deg, job, stage=1) == 2 * (41088 + 64) + 2 * 4 * 3


def test_memory_per_gpu_counts_the_fp8_copies_of_its_own_stage():
    # Off: no entry. On, pp = 2 with one tiny layer per stage and one micro-batch: stage 1 (the head's 6400
    # weights excluded from its FP8 copies, the final norm's 64 included) is the fullest, and the report's
    # entry is that of the stage it reports, not stage 0's.
    deg = Degrees(pp=2)
    assert "fp8" not in memory_per_gpu(tiny(), deg, Job(seq_len=64, global_batch=1))
    job = Job(seq_len=64, global_batch=1, fp8=True, fp8_recipe="blockwise")
    busiest = max((0, 1), key=lambda s: stage_memory(tiny(), deg, job, s)["total"])
    assert busiest == 1
    report = memory_per_gpu(tiny(), deg, job)
    assert report == stage_memory(tiny(), deg, job, busiest)
    assert report["fp8"] == fp8_memory_bytes(tiny(), deg, job, busiest)
    plain = stage_memory(tiny(), deg, replace(job, fp8=False, fp8_recipe="delayed"), busiest)
    assert report["total"] - report["fp8"] == plain["total"] - (plain["activations"] - report["activations"])


def test_a_tied_head_on_the_only_stage_is_the_embedding():
    # Tied, pp = 1: the one vocabulary matrix is the embedding (a lookup, excluded once); nothing else goes.
    tied = ModelSpec(name="tied", hidden_size=64, num_layers=2, num_heads=4, vocab_size=100, ffn_hidden_size=128,
                     tied_embeddings=True)
    job = Job(seq_len=64, fp8=True, fp8_recipe="blockwise")
    assert fp8_memory_bytes(tied, Degrees(), job) == 2 * (82176 + 64) + 2 * 4 * 6


def test_blockwise_weight_scales_by_hand():
    # The same 82240 FP8-cast parameters; one fp32 scale per 128 x 128 block of each of the two copies
    # (ceil(82240 / 16384) = 6 blocks), and no amax history.
    linear_like = 82176 + 64
    job = Job(seq_len=64, fp8=True, fp8_recipe="blockwise")
    assert fp8_memory_bytes(tiny(), Degrees(), job) == 2 * linear_like + 2 * 4 * 6


def test_blockwise_activation_tile_scales_by_hand():
    from orangetron.plan.activations import layer_activation_bytes

    # One fp32 scale per 128 elements of each saved FP8 GEMM input: QKV input 64 x 64, output-projection input
    # 64 x (4 heads x 16), up/gate input 64 x 64, down input 64 x 128 -> 20480 elements, 640 bytes.
    delayed = layer_activation_bytes(tiny(), Degrees(), Job(seq_len=64, fp8=True), moe=False)
    blockwise = layer_activation_bytes(tiny(), Degrees(), Job(seq_len=64, fp8=True, fp8_recipe="blockwise"), moe=False)
    assert blockwise - delayed == 640
    # Under tp = 2 with SP every saved input halves, and so do its scales.
    deg, sp = Degrees(tp=2), dict(seq_len=64, fp8=True, sequence_parallel=True)
    half = (layer_activation_bytes(tiny(), deg, Job(**sp, fp8_recipe="blockwise"), moe=False)
            - layer_activation_bytes(tiny(), deg, Job(**sp), moe=False))
    assert half == 320


def test_blockwise_recipe_needs_fp8():
    import pytest

    with pytest.raises(ValueError, match="fp8_recipe='blockwise' needs fp8=True"):
        Job(seq_len=64, fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="fp8_recipe='mxfp8'"):
        Job(seq_len=64, fp8=True, fp8_recipe="mxfp8")


def tiny_moe():
    # The tiny model's second layer a MoE one: 4 experts of width 32, top 2, and one shared expert of width 32.
    return tiny().with_changes(num_experts=4, top_k=2, moe_ffn_hidden_size=32, num_shared_experts=1,
                               first_dense_layers=1)


def test_cached_activations_by_hand():
    """DeepSeek-V3's low-precision activations, 128 tokens: the attention output (4 heads x 16 = 64 columns) kept
    once in 12 bits where the kernel kept 2 bytes and the projection 1 (its 1/32 byte of scales stays); in the MoE
    layer gate and up of 256 routed copies and 128 shared rows (32 columns each) as 1-byte casts plus 1/32 byte
    of scales instead of 2 bytes."""
    from orangetron.plan.activations import layer_activation_bytes

    blockwise = dict(seq_len=128, fp8=True, fp8_recipe="blockwise")
    plain, cached = Job(**blockwise), Job(**blockwise, fp8_cached_activations=True)
    attention = 128 * 64 * (2 + 1) - 128 * 64 * 3 // 2
    swiglu = 2 * (256 + 128) * 32 * (2 - 1) - 2 * (256 + 128) * 32 * 4 // 128
    for moe, saved in ((False, attention), (True, attention + swiglu)):
        assert layer_activation_bytes(tiny_moe(), Degrees(), plain, moe) - \
            layer_activation_bytes(tiny_moe(), Degrees(), cached, moe) == saved
    # Eager attention keeps its probabilities, not its output: the projection's FP8 cast is all there is to keep.
    eager = dict(blockwise, attention_kernel="eager")
    assert layer_activation_bytes(tiny_moe(), Degrees(), Job(**eager), False) == \
        layer_activation_bytes(tiny_moe(), Degrees(), Job(**eager, fp8_cached_activations=True), False)


def test_cached_activations_cast_the_swiglu_inputs():
    """Forward: read gate and up (2 bytes) and write their casts (1 byte) for 256 routed copies and 128 shared rows
    of 32 columns, at the elementwise share of HBM bandwidth."""
    import pytest

    from orangetron.plan.timing import DEFAULT_EFFICIENCY, layer_cost
    from orangetron.spec.hardware import load_gpu, make_cluster

    cluster = make_cluster(load_gpu("h100"), 1)
    blockwise = dict(seq_len=128, fp8=True, fp8_recipe="blockwise")
    plain, cached = Job(**blockwise), Job(**blockwise, fp8_cached_activations=True)
    extra = layer_cost(tiny_moe(), Degrees(), cached, cluster, True).elementwise - \
        layer_cost(tiny_moe(), Degrees(), plain, cluster, True).elementwise
    bandwidth = cluster.gpu.memory_bw_gbs * 1e9 * DEFAULT_EFFICIENCY.elementwise_bw
    assert extra == pytest.approx(2 * 3 * (256 + 128) * 32 / bandwidth, rel=1e-12)
    assert layer_cost(tiny_moe(), Degrees(), cached, cluster, False).elementwise == \
        layer_cost(tiny_moe(), Degrees(), plain, cluster, False).elementwise


def test_cached_activations_need_the_blockwise_recipe():
    import pytest

    for job in (dict(fp8=True), dict()):
        with pytest.raises(ValueError, match="fp8_cached_activations=True needs fp8=True with fp8_recipe='blockwise'"):
            Job(seq_len=64, fp8_cached_activations=True, **job)
