"""The compute model (plan/compute.py): tile and wave quantization, the K-loop fill, grouped GEMMs, the
roofline, causal block accounting and the flash-attention efficiency. Every expected value is worked by hand
from the documented constants (tiles 128x256 and 256x128 at 1.0, 128x128 at 0.92, 64x128 at 0.80, 64x64 at
0.60; K_FILL 128, 256 at FP8's doubled rate; KEY_FILL 256; attention blocks of 128)."""

import dataclasses

import pytest

from orangetron.plan.compute import (
    K_FILL,
    causal_keys,
    flash_efficiency,
    gemm_time,
    linear_time,
    shape_efficiency,
)
from orangetron.plan.timing import layer_cost
from orangetron.spec.hardware import GPUSpec, load_gpu, make_cluster
from orangetron.spec.model import load_model
from orangetron.spec.options import Degrees, Job

# A round-number GPU: 100 SMs, 1000 TFLOPS, 1000 GB/s, half of peak on ideal shapes.
GPU = GPUSpec(name="round", sms=100, bf16_tflops=1000.0, fp32_tflops=100.0, memory_gib=80.0, memory_bw_gbs=1000.0,
              intra_node="nvswitch", intra_bw_gbs=100.0, nvls=False, gpus_per_node=8, nic_gbps=100.0,
              gemm_efficiency=0.5, fp8_tflops=2000.0)


def test_large_square_gemm_loses_only_its_last_wave_and_k_fill():
    # 8192^3 on 132 SMs: 128x256 tiles -> 64*32 = 2048 tiles in 16 waves of 132 (2112 slots): 0.969697;
    # K fill 8192 / (8192 + 128) = 0.984615.
    assert shape_efficiency(8192, 8192, 8192, 132) == pytest.approx(2048 / 2112 * 8192 / 8320)


def test_small_gemm_is_wave_bound():
    # 256 x 4096 x 256 on 132 SMs: 64x64 tiles give 16 tiles at 0.60 -> 0.6*16/132; K fill 4096/4224.
    assert shape_efficiency(256, 4096, 256, 132) == pytest.approx(0.6 * 16 / 132 * 4096 / 4224)


def test_tile_padding_picks_the_shape_that_wastes_least():
    # m = 192 on one SM (no wave loss): 128-row tiles pad to 256 (0.75); 64x128 tiles fit exactly at 0.80.
    assert shape_efficiency(192, 1024, 256, 1) == pytest.approx(0.80 * 1024 / 1152)


def test_grouped_gemm_counts_waves_over_all_groups():
    # 8 experts of 64 tokens, k 4096, n 1024, 132 SMs: 64x64 tiles -> 8*1*16 = 128 tiles in one wave of 132
    # at 0.60 (0.5818) beats 64x128 (64 tiles: 0.80*64/132 = 0.3879).
    assert shape_efficiency(64, 4096, 1024, 132, groups=8) == pytest.approx(0.6 * 128 / 132 * 4096 / 4224)


def test_gemm_roofline_compute_and_memory_bound():
    # 1024^3 on the round GPU: best 128x128 (64 tiles, 64/100 * 0.92 = 0.5888), K fill 1024/1152.
    eff = 0.5 * 0.5888 * 1024 / 1152
    assert gemm_time(1024, 1024, 1024, GPU, "bfloat16", 2, 2) == pytest.approx(2 * 1024**3 / (1e15 * eff))
    # One row against a 4096 x 4096 weight: bytes 2*(4096 + 4096^2) + 2*4096 over 1e12 B/s beat the FLOPs.
    t = gemm_time(1, 4096, 4096, GPU, "bfloat16", 2, 2)
    assert t >= (2 * (4096 + 4096**2) + 2 * 4096) / 1e12
    assert t == pytest.approx(max((2 * (4096 + 4096**2) + 2 * 4096) / 1e12, 2 * 4096**2 / (
        1e15 * 0.5 * 0.6 * (1 / 64) * (64 / 100) * 4096 / 4224)))


