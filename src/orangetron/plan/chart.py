"""Bar charts of the memory and time breakdown of the best configurations (matplotlib, optional)."""

from __future__ import annotations

from orangetron.plan.estimate import Estimate
from orangetron.plan.overhead import needed_overhead
from orangetron.spec.categories import ESTIMATED_TENSORS
from orangetron.spec.hardware import GIB
from orangetron.spec.options import Job

MEMORY_PARTS = (*ESTIMATED_TENSORS, "overhead")
TIME_PARTS = ("compute_s", "bubble_s", "tp_s", "cp_s", "ep_s", "pp_s", "dp_s", "optimizer_s")


def sharding_label(job: Job) -> str:
    """ddp, zero1, distopt, zero2 or zero3, with -mb for ZeRO-3 reducing every micro-batch and +b for gradients
    reduced in buckets during backward (`plan`'s table and the chart)."""
    zero = "distopt" if job.distributed_optimizer else ("ddp" if job.zero_stage == 0 else f"zero{job.zero_stage}")
    return zero + ("-mb" if job.zero3_reduce_every_microbatch else "") + ("+b" if job.grad_bucket_numel else "")


def _label(e: Estimate) -> str:
    d, j = e.degrees, e.job
    mode = f" {j.cp_mode}" if d.cp > 1 else ""
    schedule = f" {j.pp_schedule}" if d.pp > 1 else ""
    return (f"tp{d.tp} cp{d.cp} pp{d.pp} v{j.virtual_stages}{schedule}\ndp{d.dp} ep{d.ep} mb{j.micro_batch}\n"
            f"{sharding_label(j)}{mode}")


def breakdown_chart(estimates: list[Estimate], path: str) -> None:
    """Two stacked-bar panels (memory GiB, step seconds) for `estimates`, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [_label(e) for e in estimates]
    xs = range(len(estimates))
    bottom = [0.0] * len(estimates)
    for part in MEMORY_PARTS:  # the overhead as the fit check counts it: the bars are what must fit
        vals = [(needed_overhead(e.memory) if part == "overhead" else e.memory.get(part, 0)) / GIB for e in estimates]
        ax_mem.bar(xs, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax_mem.axhline(estimates[0].cluster.gpu.memory_gib, color="k", linestyle="--", linewidth=1)
    ax_mem.set_ylabel("GiB per GPU")
    ax_mem.set_title("memory")
    bottom = [0.0] * len(estimates)
    for part in TIME_PARTS:
        vals = [getattr(e.time, part) for e in estimates]
        ax_time.bar(xs, vals, bottom=bottom, label=part[:-2])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax_time.set_ylabel("seconds per step")
    ax_time.set_title("step time")
    for ax in (ax_mem, ax_time):
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"{estimates[0].model.name} on {estimates[0].degrees.world_size} x {estimates[0].cluster.gpu.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def schedule_chart(slots: list, pp: int, title: str, path: str) -> None:
    """A timeline of a pipeline schedule: one row per rank, forwards light, backwards dark, labelled by
    micro-batch (and chunk when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = 1 + max(s.action.chunk for s in slots)
    makespan = max(s.end for s in slots)
    fig, ax = plt.subplots(figsize=(min(4 + makespan * 0.6, 24), 0.6 * pp + 1.2))
    palette = plt.get_cmap("tab10")
    for s in slots:
        shade = palette(s.action.chunk % 10)
        alpha = {"F": 0.45, "B": 0.95, "W": 0.7}[s.action.kind]
        ax.barh(s.rank, s.end - s.start, left=s.start, color=shade, alpha=alpha, edgecolor="black", linewidth=0.5,
                hatch="//" if s.action.kind == "W" else None)
        text = f"{s.action.kind}{s.action.microbatch}" + (f".{s.action.chunk}" if chunks > 1 else "")
        ax.text((s.start + s.end) / 2, s.rank, text, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward of one stage = 1)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
