"""Step time: compute from FLOPs and bytes on the shape-aware roofline of `compute`, communication from the
network model, overlap where the runtime overlaps, and the pipeline bubble; MFU by the Megatron/PaLM convention.

Compute. Every matmul is timed by `compute.linear_time` (forward, dgrad, wgrad into fp32 main grads) at the
efficiency its shape allows (tile and wave quantization, K-loop fill), so small or skinny GEMMs become slow or
memory bound by themselves; routed experts run as grouped GEMMs over their balanced tokens. Flash attention
runs at the GPU's fused-kernel efficiency (forward and backward), on the causal blocks at or below the diagonal.
Norms, residuals, activations, RoPE, FP8 casts, the loss and the routing permutation are memory bound: their
bytes over `elementwise_bw` x HBM bandwidth (backward twice the forward). Full recompute replays the forward.
A MoE layer's passes run no faster than its host issues their operations (`host`).

Overlap (what the runtime overlaps): DP gradient reduction hides behind the last micro-batch's backward,
parameter gathers behind the first forward; ring CP hides behind attention; EP all-to-all hides behind expert
compute that does not wait for it: the shared experts, and with `overlap_ep` another micro-batch's layer
(DualPipe-style pairing); TP and PP transfers are exposed.

Pipeline: step = (m + (pp-1)/v) x the slowest stage's micro-batch time (Narayanan et al. 2021).
MFU counts model FLOPs only (no recompute), attention as full (non-causal) s x s products, as Megatron's
72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)) and PaLM's 6N + 12LHQT do; HFU adds recompute.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

from orangetron.plan import host, node_dispatch, zero3_exposure
from orangetron.plan.compute import (
    ATTN_QUERY_TILE,
    TRITON_FLASH_GAP,
    causal_keys,
    flash_efficiency,
    gemm_time,
    linear_parts,
    linear_time,
    weight_grad_time,
)
from orangetron.plan.memory import main_param_bytes, moment_bytes
from orangetron.plan.network import (
    DEFAULT_PARAMS,
    NetworkParams,
    Placement,
    all_to_all_time,
    collective_time,
    p2p_time,
)
from orangetron.plan.packed import document_keys, document_square_keys, priced_batches
from orangetron.plan.param_grads import held_to_step
from orangetron.plan.params import stage_params, sums_first, zero3_unit_contents
from orangetron.plan.traffic import (
    context_parallel_records,
    data_parallel_records,
    expert_parallel_records,
    expert_tensor_parallel_records,
    pipeline_records,
    reduce_rounds,
    routed_tokens,
    tensor_parallel_records,
    tied_embedding_records,
    zero3_unit_records,
)
from orangetron.spec.hardware import Cluster, GPUSpec
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, canonical_job, model_state_job, without_data_parallel
from orangetron.spec.schedule import zero_bubble_h1_bubble
from orangetron.spec.stages import (
    distinct_stages,
    replay_split,
    replayed_layers,
    stage_layer_counts,
    stage_layers,
)
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES


@dataclass(frozen=True)
class Efficiency:
    """Global constants of the compute model (not fitted per configuration; sources in docs/planner.md)."""

    flash_fwd_efficiency: float = 0.60  # fused attention at long sequences when a preset names none
    flash_bwd_efficiency: float = 0.50
    elementwise_bw: float = 0.70  # share of HBM bandwidth elementwise kernels reach
    optimizer_bytes_per_param: int = 36  # Adam: read grad, m, v, main param; write m, v, main param, param
    overlap_contention: float = 0.10  # hidden communication still costs this share of its time (NCCL SMs, HBM)
    # Host time per operation a MoE layer issues (plan/host.py): the framework's Python, autograd, dispatch and
    # launch around it. Fitted on the calibration MoE rows (validation_runs.toml, `[[fitted_efficiency]]`).
    host_op_s: float = 37e-6


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class StepTime:
    """Seconds per step and their parts (communication parts are the exposed remainder)."""

    step_s: float
    compute_s: float
    bubble_s: float
    tp_s: float
    cp_s: float
    ep_s: float
    pp_s: float
    dp_s: float
    optimizer_s: float
    model_flops: float  # whole cluster, one step
    hardware_flops: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    mfu_causal: float  # MFU counting only the unmasked half of causal attention


# ---- FLOPs ----------------------------------------------------------------------------------------
def _gemm_dtype(job: Job) -> tuple[str, float]:
    """(operand format, bytes per GEMM input element): FP8 GEMMs read 1-byte operands."""
    if job.fp8:
        return ("float8-blockwise" if job.fp8_recipe == "blockwise" else "float8"), 1.0
    return job.param_dtype, float(job.param_bytes)


# GEMM seconds travel as (forward, backward, of which the weight gradient): zb-h1 schedules the last apart.
Gemms = tuple[float, float, float]


def _linear(m: int, k: int, n: int, cluster: Cluster, job: Job, groups: int = 1) -> Gemms:
    dtype, nbytes = _gemm_dtype(job)
    fwd, dgrad, wgrad = linear_parts(m, k, n, cluster.gpu, dtype, nbytes, groups)
    return fwd, dgrad + wgrad, wgrad


def _attention_flops(model: ModelSpec, rows: int, keys: float, heads: int) -> float:
    """Forward FLOPs of QK^T and AV for `rows` queries against `keys` keys."""
    return 2.0 * rows * keys * heads * (model.qk_head_dim + model.v_dim)


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer for one micro-batch on one GPU, split by part, forward and backward."""

    gemm_f: float
    gemm_b: float
    attention_f: float
    attention_b: float
    elementwise: float  # forward; backward is twice as much memory traffic
    experts_f: float  # the routed-expert GEMMs (part of `gemm_*`)
    experts_b: float
    shared_f: float = 0.0  # the shared-expert GEMMs (part of `gemm_*`): they need no dispatched token
    shared_b: float = 0.0
    wgrad: float = 0.0  # the weight gradients (part of `gemm_b`)
    shared_w: float = 0.0  # the shared experts' weight gradients (part of `shared_b`)
    replay: float = 0.0  # forward seconds of the modules `Job.recompute_modules` replays in backward

    @property
    def forward(self) -> float:
        return self.gemm_f + self.attention_f + self.elementwise


def _add(a: Gemms, b: Gemms) -> Gemms:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


