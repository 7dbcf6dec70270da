"""Per-parameter gradients (`.grad`) at their peak: what autograd allocates before the data-parallel wrapper
moves a gradient into its flat buffers, as `orangetron.parallel` does it.

Autograd gives each parameter its `.grad` (parameter dtype) once per backward, in the reverse of the module
order (the order of the flat buffers), and accumulates later micro-batches into it. When the wrapper frees it:

| mode | `.grad` freed |
|---|---|
| bucketed DDP, ZeRO-1, distributed optimizer | at once: added into the full main-gradient buffer |
| bucketed ZeRO-2 | when every bucket it overlaps is complete and copied to its wire buffer |
| ZeRO-3 | when every parameter of its unit has its gradient (the unit is reduce-scattered) |
| unbucketed, or gradients first summed over tp or a tied embedding's stages | at the step |

Inside `no_sync` (every backward of a step but a chunk's last) ZeRO-2 and ZeRO-3 only accumulate. The peak
is found by replaying one step's backward passes (the pipeline schedule's, or the trainer's micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from orangetron.plan.params import _ceil_div, _layer_params, routing_params, stage_params, sums_first
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, model_state_job
from orangetron.spec.schedule import actions
from orangetron.spec.sharding import bucket_layout
from orangetron.spec.stages import chunk_layers
from orangetron.spec.variants import SCHEDULES


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor on one GPU: its local elements, buffer, model chunk and ZeRO-3 unit."""

    numel: int
    expert: bool  # in the experts' flat buffer (ep > 1), else the dense one
    chunk: int  # which of the rank's model chunks computes its gradient
    unit: str  # ZeRO-3 unit: "embedding", "layer.<i>" or "rest"


def _layer_tensors(model: ModelSpec, deg: Degrees, i: int) -> list[tuple[int, bool]]:
    """(elements, expert) of layer `i`'s tensors on one rank, in the runtime's module order: norm, attention
    (q, k, v with their biases, o, QK-norms), norm, then the MLP (w1, w3, w2) or router, experts (w1, w3, w2),
    shared expert and its gate. Shapes the runtime lacks (GPT-style biases, MLA, GeLU) keep their totals in
    coarser pieces."""
    t, h = deg.tp, model.hidden_size
    norm = [h, h] if model.bias else [h]
    layer = _layer_params(model, t, deg.ep, deg.etp, i)
    ffn = model.num_shared_experts * model.moe_ffn_hidden_size if model.is_moe_layer(i) else model.ffn_hidden_size
    mats = 3 if model.mlp == "swiglu" else 2
    split = [_ceil_div(h * ffn, t)] * mats if not model.bias else [_ceil_div(model.mlp_params(ffn), t)]
    mlp = split if ffn else []  # w1 (w3) and w2 over tp; with biases one piece
    moe: list[tuple[int, bool]] = []
    if model.is_moe_layer(i):
        experts = _ceil_div(model.num_experts, deg.ep) * _ceil_div(h * model.moe_ffn_hidden_size, deg.etp)
        expert_tensors = [experts] * mats if not model.bias else [layer.expert]
        moe = [(model.num_experts * h, False)] + [(n, deg.ep > 1) for n in expert_tensors]  # router first
    gate = [model.shared_gate_params] if model.is_moe_layer(i) and model.shared_gate_params else []
    attention = _attention_tensors(model, t, layer.dense - 2 * sum(norm) - sum(mlp) - routing_params(model, i))
    return [(n, False) for n in [*norm, *attention, *norm]] + moe + [(n, False) for n in [*mlp, *gate]]


def _attention_tensors(model: ModelSpec, t: int, total: int) -> list[int]:
    """wq, wk, wv (each followed by its bias with `qkv_bias`), wo, then the QK-norm weights on one rank (the
    output projection takes any rounding); MLA and GPT-style biases keep one piece before the QK-norm weights."""
    qk_norms = [model.qk_head_dim] * 2 if model.qk_norm else []
    if model.kv_lora_rank or model.bias:
        return [total - sum(qk_norms), *qk_norms]
    h, d = model.hidden_size, model.qk_head_dim
    q = [_ceil_div(h * model.num_heads * d, t)] + ([_ceil_div(model.num_heads * d, t)] if model.qkv_bias else [])
    kv_heads = model.kv_heads // t if model.kv_heads >= t else 1  # fewer than tp: one replicated head per rank
    kv = [h * kv_heads * d] + ([kv_heads * d] if model.qkv_bias else [])
    return [*q, *kv, *kv, total - sum(q) - 2 * sum(kv) - sum(qk_norms), *qk_norms]


