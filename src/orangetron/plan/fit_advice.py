"""Why a configuration does not fit, and the cheapest changes that would make it fit, each priced.

The changes tried are the ones a user reaches for, on the same GPUs and global batch: more recompute
(selective where scores are stored, every module the model can replay, full, which a change that fits then
replays on the fewest layers of each chunk that fit, as `plan` ranks it), a higher ZeRO stage (ZeRO-3 reducing
every micro-batch among them, which holds one unit's gradient at a time), gradient
buckets reduced during backward, sequence parallelism, a larger tp (within a node, sequence-parallel) or pp (the
data-parallel degree shrinks by as much), and a smaller micro-batch (more micro-batches). Up to three of them are
combined; each combination is priced by `estimate` in full, and those that fit are ranked by step time, then fewer
changes, then less memory. A combination priced the same as one with fewer changes (a ZeRO-1 beside the
distributed optimizer, buckets under ZeRO-3) is left out, and so is a ZeRO stage where no data-parallel rank is
left to shard over.

Each change is written as the flags that, added to the command that priced the configuration, price the change:
a new data-parallel degree is named (`--dp`, which a user may have given), and so is the global batch where the
command left it to its default of one step's micro-batches per replica, which a new dp or micro-batch would
otherwise change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from orangetron.plan.estimate import Estimate, estimate
from orangetron.plan.overhead import DEFAULT_OVERHEAD, MemoryOverhead, needed_overhead
from orangetron.plan.search import BUCKET_NUMEL, fewest_replays_that_fit
from orangetron.spec.categories import ESTIMATED_TENSORS
from orangetron.spec.hardware import GIB, gpu_names, load_gpu
from orangetron.spec.model import ModelSpec, preset_names
from orangetron.spec.options import Degrees, Job, replayable_modules

_CATEGORIES = (*ESTIMATED_TENSORS, "overhead")


@dataclass(frozen=True)
class Fix:
    change: str  # the flags that make the difference, e.g. "--zero-stage 3"
    estimate: Estimate


def largest_categories(est: Estimate, n: int = 3) -> list[tuple[str, int]]:
    """The `n` memory categories that hold the most of what the layout needs, largest first: the overhead as
    the fit check counts it (`needed` less the tensors)."""
    memory = {**est.memory, "overhead": needed_overhead(est.memory)}
    held = [(k, memory[k]) for k in _CATEGORIES if memory.get(k)]
    return sorted(held, key=lambda kv: -kv[1])[:n]


def fixes(est: Estimate, overhead: MemoryOverhead = DEFAULT_OVERHEAD, most_changes: int = 3) -> list[Fix]:
    """Changes to `est`'s configuration that fit at its global batch, fastest first (none when it fits already)."""
    if est.fits:
        return []
    batch = est.job.replica_microbatches(est.degrees) * est.job.micro_batch * est.degrees.dp
    start = replace(est.job, global_batch=batch)
    found = []
    for moves in itertools.product(*_moves(est.model, est.degrees, start, est.cluster.gpus_per_node)):
        made = [m for m in moves if m[0]]
        if not made or len(made) > most_changes:
            continue
        deg, job = est.degrees, start
        try:
            for _, change in made:
                deg, job = change(deg, job)
            if deg.dp * deg.cp == 1 and any(flag.startswith("--zero-stage") for flag, _ in made):
                continue  # a tp or pp change left no data-parallel rank for the ZeRO stage to shard over
            priced = estimate(est.model, deg, job, est.cluster, overhead=overhead)
        except ValueError:  # a change this model or layout does not allow (heads, layers, dp left, batch)
            continue
        if priced.fits:
            flags = [flag for flag, _ in made]
            priced, flags = _fewest_replays(priced, flags, overhead)
            found.append(Fix(_flags(est, flags, priced), priced))
    found.sort(key=lambda f: (f.estimate.time.step_s, f.change.count("--"), f.estimate.memory["needed"]))
    return _distinct(found)