@lru_cache(maxsize=4096)
def layer_cost(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, moe: bool,
               eff: Efficiency = DEFAULT_EFFICIENCY) -> LayerCost:
    """Seconds of one layer (dense or MoE) for one micro-batch on one GPU."""
    t = deg.tp
    rows = job.seq_len // deg.cp * job.micro_batch
    h = model.hidden_size
    o_in = model.num_heads * model.v_dim // t
    gemm = _add(_qkv_time(model, rows, t, cluster, job), _linear(rows, o_in, h, cluster, job))
    experts = shared = (0.0, 0.0, 0.0)
    if moe:
        experts = _routed_experts_time(model, deg, job, cluster, rows)
        shared_ffn = model.num_shared_experts * model.moe_ffn_hidden_size // t
        shared = _mlp_time(model, rows, shared_ffn, cluster, job) if shared_ffn else shared
        gemm = _add(_add(gemm, experts), shared)
        ffn = model.moe_ffn_hidden_size * model.top_k
    else:
        gemm = _add(gemm, _mlp_time(model, rows, model.ffn_hidden_size // t, cluster, job))
        ffn = model.ffn_hidden_size
    att_f, att_b = _attention_time(model, deg, job, cluster, eff)
    elementwise = _elementwise_time(model, deg, job, cluster, ffn, eff)
    if moe:
        elementwise += _permute_time(model, deg, job, cluster, rows, eff) + _swiglu_cache_time(model, deg, job,
                                                                                              cluster, rows, eff)
    return LayerCost(gemm[0], gemm[1], att_f, att_b, elementwise, *experts[:2], *shared[:2], wgrad=gemm[2],
                     shared_w=shared[2], replay=_module_replay_time(model, deg, job, cluster, moe, eff))


def _module_replay_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, moe: bool,
                        eff: Efficiency) -> float:
    """Forward seconds the replayed modules (`Job.recompute_modules`) run again in backward: MLA's
    up-projections (and its query projection without a query latent), a dense layer's MLP, alternate_mm's K, O
    and up projections with the layer's memory-bound work; the norms that stand
    alone (`activations.module_replay_bytes`: read the input, write the output) and the experts' activation
    (read gate and up, write their product) as memory traffic."""
    modules, t = job.recompute_modules, deg.tp
    rows = job.seq_len // deg.cp * job.micro_batch
    seconds, nbytes = 0.0, 0.0
    if "mla_up_proj" in modules:
        heads, nope = model.num_heads // t, model.qk_head_dim - model.qk_rope_head_dim
        seconds += _linear(rows, model.kv_lora_rank, heads * (nope + model.v_dim), cluster, job)[0]
        q_input = model.q_lora_rank or model.hidden_size
        seconds += _linear(rows, q_input, heads * model.qk_head_dim, cluster, job)[0]
    if "mlp" in modules and not moe:
        seconds += _mlp_time(model, rows, model.ffn_hidden_size // t, cluster, job)[0]
    if "layernorm" in modules:
        rep = t if job.sequence_parallel and t > 1 else 1
        norms = (model.kv_lora_rank > 0) + moe
        nbytes += norms * 2 * job.param_bytes * rows * model.hidden_size / rep
    if "moe_act" in modules and moe:
        nbytes += 3 * job.param_bytes * _routed_copies(model, deg, job, rows) * model.moe_ffn_hidden_size / deg.etp
    if "alternate_mm" in modules:  # K, O and up (tp 1), and every memory-bound op of the layer
        h = model.hidden_size
        seconds += _linear(rows, h, model.kv_heads * model.qk_head_dim, cluster, job)[0] + \
            _linear(rows, model.num_heads * model.v_dim, h, cluster, job)[0] + \
            _linear(rows, h, model.ffn_hidden_size, cluster, job)[0] + \
            _elementwise_time(model, deg, job, cluster, model.ffn_hidden_size, eff)
    return seconds + nbytes / (cluster.gpu.memory_bw_gbs * 1e9 * eff.elementwise_bw)


def _qkv_time(model: ModelSpec, rows: int, t: int, cluster: Cluster, job: Job) -> Gemms:
    """Q, K, V projections. MLA (kv_lora_rank > 0) runs its real shapes: down-projections to the latent
    ranks and up-projections to the heads, not a full-width multi-head projection. Megatron-Core's Transformer
    Engine spec duplicates the down-projections on every tp rank, each on the rank's rows: the whole sequence,
    or its tp-th under sequence parallelism."""
    h, heads = model.hidden_size, model.num_heads // t
    down_rows = rows // t if job.sequence_parallel else rows
    if not model.kv_lora_rank:
        kv_w = max(1, model.kv_heads // t) * model.qk_head_dim
        return _linear(rows, h, heads * model.qk_head_dim + 2 * kv_w, cluster, job)
    nope = model.qk_head_dim - model.qk_rope_head_dim
    kv = _add(_linear(down_rows, h, model.kv_lora_rank + model.qk_rope_head_dim, cluster, job),
              _linear(rows, model.kv_lora_rank, heads * (nope + model.v_dim), cluster, job))
    if not model.q_lora_rank:
        return _add(kv, _linear(rows, h, heads * model.qk_head_dim, cluster, job))
    q = _add(_linear(down_rows, h, model.q_lora_rank, cluster, job),
             _linear(rows, model.q_lora_rank, heads * model.qk_head_dim, cluster, job))
    return _add(kv, q)


def _attention_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster,
                    eff: Efficiency) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core on one GPU for one micro-batch."""
    gpu, b = cluster.gpu, job.micro_batch
    rows = job.seq_len // deg.cp
    heads = model.num_heads // deg.tp
    if job.attention_kernel == "eager":
        return _eager_attention_time(model, rows, job.seq_len, b * heads, cluster, job)
    # Head-tail CP keeps every rank's causal work equal to 1/cp of the whole sequence's; packed documents are
    # sharded in balance instead, and their busiest rank sets the time.
    keys = causal_keys(job.seq_len) if model.causal else float(job.seq_len)
    if job.packed and model.causal:
        keys = document_keys(priced_batches(job), job.seq_len, deg.cp)
    flops = _attention_flops(model, rows * b, keys, heads)
    ctas = b * heads * -(-rows // ATTN_QUERY_TILE)
    peak = gpu.peak_flops(job.param_dtype)  # attention stays in 16-bit under FP8 training (as TE does)
    # Ring CP calls the kernel once per step on a K,V block of s/cp keys (USP's ring: s/(cp/u)): each call's
    # query tiles pay their fill over that block, not over the whole sequence.
    ring = CONTEXT_MODES[job.cp_mode].key_blocks(deg, job) if deg.cp > 1 else 1
    call_keys = min(keys, job.seq_len / ring) if ring > 1 else keys
    base_fwd, base_bwd = _kernel_efficiency(gpu, job.attention_kernel, eff)
    fwd_eff = flash_efficiency(base_fwd, call_keys, ctas, gpu.sms)
    bwd_eff = flash_efficiency(base_bwd, call_keys, ctas, gpu.sms)
    # Backward: dV, dP, dS->dQ, dK plus the recomputed scores: 2.5x the forward's FLOPs (Dao 2023).
    return flops / (peak * fwd_eff), 2.5 * flops / (peak * bwd_eff)


def _kernel_efficiency(gpu: GPUSpec, kernel: str, eff: Efficiency) -> tuple[float, float]:
    """(forward, backward) long-sequence share of peak of a fused attention kernel on `gpu`."""
    fwd, bwd = gpu.attention_efficiency("flash2" if kernel == "flash-triton" else kernel)
    fwd, bwd = fwd or eff.flash_fwd_efficiency, bwd or eff.flash_bwd_efficiency
    if kernel == "flash-triton":
        return fwd / TRITON_FLASH_GAP[0], bwd / TRITON_FLASH_GAP[1]
    return fwd, bwd


def _eager_attention_time(model: ModelSpec, rows: int, keys: int, batch_heads: int, cluster: Cluster,
                          job: Job) -> tuple[float, float]:
    """Eager attention as batched GEMMs (scores in 16-bit; softmax traffic is priced as elementwise)."""
    gpu, dt, a = cluster.gpu, job.param_dtype, float(job.param_bytes)
    dqk, dv = model.qk_head_dim, model.v_dim
    qk = gemm_time(rows, dqk, keys, gpu, dt, a, a, batch_heads)
    pv = gemm_time(rows, keys, dv, gpu, dt, a, a, batch_heads)
    # dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q.
    bwd = (gemm_time(rows, dv, keys, gpu, dt, a, a, batch_heads) + gemm_time(keys, rows, dv, gpu, dt, a, a, batch_heads)
           + gemm_time(rows, keys, dqk, gpu, dt, a, a, batch_heads)
           + gemm_time(keys, rows, dqk, gpu, dt, a, a, batch_heads))
    return qk + pv, bwd


def _mlp_time(model: ModelSpec, rows: int, ffn: int, cluster: Cluster, job: Job, groups: int = 1) -> Gemms:
    """Up (gate + up for SwiGLU) and down projections of width `ffn` on this GPU."""
    up = 2 if model.mlp == "swiglu" else 1
    h = model.hidden_size
    return _add(_linear(rows, h, up * ffn, cluster, job, groups), _linear(rows, ffn, h, cluster, job, groups))


def _swiglu_cache_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, rows: int,
                       eff: Efficiency) -> float:
    """Forward seconds of casting a MoE layer's SwiGLU inputs to FP8 (`Job.fp8_cached_activations`: read gate and
    up, write their casts; backward reads them back, twice the forward as for all elementwise work)."""
    if not (job.fp8_cached_activations and model.mlp == "swiglu"):
        return 0.0
    f = model.moe_ffn_hidden_size
    elements = _routed_copies(model, deg, job, rows) * f / deg.etp + rows * model.num_shared_experts * f / deg.tp
    nbytes = 2 * (job.param_bytes + 1) * elements
    return nbytes / (cluster.gpu.memory_bw_gbs * 1e9 * eff.elementwise_bw)


def _routed_copies(model: ModelSpec, deg: Degrees, job: Job, rows: int, gathered: bool = True) -> int:
    """Token copies this GPU's experts receive on balance (capacity pads them to the factor, and each expert to no
    more than the tokens, where `spec.dispatchers.capacity_slots` stops: from the factor num_experts / top_k up).
    Under SP with experts split over tp (etp = tp), each tp rank runs its expert slices on the copies all tp ranks
    received (`gathered`); the routing permutation happens before that gather."""
    sp = job.sequence_parallel and deg.tp > 1
    tokens = rows // (deg.tp if sp else 1) * (deg.etp if gathered and sp else 1)
    routed = tokens * model.top_k
    every = job.capacity_factor >= model.num_experts / model.top_k  # each expert padded to all the tokens
    padded = tokens * model.num_experts if every else int(routed * job.capacity_factor)  # below: under E x tokens
    return padded if DISPATCHERS[job.dispatcher].pads else routed


def _permute_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, rows: int, eff: Efficiency) -> float:
    """Forward memory traffic of routing: each copy's row is gathered into expert order before dispatch and
    scattered back and weighted after combine (read and write each time)."""
    nbytes = 4.0 * _routed_copies(model, deg, job, rows, gathered=False) * model.hidden_size * job.param_bytes
    return nbytes / (cluster.gpu.memory_bw_gbs * 1e9 * eff.elementwise_bw)


def busiest_share(copies: int, ranks: int) -> float:
    """Load of the busiest of `ranks` EP ranks over the mean when each receives `copies` token copies on
    average: even a router balanced in expectation lands copies on ranks at random, so each rank's load is
    binomial (mean `copies`, variance `copies * (1 - 1/ranks)`) and the expected maximum of `ranks` of them is
    about mean + std * sqrt(2 ln ranks) (the Gaussian extreme-value bound). The combine waits for that rank.
    Skew a trained router adds on top is not modelled."""
    if ranks <= 1 or copies <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * math.log(ranks) * (1.0 - 1.0 / ranks) / copies)


def _routed_experts_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster,
                         rows: int) -> Gemms:
    """This GPU's experts on the busiest rank's share of the routed token copies, as one grouped GEMM per
    projection, or per projection and token chunk under `ep_overlap_chunks` (each chunk's experts run on
    its own tokens): few tokens per expert pad their tiles and re-read the weights (see `compute`)."""
    routed = _routed_copies(model, deg, job, rows)
    if not DISPATCHERS[job.dispatcher].pads:  # a padding dispatcher gives every rank the same slots
        routed = round(routed * busiest_share(routed, deg.ep))
    local = max(1, model.num_experts // deg.ep)
    chunks = job.ep_overlap_chunks
    per_expert = max(1, routed // local // chunks)
    gemms = _mlp_time(model, per_expert, model.moe_ffn_hidden_size // deg.etp, cluster, job, groups=local)
    return gemms[0] * chunks, gemms[1] * chunks, gemms[2] * chunks


def _elementwise_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, ffn: int,
                      eff: Efficiency) -> float:
    """Memory-bound work: norms, residuals, RoPE, activation, dropout (and eager softmax), FP8 casts."""
    t = deg.tp
    rep = t if job.sequence_parallel and t > 1 else 1
    s_local = job.seq_len // deg.cp
    rows = s_local * job.micro_batch
    h = model.hidden_size
    nbytes = job.param_bytes * rows * (14 * h / rep + 3 * ffn / t + (4 * h / rep if model.dropout else 0))
    if job.fp8:
        # Each GEMM input is cast to FP8 (read 16-bit, write 8-bit and its transpose for wgrad), with an amax
        # reduction per tensor: QKV, output, up and down inputs. Current scaling first reads the input once more
        # for its amax (Transformer Engine's compute_amax kernel, before the cast that needs the scale).
        per_element = 4 + (job.param_bytes if job.fp8_recipe == "current" else 0)
        nbytes += per_element * rows * (h + model.num_heads * model.v_dim / t + h + ffn / t)
    if job.attention_kernel == "eager":
        # Softmax (read scores, write probabilities) and dropout (read, write, 1-byte mask) on [s, s] per head.
        scores = job.micro_batch * (model.num_heads // t) * s_local * job.seq_len
        nbytes += scores * (2 * job.param_bytes + ((2 * job.param_bytes + 1) if model.dropout else 0))
    return nbytes / (cluster.gpu.memory_bw_gbs * 1e9 * eff.elementwise_bw)


def _loss_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, eff: Efficiency) -> float:
    """Vocab-parallel cross entropy, memory bound: per logit, read the 16-bit logits, write and re-read fp32
    for the max and the sum of exponentials, keep the fp32 gradient, and write the 16-bit gradient in
    backward (about 20 bytes per logit)."""
    rows = job.seq_len // deg.cp * job.micro_batch
    nbytes = 20.0 * rows * model.vocab_size / deg.tp
    return nbytes / (cluster.gpu.memory_bw_gbs * 1e9 * eff.elementwise_bw)


def _fwd_bwd(c: LayerCost, job: Job) -> tuple[float, float]:
    """(executed seconds, of which attention) for forward + backward (+ recompute) of one layer."""
    total = c.gemm_f + c.gemm_b + c.attention_f + c.attention_b + 3 * c.elementwise + c.replay
    if job.recompute == "full":
        total += c.forward
    elif job.recompute == "selective" and job.attention_kernel == "eager":
        total += c.attention_f
    return total, c.attention_f + c.attention_b


@lru_cache(maxsize=4096)
def model_flops_per_step(model: ModelSpec, job: Job, sequences: int, causal_attention: bool = False) -> float:
    """Model FLOPs of one step (forward + backward, no recompute). Attention counts the full s x s products
    (Megatron's and PaLM's convention), each packed document's own n x n under `doc_lengths`, unless
    `causal_attention`, which counts the unmasked half (`model_keys`)."""
    tokens = sequences * job.seq_len
    layer_params = model.all_layer_params()
    if model.is_moe:
        idle = (model.num_experts - model.top_k) * model.mlp_params(model.moe_ffn_hidden_size)
        layer_params -= idle * model.num_moe_layers
    attention = _attention_flops(model, tokens, model_keys(model, job, causal_attention), model.num_heads)
    head = 2.0 * tokens * model.hidden_size * model.vocab_size
    mtp = model.mtp_layers * (2.0 * tokens * (_active_layer_params(model, model.mtp_layer_index)
                                              + 2 * model.hidden_size**2) + attention + head)
    return 3.0 * (2.0 * tokens * layer_params + attention * model.num_layers + head + mtp)


def model_keys(model: ModelSpec, job: Job, causal_attention: bool = False) -> float:
    """Keys per query that model FLOPs count: the whole sequence, or under `doc_lengths` the whole document
    piece holding the query (a token of a packed document attends to no other document, and the step time
    prices only that work: counting s keys put MFU past 100% at short documents); half of either with
    `causal_attention`."""
    keys = float(job.seq_len)
    if job.packed and model.causal:  # each piece's own square: how rows group into micro-batches changes nothing
        keys = document_square_keys(priced_batches(job, rows=1), job.seq_len)
    return keys / 2 if causal_attention and model.causal else keys


def _active_layer_params(model: ModelSpec, index: int) -> int:
    """Parameters of layer `index` one token multiplies by: a MoE layer's idle experts left out."""
    idle = (model.num_experts - model.top_k) * model.mlp_params(model.moe_ffn_hidden_size)
    return model.layer_params(index) - (idle if model.is_moe_layer(index) else 0)


