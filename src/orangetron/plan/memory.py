"""Per-GPU memory by category: params, grads, main_params, optimizer (docs/data_parallel.md) and activations
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198,
generalized to GQA, SwiGLU, MoE, CP and flash attention).

Every function is pure; bytes are integers so the runtime's ledger can be compared exactly.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from orangetron.plan.activations import stage_activation_bytes
from orangetron.plan.fp8 import fp8_memory_bytes
from orangetron.plan.param_grads import param_grad_bytes
from orangetron.plan.params import StageParams, shard_groups, stage_params, tp_grad_sum_numel, zero3_units
from orangetron.spec.categories import CATEGORIES
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, model_state_job
from orangetron.spec.parallel_config import DTYPE_BYTES
from orangetron.spec.sharding import bucket_layout, padded_numel, shard_numel
from orangetron.spec.stages import distinct_stages


def _shards(units: list[StageParams], deg: Degrees, n_of: dict[str, int]) -> list[tuple[str, int, int]]:
    """(mesh dim, ranks, elements) of every unit's segment in every flat buffer (empty ones left out)."""
    out = []
    for unit in units:
        for dim, ranks, numel in shard_groups(unit, deg):
            if numel:
                out.append((dim, n_of.get(dim, ranks), numel))
    return out


def data_parallel_segments(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> list[tuple[str, int, int]]:
    """(mesh dim, ranks, elements) of each separately padded and sharded piece of the flat buffers: every
    ZeRO-3 unit's share of each buffer; every gradient bucket of ZeRO-1/2 and the distributed optimizer with
    `bucket_numel` (equal buckets, `plan.sharding.bucket_layout`); else each whole buffer."""
    params = stage_params(model, deg, stage, job.virtual_stages, job.pipeline_layout)
    if job.zero_stage == 3:
        return _shards(zero3_units(model, deg, stage, job.virtual_stages, job.pipeline_layout), deg, {})
    groups = shard_groups(params, deg)
    if job.grad_bucket_numel <= 0 or not job.distributed_optimizer and job.zero_stage == 0:
        return groups
    out = []
    for dim, ranks, numel in groups:
        count, size = bucket_layout(numel, job.grad_bucket_numel, ranks) if ranks > 1 else (1, numel)
        out += [(dim, ranks, size)] * count
    return out


def main_param_bytes(job: Job) -> int:
    """Bytes of one main parameter: fp32 under mixed precision, else the parameters' own."""
    return 4 if job.mixed_precision else job.param_bytes


def moment_bytes(job: Job) -> int:
    """Bytes of one element of one of Adam's moments: `optimizer_state_dtype`, else the main parameters'."""
    if job.optimizer_state_dtype:
        return DTYPE_BYTES[job.optimizer_state_dtype]
    return main_param_bytes(job)


def model_state_bytes(params: StageParams, deg: Degrees, job: Job,
                      segments: list[tuple[str, int, int]] | None = None) -> dict[str, int]:
    """params / grads / main_params / optimizer bytes per GPU, exactly docs/planner.md section 3's table.

    Dense parameters shard over d = dp x cp, expert parameters over edp. ZeRO-1 and the distributed
    optimizer shard optimizer state and fp32 main params; ZeRO-2 also the gradients; ZeRO-3 also the params.
    A sharded flat buffer is padded to a multiple of its shard count (`plan.sharding`, shared with the runtime);
    under ZeRO-3 every unit is (`segments`, default the whole buffers).
    """
    sharding = job.zero_stage >= 1 or job.distributed_optimizer
    full = shard = 0
    # equal gradient buckets repeat one segment hundreds of times: price each distinct one once
    for (_, ranks, numel), count in Counter(segments or shard_groups(params, deg)).items():
        n = ranks if sharding else 1
        full += count * padded_numel(numel, n)
        shard += count * shard_numel(numel, n)
    p_bytes = job.param_bytes
    main_bytes = main_param_bytes(job)  # fp32 main params and grads under mixed precision
    g_bytes = DTYPE_BYTES[job.grad_dtype] if job.mixed_precision else p_bytes
    return {
        "params": p_bytes * (shard if job.zero_stage == 3 else full),
        "grads": g_bytes * (shard if job.zero_stage >= 2 else full),
        "main_params": main_bytes * shard if job.mixed_precision else 0,
        "optimizer": 2 * moment_bytes(job) * shard,  # Adam's two moments
    }


def stage_memory(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> dict[str, int]:
    """Bytes by category (and `total`) on one GPU of pipeline `stage`; `buffers` sums the transient ones."""
    states, gathered, buckets, _ = _stage_state_memory(model, deg, model_state_job(job), stage)
    out = dict(states)
    out["activations"] = stage_activation_bytes(model, deg, job, stage)
    out["gathered_params"] = gathered
    out["grad_buckets"] = max(buckets, tp_grad_sum_bytes(model, deg, job, stage))
    out["param_grads"] = param_grad_bytes(model, deg, job, stage)
    out["buffers"] = out["gathered_params"] + out["grad_buckets"] + out["param_grads"]
    out["total"] = sum(out[c] for c in CATEGORIES) + out["buffers"]
    fp8 = fp8_memory_bytes(model, deg, job, stage)
    if fp8:  # FP8 weight copies and scales (`fp8.py`), absent without FP8
        out["fp8"] = fp8
        out["total"] += fp8
    return out


@lru_cache(maxsize=16384)
def _stage_total(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> int:
    """`stage_memory(...)["total"]` without building the breakdown."""
    _, _, buckets, states = _stage_state_memory(model, deg, model_state_job(job), stage)
    tp_sum = max(0, tp_grad_sum_bytes(model, deg, job, stage) - buckets)  # one or the other at the peak
    return (states + tp_sum + stage_activation_bytes(model, deg, job, stage) + param_grad_bytes(model, deg, job, stage)
            + fp8_memory_bytes(model, deg, job, stage))


@lru_cache(maxsize=16384)
def _stage_state_memory(model: ModelSpec, deg: Degrees, job: Job,
                        stage: int) -> tuple[tuple[tuple[str, int], ...], int, int, int]:
    """(model-state bytes by category, ZeRO-3 gathered units, gradient buckets, their sum) of one stage: what
    the parameters and their sharding fix, shared by every micro-batch size, recompute and cp mode a search
    tries."""
    segments = data_parallel_segments(model, deg, job, stage)
    states = model_state_bytes(stage_params(model, deg, stage, job.virtual_stages, job.pipeline_layout), deg, job,
                               segments)
    gathered, buckets = zero3_gather_bytes(model, deg, job, stage), _dp_reduction_bytes(model, deg, job, stage)
    return tuple(states.items()), gathered, buckets, sum(states.values()) + gathered + buckets


def zero3_gather_bytes(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> int:
    """ZeRO-3's gathered full units at their peak, as `parallel.data.units` schedules them: with prefetch the unit
    in use and the next one (adjacent in forward order, and so in backward), without it the one in use, with
    kept parameters all of them; a unit listed first that spans the whole forward (tied embeddings) adds."""
    if job.zero_stage != 3:
        return 0
    units = zero3_units(model, deg, stage, job.virtual_stages, job.pipeline_layout)
    sizes = [sum(padded_numel(numel, ranks) for _, ranks, numel in shard_groups(u, deg) if numel) * job.param_bytes
             for u in units]
    if job.zero3_keep_params:
        return sum(sizes)
    held = 0
    if deg.pp > 1 or model.tied_embeddings or model.patch_size:
        held, sizes = sizes[0], sizes[1:]  # the embedding-and-head unit, gathered all forward and backward
    if not sizes:
        return held
    if job.zero3_prefetch and len(sizes) > 1:
        return held + max(a + b for a, b in zip(sizes, sizes[1:], strict=False))
    return held + max(sizes)


def grad_bucket_bytes(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> int:
    """The gradient reduction's transient buffers at their peak: the data-parallel reduction's, or the tp sum's
    that runs before it (`tp_grad_sum_bytes`)."""
    return max(_dp_reduction_bytes(model, deg, job, stage), tp_grad_sum_bytes(model, deg, job, stage))


def tp_grad_sum_bytes(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> int:
    """The tp sum of partial gradients (`plan.params.tp_grad_sum_numel`): their concatenation and the
    all-reduce's sum, out of place, both in the parameter dtype (none where they are summed in the main-gradient
    buffer, `Job.grad_accumulation_fusion`)."""
    if job.grad_accumulation_fusion:
        return 0
    return 2 * tp_grad_sum_numel(model, deg, job, stage) * job.param_bytes


def _dp_reduction_bytes(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> int:
    """The data-parallel reduction's transient buffers at their peak (reduce dtype throughout).

    ZeRO-3: one unit's padded wire buffer and the slice it reduces to (each retired before the next starts).
    ZeRO-2 with buckets: one bucket's wire buffer and slice. ZeRO-1 and the distributed optimizer with buckets
    reduce a bucket of the full main-gradient buffer where it lies, so only the slice, plus a wire copy when the
    reduce dtype is not the main gradients' dtype. Bucketed DDP all-reduces in place: only the wire copies
    (when the dtypes differ) of every bucket, all in flight until the step, so the whole of every buffer.
    Without buckets each flat buffer is reduced once after backward, one after another: ZeRO-2's temporary
    full buffer, or the others' wire copy when the dtypes differ, plus the collective's result (all-reduce: a
    full buffer, reduce-scatter: the slice; nothing over one rank). `Job.grad_accumulation_fusion` reduces the
    main-gradient buffer where it lies: nothing.
    """
    if job.grad_accumulation_fusion:
        return 0
    segments = data_parallel_segments(model, deg, job, stage)
    distinct = set(segments)  # equal buckets repeat one segment: a maximum needs each once
    if job.zero_stage == 3:
        return max(((padded_numel(numel, ranks) + shard_numel(numel, ranks)) * job.reduce_bytes
                    for _, ranks, numel in distinct), default=0)
    copies = job.wire_dtype != job.main_grad_dtype  # a wire copy of the main gradients
    sharded = job.zero_stage >= 1 or job.distributed_optimizer
    if job.grad_bucket_numel <= 0:
        return max((_unbucketed(numel, ranks, job.zero_stage == 2 or copies, sharded) * job.reduce_bytes
                    for _, ranks, numel in distinct), default=0)
    if not sharded:
        return sum(numel for _, _, numel in segments) * job.reduce_bytes if copies else 0
    wire = job.zero_stage == 2 or copies
    # Buckets are multiples of their ranks: the wire holds a whole one, the slice 1/ranks of it (none over one
    # rank, where the buffer is one bucket and the wire comes back as the result).
    return max((((numel if wire else 0) + (numel // ranks if ranks > 1 else 0)) * job.reduce_bytes
                for _, ranks, numel in distinct), default=0)


def _unbucketed(numel: int, ranks: int, wire: bool, sharded: bool) -> int:
    """Elements a whole flat buffer's reduction holds at once: its wire buffer (when not reduced where it
    lies) and the collective's result."""
    n = ranks if sharded else 1
    result = 0 if ranks == 1 else shard_numel(numel, n) if sharded else numel
    return (padded_numel(numel, n) if wire else 0) + result


def memory_per_gpu(model: ModelSpec, deg: Degrees, job: Job) -> dict[str, int]:
    """The busiest GPU's bytes by category (`busiest_stage`)."""
    return stage_memory(model, deg, job, busiest_stage(model, deg, job))


def model_state_floor(model: ModelSpec, deg: Degrees, job: Job) -> int:
    """A lower bound of `memory_per_gpu(...)["total"]`: the busiest stage's model states, ZeRO-3 gathers and
    gradient buckets alone, which every micro-batch size and recompute of the same sharding share (cached),
    so a search can drop a layout whose states cannot fit before it prices its activations."""
    state_job = model_state_job(job)
    return max(_stage_state_memory(model, deg, state_job, s)[3]
               for s in distinct_stages(model, deg.pp, job.virtual_stages, job.pipeline_layout))


def busiest_stage(model: ModelSpec, deg: Degrees, job: Job) -> int:
    """The pipeline stage with the largest total among the first of each kind of stage
    (`stages.distinct_stages`: later stages of a kind hold the same states and fewer micro-batches)."""
    stages = distinct_stages(model, deg.pp, job.virtual_stages, job.pipeline_layout)
    return max(stages, key=lambda s: _stage_total(model, deg, job, s))
