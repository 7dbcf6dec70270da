"""Whole-GPU memory against published figures (`[[reserved]]` rows of `validation_runs.toml`): the planner's
per-GPU total with the overhead term against a published peak of reserved memory, and its fit check against
layouts published as out of memory; and the fit of the overhead's fragmentation fraction on the calibration
rows. The protocol is docs/planner.md, section 'Validation protocol'."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

from orangetron.plan import validation
from orangetron.plan.memory import memory_per_gpu
from orangetron.plan.overhead import DEFAULT_OVERHEAD, MemoryOverhead, with_overhead
from orangetron.spec.hardware import GIB, load_gpu
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job

METRICS = ("reserved_gib", "oom")


@dataclass(frozen=True)
class ReservedRow:
    """One published whole-GPU memory figure, or one layout published as out of memory, and its layout."""

    name: str
    group: str
    split: str  # "calibration" (the overhead is fitted on it) or "validation" (never)
    added: date
    source: str
    metric: str  # one of METRICS
    published: float  # GiB of peak reserved memory; 0 for "oom"
    gpu: str
    model: ModelSpec
    deg: Degrees
    job: Job
    gpu_memory_gib: float = 0.0  # 0: the preset's


_KEYS = {"name", "group", "split", "added", "source", "metric", "published", "gpu", "gpu_memory_gib", "model",
         "degrees", "job"}


def _row(row: dict) -> ReservedRow:
    extra = sorted(set(row) - _KEYS)
    if extra or row["metric"] not in METRICS:
        raise ValueError(f"reserved row {row.get('name')!r}: unknown key(s) {extra} or metric {row['metric']!r}")
    model, deg, job = validation.row_layout(row)
    return ReservedRow(name=row["name"], group=row["group"], split=row["split"], added=row["added"],
                       source=row["source"], metric=row["metric"], published=float(row["published"]),
                       gpu=row["gpu"], model=model, deg=deg, job=job, gpu_memory_gib=row.get("gpu_memory_gib", 0.0))


def load_reserved(path: Path | None = None) -> list[ReservedRow]:
    """Every `[[reserved]]` row of the file, in file order."""
    return [_row(row) for row in validation.load_table(path)["reserved"]]


def predicted_bytes(row: ReservedRow, overhead: MemoryOverhead = DEFAULT_OVERHEAD) -> int:
    """The planner's per-GPU total for the row's layout (the largest stage), overhead included."""
    return with_overhead(memory_per_gpu(row.model, row.deg, row.job), row.deg, overhead)["total"]


def capacity_bytes(row: ReservedRow) -> int:
    gib = row.gpu_memory_gib or load_gpu(row.gpu).memory_gib
    return int(gib * GIB)


def needed_bytes(row: ReservedRow, overhead: MemoryOverhead = DEFAULT_OVERHEAD) -> int:
    """What the row's layout needs by the planner's fit check (`with_overhead`'s `needed`)."""
    return with_overhead(memory_per_gpu(row.model, row.deg, row.job), row.deg, overhead)["needed"]


def judged_fitting(row: ReservedRow, overhead: MemoryOverhead = DEFAULT_OVERHEAD) -> bool:
    """Whether the planner's fit check passes the row's layout on its GPU."""
    return needed_bytes(row, overhead) <= capacity_bytes(row)


def reserved_error(row: ReservedRow, overhead: MemoryOverhead = DEFAULT_OVERHEAD) -> float:
    """predicted / published - 1 for a "reserved_gib" row."""
    return predicted_bytes(row, overhead) / GIB / row.published - 1


# How a constant is fitted: the least sum of squared log errors of the predicted peaks, or (`bound`) the largest
# value at which no row's need by the fit check exceeds its published peak, which no run's need can.
RULES = ("least squares", "bound")


@dataclass(frozen=True)
class FittedOverhead:
    """A field of `MemoryOverhead` fitted on calibration "reserved_gib" rows, searched on `grid` by `rule`."""

    name: str
    field: str  # a `MemoryOverhead` field
    rows: tuple[str, ...]  # the calibration rows it is fitted on, by name
    grid: tuple[float, float, float]
    value: float  # as shipped in DEFAULT_OVERHEAD
    rule: str = "least squares"  # one of RULES

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"{self.name}: rule {self.rule!r} is not one of {RULES}")


def load_fitted_overhead(path: Path | None = None) -> list[FittedOverhead]:
    """The file's `fitted_overhead` tables."""
    return [FittedOverhead(f["name"], f["field"], tuple(f["rows"]), tuple(f["grid"]), f["value"],
                           f.get("rule", "least squares")) for f in validation.load_table(path)["fitted_overhead"]]


def fit_loss(fitted: FittedOverhead, value: float, rows: list[ReservedRow]) -> float:
    """The field set to `value`: the sum over the constant's rows of log(predicted / published)^2, or for a
    bound the number of rows whose need exceeds their published peak."""
    by_name, overhead = {r.name: r for r in rows}, replace(DEFAULT_OVERHEAD, **{fitted.field: value})
    if fitted.rule == "bound":
        return sum(needed_bytes(by_name[name], overhead) > by_name[name].published * GIB for name in fitted.rows)
    return sum(math.log(1 + reserved_error(by_name[name], overhead)) ** 2 for name in fitted.rows)


def refit(fitted: FittedOverhead, rows: list[ReservedRow]) -> float:
    """The grid value with the least `fit_loss`, the lower on a tie; for a bound, the largest value no row
    exceeds. Only calibration rows may be named."""
    by_name = {r.name: r for r in rows}
    if any(by_name[name].split != "calibration" or by_name[name].metric != "reserved_gib" for name in fitted.rows):
        raise ValueError(f"{fitted.name}: fitted on a row outside the calibration split")
    points = validation.grid_points(fitted.grid)
    if fitted.rule == "bound":
        within = [v for v in points if fit_loss(fitted, v, rows) == 0]
        if not within:
            raise ValueError(f"{fitted.name}: every grid value puts a row's need above its published peak")
        return max(within)
    return min(points, key=lambda v: (fit_loss(fitted, v, rows), v))