# The coordinates that stay fixed inside each mesh dimension's group (the runtime's `Layout.coordinates`);
# unfolded, expert tensor parallelism (etp = tp) is the tp group.
_FIXED = {"tp": ("cp", "dp", "pp"), "cp": ("tp", "dp", "pp"), "dp": ("tp", "cp", "pp"), "dp_cp": ("tp", "pp"),
          "ep": ("tp", "pp", "edp"), "edp": ("tp", "pp", "ep"), "pp": ("tp", "cp", "dp"), "etp": ("cp", "dp", "pp")}
# A folded expert mesh (etp, ep, edp) has its own coordinates over the stage's ranks.
_FIXED_FOLDED = {**_FIXED, "ep": ("pp", "edp", "etp"), "edp": ("pp", "ep", "etp"), "etp": ("pp", "ep", "edp")}
_SIZE = {"dp_cp": lambda d: d.dp_cp, "edp": lambda d: d.edp}


def _first_node(deg: Degrees, cluster: Cluster) -> list:
    """Coordinates of the ranks on the first node (ranks fill nodes in order)."""
    return [deg.coordinates(r) for r in range(min(cluster.gpus_per_node, deg.world_size))]


@lru_cache(maxsize=16384)
def group_places(deg: Degrees, cluster: Cluster) -> dict[str, Placement]:
    """Where each mesh dimension's group lands, read from the runtime's own rank order: the members of rank
    0's group that share its node (ranks fill nodes in order)."""
    first_node = _first_node(deg, cluster)
    out = {}
    for dim, fixed in (_FIXED_FOLDED if deg.expert_fold else _FIXED).items():
        size = _SIZE[dim](deg) if dim in _SIZE else getattr(deg, dim)
        local = sum(all(getattr(c, f) == getattr(first_node[0], f) for f in fixed) for c in first_node)
        out[dim] = Placement(size, local) if size > 1 else Placement(1, 1)
    return out


