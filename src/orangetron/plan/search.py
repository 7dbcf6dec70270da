"""Layout search: enumerate tp, cp, pp, virtual stages, dp, ep, ZeRO stage, recompute, cp mode, dispatcher
and micro-batch for a fixed cluster and global batch; keep what fits; rank by step time."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache

from orangetron.plan.estimate import Estimate
from orangetron.plan.memory import memory_per_gpu, model_state_floor
from orangetron.plan.overhead import DEFAULT_OVERHEAD, MemoryOverhead, fits, with_overhead
from orangetron.plan.params import sums_first
from orangetron.plan.timing import DEFAULT_EFFICIENCY, Efficiency, check_ep_placement, group_places, step_time
from orangetron.plan.traffic import step_records, summarize
from orangetron.spec.hardware import Cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job, validate, without_recompute
from orangetron.spec.parallel_config import RECOMPUTE
from orangetron.spec.sharding import cp_padded_len
from orangetron.spec.stages import longest_chunk
from orangetron.spec.variants import CONTEXT_MODES, DISPATCHERS, SCHEDULES

# Megatron-Core's default gradient bucket, in elements: what `plan` searches and the fit advice offers.
BUCKET_NUMEL = 40_000_000

@dataclass(frozen=True)
class SearchSpace:
    """The values each knob may take; `None` means every sensible value for the cluster."""

    tp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    virtual_stages: tuple[int, ...] = (1, 2, 4)
    micro_batch: tuple[int, ...] = (1, 2, 4)
    zero: tuple[str, ...] = ("ddp", "zero1", "distopt", "zero2", "zero3", "zero3-mb")
    recompute: tuple[str, ...] = ("none", "selective", "full")
    # Full recompute of only as many layers per chunk as the memory needs (Megatron's block method)
    partial_recompute: bool = True
    cp_mode: tuple[str, ...] = field(default_factory=lambda: tuple(m.name for m in CONTEXT_MODES if m.searched))
    dispatcher: tuple[str, ...] = ("ragged",)  # capacity only adds padding at the same traffic pattern
    # With pp > 1 each virtual-stage count takes the schedules here that suit it (chunked ones for v > 1)
    pp_schedule: tuple[str, ...] = ("1f1b", "interleaved")
    # Gradients reduced in buckets of this many elements as backward produces them (0: after the last backward):
    # buckets hide the reduction and hold its wire buffers. Not ZeRO-3, which reduces unit by unit.
    grad_bucket_numel: tuple[int, ...] = (0, BUCKET_NUMEL)


@dataclass(frozen=True)
class SearchResult:
    ranked: list[Estimate]
    evaluated: int  # configurations priced for time
    considered: int  # configurations enumerated (valid or not)
    refused: str = ""  # the first rule a configuration broke, where every one broke a rule (none was priced)


def _powers_of_two(limit: int) -> tuple[int, ...]:
    return tuple(1 << i for i in range(limit.bit_length()) if 1 << i <= limit)


def divisors(n: int) -> tuple[int, ...]:
    """Every divisor of n, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)


# name: (zero_stage, distributed_optimizer, zero3_reduce_every_microbatch); "zero3-mb" reduce-scatters every
# micro-batch (one unit's .grad at a time) where "zero3" accumulates whole gradients and reduces once.
_ZERO = {"ddp": (0, False, False), "zero1": (1, False, False), "distopt": (0, True, False), "zero2": (2, False, False),
         "zero3": (3, False, False), "zero3-mb": (3, False, True)}