def _fewest_replays(priced: Estimate, flags: list[str], overhead: MemoryOverhead) -> tuple[Estimate, list[str]]:
    """A fitting change to full recompute made to replay only the first r layers of each chunk, for the fewest r
    that fit (`search.fewest_replays_that_fit`, as `plan` ranks it): fewer replays are never slower."""
    job = priced.job
    if job.recompute != "full" or job.recompute_layers or not any(f.startswith("--recompute full") for f in flags):
        return priced, flags
    partial = fewest_replays_that_fit(priced.model, priced.degrees, job, priced.cluster.gpu.memory_bytes, overhead,
                                      priced.memory["needed"])
    if not partial.recompute_layers:
        return priced, flags
    layers = f"--recompute full --recompute-layers {partial.recompute_layers}"
    flags = [f.replace("--recompute full", layers, 1) for f in flags]
    return estimate(priced.model, priced.degrees, partial, priced.cluster, overhead=overhead), flags


def _flags(est: Estimate, moves: list[str], priced: Estimate) -> str:
    """The moves' flags, with the dp and global batch that the command's own defaults would not give."""
    flags = list(moves)
    if priced.degrees.dp != est.degrees.dp:
        flags.append(f"--dp {priced.degrees.dp}")
    if not est.job.global_batch and (priced.degrees.dp, priced.job.micro_batch) != (est.degrees.dp,
                                                                                    est.job.micro_batch):
        flags.append(f"--global-batch {priced.job.global_batch}")
    return " ".join(flags)


def _distinct(found: list[Fix]) -> list[Fix]:
    """`found` without a fix priced exactly as an earlier one (which has as few changes or fewer)."""
    seen, out = set(), []
    for fix in found:
        figures = (fix.estimate.memory["needed"], fix.estimate.time.step_s)
        if figures not in seen:
            seen.add(figures)
            out.append(fix)
    return out


Move = tuple[str, Callable[[Degrees, Job], tuple[Degrees, Job]]]