def check_ep_placement(deg: Degrees, job: Job, cluster: Cluster) -> None:
    """ValueError when the dispatcher cannot run on this layout's EP groups ("deepep": whole nodes, or inside
    one). A group's ranks lie tp apart (etp apart when the experts fold), so it covers ep x that many."""
    if DISPATCHERS[job.dispatcher].node_aware and deg.ep > 1:
        span = deg.ep * (deg.etp if deg.expert_fold else deg.tp)
        node_dispatch.check_placement(group_places(deg, cluster)["ep"], span, cluster)


@lru_cache(maxsize=4096)
def _subgroup_places(deg: Degrees, cluster: Cluster, groups: tuple[tuple[str, tuple[int, int]], ...]
                     ) -> dict[str, Placement]:
    """Where a cp mode's subgroups of the cp ranks land, each (ranks, stride) as `mesh.split_cp` builds them
    (USP: Ulysses over consecutive cp ranks, the ring over every `ulysses`-th): the members of rank 0's groups
    on its node."""
    same = [c for c in _first_node(deg, cluster) if (c.tp, c.dp, c.pp) == (0, 0, 0)]
    return {name: Placement(size, sum(c.cp % stride == 0 and c.cp < size * stride for c in same)) if size > 1
            else Placement(1, 1) for name, (size, stride) in groups}


def _records_time(records, places: dict[str, Placement], cluster: Cluster, net: NetworkParams,
                  msg_bytes: float = 0.0) -> float:
    return _records_times(records, places, cluster, net, msg_bytes)[0]


