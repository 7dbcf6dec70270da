"""Published training runs the planner is judged on (`validation_runs.toml`): loading, predicting each with
the shipped presets, and the in-sample / out-of-sample error summary. The protocol is docs/planner.md,
section 'Validation protocol'."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields, replace
from datetime import date
from importlib import resources
from pathlib import Path

from orangetron.plan.memory import memory_per_gpu
from orangetron.plan.overhead import DEFAULT_OVERHEAD, fits, with_overhead
from orangetron.plan.timing import DEFAULT_EFFICIENCY, Efficiency, StepTime, step_time
from orangetron.spec.hardware import GPUSpec, load_gpu, make_cluster
from orangetron.spec.model import ModelSpec, load_decoder
from orangetron.spec.options import Degrees, Job, validate
from orangetron.spec.schedules import SCHEDULES
from orangetron.spec.stages import longest_chunk

SPLITS = ("calibration", "validation")
CLASSES = ("moe", "fully sharded", "long context", "pipeline", "size")
# Knobs a source does not publish, set to the planner's fastest choice that fits (as the authors tuned them).
_TUNE_CHOICES = {"micro_batch": (1, 2, 4, 8), "virtual_stages": (1, 2, 4), "recompute": ("none", "full")}


@dataclass(frozen=True)
class PublishedRun:
    """One published throughput figure and the layout it ran with."""

    name: str
    group: str  # the source family (one citation), e.g. "sc21", "mpt"
    cls: str  # one of CLASSES, by `class_of`
    split: str  # "calibration" (constants are fitted on it) or "validation" (never)
    added: date  # when the row entered the repository
    source: str
    metric: str  # "mfu", "mfu_causal", "tflops" (hardware, with recompute), "model_tflops", "tokens" (per GPU)
    published: float
    gpu: str
    model: ModelSpec
    deg: Degrees
    job: Job
    tune: tuple[str, ...] = ()
    gpus_per_node: int = 0  # 0: the preset's node
    gpu_memory_gib: float = 0.0  # 0: the preset's; else the memory of the source's variant of that GPU
    band: tuple[float, float] | None = None  # the relative error the row must stay in, where one is asserted
    figure: str = ""  # the figure as the source states it, where `published` is derived from it


def class_of(model: ModelSpec, deg: Degrees, job: Job) -> str:
    """The class a layout is judged in, first rule that applies: experts -> "moe", ZeRO-3 -> "fully sharded",
    context parallel or 32K tokens and more -> "long context", pp > 1 -> "pipeline", else "size"."""
    if model.num_experts:
        return "moe"
    if job.zero_stage == 3:
        return "fully sharded"
    if deg.cp > 1 or job.seq_len >= 32768:
        return "long context"
    return "pipeline" if deg.pp > 1 else "size"


def _default_path() -> Path:
    return Path(str(resources.files("orangetron.plan").joinpath("validation_runs.toml")))


def load_table(path: Path | None = None) -> dict:
    """The whole file: `throughput`, `memory` and `reserved` rows, `refit`, `fitted` and `fitted_overhead` tables."""
    return tomllib.loads((path or _default_path()).read_text())


def _tuples(table: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


def _model(value: str | dict) -> ModelSpec:
    return load_decoder(value) if isinstance(value, str) else ModelSpec(**_tuples(value))


def row_layout(row: dict) -> tuple[ModelSpec, Degrees, Job]:
    """A row's model, degrees and job, read as every kind of row reads them."""
    return _model(row["model"]), Degrees(**row.get("degrees", {})), _job(row["job"])


def _run(row: dict) -> PublishedRun:
    known = {f.name for f in fields(PublishedRun)}
    extra = sorted(set(row) - known - {"class", "degrees"})
    if extra:
        raise ValueError(f"validation row {row.get('name')!r}: unknown key(s) {', '.join(extra)}")
    band = row.get("band")
    model, deg, job = row_layout(row)
    return PublishedRun(
        name=row["name"], group=row["group"], cls=row["class"], split=row["split"], added=row["added"],
        source=row["source"], metric=row["metric"], published=float(row["published"]), gpu=row["gpu"],
        model=model, deg=deg, job=job,
        tune=tuple(row.get("tune", ())), gpus_per_node=row.get("gpus_per_node", 0),
        gpu_memory_gib=row.get("gpu_memory_gib", 0.0),
        band=tuple(band) if band else None, figure=row.get("figure", ""))


def _job(values: dict) -> Job:
    """A row's job. A published fully sharded run reduce-scatters every micro-batch's gradients unless the row
    says otherwise: that is what FSDP (without its opt-in `no_sync`), FSDP2 (without
    `set_requires_gradient_sync(False)`), DeepSpeed ZeRO-3 and Megatron's FSDP do, and the only way the large
    runs fit (MPT-70B's unsharded bf16 gradients alone would take 121 GiB of an 80 GiB GPU). Every row sums
    partial gradients over tp in its reduction's pass (`tp_sum_with_reduction`): no published framework holds
    its reductions to the step for the tp sums, as orangetron's runtime does."""
    values = _tuples(values)
    values.setdefault("tp_sum_with_reduction", True)
    if values.get("zero_stage") == 3:
        values.setdefault("zero3_reduce_every_microbatch", True)
    return Job(**values)


