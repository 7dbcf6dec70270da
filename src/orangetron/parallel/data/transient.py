"""Bytes that exist only during a step (gathered units, reduction buffers, per-parameter `.grad`), counted live and
at their peak by memory category, so the measured peak is deterministic and the planner can predict it."""

from __future__ import annotations


class TransientPeaks:
    """Live and peak bytes of buffers that exist only during a step, by memory category."""

    CATEGORIES = ("gathered_params", "grad_buckets", "param_grads")

    def __init__(self) -> None:
        self.live = dict.fromkeys(self.CATEGORIES, 0)
        self.peak = dict.fromkeys(self.CATEGORIES, 0)

    def add(self, category: str, nbytes: int) -> None:
        self.live[category] += nbytes
        self.peak[category] = max(self.peak[category], self.live[category])

    def reset(self) -> None:
        self.peak = dict(self.live)