def _records_times(records, places: dict[str, Placement], cluster: Cluster, net: NetworkParams,
                   msg_bytes: float = 0.0, split_gathers: bool = False) -> tuple[float, float]:
    """Seconds of the records, summed in order; with `split_gathers`, (all but the all-gathers, the all-gathers)."""
    # Record lists repeat the same few objects (one per layer, micro-batch or gather), in runs: price each
    # once, and add a run's copies one at a time in C (the same additions in the same order as a plain loop).
    totals, cache = [0.0, 0.0], {}
    for key, run in itertools.groupby(records, key=id):
        copies = list(run)
        t = cache.get(key)
        if t is None:
            t = cache[key] = _record_time(copies[0], places[copies[0].dim], cluster, net, msg_bytes)
        gather = split_gathers and copies[0].op == "all_gather"
        totals[gather] = functools.reduce(operator.add, itertools.repeat(t, len(copies)), totals[gather])
    return totals[0], totals[1]


def _record_time(r, where: Placement, cluster: Cluster, net: NetworkParams, msg_bytes: float) -> float:
    if r.op == "all_to_all":
        return all_to_all_time(r.bytes_sent, where, cluster, msg_bytes or r.payload_bytes, net)
    if r.op == "send_recv":
        return p2p_time(r.bytes_sent, where.nodes > 1, cluster, net)
    return collective_time(r.op, r.payload_bytes, where, cluster, params=net)[0]


@dataclass(frozen=True)
class _StageTime:
    compute: float
    tp: float
    cp: float
    ep: float
    pp: float
    # Parts of `compute` only zb-h1 reads (the decoder layers' shares are summed only under it): the forward
    # pass, and the weight gradients
    forward: float = 0.0
    wgrad: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.ep + self.pp


def _stage_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, stage: int,
                net: NetworkParams, eff: Efficiency) -> _StageTime:
    """Seconds of one micro-batch (forward + backward) on one GPU of `stage`."""
    # Data-parallel sharding never changes a micro-batch's time: drop it from the cache key.
    return _stage_time_cached(model, deg, without_data_parallel(job), cluster, stage, net, eff)


@lru_cache(maxsize=16384)
def _stage_time_cached(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, stage: int,
                       net: NetworkParams, eff: Efficiency) -> _StageTime:
    if job.ep_comm_sms_reserved and model.is_moe and deg.ep > 1:
        cluster = _with_sms_reserved(cluster, job.ep_comm_sms)  # compute runs on what the dispatch leaves
    compute = tp = cp = ep = forward = wgrad = 0.0
    split = SCHEDULES[job.pp_schedule].split_backward
    for layer_job, count, moe in _layer_kinds(model, deg, job, stage):
        if not count:
            continue
        run, tp_t, cp_t, ep_t = _layer_times(model, deg, layer_job, cluster, moe, net, eff)
        compute += count * run
        tp += count * tp_t
        cp += count * cp_t
        ep += count * ep_t
        if split:
            cost = layer_cost(model, deg, layer_job, cluster, moe, eff)
            forward += count * cost.forward
            wgrad += count * cost.wgrad
    if stage == deg.pp - 1 and model.vocab_size:
        shape = _head_shape(model, deg, job, cluster)
        head = linear_time(*shape)
        loss = _loss_time(model, deg, job, cluster, eff)
        compute += sum(head) + loss
        forward += head[0] + loss
        wgrad += weight_grad_time(*shape)
        for _ in range(model.mtp_layers):
            mtp = _mtp_module_time(model, deg, job, cluster, net, eff)
            compute, forward, wgrad = compute + mtp.compute, forward + mtp.forward, wgrad + mtp.wgrad
            tp, cp, ep = tp + mtp.tp, cp + mtp.cp, ep + mtp.ep
    pp = _records_time([r for r in pipeline_records(model, deg, job, stage) if r.bytes_sent],
                       group_places(deg, cluster), cluster, net)
    return _StageTime(compute, tp, cp, ep, pp, forward, wgrad)


def _head_shape(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster) -> tuple:
    """`linear_time`'s arguments for the output head of one micro-batch: in 16 bits even under FP8 (Megatron's
    output layer is not a Transformer Engine module; DeepSeek-V3 keeps it in BF16, arXiv:2412.19437 3.3.1)."""
    rows = job.seq_len // deg.cp * job.micro_batch
    return rows, model.hidden_size, model.vocab_size // deg.tp, cluster.gpu, job.param_dtype, float(job.param_bytes)


