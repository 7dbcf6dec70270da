"""Kernel time on one GPU from first principles: FLOPs and bytes of each operation on a roofline, with the
matmul efficiency that its shape allows.

GEMM. A tensor-core GEMM of [m, k] x [k, n] is cut into output tiles; each streaming multiprocessor (SM)
computes one tile at a time. Three shape losses multiply the GPU's sustained efficiency on ideal shapes
(`GPUSpec.gemm_efficiency`):
- tile quantization: the last row and column of tiles are padded, so only m*n of ceil(m/tm)*tm x
  ceil(n/tn)*tn computed outputs are useful;
- wave quantization: tiles run in waves of one per SM; a last, partial wave leaves SMs idle;
- the K loop: each tile spends about `K_FILL` elements of K outside its main loop (pipeline fill, epilogue),
  so a short reduction (attention's head dim, a few tokens' wgrad) cannot amortize it. That time is fixed per
  tile (the epilogue writes the same 16-bit outputs), so at FP8's doubled rate it is worth twice the K
  elements (`k_fill`).
The library picks the tile shape that does best (`TILES`, with the relative speed of each shape: larger
tiles reuse more operands per byte loaded). Small or skinny GEMMs end up memory bound by the roofline:
time = max(FLOPs / (peak x efficiency), bytes / HBM bandwidth).

A grouped GEMM (MoE experts) launches every expert's tiles together: tile padding is per expert, so few
tokens per expert pad their tiles, and the waves are counted over all experts' tiles.

Backward of a linear layer is two GEMMs: dgrad [m, n] x [n, k] and wgrad [k, m] x [m, n], the latter
accumulated into the fp32 main gradient (read and written in the epilogue, as Megatron's fused gradient
accumulation does).

Attention. Fused (flash) attention runs at the GPU's attention efficiency for its kernel (forward and
backward differ), reduced at short key lengths by the same fill cost per query tile (`KEY_FILL` keys) and
by wave quantization over (batch x heads x query tiles). Causal attention computes the key blocks at or
below the diagonal: with blocks of `ATTN_BLOCK` keys a query attends on average s/2 + ATTN_BLOCK/2 computed
keys. Eager attention is its batched GEMMs (QK^T with K = head dim, PV with K = keys) on the GEMM model.
"""

from __future__ import annotations

import math
from functools import lru_cache

from orangetron.spec.hardware import FP8_FORMATS, GPUSpec

# (tile rows, tile columns, relative throughput of the shape): CUTLASS/cuBLAS Hopper and Ampere kernels.
TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.92), (64, 128, 0.80), (64, 64, 0.60))
K_FILL = 128  # K elements' worth of time a tile spends outside its main loop
KEY_FILL = 256  # keys' worth of time a flash-attention query tile spends outside its main loop
ATTN_BLOCK = 128  # flash attention's key block (the causal diagonal is computed whole)
ATTN_QUERY_TILE = 128
# FlashAttention in Triton against FlashAttention-2, forward and backward: "around 1.3-1.5x faster than
# FlashAttention in Triton in the forward pass and around 2x faster in the backward pass" (Dao 2023,
# arXiv:2307.08691, section 4.1, A100); the middle of the forward range, taken to hold on other GPUs too.
TRITON_FLASH_GAP = (1.4, 2.0)


@lru_cache(maxsize=65536)
def shape_efficiency(m: int, k: int, n: int, sms: int, groups: int = 1, k_fill: float = K_FILL) -> float:
    """Share of the ideal-shape efficiency a GEMM (or `groups` equal GEMMs launched together) reaches, its
    tiles spending `k_fill` K elements' worth of time outside the main loop."""
    if m <= 0 or k <= 0 or n <= 0:
        return 1.0
    best = 0.0
    for tm, tn, speed in TILES:
        rows, cols = -(-m // tm), -(-n // tn)
        tiles = groups * rows * cols
        padding = m * n / (rows * tm * cols * tn)
        waves = tiles / (math.ceil(tiles / sms) * sms)
        best = max(best, speed * padding * waves)
    return best * k / (k + k_fill)


def gemm_time(m: int, k: int, n: int, gpu: GPUSpec, dtype: str, in_bytes: float, out_bytes: float,
              groups: int = 1, acc_bytes: float = 0.0) -> float:
    """Seconds of `groups` [m, k] x [k, n] GEMMs: roofline of FLOPs at the shape's efficiency and bytes
    (inputs of `in_bytes`, output of `out_bytes`, plus `acc_bytes` per output element read back to
    accumulate) over HBM bandwidth."""
    flops = 2.0 * m * k * n * groups
    k_fill = K_FILL * gpu.peak_flops(dtype) / gpu.peak_flops("bfloat16") if dtype in FP8_FORMATS else K_FILL
    eff = gpu.matmul_efficiency(dtype) * shape_efficiency(m, k, n, gpu.sms, groups, k_fill)
    nbytes = groups * (in_bytes * (m * k + k * n) + (out_bytes + acc_bytes) * m * n)
    return max(flops / (gpu.peak_flops(dtype) * eff), nbytes / (gpu.memory_bw_gbs * 1e9))


def linear_time(m: int, k: int, n: int, gpu: GPUSpec, dtype: str, act_bytes: float,
                groups: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer: y[m, n] = x[m, k] W[k, n]; backward is dgrad and the
    wgrad accumulated into an fp32 main gradient (read and written: 8 bytes per weight element)."""
    fwd, dgrad, wgrad = linear_parts(m, k, n, gpu, dtype, act_bytes, groups)
    return fwd, dgrad + wgrad


def linear_parts(m: int, k: int, n: int, gpu: GPUSpec, dtype: str, act_bytes: float,
                 groups: int = 1) -> tuple[float, float, float]:
    """(forward, dgrad, wgrad) seconds of `linear_time`'s linear layer: a zero-bubble pipeline schedules the
    weight gradient apart from the input gradient."""
    out = 2.0 if act_bytes < 2 else act_bytes  # FP8 GEMMs write 16-bit outputs
    fwd = gemm_time(m, k, n, gpu, dtype, act_bytes, out, groups)
    dgrad = gemm_time(m, n, k, gpu, dtype, act_bytes, out, groups)
    return fwd, dgrad, weight_grad_time(m, k, n, gpu, dtype, act_bytes, groups)


def weight_grad_time(m: int, k: int, n: int, gpu: GPUSpec, dtype: str, act_bytes: float, groups: int = 1) -> float:
    """Seconds of a linear layer's wgrad: dW[k, n] = x^T dy, accumulated into the fp32 main gradient."""
    return gemm_time(k, m, n, gpu, dtype, act_bytes, 4.0, groups, acc_bytes=4.0)


def causal_keys(seq: int) -> float:
    """Keys a query is computed against on average under a causal mask, whole diagonal blocks included."""
    return seq / 2 + min(seq, ATTN_BLOCK) / 2


def flash_efficiency(base: float, keys: float, ctas: int, sms: int) -> float:
    """The kernel's long-sequence efficiency, reduced by its per-tile fill and by its last partial wave."""
    waves = ctas / (math.ceil(ctas / sms) * sms) if ctas > 0 else 1.0
    return base * keys / (keys + KEY_FILL) * waves
