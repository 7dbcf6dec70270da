"""DDP: every rank keeps every buffer whole; gradients are all-reduced and averaged.

Without buckets, one all-reduce per flat buffer after backward. With `grad_bucket_numel`, slices of the
flat gradient buffer are all-reduced during backward as soon as their gradients are in (`GradBuckets`), and
micro-batches accumulate in the main buffer: the earlier ones' backward runs inside `no_sync`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from orangetron.parallel.data.buckets import GradBuckets
from orangetron.parallel.data.buffers import DataParallelBuffers
from orangetron.parallel.data.strategy import DataParallelStrategy


class ReplicatedStrategy(DataParallelStrategy):
    """DDP over the dp x cp ranks (experts over edp): whole buffers, gradients all-reduced."""

    def __init__(self, buffers: DataParallelBuffers) -> None:
        super().__init__(buffers)
        self.buckets = self._make_buckets() if buffers.config.grad_bucket_numel else None

    def _make_buckets(self) -> GradBuckets:
        return GradBuckets(self.buffers, self.buffers.config.grad_bucket_numel)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.buckets is None:  # .grad waits for the step anyway
            yield
            return
        self.buckets.sync = False
        try:
            yield
        finally:
            self.buckets.sync = True

    def reduce(self) -> None:
        if self.buckets is None:
            self.buffers.reduce_parts()
            return
        self.buckets.finish()  # most buckets were summed during backward; the rest go now
        for part in self.buffers.parts:  # the loss is the mean over dp x cp, experts included
            part.owned_grads().div_(self.buffers.group.size)

    def zero_grad(self) -> None:
        super().zero_grad()
        if self.buckets is not None:  # gradients accumulate in the flat buffers themselves
            for part in self.buffers.parts:
                part.main_grads.zero_()

    def gather_params(self) -> None:
        pass  # every rank's parameters are whole all the time

    def param_tensors(self) -> list[torch.Tensor]:
        return [part.flat_params for part in self.buffers.parts]
