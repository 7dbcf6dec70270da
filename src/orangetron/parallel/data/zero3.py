"""ZeRO-3 by unit: every rank keeps only its slice of the parameters too; each unit (embedding, transformer
block, head) is all-gathered just before its forward and again before its backward, freed after each, and its
gradients are reduce-scattered as soon as backward is done with it (`units.Zero3Schedule` does the timing).

Inside `no_sync` gradients wait whole in `.grad` and are reduced once, at the last micro-batch; with
`zero3_reduce_every_microbatch` every backward reduce-scatters into the sharded main gradients instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from orangetron.parallel.data.buffers import DataParallelBuffers
from orangetron.parallel.data.strategy import DataParallelStrategy
from orangetron.parallel.data.units import Unit, Zero3Schedule, find_units


class Zero3Strategy(DataParallelStrategy):
    """Parameters, main gradients, main parameters and optimizer state all sharded over the dp x cp ranks
    (experts over edp), gathered and reduced unit by unit."""

    @classmethod
    def units(cls, module: nn.Module) -> list[Unit]:
        return find_units(module, [n for n, p in module.named_parameters() if p.requires_grad])

    def __init__(self, buffers: DataParallelBuffers) -> None:
        super().__init__(buffers)
        self.schedule = Zero3Schedule(buffers)

    def before_forward(self) -> None:
        self.schedule.begin_forward()

    def after_forward(self, out: Any) -> None:
        self.schedule.end_forward(out)
        super().after_forward(out)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.buffers.config.zero3_reduce_every_microbatch:  # each backward reduce-scatters its units anyway
            yield
            return
        self.schedule.sync = False
        try:
            yield
        finally:
            self.schedule.sync = True

    def reduce(self) -> None:
        if self.schedule.defer:  # partial gradients are summed first, then every unit goes
            self.buffers.sum_partials()
            self.schedule.reduce_all()
        self.schedule.retire()  # most units were reduce-scattered during backward
        for part in self.buffers.parts:
            part.main_grads.div_(self.buffers.group.size)

    def zero_grad(self) -> None:
        super().zero_grad()
        for part in self.buffers.parts:  # gradients accumulate in the owned slices, unit by unit
            part.main_grads.zero_()

    def gather_params(self) -> None:
        self.schedule.gather_all()

    def param_tensors(self) -> list[torch.Tensor]:
        return [part.param_shard for part in self.buffers.parts]