def _mtp_module_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, net: NetworkParams,
                     eff: Efficiency) -> _StageTime:
    """One multi-token-prediction module for one micro-batch: the 2h -> h projection, its layer (replayed only
    when full recompute replays every layer), its own pass through the shared head, and its loss."""
    layer_job = job.layer_job(False)
    moe = model.is_moe_layer(model.mtp_layer_index)
    run, tp_t, cp_t, ep_t = _layer_times(model, deg, layer_job, cluster, moe, net, eff)
    cost = layer_cost(model, deg, layer_job, cluster, moe, eff)
    rows = job.seq_len // deg.cp * job.micro_batch
    proj = _linear(rows, 2 * model.hidden_size, model.hidden_size // deg.tp, cluster, job)
    shape = _head_shape(model, deg, job, cluster)
    head, loss = linear_time(*shape), _loss_time(model, deg, job, cluster, eff)
    compute = run + proj[0] + proj[1] + sum(head) + loss
    forward = cost.forward + proj[0] + head[0] + loss
    return _StageTime(compute, tp_t, cp_t, ep_t, 0.0, forward, cost.wgrad + proj[2] + weight_grad_time(*shape))


@lru_cache(maxsize=64)
def _with_sms_reserved(cluster: Cluster, sms: int) -> Cluster:
    """`cluster` whose GPUs compute on all but `sms` SMs (one object per pair: it keys the cost caches)."""
    return replace(cluster, gpu=cluster.gpu.without_sms(sms))


def _layer_kinds(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> Iterator[tuple[Job, int, bool]]:
    """(the job a layer runs under, how many such layers, MoE or not) on `stage`: dense and MoE layers, and
    under partial recompute the replayed layers and the others apart."""
    if not job.partial_recompute:
        layers, n_moe = stage_layer_counts(model, deg.pp, job.virtual_stages, stage, job.pipeline_layout)
        yield job, layers - n_moe, False
        yield job, n_moe, True
        return
    layers = stage_layers(model.num_layers, deg.pp, job.virtual_stages, stage, job.pipeline_layout)
    for replayed, mine in replay_split(model.num_layers, deg.pp, job.virtual_stages, stage, job.recompute_layers,
                                       layers, job.pipeline_layout):
        n_moe = sum(model.is_moe_layer(i) for i in mine)
        yield job.layer_job(replayed), len(mine) - n_moe, False
        yield job.layer_job(replayed), n_moe, True


def replayed_share(model: ModelSpec, deg: Degrees, job: Job) -> float:
    """Share of the layers' forward FLOPs that full recompute replays (0 without it)."""
    if job.recompute != "full":
        return 0.0
    if not job.recompute_layers:
        return 1.0
    replayed = set().union(*(replayed_layers(model.num_layers, deg.pp, job.virtual_stages, s, job.recompute_layers,
                                             job.pipeline_layout) for s in range(deg.pp)))
    flops = [_layer_forward_flops(model, i, model_keys(model, job)) for i in range(model.num_layers)]
    return sum(f for i, f in enumerate(flops) if i in replayed) / sum(flops)


def _layer_forward_flops(model: ModelSpec, index: int, keys: float) -> float:
    """Forward FLOPs of layer `index` per token: its active parameters (a MoE layer's idle experts excluded) and
    its attention over `keys` keys, counted as `model_flops_per_step` does."""
    return 2.0 * _active_layer_params(model, index) + _attention_flops(model, 1, keys, model.num_heads)


@lru_cache(maxsize=16384)
def _layer_times(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, moe: bool, net: NetworkParams,
                 eff: Efficiency) -> tuple[float, float, float, float]:
    """(compute, exposed tp, cp and ep seconds) of one dense or MoE layer for one micro-batch: the same on
    every stage, so the stages of a layout share them."""
    places = group_places(deg, cluster)
    cost = layer_cost(model, deg, job, cluster, moe, eff)
    run, attention = _fwd_bwd(cost, job)
    if moe:  # the dispatcher's count read leaves the host no lead: the layer runs at its host's pace or slower
        run = host.paced_seconds(cost.forward, run - cost.forward, model, deg, job, eff.host_op_s)
    cp_records = context_parallel_records(model, deg, job)
    mode = CONTEXT_MODES[job.cp_mode]
    subgroups = mode.subgroups(deg, job) if deg.cp > 1 else {}
    if subgroups:
        places = {**places, **_subgroup_places(deg, cluster, tuple(subgroups.items()))}
    # What the mode overlaps (each ring step hides behind the previous block's attention) against what comes
    # before the attention that needs it (gathers, Ulysses' all-to-alls).
    hidden = [r for r in cp_records if r.op in mode.overlapped_ops]
    cp_t = _records_time([r for r in cp_records if r.op not in mode.overlapped_ops], places, cluster, net)
    cp_t += _hide(_records_time(hidden, places, cluster, net), attention, eff)
    ep_t = _ep_time(model, deg, job, cluster, places["ep"], cost, run, net, eff) if moe else 0.0
    blocks = 1 if moe and not model.num_shared_experts else 2  # experts stay whole on every tp rank
    tp_t = _tp_exposed(model, deg, job, cluster, cost, blocks, places, net, eff)
    if moe:
        tp_t += _records_time(expert_tensor_parallel_records(model, deg, job), places, cluster, net)
    return run, tp_t, cp_t, ep_t


# Chunks a pipelined GEMM + reduce-scatter is split into under `Job.tp_comm_overlap`: the userbuffers
# configurations Megatron-Bridge and NeMo ship for the output projection's and FC2's forward (docs/planner.md,
# section 6, 'Tensor-parallel overlap', names them)
TP_OVERLAP_SPLITS = 4


def _tp_exposed(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, cost: LayerCost, blocks: int,
                places: dict[str, Placement], net: NetworkParams, eff: Efficiency) -> float:
    """Exposed seconds of one layer's tensor-parallel traffic for one micro-batch (the routed experts' apart).

    Without `tp_comm_overlap` every all-gather and reduce-scatter blocks the GEMM that needs it. With it
    (Transformer Engine's userbuffers overlap), each runs in chunks beside a GEMM of its block: the forward
    all-gathers and the backward's output-gradient gathers exchange one chunk per step while the previous
    chunk's GEMM runs, the input re-gather and the input-gradient reduce-scatter run in bulk beside the
    backward's GEMMs, and the forward reduce-scatter follows its GEMM `TP_OVERLAP_SPLITS` chunks at a time, so
    the last chunk's transfer waits for nothing to hide behind. The layer's own GEMMs (the routed experts'
    excluded, a replayed forward's included) are the window; what fits in it costs the generic contention."""
    records = tensor_parallel_records(model, deg, job, blocks)
    comm = _records_time(records, places, cluster, net)
    if not (job.tp_comm_overlap and records):
        return comm
    replay = 1 if job.recompute == "full" else 0
    scatters = [r for r in records if r.op == "reduce_scatter"]  # SP's (the option needs it): never empty here
    forward_scatters = blocks * (1 + replay)  # one per block and forward pass (`tensor_parallel_records`)
    tail = _records_time(scatters, places, cluster, net) * forward_scatters / len(scatters) / TP_OVERLAP_SPLITS
    dense_f = cost.gemm_f - cost.experts_f
    window = dense_f * (1 + replay) + cost.gemm_b - cost.experts_b
    return tail + _hide(comm - tail, window, eff)


def _ep_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, where: Placement, cost: LayerCost,
             run: float, net: NetworkParams, eff: Efficiency) -> float:
    """Exposed seconds of one MoE layer's expert traffic for one micro-batch. Hidden "deepep" traffic costs
    the share of SMs its kernels take from compute (`node_dispatch.sm_share`) instead of the generic
    contention."""
    if not DISPATCHERS[job.dispatcher].node_aware:
        row = job.param_bytes * model.hidden_size
        comm = _records_time(expert_parallel_records(model, deg, job), {"ep": where}, cluster, net, msg_bytes=row)
        return _ep_exposed(comm, cost, run, job, deg, eff)
    check_ep_placement(deg, job, cluster)
    comm = node_dispatch.layer_time(model, where, job, routed_tokens(deg, job), cluster, net)
    if not comm:
        return 0.0
    # Hidden traffic takes its SMs from compute while it runs, unless they were set aside for the whole step
    # (then compute is priced on the SMs left, `_stage_time_cached`).
    share = 0.0 if job.ep_comm_sms_reserved else node_dispatch.sm_share(job, cluster)
    return _ep_exposed(comm, cost, run, job, deg, replace(eff, overlap_contention=share))


def _ep_exposed(comm: float, cost: LayerCost, run: float, job: Job, deg: Degrees, eff: Efficiency) -> float:
    """Seconds of one MoE layer's all-to-all (`comm`) that compute does not hide.

    Behind a paired micro-batch's whole layer, or behind the shared experts (`_ep_window`). With the runtime's
    `ep_overlap_chunks` c > 1 (ragged dispatch in token chunks, forward and backward), a chunk's transfers also
    overlap the other chunks' routed experts: all but the first chunk's dispatch and the last one's combine,
    (c - 1)/c of the traffic, can hide behind (c - 1)/c of the routed-expert compute; the shared experts'
    window covers any of it."""
    window = _ep_window(cost, run, job, deg)
    c = job.ep_overlap_chunks
    if c > 1 and window < run:
        experts = cost.experts_f + cost.experts_b + (cost.experts_f if job.recompute == "full" else 0.0)
        window += min(comm, experts) * (c - 1) / c
    return _hide(comm, window, eff)


def _ep_window(cost: LayerCost, run: float, job: Job, deg: Degrees) -> float:
    """Seconds of compute one MoE layer's all-to-all can overlap: only work that does not wait for it.

    Within one micro-batch the routed experts need the dispatched tokens and the combine needs their outputs,
    so the routed GEMMs can never hide their own traffic; the shared experts can, since they read the layer's
    input (DeepSeek-V2, arXiv:2405.04434 section 3.2.1, overlaps exactly these; Megatron-Core's
    `moe_shared_expert_overlap` too). With `overlap_ep` the schedule pairs two micro-batches so that one's
    tokens travel while the other's layer computes (DualPipe, DeepSeek-V3 arXiv:2412.19437 section 3.2.1;
    Megatron-Core's EP all-to-all overlap in 1F1B), which needs a second micro-batch in flight. Without
    `overlap_shared_experts` (Megatron-Core's default) the shared experts wait their turn too: nothing hides."""
    if job.overlap_ep and job.replica_microbatches(deg) > 1:
        return run
    if not job.overlap_shared_experts:  # the all-to-all runs on the layer's own stream and blocks it
        return 0.0
    shared_b = cost.shared_b - (cost.shared_w if SCHEDULES[job.pp_schedule].split_backward else 0.0)  # W apart
    return cost.shared_f + shared_b + (cost.shared_f if job.recompute == "full" else 0.0)


@lru_cache(maxsize=4096)
def _hardware_flops(model: ModelSpec, job: Job, sequences: int, replayed: float) -> float:
    flops = model_flops_per_step(model, job, sequences)
    if job.recompute == "full":  # one more forward of every replayed layer (an MTP module's only if all replay)
        tokens = sequences * job.seq_len
        keys = model_keys(model, job)
        decoder = sum(_layer_forward_flops(model, i, keys) for i in range(model.num_layers))
        mtp = 0.0 if job.partial_recompute else \
            model.mtp_layers * _layer_forward_flops(model, model.mtp_layer_index, keys)
        flops += tokens * (decoder * replayed + mtp)
    elif job.recompute == "selective" and job.attention_kernel == "eager":
        flops += _attention_flops(model, sequences * job.seq_len, model_keys(model, job), model.num_heads) \
            * model.num_layers
    return flops + sequences * job.seq_len * _module_replay_flops(model, job)


def _module_replay_flops(model: ModelSpec, job: Job) -> float:
    """GEMM FLOPs per token of one step's module replays (`Job.recompute_modules`): MLA's up-projections (its
    query projection without a query latent) in every layer, the dense layers' MLPs; MTP modules' layers
    replay theirs too."""
    flops, mtp_dense = 0.0, not model.is_moe_layer(model.mtp_layer_index)
    if "mla_up_proj" in job.recompute_modules:
        nope = model.qk_head_dim - model.qk_rope_head_dim
        up = model.kv_lora_rank * (nope + model.v_dim) + (model.q_lora_rank or model.hidden_size) * model.qk_head_dim
        flops += 2.0 * model.num_heads * up * (model.num_layers + model.mtp_layers)
    if "mlp" in job.recompute_modules:
        dense = model.num_layers - model.num_moe_layers + model.mtp_layers * mtp_dense
        flops += 2.0 * model.mlp_params(model.ffn_hidden_size) * dense
    if "alternate_mm" in job.recompute_modules:  # K, O and up
        h = model.hidden_size
        replayed = h * (model.kv_heads * model.qk_head_dim + model.num_heads * model.v_dim + model.ffn_hidden_size)
        flops += 2.0 * replayed * model.num_layers
    return flops


def step_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, net: NetworkParams = DEFAULT_PARAMS,
              eff: Efficiency = DEFAULT_EFFICIENCY) -> StepTime:
    """Predicted seconds per training step and MFU for one configuration on `cluster`."""
    m = job.replica_microbatches(deg)
    kinds = distinct_stages(model, deg.pp, job.virtual_stages, job.pipeline_layout)
    stages = [_stage_time(model, deg, job, cluster, s, net, eff) for s in kinds]
    slow = max(stages, key=lambda st: st.total)
    schedule = SCHEDULES[job.pp_schedule]
    v = job.virtual_stages if schedule.chunks else 1
    bubble = (deg.pp - 1) / v * slow.total
    if schedule.split_backward:  # exposed communication counts with the input-gradient backward
        bubble = zero_bubble_h1_bubble(deg.pp, slow.forward, slow.total - slow.forward - slow.wgrad, slow.wgrad)
    # The step ends when the stage with the most parameters has reduced their gradients (behind its own
    # backward) and stepped its optimizer: a layout can move most of them off stage 0.
    heavy = max(range(len(kinds)), key=lambda k: stage_params(model, deg, kinds[k], job.virtual_stages,
                                                              job.pipeline_layout).total)
    dp = _dp_exposed(model, deg, job, cluster, stages[heavy].total, m, net, eff, kinds[heavy])
    # A tied embedding's two copies are summed over the pipeline's ends once a step after the last backward,
    # exposed (Megatron-Core's `_allreduce_word_embedding_grads` in `finalize_model_grads`; `sum_partials`).
    tied = _records_time(tied_embedding_records(model, deg, job, 0), group_places(deg, cluster), cluster, net)
    optimizer = _optimizer_time(model, deg, job, cluster, eff, kinds[heavy])
    step = m * slow.total + bubble + dp + tied + optimizer
    sequences = m * job.micro_batch * deg.dp
    data = replace(job, seq_len=job.data_tokens, data_seq_len=0)  # cp's padding is computed, not model work
    flops = model_flops_per_step(model, data, sequences)
    hardware = _hardware_flops(model, job, sequences, replayed_share(model, deg, job))
    causal = model_flops_per_step(model, data, sequences, causal_attention=True)
    peak = cluster.gpu.peak_flops(job.param_dtype) * deg.world_size
    return StepTime(step, m * slow.compute, bubble, m * slow.tp, m * slow.cp, m * slow.ep, m * slow.pp + tied, dp,
                    optimizer, flops, hardware, flops / step / deg.world_size / 1e12, flops / step / peak,
                    hardware / step / peak, causal / step / peak)