def test_linear_backward_is_dgrad_plus_wgrad_into_fp32_main_grad():
    fwd, bwd = linear_time(1024, 1024, 1024, GPU, "bfloat16", 2)
    one = 2 * 1024**3 / (1e15 * 0.5 * 0.5888 * 1024 / 1152)
    assert fwd == pytest.approx(one)
    # dgrad as the forward; wgrad reads 2*(2*1024^2) input bytes and reads and writes the fp32 main grad
    # (8 bytes per element): 12 MiB over 1e12 B/s = 12.6 us, more than its 8.2 us of FLOPs, so memory bound.
    assert bwd == pytest.approx(one + (2 * 2 * 1024**2 + 8 * 1024**2) / 1e12)
    # FP8: the FP8 peak (2000 TFLOPS) halves the time per K element, so the tile's fixed fill is worth
    # 128 x 2000 / 1000 = 256 elements: 2 * 1024^3 / (2e15 * 0.5 * 0.5888 * 1024 / 1280) = 4.56 us, above the
    # 4.19 us its 1-byte inputs and 2-byte output (4 MiB) take.
    fwd8, _ = linear_time(1024, 1024, 1024, GPU, "float8", 1)
    assert fwd8 == pytest.approx(2 * 1024**3 / (2e15 * 0.5 * 0.5888 * 1024 / 1280))
    assert fwd8 > (2 * 1024**2 + 2 * 1024**2) / 1e12


def test_blockwise_fp8_runs_at_its_own_efficiency_where_the_gpu_sets_one():
    # 8192^3 on the round GPU (100 SMs): 128x256 tiles, 2048 in 21 waves (2100 slots); FP8 fill 256 elements.
    share = 2048 / 2100 * 8192 / (8192 + 256)
    flops = 2 * 8192**3
    assert gemm_time(8192, 8192, 8192, GPU, "float8-blockwise", 1, 2) == pytest.approx(flops / (2e15 * 0.5 * share))
    blockwise = dataclasses.replace(GPU, fp8_blockwise_gemm_efficiency=0.4)
    assert gemm_time(8192, 8192, 8192, blockwise, "float8-blockwise", 1, 2) == pytest.approx(
        flops / (2e15 * 0.4 * share))
    assert gemm_time(8192, 8192, 8192, blockwise, "float8", 1, 2) == pytest.approx(flops / (2e15 * 0.5 * share))


# DeepGEMM's release table (deepseek-ai/DeepGEMM README, February 2025: H800, NVCC 12.8, blockwise FP8 with BF16
# output), its training-sized rows (M >= 4096): (groups, M per group, N, K, TFLOPS).
DEEPGEMM_H800 = ((1, 4096, 2112, 7168, 1058), (1, 4096, 24576, 1536, 990), (1, 4096, 32768, 512, 590),
                 (1, 4096, 7168, 16384, 1358), (1, 4096, 4096, 7168, 1304), (1, 4096, 7168, 2048, 1025),
                 (4, 8192, 4096, 7168, 1297), (4, 8192, 7168, 2048, 1099), (8, 4096, 4096, 7168, 1288),
                 (8, 4096, 7168, 2048, 1093))


def test_hopper_blockwise_efficiency_is_the_mean_deepgemm_implies():
    """The Hopper presets' `fp8_blockwise_gemm_efficiency` is the mean, over the table's rows, of published
    TFLOPS / (FP8 peak x our shape share with the FP8 fill): not fitted to any training run."""
    h800 = load_gpu("h800")
    fill = K_FILL * h800.fp8_tflops / h800.bf16_tflops
    implied = [tflops / (h800.fp8_tflops * shape_efficiency(m, k, n, h800.sms, g, fill))
               for g, m, n, k, tflops in DEEPGEMM_H800]
    assert h800.fp8_blockwise_gemm_efficiency == pytest.approx(sum(implied) / len(implied), abs=0.005)
    assert {load_gpu(n).fp8_blockwise_gemm_efficiency for n in ("h100", "h100-nvl", "h200")} == {0.65}
    assert load_gpu("b200").fp8_blockwise_gemm_efficiency == 0  # Blackwell scales blocks in its tensor cores