def _moves(model: ModelSpec, deg: Degrees, job: Job, gpus_per_node: int) -> list[list[Move]]:
    """One list per kind of change, each starting with "no change" ("")."""
    keep: Move = ("", lambda d, j: (d, j))
    recompute = [keep]
    if job.recompute == "none" and job.attention_kernel == "eager":
        recompute.append(("--recompute selective", lambda d, j: (d, replace(j, recompute="selective"))))
    modules, every = replayable_modules(model, job), replayable_modules(model)
    if job.recompute != "full" and set(modules) - set(job.recompute_modules):
        recompute.append((f"--recompute-modules {','.join(modules)}",
                          lambda d, j: (d, replace(j, recompute_modules=modules))))
    if job.recompute != "full" and set(every) - set(modules):  # what delayed FP8 scaling cannot replay
        recompute.append((f"--fp8-recipe blockwise --recompute-modules {','.join(every)}",
                          lambda d, j: (d, replace(j, fp8_recipe="blockwise", recompute_modules=every))))
    if job.recompute != "full" or job.recompute_layers:
        # Full recompute replays every module: it replaces a module list
        flag = "--recompute full" + (" (no --recompute-modules)" if job.recompute_modules else "")
        recompute.append((flag, lambda d, j: (d, replace(j, recompute="full", recompute_layers=0,
                                                         recompute_modules=()))))
    zero = [keep] + [(f"--zero-stage {z}", lambda d, j, z=z: (d, replace(j, zero_stage=z)))
                     for z in range(job.zero_stage + 1, 4) if deg.dp * deg.cp > 1]
    if not job.zero3_reduce_every_microbatch and job.replica_microbatches(deg) > 1:  # one unit's .grad at a time
        flag = ("" if job.zero_stage == 3 else "--zero-stage 3 ") + "--zero3-reduce-every-microbatch"
        zero.append((flag, lambda d, j: (d, replace(j, zero_stage=3, zero3_reduce_every_microbatch=True))))
    # tp > 1 goes with sequence parallelism, as `plan` ranks it: the same bytes on the wire, activations split
    sp = "" if job.sequence_parallel else " --sequence-parallel"
    tp = [keep] + ([("--sequence-parallel", lambda d, j: (d, replace(j, sequence_parallel=True)))]
                   if sp and deg.tp > 1 else [])
    tp += [(f"--tp {deg.tp * f}{sp}", lambda d, j, f=f: (replace(d, tp=d.tp * f, dp=d.dp // f),
                                                         replace(j, sequence_parallel=True)))
           for f in (2, 4, 8) if deg.dp % f == 0 and deg.tp * f <= gpus_per_node]
    pp = [keep] + [(f"--pp {deg.pp * f}", lambda d, j, f=f: (replace(d, pp=d.pp * f, dp=d.dp // f), j))
                   for f in (2, 4, 8) if deg.dp % f == 0]
    buckets = [keep]
    if job.grad_bucket_numel <= 0:  # also at dp 1, where the tp sums of gradients go bucket by bucket
        buckets.append((f"--grad-bucket-numel {BUCKET_NUMEL}",
                        lambda d, j: (d, replace(j, grad_bucket_numel=BUCKET_NUMEL))))
    micro = [keep] + [(f"--micro-batch {job.micro_batch // f}",
                       lambda d, j, f=f: (d, replace(j, micro_batch=j.micro_batch // f)))
                      for f in (2, 4) if job.micro_batch % f == 0]
    return [recompute, zero, buckets, tp, pp, micro]


def explain(est: Estimate, overhead: MemoryOverhead = DEFAULT_OVERHEAD, n: int = 3) -> str:
    """One paragraph: the largest categories and up to `n` changes that fit, with their memory and step time."""
    largest = ", ".join(f"{k} {v / GIB:.1f}" for k, v in largest_categories(est))
    lines = [f"{est.model.name} does not fit: needs {est.memory['needed'] / GIB:.1f} GiB per GPU > "
             f"{est.cluster.gpu.memory_gib:.1f} GiB on {est.cluster.gpu.name}; largest: {largest} GiB"]
    found = fixes(est, overhead)[:n]
    if not found:
        # The other dimensions (ep, cp, dp against tp x pp) change more than a flag: the search prices them all.
        lines.append("  no change of up to three of recompute, ZeRO stage, gradient buckets, sequence parallelism, tp, "
                     f"pp and micro-batch fits; `{_plan_command(est)}` searches every layout of these GPUs, "
                     "else add GPUs")
    else:
        lines.append(f"changes that fit at the same global batch ({found[0].estimate.job.global_batch} sequences), "
                     "fastest first (each priced in full):")
    for fix in found:
        e = fix.estimate
        lines.append(f"  {fix.change}: needs {e.memory['needed'] / GIB:.1f} GiB, step {e.time.step_s:.3f} s, "
                     f"MFU {100 * e.time.mfu:.1f}%")
    return "\n".join(lines)


def _plan_command(est: Estimate) -> str:
    """The `plan` command that searches `est`'s GPUs for its problem, to paste: model, GPU, sequence, batch, and
    the options that change what a step costs set away from their defaults. A model or GPU that is not a preset
    is named by the placeholder MODEL or GPU: the file or folder it came from is not known here."""
    job, cluster, default = est.job, est.cluster, Job(seq_len=est.job.seq_len)
    model = est.model.name if est.model.name in preset_names() else "MODEL"
    preset = cluster.gpu.name in gpu_names() and load_gpu(cluster.gpu.name) == cluster.gpu  # not a file's edit
    gpu = cluster.gpu.name if preset else "GPU"
    batch = job.global_batch or est.tokens_per_step // job.data_tokens
    flags = [f"--model {model}", f"--gpu {gpu}", f"--gpus {est.degrees.world_size}",
             f"--seq {job.data_tokens}", f"--global-batch {batch}"]
    if cluster.gpus_per_node != cluster.gpu.gpus_per_node:
        flags.append(f"--gpus-per-node {cluster.gpus_per_node}")
    for name in ("param_dtype", "attention_kernel"):
        if getattr(job, name) != getattr(default, name):
            flags.append(f"--{name.replace('_', '-')} {getattr(job, name)}")
    if job.fp8:
        flags.append("--fp8" + (f" --fp8-recipe {job.fp8_recipe}" if job.fp8_recipe != default.fp8_recipe else ""))
    return "orangetron plan " + " ".join(flags)