def _optimizer_time(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, eff: Efficiency,
                    stage: int = 0) -> float:
    """Adam over this GPU's shard of `stage`: memory bound."""
    params = stage_params(model, deg, stage, job.virtual_stages, job.pipeline_layout)
    sharded = job.zero_stage > 0 or job.distributed_optimizer
    shard = params.dense / (deg.dp_cp if sharded else 1) + params.expert / (deg.edp if sharded else 1)
    # The constant reads and writes both moments in the main parameters' dtype; other moments move
    # 4 x the difference per parameter.
    moments = 4 * (main_param_bytes(job) - moment_bytes(job))
    return shard * (eff.optimizer_bytes_per_param - moments) / (cluster.gpu.memory_bw_gbs * 1e9 * eff.elementwise_bw)


def _hide(comm: float, window: float, eff: Efficiency) -> float:
    """Seconds `comm` adds when overlapped with `window` seconds of compute: what does not fit, plus the
    contention of what does (communication kernels take SMs and memory bandwidth from compute)."""
    hidden = min(comm, window)
    return comm - hidden + eff.overlap_contention * hidden


def _dp_exposed(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, t_mb: float, m: int,
                net: NetworkParams, eff: Efficiency, stage: int = 0) -> float:
    """DP traffic of `stage` left over after overlapping reductions with the last backward and gathers with the
    first forward; ZeRO-3's unit by unit (`zero3_exposure`)."""
    dp_job = _data_parallel_job(model, deg, job, m)
    reduce, gather, layers = _dp_times(model, deg, dp_job, cluster, net, stage)
    if job.zero_stage == 3:
        return _zero3_exposed(model, deg, job, dp_job, cluster, t_mb, m, net, eff, stage, reduce)
    # behind the last micro-batch's backward, bucket by bucket; not what the step holds (unbucketed, or waiting
    # for the tp sums)
    if job.overlap_grad_reduce and not held_to_step(model, deg, job):
        tail = reduce / layers  # the last bucket never overlaps
        exposed = tail + _hide(reduce - tail, 2 / 3 * t_mb, eff)
    else:  # every reduction after the last backward, before the optimizer
        exposed = reduce
    return exposed + _hide(gather, t_mb / 3, eff)