def load_runs(path: Path | None = None) -> list[PublishedRun]:
    """Every throughput row of the file, in file order."""
    return [_run(row) for row in load_table(path)["throughput"]]


def _fits(run: PublishedRun, job: Job, capacity: float) -> bool:
    try:
        validate(run.model, run.deg, job)
    except ValueError:
        return False
    return fits(with_overhead(memory_per_gpu(run.model, run.deg, job), run.deg, DEFAULT_OVERHEAD), capacity)


def _turned(job: Job, knob: str, value: object) -> Job:
    """`job` with one knob set; virtual stages come with the interleaved schedule, and one chunk with 1F1B."""
    schedule = {}
    if knob == "virtual_stages" and (value > 1 or SCHEDULES[job.pp_schedule].chunks):
        schedule = {"pp_schedule": "interleaved" if value > 1 else "1f1b"}
    return replace(job, **{knob: value}, **schedule)


def candidates(run: PublishedRun) -> list[Job]:
    """The published job with each unpublished knob at each choice, and full recompute of only the first r
    layers of each chunk (Megatron's block method) for every r short of the longest chunk."""
    jobs = [run.job]
    for knob in run.tune:
        choices = _TUNE_CHOICES[knob] if knob != "virtual_stages" or run.deg.pp > 1 else (1,)
        jobs = [_turned(j, knob, value) for j in jobs for value in choices]
    if "recompute" in run.tune:
        longest = longest_chunk(run.model.num_layers, run.deg.pp, run.job.virtual_stages, run.job.pipeline_layout)
        jobs += [replace(j, recompute_layers=r) for j in jobs if j.recompute == "full" for r in range(1, longest)]
    return jobs


def run_gpu(run: PublishedRun, gpu: GPUSpec | None = None) -> GPUSpec:
    """`gpu` (default: the run's preset) with the memory of the variant the run used, where the row gives one."""
    spec = gpu or load_gpu(run.gpu)
    return replace(spec, memory_gib=run.gpu_memory_gib) if run.gpu_memory_gib else spec


def fitting_jobs(run: PublishedRun, gpu: GPUSpec | None = None) -> list[Job]:
    """The candidates that fit in the GPU's memory by the planner's own model (overhead included)."""
    capacity = run_gpu(run, gpu).memory_bytes
    return [j for j in candidates(run) if _fits(run, j, capacity)]


def best_step(run: PublishedRun, gpu: GPUSpec | None = None, eff: Efficiency = DEFAULT_EFFICIENCY) -> StepTime:
    """The fastest candidate that fits (the published job when none fits) on `gpu` (default: the preset)."""
    cluster = make_cluster(run_gpu(run, gpu), run.deg.world_size, run.gpus_per_node or None)
    jobs = fitting_jobs(run, cluster.gpu) or [run.job]
    return min((step_time(run.model, run.deg, j, cluster, eff=eff) for j in jobs), key=lambda t: t.step_s)