def test_blockwise_fp8_gemms_against_deepgemm_table():
    """Per-row error of the priced grouped and dense GEMMs: mean |error| 10.8%, worst +41% (K = 512, where the
    BF16 epilogue of a 4096 x 32768 output dominates). Pricing blockwise at the per-tensor efficiency (mean
    17.6%) or with the 16-bit K fill (15.5%) fails here."""
    h800 = load_gpu("h800")
    errors = []
    for g, m, n, k, tflops in DEEPGEMM_H800:
        seconds = gemm_time(m, k, n, h800, "float8-blockwise", 1, 2, groups=g)
        errors.append(2 * g * m * n * k / seconds / 1e12 / tflops - 1)
    assert sum(abs(e) for e in errors) / len(errors) <= 0.12
    assert abs(sum(errors) / len(errors)) <= 0.03
    assert max(abs(e) for e in errors[:2] + errors[3:]) <= 0.15


def test_causal_keys_count_whole_diagonal_blocks():
    assert causal_keys(8192) == 4096 + 64
    assert causal_keys(128) == 128  # one block: computed whole
    assert causal_keys(64) == 64


def test_flash_efficiency_falls_with_short_keys_and_partial_waves():
    assert flash_efficiency(0.6, 768, 150, 100) == pytest.approx(0.6 * 768 / 1024 * 150 / 200)
    assert flash_efficiency(0.6, 1 << 20, 100, 100) == pytest.approx(0.6, rel=1e-3)


def test_long_context_attention_time_on_h100():
    """llama3-8b, one GPU, seq 65536, causal: FLOPs 2 * s * (s/2 + 64) * 32 heads * (128 + 128); forward at
    0.62 of 989.4 TFLOPS x keys/(keys + 256) x wave share (32 * 512 CTAs over 132 SMs: 16384 / 16500)."""
    model, cluster = load_model("llama3-8b"), make_cluster("h100", 1)
    s = 65536
    keys = s / 2 + 64
    flops = 2 * s * keys * 32 * 256
    eff_f = 0.62 * keys / (keys + 256) * 16384 / 16500
    eff_b = 0.50 * keys / (keys + 256) * 16384 / 16500
    cost = layer_cost(model, Degrees(), Job(seq_len=s), cluster, False)
    assert cost.attention_f == pytest.approx(flops / (989.4e12 * eff_f))
    assert cost.attention_b == pytest.approx(2.5 * flops / (989.4e12 * eff_b))


def test_ring_cp_attention_pays_the_fill_per_ring_block():
    """llama3-8b, seq 16384, cp=8 on one node: each rank holds 2048 queries (16 query tiles per head, 32 heads:
    512 CTAs over 132 SMs -> 512 / 528). All-gather CP runs one call over the causal 8192 + 64 keys; ring CP runs
    one call per step over a block of 16384 / 8 = 2048 keys. Same FLOPs, fill 8256/8512 vs 2048/2304."""
    model, cluster = load_model("llama3-8b"), make_cluster("h100", 8)
    deg = Degrees(cp=8)
    gathered = layer_cost(model, deg, Job(seq_len=16384, cp_mode="allgather"), cluster, False)
    ring = layer_cost(model, deg, Job(seq_len=16384, cp_mode="ring"), cluster, False)
    flops = 2 * 2048 * (8192 + 64) * 32 * 256
    assert gathered.attention_f == pytest.approx(flops / (989.4e12 * 0.62 * 8256 / 8512 * 512 / 528))
    assert ring.attention_f == pytest.approx(flops / (989.4e12 * 0.62 * 2048 / 2304 * 512 / 528))


def test_loss_and_routing_permutation_traffic():
    """Cross entropy: 20 bytes per logit at 70% of HBM bandwidth; routing: each copy's row read and written
    twice (gather before dispatch, scatter after combine) in 16 bit."""
    from orangetron.plan.timing import DEFAULT_EFFICIENCY, _loss_time, _permute_time

    model, cluster = load_model("mixtral-8x7b"), make_cluster("h100", 8)
    job = Job(seq_len=4096)
    bw = 3350e9 * 0.70
    assert _loss_time(model, Degrees(tp=2, dp=4), job, cluster, DEFAULT_EFFICIENCY) == pytest.approx(
        20 * 4096 * 32000 / 2 / bw)
    # top 2 of 8, ep 8: 8192 copies arrive on balance, rows of 4096 x 2 bytes, 4 passes.
    assert _permute_time(model, Degrees(dp=8, ep=8), job, cluster, 4096, DEFAULT_EFFICIENCY) == pytest.approx(
        4 * 8192 * 4096 * 2 / bw)