@lru_cache(maxsize=4096)
def stage_tensors(model: ModelSpec, deg: Degrees, stage: int, virtual_stages: int = 1,
                  layout: tuple[int, ...] = ()) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of pipeline `stage` on one GPU, in the runtime's module order: the embedding,
    the layers by index, the final norm and the output layer."""
    chunks = chunk_layers(model.num_layers, deg.pp * virtual_stages, layout)
    mine = [(c, chunks[c * deg.pp + stage]) for c in range(virtual_stages)]
    first, last = stage == 0, stage == deg.pp - 1
    separate = deg.pp == 1 and not model.tied_embeddings and not model.patch_size  # as `zero3_units`
    out: list[ParamTensor] = []
    layers = 0
    for c, layer_range in mine:
        for i in layer_range:
            out += [ParamTensor(n, e, c, f"layer.{i}") for n, e in _layer_tensors(model, deg, i)]
            layers += _layer_params(model, deg.tp, deg.ep, deg.etp, i).total
    whole = stage_params(model, deg, stage, virtual_stages, layout).total
    if first:
        table = _ceil_div(model.vocab_size * model.hidden_size, deg.tp) if not model.patch_size else 0
        positions = model.embedding_params() - (0 if model.patch_size else model.vocab_size * model.hidden_size)
        embedding = [n for n in (table, positions) if n]
        out = [ParamTensor(n, False, 0, "embedding" if separate else "rest") for n in embedding] + out
        layers += sum(embedding)
    if last:
        h = model.hidden_size
        if model.mtp_layers and deg.pp > 1 and not model.tied_embeddings:  # the MTP modules' embedding copy
            copy = _ceil_div(model.vocab_size * h, deg.tp)
            out.append(ParamTensor(copy, False, virtual_stages - 1, "rest"))
            layers += copy
        for k in range(model.mtp_layers):  # each MTP module: its layer's tensors, the projection, three norms
            mtp = _layer_tensors(model, deg, model.mtp_layer_index) + [(_ceil_div(2 * h * h, deg.tp), False)]
            mtp += [(h, False)] * (model.mtp_norm_params() // h)
            out += [ParamTensor(n, e, virtual_stages - 1, f"mtp.{k}") for n, e in mtp]
            layers += sum(n for n, _ in mtp)
        norm = [model.hidden_size] * (2 if model.bias else 1)
        head = whole - layers - sum(norm)
        out += [ParamTensor(n, False, virtual_stages - 1, "rest") for n in [*norm, head] if n]
    return tuple(out)


def _backward_passes(deg: Degrees, job: Job, stage: int, m: int) -> list[tuple[int, bool]]:
    """(chunk, reduces) of every backward pass of a step of `m` micro-batches on `stage`: each chunk reduces on
    its last one."""
    if deg.pp == 1:
        return [(0, k == m - 1) for k in range(m)]
    if m == 1:  # one backward per chunk, the last chunk's first (also ZeRO-3 reducing every micro-batch)
        return [(c, True) for c in reversed(range(job.virtual_stages))]
    grads = "W" if SCHEDULES[job.pp_schedule].split_backward else "B"  # weight gradients come in W passes
    plan = [a for a in actions(deg.pp, m, job.pp_schedule, job.virtual_stages)[stage] if a.kind == grads]
    last = {a.chunk: k for k, a in enumerate(plan)}
    return [(a.chunk, k == last[a.chunk]) for k, a in enumerate(plan)]


def held_to_step(model: ModelSpec, deg: Degrees, job: Job) -> bool:
    """Unbucketed reductions, and gradients first summed over tp (sequence parallel, kv heads fewer than tp) or
    over a tied embedding's two stages (`params.sums_first`), keep every `.grad` until the step, and reduce after
    the last backward."""
    if job.grad_accumulation_fusion:  # Megatron-Core sums and reduces inside the main-gradient buffer
        return False
    return sums_first(model, deg, job) or (job.zero_stage != 3 and job.grad_bucket_numel <= 0)


def param_grad_bytes(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> int:
    """Peak bytes of per-parameter `.grad` tensors on one GPU of pipeline `stage` during one step."""
    total, largest = _totals(model, deg, stage, job.virtual_stages, job.pipeline_layout)
    if held_to_step(model, deg, job):
        return total * _waiting_bytes(job, job.replica_microbatches(deg))
    if job.zero_stage < 2:  # added into the full main buffer as each arrives
        return largest * job.param_bytes
    m = 1 if job.zero3_reduce_every_microbatch else job.replica_microbatches(deg)  # each backward frees its units
    # Inside no_sync nothing is freed: with one chunk its first backward fills every .grad, and with more
    # micro-batches than stages every chunk's first backward comes before any chunk's last (the interleaved
    # schedule runs the chunks in groups of pp micro-batches). Only shorter steps need the replay.
    width = _waiting_bytes(job, m)
    if m > 1 and (job.virtual_stages == 1 or deg.pp == 1 or m > deg.pp):
        return total * width
    return _replayed_peak(model, deg, model_state_job(job), stage, m) * width


def _waiting_bytes(job: Job, microbatches: int) -> int:
    """Bytes per element of a `.grad` that waits over `microbatches` backwards (ZeRO-2/3 inside `no_sync`, or
    held to the step): the parameter dtype's, or, when it waits across several under
    `Job.accumulate_in_reduce_dtype` (FSDP2), the reduce dtype's."""
    return job.reduce_bytes if job.accumulate_in_reduce_dtype and microbatches > 1 else job.param_bytes