def predict(run: PublishedRun, gpu: GPUSpec | None = None, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """The run's metric as the planner predicts it."""
    best, gpus = best_step(run, gpu, eff), run.deg.world_size
    if run.metric in ("mfu", "mfu_causal"):
        return getattr(best, run.metric)
    if run.metric == "tflops":
        return best.hardware_flops / best.step_s / gpus / 1e12
    if run.metric == "model_tflops":
        return best.model_flops / best.step_s / gpus / 1e12
    if run.metric == "tokens":
        return run.job.global_batch * run.job.seq_len / best.step_s / gpus
    raise ValueError(f"validation row {run.name!r}: unknown metric {run.metric!r}")


def relative_error(run: PublishedRun, gpu: GPUSpec | None = None, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    return predict(run, gpu, eff) / run.published - 1


def log_error(run: PublishedRun, gpu: GPUSpec | None = None, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    return math.log(predict(run, gpu, eff) / run.published)


@dataclass(frozen=True)
class Scored:
    """One row's error, with what the report groups it by."""

    name: str
    cls: str
    split: str
    added: date
    error: float  # predicted / published - 1


def _cell(errors: list[float]) -> str:
    if not errors:
        return f"{'-':>19}"
    mean = sum(abs(e) for e in errors) / len(errors)
    return f"{len(errors):>3} {100 * mean:6.1f}% {100 * max(abs(e) for e in errors):6.1f}%"


def side_by_side(scored: list[Scored], refit: date, title: str) -> list[str]:
    """Per class and overall: calibration (in sample), validation rows added before the day of the last refit
    (out of sample), and validation rows added on that day or later (a refit is recorded by its day, so a row of
    the same day is counted as later), each as count, mean |error| and worst |error|."""
    columns = [lambda s: s.split == "calibration", lambda s: s.split == "validation" and s.added < refit,
               lambda s: s.split == "validation" and s.added >= refit]
    head = f"{title:<16}{'in sample (n mean worst)':>26}{'out of sample':>26}{f'added since {refit}':>26}"
    lines = [head]
    classes = [c for c in (*CLASSES, "memory", "reserved") if any(s.cls == c for s in scored)]
    for label, keep in [(c, lambda s, c=c: s.cls == c) for c in classes] + [("all", lambda s: True)]:
        cells = [_cell([s.error for s in scored if keep(s) and col(s)]) for col in columns]
        lines.append(f"{label:<16}" + "".join(f"{c:>26}" for c in cells))
    return lines


def summary(scored: list[Scored], split: str, cls: str | None = None) -> tuple[int, float, float]:
    """(count, mean |error|, worst |error|) of one split, of one class or of all."""
    errors = [abs(s.error) for s in scored if s.split == split and cls in (None, s.cls)]
    if not errors:
        return 0, 0.0, 0.0
    return len(errors), sum(errors) / len(errors), max(errors)


@dataclass(frozen=True)
class Fitted:
    """A constant fitted on calibration rows: `constant` of every GPU preset in `presets` (one tensor-core
    generation), searched on `grid` (low, high, step)."""

    name: str
    constant: str  # a `GPUSpec` field
    presets: tuple[str, ...]
    rows: tuple[str, ...]  # the calibration rows it is fitted on, by name
    grid: tuple[float, float, float]
    value: float  # as shipped in each preset


def load_fitted(path: Path | None = None) -> list[Fitted]:
    """The file's `fitted` tables."""
    return [Fitted(f["name"], f["constant"], tuple(f["presets"]), tuple(f["rows"]), tuple(f["grid"]), f["value"])
            for f in load_table(path)["fitted"]]


def fit_loss(fitted: Fitted, value: float, runs: list[PublishedRun]) -> float:
    """Sum over the constant's rows of log(predicted / published)^2, the constant set to `value` in its presets."""
    by_name = {r.name: r for r in runs}
    loss = 0.0
    for name in fitted.rows:
        run = by_name[name]
        gpu = load_gpu(run.gpu)
        if run.gpu in fitted.presets:
            gpu = replace(gpu, **{fitted.constant: value})
        loss += log_error(run, gpu) ** 2
    return loss


def grid_points(grid: tuple[float, float, float]) -> list[float]:
    """Every point of a (low, high, step) grid, low and high included."""
    low, high, step = grid
    return [round(low + i * step, 6) for i in range(round((high - low) / step) + 1)]


def grid_values(fitted: Fitted) -> list[float]:
    return grid_points(fitted.grid)


def _require_calibration(constant: str, rows: tuple[str, ...], runs: list[PublishedRun]) -> None:
    split = {r.name: r.split for r in runs}
    if any(split[name] != "calibration" for name in rows):
        raise ValueError(f"{constant}: fitted on a row outside the calibration split")


def refit(fitted: Fitted, runs: list[PublishedRun]) -> float:
    """The grid value with the least `fit_loss`, the lower on a tie. Only calibration rows may be named."""
    _require_calibration(fitted.name, fitted.rows, runs)
    return min(grid_values(fitted), key=lambda v: (fit_loss(fitted, v, runs), v))


@dataclass(frozen=True)
class FittedEfficiency:
    """A field of the compute model's `Efficiency` (plan/timing.py), one value for every GPU, fitted on the
    calibration rows whose class its mechanism acts on, searched on `grid`."""

    name: str
    field: str  # an `Efficiency` field
    cls: str  # the class of every calibration row it is fitted on
    rows: tuple[str, ...]
    grid: tuple[float, float, float]
    value: float  # as shipped in DEFAULT_EFFICIENCY


def load_fitted_efficiency(path: Path | None = None) -> list[FittedEfficiency]:
    """The file's `fitted_efficiency` tables."""
    return [FittedEfficiency(f["name"], f["field"], f["class"], tuple(f["rows"]), tuple(f["grid"]), f["value"])
            for f in load_table(path).get("fitted_efficiency", [])]


def efficiency_fit_loss(fitted: FittedEfficiency, value: float, runs: list[PublishedRun]) -> float:
    """Sum over the field's rows of log(predicted / published)^2, the field set to `value`."""
    by_name, eff = {r.name: r for r in runs}, replace(DEFAULT_EFFICIENCY, **{fitted.field: value})
    return sum(log_error(by_name[name], eff=eff) ** 2 for name in fitted.rows)


def refit_efficiency(fitted: FittedEfficiency, runs: list[PublishedRun]) -> float:
    """The grid value with the least `efficiency_fit_loss`, the lower on a tie. Only calibration rows may be
    named."""
    _require_calibration(fitted.name, fitted.rows, runs)
    return min(grid_points(fitted.grid), key=lambda v: (efficiency_fit_loss(fitted, v, runs), v))