def _zero3_exposed(model: ModelSpec, deg: Degrees, job: Job, dp_job: Job, cluster: Cluster, t_mb: float, m: int,
                   net: NetworkParams, eff: Efficiency, stage: int, reduce: float) -> float:
    """ZeRO-3's exposed seconds per step: its units' gathers and reduce-scatters against their compute, each
    micro-batch split into forward and backward as its FLOPs are (a replayed forward goes with backward), and
    the step's other reductions (the clipping norm's) after the last backward. Partial gradients summed over tp
    first hold every reduce-scatter to the step, as the runtime does."""
    forward_order, backward_order = _zero3_units(model, deg, dp_job, cluster, net, stage, job.seq_len)
    rounds = reduce_rounds(model, deg, dp_job)
    forward = t_mb / (3.0 + replayed_share(model, deg, job))
    overlap = job.overlap_grad_reduce and not sums_first(model, deg, job)
    exposed = zero3_exposure.step_exposed(list(forward_order), list(backward_order), forward, t_mb - forward, m,
                                          rounds, job.zero3_prefetch, job.zero3_keep_params, overlap,
                                          eff.overlap_contention)
    return exposed + max(0.0, reduce - rounds * sum(u.reduce for u in backward_order))


Units = tuple[zero3_exposure.UnitTraffic, ...]


@lru_cache(maxsize=4096)
def _zero3_units(model: ModelSpec, deg: Degrees, dp_job: Job, cluster: Cluster, net: NetworkParams, stage: int,
                 seq_len: int) -> tuple[Units, Units]:
    """`stage`'s ZeRO-3 units in forward and in backward order: each one's transfers and its share of the forward
    FLOPs (the embedding none; the head, and an MTP module's pass through it, 2 x hidden x vocabulary per token).
    The unit gathered for a whole pass (`rest`: the stage's embedding and head where they are not units of their
    own, as `parallel.data.units` cuts them) is gathered first in both passes; its head computes at the end of
    forward and first in backward; when it holds the embedding, whose gradient comes last, its reduce-scatter
    ends backward."""
    places = group_places(deg, cluster)
    head = 2.0 * model.hidden_size * model.vocab_size if stage == deg.pp - 1 else 0.0
    contents = zero3_unit_contents(model, deg, stage, dp_job.virtual_stages, dp_job.pipeline_layout)
    flops = [_unit_forward_flops(model, what, seq_len, head) for _, what in contents]
    total = sum(flops) or 1.0
    units = [zero3_exposure.UnitTraffic(*_records_times(records, places, cluster, net, split_gathers=True)[::-1],
                                        share=f / total)
             for records, f in zip(zero3_unit_records(model, deg, dp_job, stage), flops, strict=True)]
    if not contents or contents[0][1] != "rest":
        return tuple(units), tuple(units[::-1])
    rest, layers = units[0], units[1:]
    forward_order = (replace(rest, share=0.0), *layers)  # its head runs after the layers, hiding no gather
    if stage != 0:  # the last stage's head alone: reduced after its own backward
        return forward_order, (rest, *layers[::-1])
    return forward_order, (replace(rest, reduce=0.0), *layers[::-1], zero3_exposure.UnitTraffic(0.0, rest.reduce, 0.0))


def _unit_forward_flops(model: ModelSpec, what: str | int, seq_len: int, head: float) -> float:
    """Forward FLOPs per token of a ZeRO-3 unit (`params.zero3_unit_contents`), `head` those of the output head."""
    if isinstance(what, int):
        return _layer_forward_flops(model, what, seq_len)
    if what == "mtp":
        return _layer_forward_flops(model, model.mtp_layer_index, seq_len) + 4.0 * model.hidden_size**2 + head
    return 0.0 if what == "embedding" else head


@lru_cache(maxsize=16384)
def _data_parallel_job(model: ModelSpec, deg: Degrees, job: Job, microbatches: int) -> Job:
    """The key for one step's data-parallel traffic: the model-state options, and under ZeRO-3 (which gathers
    every unit again per micro-batch) the micro-batch count, carried as `microbatches`, with
    `zero3_reduce_every_microbatch` only where it takes effect (the key drops sequence parallelism)."""
    states = model_state_job(job)
    if job.zero_stage != 3:
        return states
    every = reduce_rounds(model, deg, replace(job, microbatches=microbatches, global_batch=0)) > 1
    return canonical_job(replace(states, microbatches=microbatches, zero3_reduce_every_microbatch=every))


@lru_cache(maxsize=16384)
def _dp_times(model: ModelSpec, deg: Degrees, job: Job, cluster: Cluster, net: NetworkParams,
              stage: int = 0) -> tuple[float, float, int]:
    """(reduction seconds, gather seconds, layers) of one step's data-parallel traffic on `stage`."""
    places = group_places(deg, cluster)
    reduce, gather = _records_times(data_parallel_records(model, deg, job, stage), places, cluster, net,
                                    split_gathers=True)
    return reduce, gather, max(1, len(stage_layers(model.num_layers, deg.pp, job.virtual_stages, stage,
                                                   job.pipeline_layout)))
