"""Bytes a rank sends per training step and per evaluation, apart: `train --json`'s `comm_per_step`.

`comm` in the result is every measured byte of the run, evaluation included, as the project's design names it. A
training step's traffic is what the cost model prices per step, so it is kept step by step here; the
evaluations' traffic is kept apart. Checkpoint and bookkeeping collectives are unmeasured
(`comm.unmeasured`) and appear in neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from orangetron import comm
from orangetron.comm import CommRecord


class StepTraffic:
    """Collects the ledger's records of each training step and of each evaluation, by "op/dim"."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self.evaluations: list[dict[str, int]] = []

    @contextmanager
    def step(self, records: list[CommRecord]) -> Iterator[None]:
        """Inside: one training step, measured into `records` (the open `comm.measure` scope)."""
        first = len(records)
        yield
        self.steps.append(comm.bytes_by_key(records[first:]))

    @contextmanager
    def evaluation(self, records: list[CommRecord]) -> Iterator[None]:
        first = len(records)
        yield
        self.evaluations.append(comm.bytes_by_key(records[first:]))

    def summary(self) -> dict[str, Any]:
        """train: bytes of one step by "op/dim" (the last step's; `steps_differ` says whether any step sent
        other bytes), eval: bytes of one evaluation (the last one's), how many of each were measured, and the
        sums over all of each (`train_total`, `eval_total`), which add up to the run's measured bytes whether or
        not the steps differ (under ZeRO-1/2 the first step gathers nothing, and an evaluation after a step
        sends that step's all-gather: `sharded.py` gathers at the next forward)."""
        last_step = self.steps[-1] if self.steps else {}
        last_eval = self.evaluations[-1] if self.evaluations else {}
        return {"train": dict(sorted(last_step.items())), "eval": dict(sorted(last_eval.items())),
                "train_steps": len(self.steps), "evaluations": len(self.evaluations),
                "steps_differ": any(s != last_step for s in self.steps),
                "train_total": _summed(self.steps), "eval_total": _summed(self.evaluations)}


def _summed(windows: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for window in windows:
        for key, sent in window.items():
            total[key] = total.get(key, 0) + sent
    return dict(sorted(total.items()))
