"""One flat data-parallel buffer: the parameters it holds, the group it shards over, and its slices.

`DataParallelBuffers` keeps one for the dense parameters (over dp x cp) and, under expert parallelism, one for the
routed experts (over edp): each rank owns `[r * s, (r + 1) * s)` of every buffer of a part, with
`s = ceil(numel / n)` (`plan.sharding`, shared with the planner).

A buffer is cut into segments, each padded to a multiple of n and sharded on its own: ZeRO-3's units, or the
equal gradient buckets of ZeRO-1/2 and the distributed optimizer with `grad_bucket_numel`
(`plan.sharding.bucket_layout`), whose padding lies at the end of the last one. A rank then owns slice r of
every segment; laid one after another, these slices are its shard layout (of `main_params`, the AdamW moments
and ZeRO-2's gradients). For equal buckets the owned slices of a full buffer are one strided view
`[buckets, s_bucket]`, so the optimizer still updates the parameters where they lie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.config import DTYPES, ParallelConfig
from orangetron.spec.sharding import bucket_layout, padded_numel, shard_numel

if TYPE_CHECKING:
    from orangetron.parallel.data.transient import TransientPeaks


@dataclass
class Segment:
    """One unit's share of a part: its own padded buffer under ZeRO-3 (the whole part otherwise)."""

    unit: int
    start: int  # offset in the part's padded layout (units one after another, each padded to n)
    numel: int
    padded: int
    shard_start: int  # offset of this rank's slice in the part's shard layout
    shard_numel: int
    flat: torch.Tensor | None = None  # the gathered parameters (storage freed between uses under ZeRO-3)


