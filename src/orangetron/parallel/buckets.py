"""DDP gradient buckets: each slice of the flat gradient buffer is all-reduced as soon as every parameter
that overlaps it has its gradient, while backward goes on computing the rest.

Buckets are fixed-size slices of the flat buffer in parameter order (the last may be shorter), the layout
the cost model prices (`plan.traffic`, `bucket_numel`). Gradients are added into the fp32 (or wider) main
buffer as they arrive, so micro-batches accumulate there in the main dtype; inside `DataParallel.no_sync()`
they only accumulate, and the last micro-batch's backward starts the reductions.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from orangetron import comm

if TYPE_CHECKING:
    from orangetron.parallel.data import DataParallel


class GradBuckets:
    """Hooks every parameter of `dp` and launches one asynchronous all-reduce per full bucket."""

    def __init__(self, dp: DataParallel, bucket_numel: int) -> None:
        self.dp = dp
        self.bounds = [(start, min(start + bucket_numel, dp.numel)) for start in range(0, dp.numel, bucket_numel)]
        self.spans: list[tuple[int, int]] = []  # (offset, numel) of each parameter in the flat buffer
        self.buckets_of: list[list[int]] = []  # bucket indices each parameter overlaps
        offset = 0
        for index, (_, p) in enumerate(dp._named):
            self.spans.append((offset, p.numel()))
            first, last = offset // bucket_numel, (offset + p.numel() - 1) // bucket_numel
            self.buckets_of.append(list(range(first, last + 1)))
            p.register_post_accumulate_grad_hook(partial(self._on_grad, index))
            offset += p.numel()
        self.sync = True
        self._reset()

    def _reset(self) -> None:
        self.arrived: set[int] = set()
        self.missing = [0] * len(self.bounds)
        for buckets in self.buckets_of:
            for k in buckets:
                self.missing[k] += 1
        self.in_flight: dict[int, tuple[torch.Tensor, comm.PendingAllReduce]] = {}

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        offset, numel = self.spans[index]
        self.dp.main_grads[offset:offset + numel].add_(param.grad.reshape(-1))
        param.grad = None  # the flat buffer holds it now
        if not self.sync:
            return
        if index in self.arrived:
            raise RuntimeError(f"{self.dp._named[index][0]}: a second gradient arrived before the step; run "
                               "the earlier micro-batches' backward inside dp.no_sync()")
        self.arrived.add(index)
        for k in self.buckets_of[index]:
            self.missing[k] -= 1
            if self.missing[k] == 0:
                self._launch(k)

    def _launch(self, k: int) -> None:
        start, end = self.bounds[k]
        region = self.dp.main_grads[start:end]
        wire = region.to(self.dp.config.torch_reduce_dtype)  # the region itself when the dtypes agree
        self.in_flight[k] = (region, comm.all_reduce_start(wire, self.dp.group))

    def finish(self) -> None:
        """Launch what backward did not (buckets of unused parameters), wait for all, in bucket order."""
        for k in range(len(self.bounds)):
            if k not in self.in_flight:
                self._launch(k)
        for k in sorted(self.in_flight):
            region, pending = self.in_flight[k]
            summed = pending.wait()
            if summed.data_ptr() != region.data_ptr():
                region.copy_(summed)
        self._reset()
