"""Throughput against published runs the constants were NOT chosen on (held out), by class.

The calibration set is tests/test_plan_timing.py (Korthikanti et al. 2022 on A100, Llama 3 405B on H100): the
per-GPU-type GEMM efficiency was set looking at those. Every run below is predicted with the same shipped
presets and global constants; nothing is set per run. Knobs a source does not publish (micro-batch, virtual
pipeline stages) are chosen as the authors would have tuned them: the planner's fastest choice that fits.

Sources (each run's numbers are quoted from its paper; metrics use the paper's own FLOP convention). The
Megatron-LM (SC'21) and DeepSpeed pipeline-engine runs (MT-NLG, BLOOM, GPT-NeoX) reduced gradients after the last
backward, not behind it (Megatron-LM's train_step of the time calls allreduce_gradients() after the schedule;
DeepSpeed's TrainSchedule issues ReduceGrads after its last step): `overlap_grad_reduce=False`.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
  (SC'21, arXiv:2104.04473), Table 1: GPT 1.7B-1T on A100 80GB, seq 2048, vocab 51200, full activation
  recomputation, achieved teraFLOP/s per GPU counted with recomputation (96BslH^2(1 + s/6h + V/16lh)).
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990):
  tp 8, pp 35, batch 1920, seq 2048 on 280, 350 and 420 DGX A100 nodes: 126, 121 and 113 teraFLOP/s per GPU
  (iteration 60.1, 50.2 and 44.4 s), same convention.
- BigScience 2022, "BLOOM" (arXiv:2211.05100) section 3.4: 176B on 384 A100 80GB, tp 4, pp 12, dp 8, global
  batch 2048, micro-batch 2, 156 TFLOPs per GPU in the fastest configuration (Megatron convention with
  recomputation).
- Black et al. 2022, "GPT-NeoX-20B" (arXiv:2204.06745): 96 A100 40GB, tp 2, pp 4, dp 12, micro-batch 4,
  about 3.15M tokens per batch (1538 sequences; 1536 here, the nearest multiple of dp x micro-batch),
  117 teraFLOP/s per GPU counted as GPT-NeoX logged it then (megatron/training.py `get_flops`: 6 x parameters
  + 60 x seq x hidden x layers per token, no recomputation term), which the paper's 1830 hours of training
  for 150,000 such steps confirm; compared as tokens/s per GPU.
- DeepSeek-AI 2024, DeepSeek-V2 (arXiv:2405.04434) section 3: 172.8K H800 GPU hours per trillion tokens
  (1607.5 tokens/s per GPU), pp 16 (zero-bubble), ep 8, ZeRO-1 data parallel, seq 4096, batch 9216 sequences
  (after 2304 rising to 9216 over the first 225B of 8.1T tokens), MLA on an improved FlashAttention-2, some
  operators recomputed. The cluster size is not published; 1024 GPUs assumed.
- DeepSeek-AI 2024, DeepSeek-V3 (arXiv:2412.19437) sections 3.2 and 4.2: 180K H800 GPU hours per trillion
  tokens (1543.2 tokens/s per GPU) on 2048 H800, pp 16, ep 64, ZeRO-1 data parallel, FP8 GEMMs with blockwise
  scales (section 3.3.2: 1 x 128 activation tiles, 128 x 128 weight blocks), seq 4096,
  batch 15360 sequences. Its dispatch sends a token once to each of at most 4 nodes and forwards it over NVLink
  (section 3.2.2, 20 SMs for communication): the "deepep" dispatcher with the preset's node-limited routing.
  DualPipe is priced as 1F1B whose expert traffic hides behind the paired micro-batch's layer (`overlap_ep`);
  DeepSeek-V2 overlapped only its shared experts with the all-to-all (section 3.2.1), so it runs with
  `overlap_ep=False` (the shared experts are still the window).
- NVIDIA Megatron-LM, megatron/core/transformer/moe/README.md (MCore v0.9): "468 TFLOPS for Mixtral 8X7B bf16
  training", with the same README's reference mapping for it: 64 H100, dropless all-to-all dispatcher, seq 4096,
  tp 1, ep 8, pp 4, virtual pipeline 8, micro-batch 1, global batch 256, distributed optimizer. TFLOP/s in
  Megatron's count (training.py `num_floating_point_operations`: routed top-k MLPs, full s x s attention, no
  recomputation term: the planner's model FLOPs). The all-to-all dispatcher of that version did not overlap the
  expert all-to-all with computation, and Mixtral has no shared expert: `overlap_ep=False`.
- NVIDIA NeMo, "Long Sequence Performance" (docs/source/performance/performance_long_sequence.md, NeMo 24.03.01
  container, DGX-H100): LLAMA2-7B in FP8 from 4K to 1M tokens, tp/pp/dp/cp as published, TFLOPS per GPU in
  NeMo's convention (nemo/utils/flops_formulas.py `llama2`: full s x s attention, `12*s/h`, not halved; the same
  file's formula reproduces NeMo's published tokens/s from its TFLOPS, e.g. 16847 tokens/s = 776 TFLOPS for
  LLAMA2-7B in docs/source/performance/performance_summary.md). Transformer Engine in that container runs
  attention with FlashAttention-2's kernels (its context-parallel path calls them directly; cuDNN attention
  under CP came in later releases), so these rows use `attention_kernel="flash2"`. Not published: the batch (we
  use 4M tokens per step, the batch of NeMo's later version of this table) and recompute (the fastest that fits).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from orangetron.plan.memory import memory_per_gpu
from orangetron.plan.overhead import DEFAULT_OVERHEAD, with_overhead
from orangetron.plan.timing import step_time
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec, load_model
from orangetron.spec.options import Degrees, Job, validate
from orangetron.spec.stages import longest_chunk


def gpt(heads: int, hidden: int, layers: int, vocab: int = 51200, dropout: float = 0.1, positions: int = 2048,
        tied: bool = True) -> ModelSpec:
    return ModelSpec(name=f"gpt-{hidden}x{layers}", hidden_size=hidden, num_layers=layers, num_heads=heads,
                     vocab_size=vocab, ffn_hidden_size=4 * hidden, mlp="gelu", dropout=dropout, bias=True,
                     max_position_embeddings=positions, tied_embeddings=tied)


@dataclass(frozen=True)
class Run:
    name: str
    cls: str  # size (small models), scale (large models, many GPUs), long (context), moe, precision; check
    model: ModelSpec
    gpu: str
    deg: Degrees
    job: Job
    # "tflops": hardware TFLOP/s per GPU with recompute (Megatron convention); "model_tflops": model TFLOP/s per
    # GPU with full s x s attention (NeMo's convention); "tokens": tokens per GPU per second
    metric: str
    published: float
    tune: tuple[str, ...] = ()  # unpublished knobs, set to the planner's fastest choice that fits
    gpus_per_node: int = 0  # 0: the preset's node (NVLink domain)


def _sc21(name, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> Run:
    cls = "size" if hidden <= 6144 else "scale"
    job = Job(seq_len=2048, global_batch=batch, recompute="full", attention_kernel="eager", overlap_grad_reduce=False)
    return Run(f"SC'21 {name}", cls, gpt(heads, hidden, layers), "a100-80gb",
               Degrees(tp=tp, pp=pp, dp=gpus // (tp * pp)), job, "tflops", tflops, ("micro_batch", "virtual_stages"))


def _mcore_buckets(dp_cp: int) -> int:
    """Megatron-Core's gradient buckets under overlapped reduction (DistributedDataParallelConfig.bucket_size
    default: max(40M, 1M x dp) parameters), as NeMo and Megatron-Bridge run it; unbucketed, the reduction would
    hold a second copy of every gradient that Megatron never allocates."""
    return max(40_000_000, 1_000_000 * dp_cp)


_LLAMA2_7B = ModelSpec(name="llama2-7b", hidden_size=4096, num_layers=32, num_heads=32, vocab_size=32000,
                       ffn_hidden_size=11008, mlp="swiglu")


def _nemo_long(k: int, tp: int, pp: int, dp: int, cp: int, tflops: float) -> Run:
    seq = k * 1024
    job = Job(seq_len=seq, global_batch=max(dp, 4 * 1024 * 1024 // seq), sequence_parallel=tp > 1, fp8=True,
              distributed_optimizer=True, attention_kernel="flash2", grad_bucket_numel=_mcore_buckets(dp * cp),
              grad_accumulation_fusion=True)
    return Run(f"NeMo LLAMA2-7B {k}K", "long" if cp > 1 else "size", _LLAMA2_7B, "h100",
               Degrees(tp=tp, pp=pp, dp=dp, cp=cp), job, "model_tflops", tflops, ("recompute",))


def _neox_tokens_per_s(tflops: float) -> float:
    """GPT-NeoX-20B's published TFLOP/s per GPU as tokens/s per GPU, in the count GPT-NeoX logged in 2022."""
    per_token = 6 * 20_556_201_984 + 60 * 2048 * 6144 * 44  # parameters from the released model card
    return tflops * 1e12 / per_token