@lru_cache(maxsize=16384)
def _totals(model: ModelSpec, deg: Degrees, stage: int, virtual_stages: int,
            layout: tuple[int, ...] = ()) -> tuple[int, int]:
    """(all, the largest) of a stage's tensors' elements."""
    numels = [t.numel for t in stage_tensors(model, deg, stage, virtual_stages, layout)]
    return sum(numels), max(numels, default=0)


@lru_cache(maxsize=4096)
def _replayed_peak(model: ModelSpec, deg: Degrees, job: Job, stage: int, microbatches: int) -> int:
    """Peak `.grad` elements over one step's backward passes under ZeRO-2 buckets or ZeRO-3 units: a tensor is
    freed once every group it belongs to has all its members' gradients, counted in passes that reduce."""
    tensors = stage_tensors(model, deg, stage, job.virtual_stages, job.pipeline_layout)
    groups = _release_groups(tensors, deg, job)
    missing: dict[object, int] = {}
    for gs in groups:
        for g in gs:
            missing[g] = missing.get(g, 0) + 1
    live: dict[int, int] = {}
    held = peak = 0
    for chunk, reduces in _backward_passes(deg, job, stage, microbatches):
        for k in reversed(range(len(tensors))):
            if tensors[k].chunk != chunk:
                continue
            if k not in live:
                live[k] = tensors[k].numel
                held += live[k]
                peak = max(peak, held)
            if not reduces:
                continue
            completed = False
            for g in groups[k]:
                missing[g] -= 1
                completed |= missing[g] == 0
            if completed:
                for j in [j for j in live if all(missing[g] == 0 for g in groups[j])]:
                    held -= live.pop(j)
    return peak


def _release_groups(tensors: tuple[ParamTensor, ...], deg: Degrees, job: Job) -> list[tuple[object, ...]]:
    """The groups each tensor's `.grad` waits for: its ZeRO-3 unit, or the ZeRO-2 buckets it overlaps."""
    if job.zero_stage == 3:
        return [(t.unit,) for t in tensors]
    out, offset = [], {False: 0, True: 0}
    sizes = {}
    for expert, ranks in ((False, deg.dp_cp), (True, deg.edp)):
        numel = sum(t.numel for t in tensors if t.expert == expert)
        sizes[expert] = bucket_layout(numel, job.grad_bucket_numel, ranks)[1] if ranks > 1 else max(numel, 1)
    for t in tensors:
        at, size = offset[t.expert], sizes[t.expert]
        out.append(tuple((t.expert, k) for k in range(at // size, (at + t.numel - 1) // size + 1)))
        offset[t.expert] = at + t.numel
    return out
