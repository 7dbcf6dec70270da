"""Saved activations per transformer layer and per pipeline stage.

Korthikanti et al. 2022 (arXiv:2205.05198), section 4, count the bytes one layer keeps for backward with
16-bit activations and 1-byte dropout masks: s*b*h*(34 + 5*a*s/h) without parallelism; with tensor
parallelism s*b*h*(10 + 24/t + 5*a*s/(h*t)); with sequence parallelism everything divides by t; selective
recompute drops the 5*a*s/h attention-score term; full recompute keeps only the layer input (2*s*b*h).
`layer_activation_bytes` reproduces these term by term for GPT-style layers and extends them to GQA,
SwiGLU, MoE, context parallelism (the local sequence s/cp) and flash attention (no s x s scores, plus the
attention output and its log-sum-exp). Pipeline in-flight counts follow the paper's section 4.2.3.
Under FP8 (`Job.fp8`, Transformer Engine's recipe) every linear layer saves the FP8 cast of its input that its
GEMM read (1 byte: the QKV, output-projection, up and down inputs), while norms, Q/K/V, gate/up and the fused
attention kernel's own output stay 16-bit; the blockwise recipe adds one fp32 scale per 1 x 128 tile of each
such input (1/32 byte per element).

For Llama-style models (SwiGLU, RMSNorm, RoPE: orangetron's reference model) the count is exact: it is
what `orangetron.model.Transformer` keeps for backward, as `orangetron.memory.track_activations` measures
it (tests/test_plan_activations_exact.py). Per layer: each norm's input; the QKV input; Q and K after RoPE
and V with their own head counts (K and V not expanded to the query heads); with QK-norm, Q and K before it
(the norm's input; biases keep nothing); the attention output; a
log-sum-exp per query and head; the MLP input, gate, up and their product. Softmax statistics, router
scores and the loss's logits are float32, float64 for float64 activations. Besides these, such models count
the small buffers Korthikanti et al. leave out: the int64 token ids (first stage), the RoPE cos/sin tables,
and for MoE the int64 top-k expert ids, each routed copy's routing weight and the 1-byte padding mask read
by the load-balancing loss. GPT-style layers keep the paper's terms unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from orangetron.plan.fp8 import ACTIVATION_TILE
from orangetron.spec.dispatchers import capacity_slots
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, without_data_parallel, without_recompute
from orangetron.spec.schedule import actions, peak_held
from orangetron.spec.stages import replay_split, stage_layer_counts, stage_layers
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES


@dataclass(frozen=True)
class LayerShape:
    """The sizes every activation formula needs, for one micro-batch on one GPU."""

    s: int  # local sequence (seq / cp)
    s_kv: int  # keys each query attends to (full sequence)
    b: int
    t: int
    sp: bool
    a: int  # bytes per activation element (the param dtype)
    g: int = 0  # bytes per element of a saved GEMM input: 1 under FP8 (the cast the GEMM read), else `a`
    tiled: bool = False  # blockwise FP8: each saved GEMM input also keeps one fp32 scale per 128 elements
    cached: bool = False  # `Job.fp8_cached_activations`: DeepSeek-V3's 12-bit attention output, FP8 SwiGLU inputs

    def __post_init__(self) -> None:
        if not self.g:
            object.__setattr__(self, "g", self.a)

    @property
    def acc(self) -> int:
        """Bytes per element of softmax statistics, router scores and logits: float32, float64 for float64."""
        return 8 if self.a == 8 else 4

    @property
    def rep(self) -> int:
        """Divisor of the pieces TP alone leaves replicated (norms, block inputs, dropout masks)."""
        return self.t if self.sp else 1

    def tile_scales(self, elements: int) -> int:
        """Bytes of the fp32 tile scales a saved FP8 GEMM input of `elements` keeps (blockwise recipe)."""
        return 4 * elements // ACTIVATION_TILE if self.tiled else 0

    def gemm_input(self, elements: int) -> int:
        """Bytes a GEMM keeps of an input of `elements`: the cast it read (or the 16-bit tensor) and its scales."""
        return self.g * elements + self.tile_scales(elements)


def layer_shape(deg: Degrees, job: Job) -> LayerShape:
    return LayerShape(job.seq_len // deg.cp, job.seq_len, job.micro_batch, deg.tp,
                      job.sequence_parallel and deg.tp > 1, job.param_bytes, 1 if job.fp8 else job.param_bytes,
                      job.fp8 and job.fp8_recipe == "blockwise", job.fp8_cached_activations)


def _heads(n: int, t: int) -> int:
    # KV heads fewer than tp are replicated, one per rank.
    return max(1, n // t)


def _counts_small_buffers(m: ModelSpec) -> bool:
    """Llama-style (SwiGLU) models count the small buffers exactly; GPT-style layers follow the paper."""
    return m.mlp == "swiglu"


def attention_bytes(m: ModelSpec, x: LayerShape, job: Job) -> int:
    """Attention block (its input norm excluded): QKV input, Q, K, V, output, masks, optional scores."""
    sb, h, a = x.s * x.b, m.hidden_size, x.a
    heads, kv = _heads(m.num_heads, x.t), _heads(m.kv_heads, x.t)
    # The QKV projection's input; under FP8 MLA's two projections of the hidden state keep a cast each.
    total = (2 if m.kv_lora_rank and x.g < a else 1) * x.gemm_input(sb * h // x.rep)
    total += a * sb * (heads * m.qk_head_dim + kv * m.qk_head_dim + kv * m.v_dim)  # Q, K, V
    if m.kv_lora_rank:  # MLA: its latent norms' inputs and its up-projections' inputs
        total += a * sb * (m.q_lora_rank + m.kv_lora_rank) // x.rep + _mla_up_input_bytes(m, x)
    if m.qk_norm:
        total += a * sb * (heads + kv) * m.qk_head_dim  # QK-norm inputs: Q and K before their norm and rotation
    out = sb * heads * m.v_dim
    fused = job.attention_kernel != "eager"
    if x.cached and fused:  # one 12-bit copy and its tile scales serve the kernel's backward and the projection's
        total += 3 * out // 2 + x.tile_scales(out)
    else:
        total += x.gemm_input(out)  # attention output = output-projection input
    if x.g < a and fused and not x.cached:
        total += a * out  # under FP8 the fused kernel keeps its 16-bit output besides the projection's FP8 copy
    if m.dropout:
        total += sb * h // x.rep  # dropout mask after the output projection (1 byte)
    if x.s_kv > x.s:  # what the cp mode keeps besides (rsa: its probabilities instead of the kernel's state)
        mode = CONTEXT_MODES[job.cp_mode]
        total += mode.saved_bytes(m, x, job, heads, kv)
        if not mode.keeps_kernel_state:
            return total
    if job.attention_kernel != "eager":
        return total + x.acc * x.b * heads * x.s  # fp32 (fp64) log-sum-exp per query and head
    if job.recompute != "selective":
        scores = x.b * heads * x.s * x.s_kv
        total += a * scores  # softmax output
        if m.dropout:
            total += scores + a * scores  # attention-dropout mask (1 byte) and output
    return total


def _mla_up_input_bytes(m: ModelSpec, x: LayerShape) -> int:
    """MLA's normed latents as its up-projection GEMMs keep them: under sequence parallelism the
    down-projections run on the rank's part of the sequence, and the up-projections gather their input again
    in backward (Transformer Engine's LayerNormLinear), so a rank keeps its part."""
    latents = x.s * x.b * (m.q_lora_rank + m.kv_lora_rank) // x.rep
    return x.gemm_input(latents)


def mlp_bytes(m: ModelSpec, x: LayerShape, ffn: int, tokens: int | None = None, shard_h: bool = True,
              split: int | None = None, in_moe: bool = False) -> int:
    """One MLP of width `ffn` (split `split` ways, default tp) over `tokens` rows (default s*b); `in_moe`: a MoE
    layer's, whose SwiGLU inputs `x.cached` keeps as FP8 casts."""
    rows = x.s * x.b if tokens is None else tokens
    f = ffn // (x.t if split is None else split)
    inp = x.gemm_input(rows * m.hidden_size // (x.rep if shard_h else 1))
    cast = x.gemm_input(rows * f)  # the product (the down projection's input), as kept
    if in_moe and x.cached and m.mlp == "swiglu":
        return inp + 3 * cast  # gate and up kept as casts too
    # Gate and up (16-bit) and their product, or fc1's output and the GeLU output.
    return inp + (2 if m.mlp == "swiglu" else 1) * x.a * rows * f + cast


def moe_bytes(m: ModelSpec, x: LayerShape, job: Job, etp: int = 1) -> int:
    """Router, routed experts on this GPU (its dispatched tokens, full hidden) and shared experts."""
    sb = x.s * x.b
    router = x.a * sb * m.hidden_size // x.rep + x.acc * sb * m.num_experts // x.rep  # input, fp32 probs
    # Each EP rank receives, on balance, top_k copies of its own token count; capacity keeps at most
    # `capacity` of each rank's assignments per expert (padding rows carry no copies). etp = tp under SP: the
    # tp group's copies, gathered.
    routed = _routed_rows(m, x, job, etp)
    total = router + mlp_bytes(m, x, m.moe_ffn_hidden_size, tokens=routed, shard_h=False, split=etp, in_moe=True)
    if _counts_small_buffers(m):
        total += 8 * (sb // x.rep * m.top_k) + x.acc * routed  # int64 top-k ids, each copy's routing weight
    if m.num_shared_experts:
        shared = mlp_bytes(m, x, m.num_shared_experts * m.moe_ffn_hidden_size, in_moe=True)
        # Its first GEMM shares the router's 16-bit input; under FP8 it keeps its own cast.
        total += shared - (x.a * sb * m.hidden_size // x.rep if x.g == x.a else 0)
    if m.shared_expert_gate:  # the gate's sigmoid [T, 1] and the shared output it multiplies [T, h]
        total += x.a * sb * (m.hidden_size + 1) // x.rep
    return total


def _routed_rows(m: ModelSpec, x: LayerShape, job: Job, etp: int) -> int:
    """Token copies this GPU's experts run on (see `moe_bytes`)."""
    sb = x.s * x.b
    routed = sb // x.rep * m.top_k * (etp if x.sp else 1)
    if DISPATCHERS[job.dispatcher].pads:
        routed = min(routed, m.num_experts * capacity_slots(m, sb // x.rep, job))
    return routed


def expert_dispatch_bytes(m: ModelSpec, x: LayerShape, job: Job, ep: int) -> int:
    """What an expert-parallel dispatcher keeps besides the single-device MoE's tensors, with balanced routing.

    Each of this rank's T tokens travels as one row to each of `routed_ranks(ep)` ranks (R rows out, as many in),
    and the rank's experts receive T * top_k copies (C; capacity's kept ones, at most E * capacity). ragged
    keeps each row's token (int64 [R]) and the mask of its slots on the destination (bool [R, k]); allgather
    keeps the rows it serves (int64 [R]) and the mask over the gathered slots (bool [ep * T, k]); capacity,
    ragged's with every destination padded to min(E/ep * capacity, T) rows. Every mode keeps each copy's row
    and slot (two int64 [C]) to put the copies in expert order and sum them back. Overlap chunks split the same
    tensors.
    """
    if ep == 1:
        return 0
    tokens = x.s * x.b // x.rep
    copies = _routed_rows(m, x, job, 1)  # capacity's kept ones: a dropped copy has no row or slot
    dispatcher = DISPATCHERS[job.dispatcher]
    rows = dispatcher.rows(m, tokens, job, ep)
    return 8 * rows + dispatcher.mask_bytes(m, tokens, job, ep, rows) + 16 * copies


@lru_cache(maxsize=16384)
def layer_activation_bytes(m: ModelSpec, deg: Degrees, job: Job, moe: bool) -> int:
    """Bytes one layer saves for backward for one micro-batch on one GPU, under `job.recompute`."""
    x = layer_shape(deg, job)
    if job.recompute == "full":
        return x.a * x.s * x.b * m.hidden_size // x.rep  # the checkpointed layer input
    return _whole_layer_bytes(m, deg, job, moe) - module_replay_bytes(m, deg, job, moe)[0]


def _whole_layer_bytes(m: ModelSpec, deg: Degrees, job: Job, moe: bool) -> int:
    """What a layer keeps when nothing of it replays."""
    x = layer_shape(deg, job)
    sb, h = x.s * x.b, m.hidden_size
    norms = 2 * x.a * sb * h // x.rep
    ffn = moe_bytes(m, x, job, deg.etp) + expert_dispatch_bytes(m, x, job, deg.ep) if moe else \
        mlp_bytes(m, x, m.ffn_hidden_size)
    if moe and m.aux_loss_coef and (deg.dp_cp > 1 or x.sp):
        ffn += x.acc * (m.num_experts + 1)  # the global balancing loss keeps the expert fractions and the count
    if moe and m.router_z_loss_coef:  # the z-loss keeps the router logits (and the global count)
        ffn += x.acc * sb * m.num_experts // x.rep + (x.acc if deg.dp_cp > 1 or x.sp else 0)
    mask = sb * h // x.rep if m.dropout else 0
    return norms + attention_bytes(m, x, job) + ffn + mask


def alternate_mm_bytes(m: ModelSpec, x: LayerShape) -> int:
    """What a layer keeps under torchtitan's op-level selective checkpointing (`options.RECOMPUTE_MODULES`,
    "alternate_mm"; tp 1, cp 1): its input (the checkpoint's), and the outputs of the ops its policy saves:
    the odd matmuls (Q, V, gate, and down, whose output no backward reads but the policy keeps) and the fused
    attention kernel's output and log-sum-exp. Everything else (K, O, up, the norms, RoPE, SwiGLU's product)
    replays when the layer's backward starts."""
    sb, h, d = x.s * x.b, m.hidden_size, m.qk_head_dim
    matmuls = m.num_heads * d + m.kv_heads * m.v_dim + m.ffn_hidden_size + h
    return x.a * sb * (h + matmuls + m.num_heads * m.v_dim) + x.acc * x.b * m.num_heads * x.s


def _mla_qkv_bytes(m: ModelSpec, x: LayerShape) -> int:
    """MLA's Q, K and V after its up-projections (Q from the hidden state itself without a query latent, a
    projection the up-projections' replay runs again too)."""
    heads, kv = _heads(m.num_heads, x.t), _heads(m.kv_heads, x.t)
    return x.a * x.s * x.b * (heads * m.qk_head_dim + kv * m.qk_head_dim + kv * m.v_dim)


def module_replay_bytes(m: ModelSpec, deg: Degrees, job: Job, moe: bool) -> tuple[int, int]:
    """(bytes freed, bytes a replay brings back besides them) of one layer's replayed modules, under
    Megatron-Core's Transformer Engine layer spec: a norm fused into the GEMM after it (plain attention's QKV
    projection, a dense MLP's first GEMM, MLA's latent norms) is not a module of its own. torchtitan's
    "alternate_mm" frees all but `alternate_mm_bytes`, and its replay brings that back.

    "layernorm": the norms that stand alone: MLA's input norm, whose output the down-projections keep, and a
    MoE layer's pre-MLP norm, whose output the router keeps (16-bit) and the shared experts' first GEMM (its cast
    under FP8). Under FP8 those GEMMs keep the 16-bit output, freed, instead of their cast (Transformer Engine's
    save_original_input), so the casts are what goes (not the query projection's without a query latent, which
    keeps its cast); the replay brings the 16-bit output back and casts again. "mla_up_proj": Q, K, V and the
    up-projections' normed inputs (and, under FP8 without a query latent, the query projection's cast, its
    16-bit input kept instead unless the norm replays too); the replay keeps the latents before their norms
    (kept anyway, for the norms' backward) and the key's rotary part, gathered to the whole sequence, which it
    needs beside what it brings back.
    "mlp": a dense MLP whole; its input is the pre-norm residual, kept anyway. "moe_act": the experts'
    activation output, the down projection's input (its cast under FP8)."""
    x, etp, modules = layer_shape(deg, job), deg.etp, job.recompute_modules
    if "alternate_mm" in modules:
        return _whole_layer_bytes(m, deg, job, moe) - alternate_mm_bytes(m, x), 0
    hidden = x.s * x.b * m.hidden_size // x.rep
    cast = x.gemm_input(hidden)  # a GEMM's saved input of the hidden width
    fp8 = x.g < x.a
    freed = back = 0
    if "layernorm" in modules and m.kv_lora_rank:
        freed += (2 if fp8 and m.q_lora_rank else 1) * cast
        back += x.a * hidden if fp8 else 0
    if "layernorm" in modules and moe:
        freed += x.a * hidden + (cast if fp8 and m.num_shared_experts else 0)
    if "mla_up_proj" in modules:
        rotary_key = x.a * x.s * x.b * m.qk_rope_head_dim
        freed += _mla_qkv_bytes(m, x) + _mla_up_input_bytes(m, x) - rotary_key
        if fp8 and not m.q_lora_rank:
            freed += cast - (0 if "layernorm" in modules else x.a * hidden)
        back += rotary_key
    if "mlp" in modules and not moe:
        freed += mlp_bytes(m, x, m.ffn_hidden_size)
    if "moe_act" in modules and moe:
        activation = _routed_rows(m, x, job, etp) * (m.moe_ffn_hidden_size // etp)
        freed += x.gemm_input(activation)
        back += x.a * activation if fp8 else 0
    return freed, back


def in_flight(deg: Degrees, job: Job, stage: int) -> float:
    """Layer-chunks' worth of micro-batches a stage holds at its peak, in units of the stage's layers: what the
    schedule's record says (spec/schedules.py), or what its action lists hold."""
    p, m, v = deg.pp, job.replica_microbatches(deg), job.virtual_stages
    if p == 1:
        return 1.0
    schedule = SCHEDULES[job.pp_schedule]
    if schedule.in_flight is None:
        return peak_held(actions(p, m, job.pp_schedule, v)[stage], v)
    return schedule.in_flight(p, v, m, stage)


def stage_activation_bytes(m: ModelSpec, deg: Degrees, job: Job, stage: int) -> int:
    """Peak saved activations on one GPU of `stage`, including embedding and output/loss buffers."""
    # Optimizer sharding never changes activations: drop it from the cache key.
    return _stage_activation_bytes(m, deg, without_data_parallel(job), stage)


@lru_cache(maxsize=16384)
def _stage_activation_bytes(m: ModelSpec, deg: Degrees, job: Job, stage: int) -> int:
    x = layer_shape(deg, job)
    layers = stage_layers(m.num_layers, deg.pp, job.virtual_stages, stage, job.pipeline_layout)
    _, moe_layers = stage_layer_counts(m, deg.pp, job.virtual_stages, stage, job.pipeline_layout)
    schedule = SCHEDULES[job.pp_schedule]
    if deg.pp > 1 and schedule.chunks and job.virtual_stages > 1:
        return _interleaved_peak(m, deg, job, stage, x)
    total = int(_saved_bytes(m, deg, job, stage, layers) * in_flight(deg, job, stage))
    if schedule.split_backward and deg.pp > 1:
        total = _zero_bubble_layers_bytes(m, deg, job, stage, layers)
    transient = _stage_replay_transient(m, deg, job, stage, layers)
    # The loss's backward frees the output layer's buffers of its micro-batch before any layer replays (not
    # under zb-h1, whose head W keeps the logits' gradient, nor with an MTP module, which replays first).
    head_freed_first = transient > 0 and not schedule.split_backward and not m.mtp_layers
    if not (stage == deg.pp - 1 and head_freed_first):
        total += transient
    sb, h = x.s * x.b, m.hidden_size
    if stage == 0 and m.dropout:
        total += int(sb * h // x.rep * in_flight(deg, job, 0))  # embedding-dropout mask
    if _counts_small_buffers(m):
        ids, rope, mask = _small_stage_buffers(m, x, stage, len(layers), moe_layers, job.packed)
        chunk_mbs = in_flight(deg, job, stage) * job.virtual_stages  # (chunk, micro-batch) pairs
        mbs = _microbatches_in_flight(deg, job, stage)
        total += int(ids * mbs + rope * chunk_mbs + mask * (chunk_mbs if x.rep > 1 else mbs))
    if stage == deg.pp - 1:
        # The output layer's buffers, per micro-batch whose loss waits for its backward (`head_in_flight`), and an
        # eager loss's extra copies once: only the loss backward that runs holds them.
        head, loss = _head_bytes(m, x), _eager_loss_bytes(m, x, job)
        if head_freed_first:  # the larger of the end of forward and the replay
            total += head * (head_in_flight(deg, job) - 1) + max(head + loss, transient)
        else:
            total += head * head_in_flight(deg, job) + loss
        if m.mtp_layers:
            layer, inputs = _mtp_layer_bytes(m, deg, job)
            if schedule.split_backward:  # as a decoder layer: one waits for its B, pp - 1 for their W
                moe = m.is_moe_layer(m.mtp_layer_index)
                layer = layer + weight_grad_state_bytes(m, deg, without_recompute(job), moe) * stage
            else:
                layer = layer * in_flight(deg, job, stage)
            total += m.mtp_layers * (layer + inputs * in_flight(deg, job, stage) + head * head_in_flight(deg, job))
    return total


def _head_bytes(m: ModelSpec, x: LayerShape) -> int:
    """The output layer's buffers for one micro-batch until its backward: the final norm's and the output
    projection's inputs and the loss's fp32 (fp64) logits' gradient (vocab-parallel)."""
    sb = x.s * x.b
    return 2 * x.a * sb * m.hidden_size // x.rep + x.acc * sb * m.vocab_size // x.t


def _eager_loss_bytes(m: ModelSpec, x: LayerShape, job: Job) -> int:
    """What an eager fp32 loss's backward adds while it runs, once at a time (`Job.eager_fp32_loss`): beside
    the saved log-softmax, which a micro-batch keeps as the fused loss keeps its gradient, the gradient
    nll_loss writes and log-softmax's input gradient."""
    return 2 * x.acc * x.s * x.b * m.vocab_size // x.t if job.eager_fp32_loss else 0


def _mtp_layer_bytes(m: ModelSpec, deg: Degrees, job: Job) -> tuple[int, int]:
    """(its layer's saved activations, its other inputs) of one multi-token-prediction module for one
    micro-batch: the layer replays only when full recompute replays every layer; the projection keeps its 2h
    input and the two norms theirs. Its head and loss keep what the main head does."""
    x = layer_shape(deg, job)
    sb, h = x.s * x.b, m.hidden_size
    layer = layer_activation_bytes(m, deg, job.layer_job(False), m.is_moe_layer(m.mtp_layer_index))
    proj_in = 2 * sb * h // x.rep
    return layer, x.gemm_input(proj_in) + 2 * x.a * sb * h // x.rep


def _zero_bubble_layers_bytes(m: ModelSpec, deg: Degrees, job: Job, stage: int, layers: Sequence[int]) -> int:
    """zb-h1 (pp <= m): stage s holds pp - s micro-batches waiting for their B, as 1F1B's stage 0 does, and s
    whose W waits. A W reads each GEMM's input and output gradient, whatever the recompute (a replayed layer's
    inputs were made again by its B's replay, and its W keeps them)."""
    waiting_for_b = _saved_bytes(m, deg, job, stage, layers) * (deg.pp - stage)
    moe = sum(m.is_moe_layer(i) for i in layers)
    w_state = moe * weight_grad_state_bytes(m, deg, job, True) + \
        (len(layers) - moe) * weight_grad_state_bytes(m, deg, job, False)
    return int(waiting_for_b + w_state * stage)


@lru_cache(maxsize=4096)
def weight_grad_state_bytes(m: ModelSpec, deg: Degrees, job: Job, moe: bool) -> int:
    """Bytes one layer's weight gradients read for one micro-batch: every GEMM's input (as saved: in the GEMM's
    dtype, sharded under SP) and its 16-bit output gradient. The GEMMs: Q, K, V (MLA: its down- and
    up-projections) and the output projection; the MLP's up (gate and up) and down projections, per routed copy
    and for the shared experts in a MoE layer."""
    x = layer_shape(deg, job)
    sb, h, t, rep = x.s * x.b, m.hidden_size, x.t, x.rep
    heads, kv = _heads(m.num_heads, t), _heads(m.kv_heads, t)
    up = 2 if m.mlp == "swiglu" else 1
    gemms = [(sb, heads * m.v_dim, h // rep)]  # (rows, input width, output width); the output projection
    if m.kv_lora_rank:
        nope = m.qk_head_dim - m.qk_rope_head_dim
        gemms += [(sb, h // rep, m.kv_lora_rank + m.qk_rope_head_dim), (sb, m.kv_lora_rank, heads * (nope + m.v_dim))]
        gemms += [(sb, h // rep, m.q_lora_rank), (sb, m.q_lora_rank, heads * m.qk_head_dim)] if m.q_lora_rank else \
            [(sb, h // rep, heads * m.qk_head_dim)]
    else:
        gemms.append((sb, h // rep, heads * m.qk_head_dim + kv * (m.qk_head_dim + m.v_dim)))
    mlps = [(sb, m.ffn_hidden_size // t, rep)] if not moe else \
        [(sb // rep * m.top_k * (deg.etp if x.sp else 1), m.moe_ffn_hidden_size // deg.etp, 1)]
    if moe and m.num_shared_experts:
        mlps.append((sb, m.num_shared_experts * m.moe_ffn_hidden_size // t, rep))
    for rows, ffn, h_div in mlps:
        gemms += [(rows, h // h_div, up * ffn), (rows, ffn, h // h_div)]
    if moe and m.shared_expert_gate:  # h -> 1 on this rank's tokens
        gemms.append((sb // rep, h, 1))
    return sum(rows * (x.g * k + x.a * n) for rows, k, n in gemms)


def head_in_flight(deg: Degrees, job: Job) -> int:
    """Micro-batches whose output layer and loss the last stage holds at once: GPipe runs every forward
    before any backward (m); 1F1B and interleaved 1F1B run the last chunk's backward right after its forward;
    zb-h1's last stage runs each W pp - 1 backwards late, and the head's W needs the logits' gradient."""
    if deg.pp == 1:
        return 1
    p, m, v, schedule = deg.pp, job.replica_microbatches(deg), job.virtual_stages, SCHEDULES[job.pp_schedule]
    if schedule.held_outputs is None:
        return int(peak_held([a for a in actions(p, m, job.pp_schedule, v)[p - 1] if a.chunk == v - 1], 1))
    return schedule.held_outputs(p, m)


def _layer_bytes(m: ModelSpec, deg: Degrees, job: Job, layers: int, moe: int) -> int:
    """Bytes `layers` layers save, `moe` of them MoE: every layer of a kind saves the same."""
    return (moe * layer_activation_bytes(m, deg, job, True) if moe else 0) + \
        (layers - moe) * layer_activation_bytes(m, deg, job, False)


def _stage_replay_transient(m: ModelSpec, deg: Degrees, job: Job, stage: int, layers: Sequence[int]) -> int:
    """The replay transient of `layers` (a stage's or one chunk's), or on the last stage of an MTP module's layer
    when full recompute replays every layer (its backward runs first, before any decoder layer's)."""
    mtp = 0
    if stage == deg.pp - 1 and m.mtp_layers and job.recompute == "full" and not job.partial_recompute:
        mtp = layer_activation_bytes(m, deg, without_recompute(job), m.is_moe_layer(m.mtp_layer_index))
    return max(mtp, _replay_transient(m, deg, job, stage, layers))


def _replay_transient(m: ModelSpec, deg: Degrees, job: Job, stage: int, layers: Sequence[int]) -> int:
    """Bytes backward adds while it replays a layer's forward under full recompute: the largest replayed layer's
    activations, less what the chunk's kept layers freed first (their backward runs before the replays). Replayed
    modules bring back one layer's module outputs while that layer's backward runs, before anything is freed."""
    if job.recompute_modules and layers:
        return max(sum(module_replay_bytes(m, deg, job, moe)) for moe in {m.is_moe_layer(i) for i in layers})
    if job.recompute != "full" or not layers:
        return 0
    split = dict(replay_split(m.num_layers, deg.pp, job.virtual_stages, stage, job.recompute_layers, layers,
                              job.pipeline_layout))
    whole, kept = without_recompute(job), split.get(False, ())
    # The replay runs on the kept input itself, which the stage counts already: the rest of the layer is new.
    largest = max(layer_activation_bytes(m, deg, whole, moe) - layer_activation_bytes(m, deg, job.layer_job(True), moe)
                  for moe in {m.is_moe_layer(i) for i in split[True]})
    freed = _layer_bytes(m, deg, whole, len(kept), sum(m.is_moe_layer(i) for i in kept))
    return max(0, largest - freed)


def _saved_bytes(m: ModelSpec, deg: Degrees, job: Job, stage: int, layers: Sequence[int]) -> int:
    """Bytes `layers` of `stage` (all of them, or one chunk's) save for one micro-batch: under partial
    recompute the replayed ones keep their input only, the others everything."""
    if not job.partial_recompute:
        return _layer_bytes(m, deg, job, len(layers), sum(m.is_moe_layer(i) for i in layers))
    split = replay_split(m.num_layers, deg.pp, job.virtual_stages, stage, job.recompute_layers, layers,
                         job.pipeline_layout)
    return sum(_layer_bytes(m, deg, job.layer_job(flag), len(mine), sum(m.is_moe_layer(i) for i in mine))
               for flag, mine in split)


def _interleaved_prefix(p: int, microbatches: int, v: int, stage: int) -> tuple:
    """The first 16*p*v actions of `stage` in the interleaved schedule the runtime executes. Action k of the list
    does not depend on the micro-batch count once the warmup and 16*p*v more fit, so a long run's prefix is
    taken from a shorter one (a search prices thousands of micro-batches per configuration)."""
    enough = p * math.ceil((2 * p + v * p + 16 * p * v) / (v * p))  # warmup <= 2(p-1) + (v-1)p forwards
    return _interleaved_prefixes(p, min(microbatches, enough), v)[stage]


@lru_cache(maxsize=1024)
def _interleaved_prefixes(p: int, microbatches: int, v: int) -> tuple:
    from orangetron.spec.schedule import interleaved_prefix

    return tuple(tuple(rank) for rank in interleaved_prefix(p, microbatches, v, 16 * p * v))


def _interleaved_peak(m: ModelSpec, deg: Degrees, job: Job, stage: int, x: LayerShape) -> int:
    """Peak bytes of an interleaved stage, walking its action list: every (chunk, micro-batch) between its
    forward and its backward holds its layers and RoPE tables (and under SP its mask copy); a micro-batch's
    token ids stay while chunk 0 holds it, its padding mask while any chunk with MoE layers does, and the
    output layer's buffers while the last chunk does."""
    p, v, mbs = deg.pp, job.virtual_stages, job.replica_microbatches(deg)
    sb, h = x.s * x.b, m.hidden_size
    weights, masked, mask = [], [], 0
    for c in range(v):
        layers, moe_layers = stage_layer_counts(m, p * v, 1, stage + c * p, job.pipeline_layout)
        ids, rope, mask_c = _small_stage_buffers(m, x, stage, layers, moe_layers, job.packed)
        saved = _saved_bytes(m, deg, job, stage, stage_layers(m.num_layers, p * v, 1, stage + c * p,
                                                              job.pipeline_layout))
        weights.append(saved + rope + (mask_c if x.rep > 1 else 0))
        masked.append(bool(mask_c) and x.rep == 1)
        mask = mask_c or mask  # every chunk with MoE layers has the same mask size
    if stage == 0:  # token ids (Llama-style models), embedding-dropout mask
        weights[0] += (8 * sb if _counts_small_buffers(m) else 0) + (sb * h // x.rep if m.dropout else 0)
    if stage == p - 1:
        head = _head_bytes(m, x)
        weights[-1] += head + m.mtp_layers * (sum(_mtp_layer_bytes(m, deg, job)) + head)
    weights.append(mask)
    chunks = [stage_layers(m.num_layers, p * v, 1, stage + c * p, job.pipeline_layout) for c in range(v)]
    transients = [_stage_replay_transient(m, deg, job, stage, layers) for layers in chunks]
    loss = _eager_loss_bytes(m, x, job) if stage == p - 1 else 0
    frees_head = stage == p - 1 and not m.mtp_layers  # the loss's backward frees the head before any replay

    def during(entry: tuple[int, ...]) -> int:
        """Bytes held at `entry` of the walk: after a forward, or while a backward of chunk `tag` replays."""
        tag, *held = entry
        live = sum(w * n for w, n in zip(weights, held, strict=True))
        if tag < 0:
            return live
        if tag == v - 1 and frees_head and transients[tag] > 0:
            return live - head + max(head + loss, transients[tag])
        return live + transients[tag] + (loss if tag == v - 1 else 0)

    return max(during(entry) for entry in _interleaved_holdings(p, mbs, v, stage, tuple(masked)))


def _interleaved_holdings(p: int, microbatches: int, v: int, stage: int,
                          masked: tuple[bool, ...]) -> tuple[tuple[int, ...], ...]:
    """What an interleaved stage holds after each forward and before each backward, as counts tagged by what
    comes with them: (-1 after a forward, else the chunk whose backward runs then, with its replay; chunk-micro-batch
    pairs of chunk 0, ..., of chunk v-1, micro-batches some `masked` chunk holds). Bytes held are these counts times
    non-negative sizes, so of each tag only the counts no other one covers in every entry can be the peak: those are
    returned (a handful, priced per configuration, while the walk is shared by every model and layout with the same
    schedule)."""
    enough = p * math.ceil((2 * p + v * p + 16 * p * v) / (v * p))  # as in `_interleaved_prefix`
    return _walk_holdings(p, min(microbatches, enough), v, stage, masked)


@lru_cache(maxsize=4096)
def _walk_holdings(p: int, microbatches: int, v: int, stage: int,
                   masked: tuple[bool, ...]) -> tuple[tuple[int, ...], ...]:
    chunks, holders = [0] * v, [0] * microbatches  # holders[i]: masked chunks holding micro-batch i
    masks, seen = 0, set()
    # After the warmup the list repeats every p*v forwards with micro-batches p further on, so what is held
    # repeats too: the peak lies within the warmup and a few periods (m can be thousands in a search).
    for act in _interleaved_prefix(p, microbatches, v, stage):
        forward = act.kind == "F"
        if not forward:  # what the backward's replay finds held; after it, less is
            seen.add((act.chunk, *chunks, masks))
        sign = 1 if forward else -1
        chunks[act.chunk] += sign
        if masked[act.chunk]:
            before = holders[act.microbatch]
            holders[act.microbatch] += sign
            masks += (holders[act.microbatch] > 0) - (before > 0)
        if forward:
            seen.add((-1, *chunks, masks))
    by_tag: dict[int, set[tuple[int, ...]]] = {}
    for tag, *counts in seen:
        by_tag.setdefault(tag, set()).add(tuple(counts))
    return tuple((tag, *counts) for tag, group in sorted(by_tag.items()) for counts in _not_covered(group))


def _not_covered(counts: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The count vectors no other one covers entry by entry. One that covers another has a larger sum, so in
    order of decreasing sums each needs checking only against those kept before it."""
    kept: list[tuple[int, ...]] = []
    for h in sorted(counts, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(k, h, strict=True)) for k in kept):
            kept.append(h)
    return tuple(kept)


def _small_stage_buffers(m: ModelSpec, x: LayerShape, stage: int, layers: int, moe_layers: int,
                         packed: bool = False) -> tuple[int, int, int]:
    """(token ids, RoPE tables, padding mask) bytes: the int64 token ids of a micro-batch (embedding), the
    RoPE cos/sin [s, rope_dim/2] each in the activation dtype of one chunk's forward (shared by its layers
    and, with the default positions, by the micro-batch's sequences; `packed` rows have positions of their
    own, [b, s]), and the 1-byte padding mask that the load-balancing loss reads (one per micro-batch; under
    SP each chunk keeps a copy of its rank's share)."""
    ids = 8 * x.s * x.b if stage == 0 else 0
    rows = x.b if packed else 1
    rope = x.a * x.s * rows * (m.qk_rope_head_dim or m.qk_head_dim) if layers and not m.max_position_embeddings else 0
    mask = x.s * x.b // x.rep if moe_layers else 0
    return ids, rope, mask


def _microbatches_in_flight(deg: Degrees, job: Job, stage: int) -> int:
    """Distinct micro-batches a stage holds at its peak. Interleaved: the forwards run before the first
    backward (warmup + 1) visit micro-batches in groups of pp per chunk, each micro-batch first in chunk 0."""
    v = job.virtual_stages
    if deg.pp == 1 or v == 1 or not SCHEDULES[job.pp_schedule].chunks:
        return int(in_flight(deg, job, stage))
    p, m = deg.pp, job.replica_microbatches(deg)
    forwards = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    return min(m, forwards // (p * v) * p + min(forwards % (p * v), p))