def candidate_degrees(model: ModelSpec, cluster: Cluster, space: SearchSpace, seq_len: int = 0) -> Iterator[Degrees]:
    """Every (tp, cp, pp, dp, ep) whose product is the cluster size; tp stays inside a node."""
    world = cluster.num_gpus
    tps = space.tp or tuple(t for t in _powers_of_two(cluster.gpus_per_node) if model.num_heads % t == 0)
    # A CP rank below 512 tokens (256 per head-tail chunk) only adds latency-bound steps.
    # cp = 1 always stays: a sequence shorter than 512 tokens still runs without context parallelism.
    cps = space.cp or tuple(c for c in _powers_of_two(world) if c == 1 or not seq_len or seq_len // c >= 512)
    pps = space.pp or tuple(p for p in divisors(world) if p <= model.num_layers)
    for tp, cp, pp in itertools.product(tps, cps, pps):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        eps = space.ep or (tuple(e for e in divisors(dp * cp) if model.num_experts % e == 0)
                           if model.is_moe else (1,))
        for ep in eps:
            if (dp * cp) % ep == 0:
                yield Degrees(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep)
        if model.is_moe:
            for ep in _folded_eps(model, tp * cp * dp, dp * cp, space):
                yield Degrees(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, expert_fold=True)


def _folded_eps(model: ModelSpec, stage_ranks: int, dp_cp: int, space: SearchSpace) -> tuple[int, ...]:
    """Expert-parallel degrees that only a folded expert mesh allows (ep dividing the stage's tp*cp*dp ranks
    but not dp*cp): where folding changes what can run, not just where the groups land."""
    eps = space.ep or divisors(stage_ranks)
    return tuple(e for e in eps if stage_ranks % e == 0 and dp_cp % e and model.num_experts % e == 0)


def candidate_jobs(model: ModelSpec, deg: Degrees, seq_len: int, global_batch: int, space: SearchSpace,
                   base: Job) -> Iterator[list[Job]]:
    """Groups of training options for one layout, each group in order of preference: the same micro-batch,
    schedule, cp mode and dispatcher with less sharding and less recompute first. Under cp a sequence its ranks
    cannot split is priced at the length the trainer pads it to (`cp_padded_len`), as `estimate` prices it."""
    padded = cp_padded_len(seq_len, deg.cp, deg.tp, deg.tp > 1)
    base, seq_len = (replace(base, data_seq_len=seq_len), padded) if padded != seq_len else (base, seq_len)
    vs = space.virtual_stages if deg.pp > 1 else (1,)
    if base.pipeline_layout:  # a given layout fixes the chunks per pipeline rank
        chunks, rest = divmod(len(base.pipeline_layout), deg.pp)
        vs = () if rest or (deg.pp == 1 and chunks > 1) else (chunks,)
    modes = space.cp_mode if deg.cp > 1 else (base.cp_mode,)
    dispatchers = space.dispatcher if deg.ep > 1 else (base.dispatcher,)
    buckets = space.grad_bucket_numel if deg.dp * deg.cp > 1 else (0,)  # no reduction, nothing to bucket
    for mb, v, mode, disp, bucket in itertools.product(space.micro_batch, vs, modes, dispatchers, buckets):
        if global_batch % (mb * deg.dp):
            continue
        for schedule in _schedules(space, deg.pp, v):
            group = _job_group(seq_len, global_batch, mb, v, mode, disp, schedule, deg.tp > 1, space, base, bucket)
            if group:
                yield list(group)


def _schedules(space: SearchSpace, pp: int, v: int) -> tuple[str, ...]:
    """The searched schedules for `v` virtual stages; without a pipeline the schedule plays no part."""
    if pp == 1:
        return ("1f1b",)
    return tuple(s for s in space.pp_schedule if SCHEDULES[s].chunks == (v > 1))


@lru_cache(maxsize=4096)
def _job_group(seq_len: int, global_batch: int, mb: int, v: int, mode: str, disp: str, schedule: str,
               sequence_parallel: bool, space: SearchSpace, base: Job, bucket: int = 0) -> tuple[Job, ...]:
    # Built once for every layout that shares these options: the same Job objects then key the cost caches,
    # which match them by identity instead of comparing every field. A bucketed group is its own: buckets move
    # both time and memory (wire buffers held; under ZeRO-2 each .grad freed once reduced), so neither group's
    # first fitting option dominates the other's. Every option the search does not vary is the base job's.
    zeros = [z for z in _ZERO if z in space.zero and not (bucket and _ZERO[z][0] == 3)]
    recomputes = [r for r in RECOMPUTE if r in space.recompute]
    group = []
    for rc, zero in itertools.product(recomputes, zeros):
        stage, distopt, every = _ZERO[zero]
        group.append(replace(base, seq_len=seq_len, micro_batch=mb, global_batch=global_batch,
                             sequence_parallel=sequence_parallel, cp_mode=mode, dispatcher=disp,
                             ep_comm_sms_reserved=base.ep_comm_sms_reserved and DISPATCHERS[disp].node_aware,
                             zero_stage=stage, distributed_optimizer=distopt, zero3_reduce_every_microbatch=every,
                             pp_schedule=schedule, virtual_stages=v, recompute=rc, recompute_layers=0,
                             recompute_modules=() if rc == "full" else base.recompute_modules,  # full replays all
                             grad_bucket_numel=bucket))
    return tuple(group)


def _pricing_class(job: Job, sharded: bool) -> int:
    # DDP, ZeRO-1/2 and the distributed optimizer move the same bytes per step and overlap them the same
    # way, and less recompute is never slower, so within a class the first option that fits (groups are
    # ordered by recompute, then sharding) is never slower than the later ones. The sharded optimizers step
    # 1/d of the parameters where DDP steps them all: over d > 1 ranks (`sharded`) they are a class of their
    # own, which can be faster than DDP (it was never timed once DDP fit). ZeRO-3 adds per-micro-batch gathers
    # and is its own class; reduce-scattering every micro-batch another.
    if job.zero_stage == 3:
        return 4 if job.zero3_reduce_every_microbatch else 3
    return 1 if sharded and (job.zero_stage or job.distributed_optimizer) else 0


def fewest_replays_that_fit(model: ModelSpec, deg: Degrees, job: Job, limit: float,
                            overhead: MemoryOverhead = DEFAULT_OVERHEAD, full: int | None = None) -> Job:
    """`job` (full recompute) replaying only the first r layers of each pipeline chunk, for the smallest r whose
    memory fits in `limit` bytes: fewer replays are never slower, and memory falls as r grows, about linearly
    (each replayed layer keeps its input instead of its activations), so the walk starts where the line
    between no recompute and full recompute crosses the limit. `job` itself when no r short of the longest
    chunk fits. `full`: the job's own need (`with_overhead`'s `needed`), when known."""
    longest = longest_chunk(model.num_layers, deg.pp, job.virtual_stages, job.pipeline_layout)

    def needed(r: int) -> int:
        at_r = without_recompute(job) if r == 0 else replace(job, recompute_layers=r % longest)
        return with_overhead(memory_per_gpu(model, deg, at_r), deg, overhead)["needed"]

    if longest < 2:
        return job
    none, full = needed(0), full if full is not None else needed(longest)
    r = max(1, min(longest - 1, math.ceil(longest * (none - limit) / max(1, none - full))))
    if needed(r) <= limit:
        while r > 1 and needed(r - 1) <= limit:
            r -= 1
        return replace(job, recompute_layers=r)
    while r < longest - 1:
        r += 1
        if needed(r) <= limit:
            return replace(job, recompute_layers=r)
    return job


Scored = list[tuple[float, int, Degrees, Job, dict[str, int]]]


def _reduces_once(model: ModelSpec, deg: Degrees, job: Job) -> bool:
    """One gradient reduction a step whatever `zero3_reduce_every_microbatch` says: one micro-batch, or gradients
    summed first (`params.sums_first`)."""
    return job.replica_microbatches(deg) == 1 or sums_first(model, deg, job)


def _price_group(model: ModelSpec, deg: Degrees, group: list[Job], cluster: Cluster, limit: float,
                 overhead: MemoryOverhead, partial: bool, eff: Efficiency, refusals: list[str]) -> Scored:
    """The options of one group worth timing. Within a pricing class the first that fits (less recompute, then
    less sharding) is never slower than the later ones. Under partial recompute a more sharded option replays
    fewer layers, and a few replayed layers may beat selective recompute: then only no recompute closes a class,
    selective recompute closes its own options, and of the full-recompute options that fit only the smallest is
    kept, to replay as few layers as it needs (`_replay_fewer_layers`). A group whose degrees break a rule adds
    the rule's message to `refusals`."""
    rows: Scored = []
    closed: set = set()
    smallest: dict[int, tuple[Job, dict[str, int]]] = {}
    for job in group:
        cls = _pricing_class(job, deg.dp * deg.cp > 1)
        key = (cls, job.recompute) if partial and job.recompute != "none" else cls
        if cls in closed or key in closed or job.zero3_reduce_every_microbatch and _reduces_once(model, deg, job):
            continue  # dominated, or (one reduction a step) the same step as "zero3"
        try:
            validate(model, deg, job)
            check_ep_placement(deg, job, cluster)
        except ValueError as err:
            refusals.append(str(err))
            break  # the group shares every degree-dependent rule
        if model_state_floor(model, deg, job) + overhead.fixed_bytes(deg) > limit:
            continue  # its states alone overflow: `needed` is never less than this
        mem = with_overhead(memory_per_gpu(model, deg, job), deg, overhead)
        if not fits(mem, limit):
            continue
        if partial and job.recompute == "full":
            if cls not in smallest or mem["needed"] < smallest[cls][1]["needed"]:
                smallest[cls] = (job, mem)
            continue
        closed.add(key)
        rows.append((step_time(model, deg, job, cluster, eff=eff).step_s, mem["needed"], deg, job, mem))
    for job, mem in smallest.values():
        rows.append((step_time(model, deg, job, cluster, eff=eff).step_s, mem["needed"], deg, job, mem))
    return rows


def _replay_fewer_layers(model: ModelSpec, cluster: Cluster, scored: Scored, top: int, limit: float,
                         overhead: MemoryOverhead, eff: Efficiency) -> Scored:
    """`scored` (fastest first) with each full-recompute layout that could reach the `top` replaying only the
    layers its memory needs (`fewest_replays_that_fit`). Time only grows with the layers replayed, so a layout
    that would miss the top even replaying none cannot get there, and stays as it is."""
    done: set[tuple[Degrees, Job]] = set()
    while True:
        cutoff = scored[top - 1][0] if len(scored) >= top else math.inf
        todo = [i for i, (_, _, deg, job, _) in enumerate(scored)
                if job.recompute == "full" and not job.recompute_layers and (deg, job) not in done]
        if not todo:
            return scored
        for i in todo:
            t, _, deg, job, mem = scored[i]
            done.add((deg, job))
            if t >= cutoff and step_time(model, deg, without_recompute(job), cluster, eff=eff).step_s >= cutoff:
                continue  # no replay at all would still miss the top
            partial = fewest_replays_that_fit(model, deg, job, limit, overhead, mem["needed"])
            if partial is not job:
                mem = with_overhead(memory_per_gpu(model, deg, partial), deg, overhead)
                scored[i] = (step_time(model, deg, partial, cluster, eff=eff).step_s, mem["needed"], deg, partial, mem)
        scored.sort(key=lambda row: (row[0], row[1]))


def search(model: ModelSpec, cluster: Cluster, seq_len: int, global_batch: int, space: SearchSpace | None = None,
           base: Job | None = None, top: int = 10, memory_fraction: float = 1.0,
           overhead: MemoryOverhead = DEFAULT_OVERHEAD, eff: Efficiency = DEFAULT_EFFICIENCY) -> SearchResult:
    """Price every valid configuration whose memory, `overhead` included, fits in `memory_fraction` of GPU
    memory, with the compute model's constants `eff`; fastest first.

    Options dominated by a cheaper one that fits (more sharding or more recompute at the same traffic) are
    counted as considered but not priced.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction}: must be > 0 and <= 1 (a share of GPU memory)")
    space = space or SearchSpace()
    base = base or Job(seq_len=seq_len)
    limit = cluster.gpu.memory_bytes * memory_fraction
    scored: list[tuple[float, int, Degrees, Job, dict[str, int]]] = []
    considered, groups, refusals = 0, 0, []
    for deg in candidate_degrees(model, cluster, space, seq_len):
        for group in candidate_jobs(model, deg, seq_len, global_batch, space, base):
            considered += len(group)
            groups += 1
            scored += _price_group(model, deg, group, cluster, limit, overhead, space.partial_recompute, eff,
                                   refusals)
    scored.sort(key=lambda row: (row[0], row[1]))
    if space.partial_recompute:
        scored = _replay_fewer_layers(model, cluster, scored, top, limit, overhead, eff)
    ranked = [Estimate(model, deg, job, cluster, mem,
                       summarize(step_records(model, deg, job, ep_where=group_places(deg, cluster)["ep"])),
                       step_time(model, deg, job, cluster, eff=eff)) for _, _, deg, job, mem in scored[:top]]
    refused = refusals[0] if refusals and len(refusals) == groups else ""  # every group broke a rule
    return SearchResult(ranked, len(scored), considered, refused)
