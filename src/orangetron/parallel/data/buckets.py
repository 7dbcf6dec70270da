"""Gradient buckets: each slice of the flat gradient buffer is reduced as soon as every parameter that
overlaps it has its gradient, while backward goes on computing the rest.

DDP (`GradBuckets`): fixed-size slices of the flat buffer in parameter order (the last may be shorter), each
all-reduced. Gradients are added into the fp32 (or wider) main buffer as they arrive, so micro-batches
accumulate there in the main dtype; inside the model's `no_sync()` they only accumulate, and the last
micro-batch's backward starts the reductions. The all-reduce sums in place; when the reduce dtype is not the
main buffer's, each bucket travels as a wire copy, held (and counted in `grad_buckets`) until `finish()`.

ZeRO-1, ZeRO-2 and the distributed optimizer (`ShardedGradBuckets`): the flat buffer's equal buckets, each a
multiple of the shard count (`plan.sharding.bucket_layout`), each reduce-scattered so that every rank keeps
its slice of every bucket (`FlatPart`'s shard layout). ZeRO-1 and the distributed optimizer add gradients
into their full main buffer as they arrive (as DDP) and reduce a bucket where it lies; ZeRO-2, which keeps
only its slices, copies a full bucket's gradients into a padded wire buffer, frees their `.grad` and
reduce-scatters the wire. One reduce-scatter is in flight at a time (the previous one is retired before the
next starts), so the transient peak is one bucket, as `plan.memory.grad_bucket_bytes` predicts.

Every layout the cost model prices the same way (`plan.traffic`, `bucket_numel`).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from orangetron import comm
from orangetron.parallel.config import DTYPES

if TYPE_CHECKING:
    from orangetron.parallel.data.buffers import DataParallelBuffers
    from orangetron.parallel.data.flat import FlatPart, Segment


class _Arrivals:
    """Which parameters' gradients are in, and the buckets they complete (both kinds of buckets count alike)."""

    names: list[str]
    buckets_of: list[list[int]]  # bucket indices each parameter overlaps
    arrived: set[int]
    missing: list[int]  # per bucket: parameters yet to arrive

    def _arrive(self, index: int) -> None:
        """Parameter `index`'s gradient is in: launch every bucket it completes."""
        if index in self.arrived:
            raise RuntimeError(f"{self.names[index]}: a second gradient arrived before the step; run "
                               "the earlier micro-batches' backward inside dp.no_sync()")
        self.arrived.add(index)
        for k in self.buckets_of[index]:
            self.missing[k] -= 1
            if self.missing[k] == 0:
                self._launch(k)

    def _launch(self, k: int) -> None:
        raise NotImplementedError