# Megatron-Bridge's DeepSeek-V3 recipe (NVIDIA-NeMo/Megatron-Bridge recipes/deepseek/deepseek_v3.py, its layout map
# for pp 16 x vp 1 and pp 4 x vp 4): embedding and 4 layers, 14 virtual stages of 4, then 1 layer, the MTP module
# and the loss.
_V3_PP16_LAYOUT = (4,) * 15 + (1,)
# NVIDIA's layout for DeepSeek-V3 at pp 8 x vp 4 (yanring/Megatron-MoE-ModelZoo's DeepSeek-V3 benchmarking configs,
# "Et*2|(tt|)*22t|(tt|)*7mL"): 23 chunks of 2 layers, one of 1, 7 of 2, and a last chunk with the MTP module and
# the loss only.
_V3_PP8_VP4_LAYOUT = (2,) * 23 + (1,) + (2,) * 7 + (0,)
_MTNLG = gpt(128, 20480, 105)
_MTNLG_JOB = Job(seq_len=2048, global_batch=1920, recompute="full", attention_kernel="eager", overlap_grad_reduce=False)

RUNS = [
    _sc21("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _sc21("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _sc21("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _sc21("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _sc21("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _sc21("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _sc21("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _sc21("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _sc21("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _sc21("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    Run("MT-NLG 530B, 2240 GPUs", "scale", _MTNLG, "a100-80gb", Degrees(tp=8, pp=35, dp=8), _MTNLG_JOB, "tflops",
        126),
    Run("MT-NLG 530B, 2800 GPUs", "scale", _MTNLG, "a100-80gb", Degrees(tp=8, pp=35, dp=10), _MTNLG_JOB, "tflops",
        121),
    Run("MT-NLG 530B, 3360 GPUs", "scale", _MTNLG, "a100-80gb", Degrees(tp=8, pp=35, dp=12), _MTNLG_JOB, "tflops",
        113),
    Run("BLOOM 176B, 384 GPUs", "scale", gpt(112, 14336, 70, vocab=250880, dropout=0.0, positions=0),
        "a100-80gb", Degrees(tp=4, pp=12, dp=8),
        Job(seq_len=2048, global_batch=2048, micro_batch=2, recompute="full", attention_kernel="eager",
            zero_stage=1, overlap_grad_reduce=False), "tflops", 156),
    Run("GPT-NeoX 20B, 96 GPUs", "size", gpt(64, 6144, 44, vocab=50432, dropout=0.0, positions=0, tied=False),
        "a100-40gb", Degrees(tp=2, pp=4, dp=12),
        Job(seq_len=2048, global_batch=1536, micro_batch=4, recompute="full", attention_kernel="eager",
            zero_stage=1, overlap_grad_reduce=False), "tokens", _neox_tokens_per_s(117)),
    # DeepSeek-V2 (arXiv:2405.04434): 172.8K H800 hours per trillion tokens. The batch grew from 2304 to 9216
    # sequences over the first 225B of 8.1T tokens and stayed at 9216, so 97% of the tokens ran at 9216. "A portion
    # of the operators are recomputed to save activation memory", which ones unpublished: recompute is tuned. "MLA
    # is also optimized based on an improved version of FlashAttention-2": priced as FlashAttention-2. Its "16-way
    # zero-bubble pipeline parallelism" is priced as 1F1B: under zb-h1 no recompute choice fits the planner's
    # memory model (the last stage holds 15 micro-batches' weight-gradient inputs, docs/planner.md section 6).
    Run("DeepSeek-V2, 1024 GPUs", "moe", load_model("deepseek-v2"), "h800", Degrees(pp=16, dp=64, ep=8),
        Job(seq_len=4096, global_batch=9216, zero_stage=1, overlap_ep=False, attention_kernel="flash2"), "tokens",
        1e12 / (172.8e3 * 3600),
        ("recompute",)),
    # DeepSeek-V3 as its report describes the run: node-limited DeepEP-style dispatch (section 3.2.2) with 20 of the
    # 132 SMs set aside for communication (section 3.5.1), blockwise FP8 (section 3.3), ZeRO-1, pp 16, ep 64, one
    # MTP module (the preset). Its layer split is not published: NVIDIA's for this model at pp 16 (Megatron-Bridge's
    # DeepSeek-V3 recipe: 4 layers on each stage but the last, which holds 1 and the MTP module and the loss).
    Run("DeepSeek-V3, 2048 GPUs", "precision", load_model("deepseek-v3"), "h800", Degrees(pp=16, dp=128, ep=64),
        Job(seq_len=4096, global_batch=15360, zero_stage=1, fp8=True, fp8_recipe="blockwise", dispatcher="deepep",
            ep_comm_sms_reserved=True, pipeline_layout=_V3_PP16_LAYOUT),
        "tokens",
        1e12 / (180e3 * 3600)),
    Run("Megatron-Core Mixtral 8x7B, 64 GPUs", "moe", load_model("mixtral-8x7b"), "h100", Degrees(pp=4, dp=16, ep=8),
        Job(seq_len=4096, global_batch=256, distributed_optimizer=True, virtual_stages=8, pp_schedule="interleaved",
            grad_bucket_numel=_mcore_buckets(16), overlap_ep=False, grad_accumulation_fusion=True), "model_tflops", 468,
        ("recompute",)),
    # NeMo long-sequence table (tp, pp, dp, cp as published).
    _nemo_long(4, 1, 1, 4, 1, 768),
    _nemo_long(8, 1, 2, 4, 1, 730),
    _nemo_long(16, 2, 1, 8, 1, 660),
    _nemo_long(32, 2, 1, 8, 2, 610),
    _nemo_long(64, 4, 1, 8, 2, 574),
    _nemo_long(128, 4, 1, 8, 4, 555),
    _nemo_long(256, 4, 1, 8, 8, 549),
    _nemo_long(512, 8, 1, 4, 16, 549),
    _nemo_long(1024, 8, 1, 4, 32, 536),
]


# ---- checks reported beside the validation set, not in its totals (docs/planner.md section 6) --------------
# NVIDIA NeMo 24.07 "Performance Benchmarks" pre-training table (docs/source/performance/performance_summary.md,
# DGX-H100, FP8, tokens/s per GPU): which attention kernel Transformer Engine picked is not published.
_LLAMA2_13B = ModelSpec(name="llama2-13b", hidden_size=5120, num_layers=40, num_heads=40, vocab_size=32000,
                        ffn_hidden_size=13824, mlp="swiglu")
_LLAMA2_70B = ModelSpec(name="llama2-70b", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                        vocab_size=32000, ffn_hidden_size=28672, mlp="swiglu")


def _nemo_2407(name, model, gpus, batch, mb, seq, tp, pp, cp, vp, tokens) -> Run:
    dp_cp = gpus // (tp * pp)
    job = Job(seq_len=seq, global_batch=batch, micro_batch=mb, sequence_parallel=tp > 1, fp8=True,
              distributed_optimizer=True, virtual_stages=vp, pp_schedule="interleaved" if vp > 1 else "1f1b",
              grad_bucket_numel=_mcore_buckets(dp_cp), grad_accumulation_fusion=True)
    return Run(f"NeMo 24.07 {name}", "check", model, "h100", Degrees(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp)),
               job, "tokens", tokens, ("recompute",))


NEMO_2407 = [
    _nemo_2407("GPT3-5B", gpt(32, 4096, 24), 64, 2048, 4, 2048, 1, 1, 1, 1, 22521),
    _nemo_2407("GPT3-20B", gpt(48, 6144, 44), 64, 256, 2, 2048, 2, 1, 1, 1, 5851),
    _nemo_2407("GPT3-175B 128", gpt(96, 12288, 96), 128, 256, 1, 2048, 4, 8, 1, 6, 726),
    _nemo_2407("GPT3-175B 512", gpt(96, 12288, 96), 512, 2048, 2, 2048, 4, 8, 1, 6, 782),
    _nemo_2407("LLAMA2-7B", _LLAMA2_7B, 8, 128, 1, 4096, 1, 1, 1, 1, 16847),
    _nemo_2407("LLAMA2-13B", _LLAMA2_13B, 16, 128, 1, 4096, 1, 4, 1, 10, 8646),
    _nemo_2407("LLAMA2-70B", _LLAMA2_70B, 64, 128, 1, 4096, 4, 4, 1, 20, 1707),
    _nemo_2407("LLAMA3-8B", load_model("llama3-8b"), 8, 128, 1, 8192, 1, 1, 2, 1, 12036),
    _nemo_2407("LLAMA3-70B", load_model("llama3-70b"), 64, 128, 1, 8192, 4, 4, 2, 5, 1533),
]


# Megatron-Bridge 25.11 performance summary (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md), MoE rows
# with presets we ship, tokens/s per GPU; "we force-balance the token distribution among experts" (random
# routing, as `busiest_share` assumes). GB200 jobs of 256 GPUs are placed 64 per NVL72 rack.
def _bridge(name, preset, gpu, gpus, fp8, batch, mb, seq, pp, vp, ep, tokens, per_node=0) -> Run:
    # DeepSeek-V3 runs the recipe's layout (pp x vp = 16 chunks) or NVIDIA's own for pp 8 x vp 4.
    layout = {16: _V3_PP16_LAYOUT, 32: _V3_PP8_VP4_LAYOUT}.get(pp * vp, ()) if preset == "deepseek-v3" else ()
    job = Job(seq_len=seq, global_batch=batch, micro_batch=mb, fp8=fp8, distributed_optimizer=True,
              virtual_stages=vp, pp_schedule="interleaved" if vp > 1 else "1f1b", pipeline_layout=layout,
              grad_bucket_numel=_mcore_buckets(gpus // pp), grad_accumulation_fusion=True)
    return Run(f"Megatron-Bridge 25.11 {name}", "check", load_model(preset), gpu,
               Degrees(pp=pp, dp=gpus // pp, ep=ep), job, "tokens", tokens, ("recompute",), per_node)


BRIDGE_MOE = [
    _bridge("GPT-OSS-120B, 64 H100, BF16", "gpt-oss-120b", "h100", 64, False, 512, 4, 4096, 4, 1, 8, 5630),
    _bridge("Qwen3-30B-A3B, 16 H100, FP8", "qwen3-30b-a3b", "h100", 16, True, 512, 2, 4096, 2, 24, 8, 5275),
    _bridge("GPT-OSS-120B, 64 B200, BF16", "gpt-oss-120b", "b200", 64, False, 512, 4, 4096, 1, 1, 8, 8213),
    _bridge("Qwen3-30B-A3B, 8 B200, FP8", "qwen3-30b-a3b", "b200", 8, True, 512, 1, 4096, 1, 1, 8, 9299),
    _bridge("DeepSeek-V3, 256 B200, FP8", "deepseek-v3", "b200", 256, True, 2048, 1, 4096, 16, 1, 8, 2139),
    _bridge("GPT-OSS-120B, 64 GB200, BF16", "gpt-oss-120b", "gb200", 64, False, 1280, 1, 8192, 1, 1, 64, 15876),
    _bridge("Qwen3-30B-A3B, 8 GB200, FP8", "qwen3-30b-a3b", "gb200", 8, True, 512, 4, 4096, 1, 1, 8, 23766),
    _bridge("DeepSeek-V3, 256 GB200, BF16", "deepseek-v3", "gb200", 256, False, 4096, 1, 4096, 4, 4, 64, 3139, 64),
    _bridge("DeepSeek-V3, 256 GB200, FP8", "deepseek-v3", "gb200", 256, True, 4096, 1, 4096, 8, 4, 32, 4018, 64),
]


# Megatron-Core's MoE model zoo (NVIDIA's Megatron-MoE-ModelZoo, best_practice/Qwen3/readme.md "Performance
# Results": Qwen3-235B-A22B on 256 H100, BF16, seq 4096, global batch 2048, micro-batch as listed), run with the
# repository's own model_configs/benchmarking/Qwen3-235B-A22B.yaml: distributed optimizer with overlapped
# reduction, SP, flash attention, aux-loss routing (not forced to balance), expert tensor parallelism 1, so
# the experts fold over the stage's tp x dp ranks. Published step time as tokens/s per GPU. The "norm, act"
# selective recompute is not priced (recompute "none"); FSDP is priced as ZeRO-3. Left out: the A2A row with
# pp 32 x vp 3 = 96 chunks, which holds 94 layers only because that config counts the embedding and the loss
# as layers of the pipeline split (--account-for-embedding/loss-in-pipeline-split), which the planner cannot.
def _zoo(name, tp, ep, pp, vp, mb, recompute, step_s, overlap_ep=False, zero3=False) -> Run:
    dp = 256 // (tp * pp)
    job = Job(seq_len=4096, global_batch=2048, micro_batch=mb, sequence_parallel=True, zero_stage=3 if zero3 else 0,
              distributed_optimizer=not zero3, virtual_stages=vp, pp_schedule="interleaved" if vp > 1 else "1f1b",
              grad_bucket_numel=_mcore_buckets(dp), recompute=recompute, overlap_ep=overlap_ep,
              grad_accumulation_fusion=not zero3, dispatcher="deepep")
    return Run(f"MoE model zoo Qwen3-235B-A22B, {name}", "check", load_model("qwen3-235b-a22b"), "h100",
               Degrees(tp=tp, pp=pp, dp=dp, ep=ep, expert_fold=True), job, "tokens", 2048 * 4096 / step_s / 256)


MODELZOO_MOE = [
    _zoo("tp2 ep32 pp8 vp4, DeepEP", 2, 32, 8, 4, 1, "none", 19.7),
    _zoo("tp2 ep32 pp8 vp4, DeepEP, EP overlap", 2, 32, 8, 4, 1, "none", 17.6, overlap_ep=True),
    _zoo("tp2 ep8 FSDP, mb 4, DeepEP", 2, 8, 1, 1, 4, "full", 17.6, zero3=True),
    _zoo("tp4 ep8 pp8 vp4, DeepEP", 4, 8, 8, 4, 1, "none", 29.0),
]


# NVIDIA's "Optimizing DeepSeek-V3 Training Performance on NVIDIA GB200 NVL72" (NVIDIA/Megatron-LM
# docs/discussions/deepseek-v3-gb200-optimization): 256 GB200, MXFP8 (priced as the planner's FP8), tp1 pp8 vp4
# ep32, micro-batch 1, global batch 2048, seq 4096, from a 494 TFLOP/s baseline (NCCL all-to-all dispatcher)
# to 970 after kernel fusions, CUDA graphs, CPU-side work and HybridEP. TFLOP/s in Megatron's count, turned
# into tokens/s with that count's own ratio for DeepSeek-V3 at seq 4096 in Megatron-Bridge's table (3454
# tokens/s per GPU = 899 TFLOP/s, docs/performance-summary.md, 25.11, DGX-GB200).
def _gb200_guide(name: str, tflops: float) -> Run:
    job = Job(seq_len=4096, global_batch=2048, fp8=True, distributed_optimizer=True, virtual_stages=4,
              pp_schedule="interleaved", pipeline_layout=_V3_PP8_VP4_LAYOUT, grad_bucket_numel=_mcore_buckets(32),
              grad_accumulation_fusion=True)
    return Run(f"DeepSeek-V3 on 256 GB200 (MCore guide), {name}", "check", load_model("deepseek-v3"), "gb200",
               Degrees(pp=8, dp=32, ep=32), job, "tokens", tflops * 3454 / 899, (), 64)


GB200_GUIDE = [_gb200_guide("baseline", 494.46), _gb200_guide("optimized", 970.01)]


# MosaicML llm-foundry's MPT benchmark table (mosaicml/llm-foundry scripts/train/benchmarking/README.md, "H100 80GB
# BF16"): Composer with PyTorch FSDP FULL_SHARD (ZeRO-3, bf16 gathers and reductions), tokens/s per GPU. The MPT
# benchmark models are GPT-style (biases, LayerNorm, GeLU 4h, learned positions, tied embeddings, vocabulary
# 50368); their shapes (scripts/train/yamls/pretrain/mpt-*.yaml) reproduce the table's NumParams exactly. Which
# attention kernel ran is not stated: the yamls set `attn_impl: triton` (FlashAttention in Triton), as did
# submit_benchmarks.py's default until a later version defaulted to `flash` (FlashAttention-2). Priced with the
# Triton kernel; docs/planner.md gives both. Reported beside the validation set.
MPT_SHAPES = {"760m": (12, 1536, 24), "1b": (16, 2048, 24), "3b": (20, 2560, 32), "7b": (32, 4096, 32),
              "13b": (40, 5120, 40), "30b": (56, 7168, 48), "70b": (64, 8192, 80)}
# (model, seq, GPUs, micro-batch, accumulation, global batch, tokens/s per GPU, activation checkpointing)
_MPT_TABLE = [
    ('70b', 2048, 64, 8, 4, 2048, 1039, 'T'),
    ('70b', 2048, 32, 2, 16, 1024, 882, 'T'),
    ('30b', 8192, 8, 1, 21, 168, 1384, 'T'),
    ('30b', 4096, 8, 1, 21, 168, 1802, 'T'),
    ('30b', 2048, 32, 14, 3, 1344, 2308, 'T'),
    ('30b', 2048, 16, 10, 3, 480, 2263, 'T'),
    ('30b', 2048, 8, 3, 21, 504, 2002, 'T'),
    ('30b', 1024, 8, 6, 21, 1008, 2084, 'T'),
    ('13b', 32768, 8, 1, 3, 24, 1976, 'T'),
    ('13b', 16384, 8, 3, 3, 72, 2985, 'T'),
    ('13b', 4096, 8, 10, 3, 240, 4717, 'T'),
    ('13b', 2048, 64, 2, 1, 128, 4800, 'F'),
    ('13b', 2048, 32, 2, 1, 64, 4811, 'F'),
    ('13b', 2048, 16, 2, 1, 32, 4767, 'F'),
    ('13b', 2048, 8, 2, 1, 16, 4792, 'F'),
    ('13b', 1024, 8, 40, 3, 960, 5502, 'T'),
    ('7b', 65536, 8, 1, 2, 16, 1956, 'T'),
    ('7b', 32768, 8, 2, 2, 32, 3318, 'T'),
    ('7b', 8192, 8, 8, 2, 128, 6935, 'T'),
    ('7b', 4096, 8, 16, 2, 256, 8611, 'T'),
    ('7b', 2048, 8, 6, 1, 48, 10643, 'F'),
    ('7b', 1024, 8, 64, 2, 1024, 10203, 'T'),
    ('3b', 65536, 8, 1, 2, 16, 3262, 'T'),
    ('3b', 32768, 8, 3, 6, 144, 5873, 'T'),
    ('3b', 16384, 8, 1, 6, 48, 11152, 'F'),
    ('3b', 8192, 8, 3, 6, 144, 16578, 'F'),
    ('3b', 4096, 8, 5, 6, 240, 20964, 'F'),
    ('3b', 2048, 64, 6, 3, 1152, 22525, 'F'),
    ('3b', 2048, 32, 6, 3, 576, 23021, 'F'),
    ('3b', 2048, 16, 10, 3, 480, 24142, 'F'),
    ('3b', 1024, 8, 20, 6, 960, 27046, 'F'),
    ('3b', 512, 8, 40, 6, 1920, 27965, 'F'),
    ('1b', 65536, 8, 1, 2, 16, 5506, 'T'),
    ('1b', 32768, 8, 1, 4, 32, 12025, 'F'),
    ('1b', 16384, 8, 2, 4, 64, 19649, 'F'),
    ('1b', 8192, 8, 3, 4, 96, 29157, 'F'),
    ('1b', 4096, 8, 7, 4, 224, 38535, 'F'),
    ('1b', 2048, 64, 20, 1, 1280, 44402, 'F'),
    ('1b', 2048, 32, 20, 1, 640, 45130, 'F'),
    ('1b', 2048, 16, 20, 1, 320, 46037, 'F'),
    ('1b', 2048, 8, 14, 1, 112, 45455, 'F'),
    ('1b', 1024, 8, 18, 4, 576, 48910, 'F'),
    ('1b', 512, 8, 56, 4, 1792, 52275, 'F'),
    ('760m', 32768, 8, 1, 2, 16, 16291, 'F'),
    ('760m', 16384, 8, 3, 2, 48, 27815, 'F'),
    ('760m', 8192, 8, 6, 2, 96, 41825, 'F'),
    ('760m', 4096, 8, 12, 2, 192, 55459, 'F'),
    ('760m', 2048, 32, 24, 1, 768, 67971, 'F'),
    ('760m', 2048, 16, 24, 1, 384, 68551, 'F'),
    ('760m', 2048, 8, 24, 2, 384, 63147, 'F'),
    ('760m', 1024, 8, 48, 2, 768, 78581, 'F'),
    ('760m', 512, 8, 96, 2, 1536, 83749, 'F'),
]


def _mpt(name, seq, gpus, mb, _accumulation, batch, tokens, checkpointing) -> Run:
    heads, hidden, layers = MPT_SHAPES[name]
    job = Job(seq_len=seq, global_batch=batch, micro_batch=mb, zero_stage=3, attention_kernel="flash-triton",
              recompute="full" if checkpointing == "T" else "none")
    return Run(f"MPT-{name} seq {seq}, {gpus} H100, mb {mb}", "check",
               gpt(heads, hidden, layers, vocab=50368, dropout=0.0, positions=seq), "h100", Degrees(dp=gpus), job,
               "tokens", tokens)


MOSAIC_MPT = [_mpt(*row) for row in _MPT_TABLE]

def _fits(model: ModelSpec, deg: Degrees, job: Job, capacity: float) -> bool:
    try:
        validate(model, deg, job)
    except ValueError:
        return False
    return with_overhead(memory_per_gpu(model, deg, job), deg, DEFAULT_OVERHEAD)["total"] <= capacity


def _partial_recomputes(run: Run, job: Job) -> list[Job]:
    """`job` replaying only the first r layers of each pipeline chunk (Megatron's block method), for every r
    short of the longest chunk."""
    longest = longest_chunk(run.model.num_layers, run.deg.pp, job.virtual_stages, job.pipeline_layout)
    return [replace(job, recompute_layers=r) for r in range(1, longest)]


def _turned(job: Job, knob: str, value: object) -> Job:
    """`job` with one knob set; virtual stages come with the interleaved schedule (a job checks that when built)."""
    schedule = {"pp_schedule": "interleaved"} if knob == "virtual_stages" and value > 1 else {}
    return replace(job, **{knob: value}, **schedule)


def _tuned(run: Run, cluster) -> list[Job]:
    choices = {"micro_batch": (1, 2, 4, 8), "virtual_stages": (1, 2, 4) if run.deg.pp > 1 else (1,),
               "recompute": ("none", "full")}
    jobs = [run.job]
    for knob in run.tune:
        jobs = [_turned(j, knob, value) for j in jobs for value in choices[knob]]
    if "recompute" in run.tune:
        jobs += [partial for j in jobs if j.recompute == "full" for partial in _partial_recomputes(run, j)]
    fitting = [j for j in jobs if _fits(run.model, run.deg, j, cluster.gpu.memory_bytes)]
    return fitting or [run.job]


def predict(run: Run) -> float:
    """The run's metric as the planner predicts it."""
    cluster = make_cluster(run.gpu, run.deg.world_size, run.gpus_per_node or None)
    best = min((step_time(run.model, run.deg, j, cluster) for j in _tuned(run, cluster)), key=lambda t: t.step_s)
    if run.metric == "tflops":
        return best.hardware_flops / best.step_s / run.deg.world_size / 1e12
    if run.metric == "model_tflops":
        return best.model_flops / best.step_s / run.deg.world_size / 1e12
    job = run.job
    tokens = job.global_batch * job.seq_len
    return tokens / best.step_s / run.deg.world_size


def errors() -> dict[str, tuple[str, float, float]]:
    """name -> (class, predicted, relative error)."""
    out = {}
    for run in RUNS:
        pred = predict(run)
        out[run.name] = (run.cls, pred, pred / run.published - 1)
    return out


# Runs whose figure rests on a choice their source does not publish, and whose pricing was revised while
# studying them (so they are not blind), with the band their error must stay in: a change of more than about
# 3 points fails here and must be explained in docs/planner.md section 6. DeepSeek-V2: which operators it
# recomputes (the fewest replayed layers that fit, +12.1%; +38.4% if its recompute cost nothing). DeepSeek-V3: its
# layer split (NVIDIA's published layout for this model at pp 16, +6.7%; Megatron's even split, -22%).
PINNED = {"DeepSeek-V2, 1024 GPUs": (0.09, 0.15), "DeepSeek-V3, 2048 GPUs": (0.04, 0.10)}


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_each_validation_run_within_40_percent_or_its_pinned_band(run):
    error = predict(run) / run.published - 1
    low, high = PINNED.get(run.name, (-0.40, 0.40))
    assert low <= error <= high


def test_mean_error_overall_and_by_class():
    """The goals on all the runs: mean <= 12%, worst <= 30%, every class <= 20%, and the MoE class so with
    DeepSeek-V3 (an MoE run filed under precision) counted in it too."""
    everything = errors()
    assert sum(abs(e) for _, _, e in everything.values()) / len(everything) <= 0.12
    assert max(abs(e) for _, _, e in everything.values()) <= 0.30
    for cls in {c for c, _, _ in everything.values()}:
        mine = [abs(e) for c, _, e in everything.values() if c == cls]
        assert sum(mine) / len(mine) <= 0.20, cls
    moe = [abs(e) for name, (c, _, e) in everything.items() if c == "moe" or name.startswith("DeepSeek-V3")]
    assert sum(moe) / len(moe) <= 0.20


# ---- memory -------------------------------------------------------------------------------------------------
# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20,
# arXiv:1910.02054), Table 1: model-state memory per device in GB for 7.5B, 128B and 1T parameters under
# P_os (ZeRO-1), P_os+g (ZeRO-2) and P_os+g+p (ZeRO-3) at several data-parallel degrees, with fp16 parameters
# and gradients and K = 12 bytes of fp32 optimizer state per parameter (fp32 copy, momentum, variance).
ZERO_TABLE_1 = {  # (parameters, dp): (P_os, P_os+g, P_os+g+p) in GB
    (7.5e9, 4): (52.5, 41.3, 30), (7.5e9, 16): (35.6, 21.6, 7.5), (7.5e9, 64): (31.4, 16.6, 1.88),
    (7.5e9, 256): (30.4, 15.4, 0.47), (7.5e9, 1024): (30.1, 15.1, 0.12),
    (128e9, 4): (896, 704, 512), (128e9, 16): (608, 368, 128), (128e9, 64): (536, 284, 32),
    (128e9, 256): (518, 263, 8), (128e9, 1024): (513, 257, 2),
    (1e12, 4): (7000, 5500, 4000), (1e12, 16): (4750, 2875, 1000), (1e12, 64): (4187, 2218, 250),
    (1e12, 256): (4046, 2054, 62.5), (1e12, 1024): (4011, 2013, 15.6),
}


@pytest.mark.parametrize(("params", "dp"), list(ZERO_TABLE_1), ids=[f"{p:.1e}-dp{d}" for p, d in ZERO_TABLE_1])
def test_model_states_within_10_percent_of_zero_table_1(params, dp):
    from orangetron.plan.memory import StageParams, model_state_bytes

    for stage, published in zip((1, 2, 3), ZERO_TABLE_1[(params, dp)], strict=True):
        job = Job(seq_len=1024, zero_stage=stage, param_dtype="float16", grad_dtype="float16")
        got = sum(model_state_bytes(StageParams(int(params), 0), Degrees(dp=dp), job).values()) / 1e9
        assert got == pytest.approx(published, rel=0.10), stage


# Megatron-LM's CI runs (NVIDIA/Megatron-LM, tests/functional_tests/test_cases/gpt/<case>/model_config.yaml and
# golden_values_*.json): one node of 8 GPUs, 12 layers, hidden 512, 8 heads, ffn 2048, GeLU, learned positions
# (1024), tied embeddings, GPT-2 vocabulary 50257 padded to a multiple of 128 x tp, seq 1024, micro-batch 4,
# global batch 32, bf16 with fp32 main gradients (Megatron forces them for bf16), Adam, dropout 0.1 unless set.
# `mem-max-allocated-bytes` is torch.cuda's allocated peak (no context, no cached-but-free blocks) on the last
# rank (the tensorboard writer's), i.e. the last pipeline stage; the value after step 1, once Adam's moments exist.
# Megatron differs from the runtime the planner prices in three ways, each read from its code, added here:
# - its vocab-parallel cross entropy upcasts the logits to a new fp32 tensor it keeps for backward (the planner's
#   4 bytes per logit) while the bf16 logits are still alive at the end of forward: +2 bytes per logit;
# - it adds each parameter's .grad into its contiguous main-gradient buffer as it arrives and frees it (or its fused
#   weight-gradient GEMM writes there directly), and reduces (and sums SP's partial gradients over tp) in place in
#   that buffer: no `grad_buckets`, and one .grad at a time, the largest tensor's, not the planner's `param_grads`;
# - cuBLAS workspaces come from the caching allocator: PyTorch's (aten/src/ATen/cuda/CublasHandlePool.cpp: 32 MiB
#   on Hopper, else CUBLAS_WORKSPACE_CONFIG, ":4096:8" = 32 MiB in every case that sets it, or 8 MiB + 128 KiB)
#   and Transformer Engine's (`get_cublas_workspace_size_bytes`: 4 MiB before Hopper, 32 MiB on Hopper). The A100
#   and H100 golden values of the same case differ by exactly 28 MiB, TE's difference.
@dataclass(frozen=True)
class MegatronMemory:
    case: str
    gpu: str
    deg: Degrees
    job: Job
    dropout: float
    te: bool  # --transformer-impl transformer_engine (else local: no TE workspace)
    cublas_config: bool  # CUBLAS_WORKSPACE_CONFIG=:4096:8 in ENV_VARS
    max_allocated: int


_MCORE = dict(seq_len=1024, micro_batch=4, global_batch=32)
MEGATRON_CI = [
    MegatronMemory("gpt3_mr_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files (golden_values_dev_dgx_a100)",
                   "a100-80gb", Degrees(dp=8), Job(**_MCORE, distributed_optimizer=True, attention_kernel="eager"),
                   0.1, True, True, 4_673_069_568),
    MegatronMemory("gpt3_mr_mcore_te_tp1_pp1_dist_optimizer_no_mmap_bin_files (golden_values_dev_dgx_h100)",
                   "h100", Degrees(dp=8), Job(**_MCORE, distributed_optimizer=True, attention_kernel="eager"),
                   0.1, True, True, 4_702_429_696),
    MegatronMemory("gpt3_mr_mcore_te_tp1_pp1_uniform_full_recompute (golden_values_dev_dgx_a100)", "a100-80gb",
                   Degrees(dp=8), Job(**_MCORE, recompute="full"), 0.1, True, True, 2_534_070_272),
    MegatronMemory("gpt3_mcore_te_tp2_pp2 (golden_values_dev_dgx_a100)", "a100-80gb", Degrees(tp=2, pp=2, dp=2),
                   Job(**_MCORE, attention_kernel="eager"), 0.1, True, True, 1_900_158_464),
    MegatronMemory("gpt3_mr_mcore_te_tp2_pp2_cp2 (golden_values_dev_dgx_h100)", "h100",
                   Degrees(tp=2, pp=2, cp=2), Job(**_MCORE, sequence_parallel=True), 0.0, True, False, 934_204_928),
    MegatronMemory("gpt3_345m_nightly_dgx_a100_1N8G_mcore_tp1_pp2 (golden_values_dev_dgx_h100)", "h100",
                   Degrees(pp=2, dp=4), Job(**_MCORE, attention_kernel="eager"), 0.1, False, True, 3_637_371_904),
]


def megatron_peak(run: MegatronMemory) -> int:
    """The planner's last-stage bytes with Megatron's three implementation differences: its gradient path is the
    planner's `grad_accumulation_fusion`; the loss's fp32 logits and the cuBLAS workspaces are added here."""
    from orangetron.plan.memory import stage_memory

    tp, cp = run.deg.tp, run.deg.cp
    vocab = -(-50257 // (128 * tp)) * 128 * tp
    model = gpt(8, 512, 12, vocab=vocab, dropout=run.dropout, positions=1024)
    planned = stage_memory(model, run.deg, replace(run.job, grad_accumulation_fusion=True), run.deg.pp - 1)
    logits = run.job.micro_batch * (run.job.seq_len // cp) * (vocab // tp)
    mib, hopper = 1024**2, run.gpu == "h100"
    torch_workspace = 32 * mib if hopper or run.cublas_config else 8 * mib + 128 * 1024
    te_workspace = (32 if hopper else 4) * mib if run.te else 0
    return planned["total"] + 2 * logits + torch_workspace + te_workspace


@pytest.mark.parametrize("run", MEGATRON_CI, ids=[r.case.split(" ")[0] + "-" + r.gpu for r in MEGATRON_CI])
def test_peak_memory_within_10_percent_of_megatron_ci(run):
    assert megatron_peak(run) == pytest.approx(run.max_allocated, rel=0.10)


# torchtitan's December 2024 benchmark (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1
# and 3): Llama 3.1 8B under FSDP on 8 and on 128 H100 with the same local batch, peak reserved memory 82.4 / 77.0
# / 76.8 GiB and 67.0 / 62.0 / 61.8 GiB (plain, torch.compile, + Float8). Its absolute figures hold a loss and an
# allocator cache the planner does not price (docs/planner.md); their difference cancels both, and activations,
# leaving what sharding over 16x more ranks frees: fp32 parameters, gradients and Adam moments (FSDP2 keeps fp32
# shards and, by default, reduces in fp32).
TORCHTITAN_FSDP_DROP_GIB = (82.4 - 67.0, 77.0 - 62.0, 76.8 - 61.8)


@pytest.mark.parametrize("measured", TORCHTITAN_FSDP_DROP_GIB)
def test_fsdp_memory_freed_from_8_to_128_gpus_within_10_percent_of_torchtitan(measured):
    model, job = load_model("llama3-8b"), Job(seq_len=8192, micro_batch=2, zero_stage=3, param_dtype="float32")
    drop = memory_per_gpu(model, Degrees(dp=8), job)["total"] - memory_per_gpu(model, Degrees(dp=128), job)["total"]
    assert drop / 2**30 == pytest.approx(measured, rel=0.10)