class FlatPart:
    """Flat parameter, main-gradient and main-parameter buffers of `named` parameters over `group`.

    Under ZeRO-3 `unit_of` gives each parameter's unit (`parallel.data.units`): every unit is padded to a multiple
    of n on its own and gathered alone, and a rank's shard is its slice of every unit, one after another.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], group: MeshGroup, config: ParallelConfig,
                 device: torch.device, unit_of: dict[str, int] | None = None) -> None:
        self.group, self.config, self.device = group, config, device
        self.zero3 = config.zero_stage == 3
        self.shards = group.size if config.shards_optimizer else 1
        unit_of = unit_of if self.zero3 and unit_of else {}
        self.named = sorted(named, key=lambda item: unit_of.get(item[0], 0))  # stable: units stay contiguous
        self.numel = sum(p.numel() for _, p in named)
        self.unit_of = [unit_of.get(n, 0) for n, _ in self.named]
        self.bucketed = not self.zero3 and self.shards > 1 and config.grad_bucket_numel > 0
        self.segments = self._buckets() if self.bucketed else self._segments(self.unit_of)
        self.padded_numel = sum(s.padded for s in self.segments)
        self.shard_numel = sum(s.shard_numel for s in self.segments)
        # Shard-layout tensors: [buckets, slice] for equal buckets (a strided view of a full buffer), else flat.
        self.shard_shape = (len(self.segments), self.segments[0].shard_numel) if self.bucketed else (self.shard_numel,)
        self.owned = self._owned_index()  # this rank's elements of every padded-layout buffer
        self._build()

    def _buckets(self) -> list[Segment]:
        count, size = bucket_layout(self.numel, self.config.grad_bucket_numel, self.shards)
        s = size // self.shards
        return [Segment(0, k * size, min(size, self.numel - k * size), size, k * s, s) for k in range(count)]

    def _segments(self, units: list[int]) -> list[Segment]:
        sizes: dict[int, int] = {}
        for unit, (_, p) in zip(units, self.named, strict=True):
            sizes[unit] = sizes.get(unit, 0) + p.numel()
        out, start, shard_start = [], 0, 0
        for unit, numel in sizes.items():
            s = shard_numel(numel, self.shards)
            out.append(Segment(unit, start, numel, padded_numel(numel, self.shards), shard_start, s))
            start, shard_start = start + out[-1].padded, shard_start + s
        return out

    def _owned_index(self) -> slice | torch.Tensor:
        r = self.group.rank if self.shards > 1 else 0
        if len(self.segments) == 1:
            return slice(r * self.shard_numel, (r + 1) * self.shard_numel)
        return torch.cat([torch.arange(s.start + r * s.shard_numel, s.start + (r + 1) * s.shard_numel,
                                       device=self.device) for s in self.segments])

    def owned_view(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of the full padded-layout buffer `full`, as a view in `shard_shape` (one slice,
        or one strided row per bucket); ZeRO-3's unequal units have none (see `take_owned`)."""
        if not self.bucketed:
            return full[self.owned]
        count, s = self.shard_shape
        r = self.group.rank
        return full.as_strided((count, s), (self.segments[0].padded, 1), full.storage_offset() + r * s)

    def _build(self) -> None:
        cfg = self.config
        self.offsets: dict[str, int] = {}  # each parameter's offset in the padded layout
        with torch.no_grad():
            if self.zero3:  # one buffer per unit, freed between uses
                for seg in self.segments:
                    seg.flat = torch.zeros(seg.padded, dtype=DTYPES[cfg.param_dtype], device=self.device)
            else:  # one buffer; segments (buckets) are views of it
                self.flat_params = torch.zeros(self.padded_numel, dtype=DTYPES[cfg.param_dtype], device=self.device)
                for seg in self.segments:
                    seg.flat = self.flat_params[seg.start:seg.start + seg.padded]
            by_unit = {s.unit: s for s in self.segments}  # ZeRO-3's units; else every parameter is in unit 0
            local = dict.fromkeys(self.unit_of, 0)  # the next free element of each unit's buffer
            for (name, p), unit in zip(self.named, self.unit_of, strict=True):
                buffer, base = (by_unit[unit].flat, by_unit[unit].start) if self.zero3 else (self.flat_params, 0)
                at = local[unit]
                buffer[at:at + p.numel()].copy_(p.reshape(-1))
                p.data = buffer[at:at + p.numel()].view(p.shape)  # the module now computes on the buffer
                self.offsets[name] = base + at
                local[unit] = at + p.numel()
        r = self.group.rank if self.shards > 1 else 0
        if self.zero3:
            self.param_shard = torch.cat([s.flat[r * s.shard_numel:(r + 1) * s.shard_numel] for s in self.segments])
        else:
            self.param_shard = self.owned_view(self.flat_params)
        main_dtype = torch.float32 if cfg.mixed_precision else DTYPES[cfg.param_dtype]
        self.main_params = self.param_shard.to(main_dtype, copy=True) if cfg.mixed_precision else self.param_shard
        grads = self.shard_numel if cfg.zero_stage >= 2 else self.padded_numel
        self.main_grads = torch.zeros(grads, dtype=main_dtype, device=self.device)
        if self.zero3:
            self.release()

    def shard_of(self, seg: Segment) -> torch.Tensor:
        """This rank's slice of `seg` in the shard-layout buffers (param_shard, main_params, ZeRO-2/3 grads)."""
        return self.param_shard[seg.shard_start:seg.shard_start + seg.shard_numel]

    def release(self, seg: Segment | None = None) -> None:
        # The parameters stay views of the segment's buffer; only its storage goes (tensors saved for backward
        # keep referring to it and see the values again once it is re-gathered).
        for s in [seg] if seg is not None else self.segments:
            s.flat.untyped_storage().resize_(0)

    def is_gathered(self, seg: Segment) -> bool:
        return seg.flat.untyped_storage().nbytes() > 0

    def gather_start(self, seg: Segment) -> comm.Pending:
        """Start gathering `seg`'s full parameters into its buffer (allocated here when freed)."""
        nbytes = seg.padded * seg.flat.element_size()
        if self.zero3 and seg.flat.untyped_storage().nbytes() != nbytes:
            seg.flat.untyped_storage().resize_(nbytes)
        # Under ZeRO-1/2 the shard is a view of the buffer being gathered into, so it travels as a copy.
        r = self.group.rank
        shard = self.shard_of(seg) if self.zero3 else seg.flat[r * seg.shard_numel:(r + 1) * seg.shard_numel].clone()
        return comm.all_gather_into_start(seg.flat, shard, self.group)

    def gather(self) -> None:
        for seg in self.segments:
            self.gather_start(seg).wait()

    def reduce(self, divisor: int, transient: TransientPeaks, free: Callable[[torch.Tensor], None]) -> None:
        """Sum the parameters' gradients over the group into `main_grads`, divided by `divisor`; the buffers it
        allocates on the way count in `transient`'s `grad_buckets` until they are freed here, and each `.grad`
        goes through `free` once copied."""
        cfg = self.config
        # DDP and ZeRO-1 collect into the persistent full buffer; ZeRO-2/3 only into a temporary one.
        if cfg.zero_stage >= 2:
            full = torch.zeros(self.padded_numel, dtype=DTYPES[cfg.wire_dtype], device=self.device)
        else:
            full = self.main_grads
        for name, p in self.named:
            at = self.offsets[name]
            if p.grad is not None:
                full[at:at + p.numel()].copy_(p.grad.reshape(-1))
            else:
                full[at:at + p.numel()].zero_()
            free(p)
        wire = full.to(DTYPES[cfg.wire_dtype])  # no copy when the dtypes already agree
        # The temporary full buffer (ZeRO-2) or the wire copy, then the collective's result: all_reduce is out
        # of place (a full buffer), reduce_scatter returns the slice; over a group of one neither allocates.
        held = wire.numel() if wire.data_ptr() != self.main_grads.data_ptr() else 0
        if self.group.size > 1:
            held += self.padded_numel if self.shards == 1 else self.shard_numel
        nbytes = held * wire.element_size()
        transient.add("grad_buckets", nbytes)
        if self.shards == 1:
            self.main_grads.copy_(comm.all_reduce(wire, self.group))
        else:
            self.owned_grads().copy_(comm.reduce_scatter(wire, self.group))
        transient.add("grad_buckets", -nbytes)
        self.owned_grads().div_(divisor)

    def owned_grads(self) -> torch.Tensor:
        """This rank's main gradients in `shard_shape`, a view (aligned with `main_params`)."""
        if self.config.zero_stage >= 2:
            return self.main_grads.view(self.shard_shape)
        return self.owned_view(self.main_grads)

    def owned_mask(self, rule) -> torch.Tensor:
        mask = torch.zeros(self.padded_numel, dtype=torch.bool, device=self.device)
        for name, p in self.named:
            mask[self.offsets[name]:self.offsets[name] + p.numel()] = rule(name, p)
        return self.take_owned(mask)

    def take_owned(self, full: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's elements of a padded-layout buffer, in `shard_shape`."""
        return full[self.owned].reshape(self.shard_shape).clone()

    def gather_owned(self, owned: torch.Tensor) -> torch.Tensor:
        """The full padded flat buffer from every rank's owned slice (no copy when nothing is sharded)."""
        if self.shards == 1:
            return owned
        gathered = owned.new_empty(self.shard_numel * self.shards)
        comm.all_gather_into(gathered, owned.contiguous().view(-1), self.group)
        rows = gathered.view(self.shards, self.shard_numel)  # [ranks, shard layout]
        return torch.cat([rows[:, s.shard_start:s.shard_start + s.shard_numel].reshape(-1) for s in self.segments])

    def locals_by_name(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[self.offsets[name]:self.offsets[name] + p.numel()].view(p.shape).clone()
                for name, p in self.named}