class GradBuckets(_Arrivals):
    """Hooks every parameter of `buffers` and launches one asynchronous all-reduce per full bucket.

    Each flat buffer (dense over dp x cp, experts over edp) has its own buckets. When partial gradients must
    first be summed (over tp, or a tied embedding's over the pipeline's ends: `buffers.held_to_step`), the
    buckets wait for the step and go out there (same records, no overlap).
    """

    def __init__(self, buffers: DataParallelBuffers, bucket_numel: int) -> None:
        self.buffers, self.defer = buffers, buffers.held_to_step
        self.bounds: list[tuple[FlatPart, int, int]] = []  # (part, start, end) of each bucket
        self.spans: list[tuple[FlatPart, int, torch.Tensor]] = []  # (part, offset, parameter)
        self.names: list[str] = []
        self.buckets_of: list[list[int]] = []  # bucket indices each parameter overlaps
        for part in buffers.parts:
            first = len(self.bounds)
            self.bounds += [(part, at, min(at + bucket_numel, part.numel)) for at in range(0, part.numel, bucket_numel)]
            for name, p in part.named:
                at = part.offsets[name]
                self.spans.append((part, at, p))
                self.names.append(name)
                self.buckets_of.append(list(range(first + at // bucket_numel,
                                                  first + (at + p.numel() - 1) // bucket_numel + 1)))
                p.register_post_accumulate_grad_hook(partial(self._on_grad, len(self.spans) - 1))
        self.sync = True
        self._reset()

    def _reset(self) -> None:
        self.arrived: set[int] = set()
        self.missing = [0] * len(self.bounds)
        for buckets in self.buckets_of:
            for k in buckets:
                self.missing[k] += 1
        self.in_flight: dict[int, tuple[torch.Tensor, comm.Pending, int]] = {}  # region, all-reduce, wire bytes

    def _add(self, index: int) -> None:
        part, at, p = self.spans[index]
        part.main_grads[at:at + p.numel()].add_(p.grad.reshape(-1))
        self.buffers.param_grads.free(p)  # the flat buffer holds it now

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if self.defer:
            return  # .grad waits for `sum_partials` at the step
        self._add(index)
        if not self.sync:
            return
        self._arrive(index)

    def _launch(self, k: int) -> None:
        part, start, end = self.bounds[k]
        region = part.main_grads[start:end]
        wire = region.to(DTYPES[self.buffers.config.wire_dtype])  # the region itself when the dtypes agree
        # all_reduce_start sums in place: only a wire copy is extra, held until `finish` waits for it.
        nbytes = 0 if wire.data_ptr() == region.data_ptr() else wire.numel() * wire.element_size()
        self.buffers.transient.add("grad_buckets", nbytes)
        self.in_flight[k] = (region, comm.all_reduce_start(wire, part.group), nbytes)

    def finish(self) -> None:
        """Launch what backward did not (buckets of unused parameters; all of them when deferred, after the tp
        sum), wait for all, in bucket order."""
        if self.defer:
            self.buffers.sum_partials()
            for index, (_, _, p) in enumerate(self.spans):
                if p.grad is not None:
                    self._add(index)
        for k in range(len(self.bounds)):
            if k not in self.in_flight:
                self._launch(k)
        for k in sorted(self.in_flight):
            region, pending, nbytes = self.in_flight.pop(k)
            summed = pending.wait()
            if summed.data_ptr() != region.data_ptr():
                region.copy_(summed)
            del pending, summed  # the wire copy goes with them
            self.buffers.transient.add("grad_buckets", -nbytes)
        self._reset()


class ShardedGradBuckets(_Arrivals):
    """Hooks every parameter of `buffers` and launches one asynchronous reduce-scatter per full bucket.

    When partial gradients must first be summed (`buffers.held_to_step`: over tp under sequence parallelism or
    replicated kv heads, a tied embedding's over the pipeline's ends), the buckets wait for the step and go out
    one after another there (the same records, no overlap).
    """

    def __init__(self, buffers: DataParallelBuffers) -> None:
        self.buffers, self.defer = buffers, buffers.held_to_step
        self.in_place = buffers.config.zero_stage < 2  # ZeRO-1 / distributed optimizer: a full main-gradient buffer
        self.buckets: list[tuple[FlatPart, Segment]] = [
            (part, seg) for part in buffers.parts for seg in part.segments]
        self.params: list[tuple[FlatPart, int, torch.Tensor]] = []  # (part, offset, parameter)
        self.names: list[str] = []
        self.buckets_of: list[list[int]] = []  # bucket indices each parameter overlaps
        first = 0
        for part in buffers.parts:
            size = part.segments[0].padded  # equal buckets
            for name, p in part.named:
                at = part.offsets[name]
                self.params.append((part, at, p))
                self.names.append(name)
                self.buckets_of.append(list(range(first + at // size, first + (at + p.numel() - 1) // size + 1)))
                p.register_post_accumulate_grad_hook(partial(self._on_grad, len(self.params) - 1))
            first += len(part.segments)
        self.members: list[list[int]] = [[] for _ in self.buckets]  # parameters overlapping each bucket
        for i, ks in enumerate(self.buckets_of):
            for k in ks:
                self.members[k].append(i)
        self.events: list[int] = []  # buckets in launch order, for overlap checks
        self.sync = True
        self.in_flight: list[tuple[int, comm.Pending, int]] = []
        self._reset()

    def _reset(self) -> None:
        self.arrived: set[int] = set()
        self.launched: set[int] = set()
        self.missing = [len(members) for members in self.members]  # per bucket: parameters yet to arrive
        self.pending_buckets = [len(ks) for ks in self.buckets_of]  # per parameter: its buckets not yet launched

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if self.defer:
            return  # .grad waits for `sum_partials` at the step
        if self.in_place:
            part, at, _ = self.params[index]
            part.main_grads[at:at + param.numel()].add_(param.grad.reshape(-1))
            self.buffers.param_grads.free(param)  # the main buffer holds it now
        if not self.sync:
            return  # ZeRO-2 accumulates micro-batches in .grad, the others in the main buffer
        self._arrive(index)

    def _launch(self, k: int) -> None:
        self.retire()  # one bucket in flight: the transient peak is one bucket's
        part, seg = self.buckets[k]
        self.launched.add(k)
        self.events.append(k)
        dtype = DTYPES[self.buffers.config.wire_dtype]
        if self.in_place:
            region = part.main_grads[seg.start:seg.start + seg.padded]
            wire = region.to(dtype)  # the region itself when the dtypes agree
            extra = 0 if wire.data_ptr() == region.data_ptr() else wire.numel()
        else:
            wire = self._fill_wire(k, part, seg, dtype)
            extra = wire.numel()
        slice_numel = seg.shard_numel if part.shards > 1 else 0  # over one rank the wire itself comes back
        nbytes = (extra + slice_numel) * wire.element_size()
        self.buffers.transient.add("grad_buckets", nbytes)
        self.in_flight.append((k, comm.reduce_scatter_start(wire, part.group), nbytes))

    def _fill_wire(self, k: int, part: FlatPart, seg: Segment, dtype: torch.dtype) -> torch.Tensor:
        """ZeRO-2: bucket `k`'s gradients in a padded wire buffer; each `.grad` freed once all its buckets are."""
        wire = torch.zeros(seg.padded, dtype=dtype, device=part.device)
        for i in self.members[k]:
            _, at, p = self.params[i]
            lo, hi = max(at, seg.start), min(at + p.numel(), seg.start + seg.padded)  # overlap, padded layout
            if p.grad is not None:
                wire[lo - seg.start:hi - seg.start].copy_(p.grad.reshape(-1)[lo - at:hi - at])
            self.pending_buckets[i] -= 1
            if self.pending_buckets[i] == 0:
                self.buffers.param_grads.free(p)  # the wire buffers hold it now
        return wire

    def retire(self) -> None:
        """Wait for the reduce-scatter in flight and put its slice into the main gradients."""
        for k, pending, nbytes in self.in_flight:
            part, seg = self.buckets[k]
            owned = pending.wait()
            if self.in_place:
                r = part.group.rank
                part.main_grads[seg.start + r * seg.shard_numel:seg.start + (r + 1) * seg.shard_numel].copy_(owned)
            else:
                part.main_grads[seg.shard_start:seg.shard_start + seg.shard_numel].copy_(owned)
            self.buffers.transient.add("grad_buckets", -nbytes)
        self.in_flight = []

    def finish(self) -> None:
        """Launch what backward did not (all of them when deferred, after `sum_partials`), wait for the last."""
        if self.defer:
            self.buffers.sum_partials()
            if self.in_place:
                for part, at, p in self.params:
                    if p.grad is not None:
                        part.main_grads[at:at + p.numel()].add_(p.grad.reshape(-1))
                        self.buffers.param_grads.free(p)
        for k in range(len(self.buckets)):
            if k not in self.launched:
                self._launch(k)
        self.retire()
        self._reset()
