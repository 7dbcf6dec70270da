"""ZeRO-3 by unit: which parameters form a unit, and when each unit is gathered, freed and reduced.

A unit is one transformer block, the embedding, or the rest of the model (the head: final norm and output
layer; with tied embeddings the embedding joins it, since the head reuses its matrix). A module without
`layers` is one unit. Per unit, as FSDP2's `fully_shard` per block:

- forward: gathered just before the unit runs (a forward pre-hook on its entry module), freed right after
  (post-hook); the head, whose output layer runs outside any module, from its norm to the end of forward;
- backward: gathered again when the gradient of its output arrives, freed once every parameter of the unit
  has its gradient, which is then reduce-scattered at once (asynchronously) while backward goes on;
- prefetch: entering a unit starts the next unit's gather (forward order; reverse order in backward);
- `zero3_keep_params`: the forward's gathered parameters stay until the unit's backward (no second gather).

Gradient reduce-scatters in flight are retired (waited for and added into the main gradients) before the
next one starts, so at most one unit's wire buffer exists at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from orangetron import comm
from orangetron.parallel.config import DTYPES
from orangetron.parallel.data.flat import FlatPart, Segment

if TYPE_CHECKING:
    from orangetron.parallel.data.buffers import DataParallelBuffers


@dataclass
class Unit:
    """Parameters gathered and freed together; `enter` runs them (None: from the start of forward)."""

    index: int
    enter: nn.Module | None
    bounded: bool  # freed after `enter` runs; else at the end of forward
    names: list[str] = field(default_factory=list)


def find_units(module: nn.Module, names: list[str]) -> list[Unit]:
    """The units of `module` in forward order, each with the trainable parameter `names` it holds."""
    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.ModuleDict):  # a pipeline stage's layers, by global index
        layers = list(layers.values())
    if not isinstance(layers, (nn.ModuleList, list)) or len(layers) == 0:
        return [Unit(0, None, False, list(names))]
    embedding, norm = getattr(module, "tok_embeddings", None), getattr(module, "norm", None)
    tied = bool(getattr(getattr(module, "cfg", None), "tied_embeddings", False))
    separate_embedding = isinstance(embedding, nn.Module) and isinstance(norm, nn.Module) and not tied
    units = [Unit(0, embedding, True)] if separate_embedding else []
    units += [Unit(len(units) + i, block, True) for i, block in enumerate(layers)]
    rest = Unit(len(units), norm if separate_embedding else None, False)
    owner = {}
    for unit in units:
        for name, _ in unit.enter.named_parameters():
            owner[_qualified(module, unit.enter, name)] = unit
    for name in names:
        owner.get(name, rest).names.append(name)
    return [u for u in [*units, rest] if u.names]


def _qualified(root: nn.Module, sub: nn.Module, name: str) -> str:
    prefix = next(n for n, m in root.named_modules() if m is sub)
    return f"{prefix}.{name}" if prefix else name


class Zero3Schedule:
    """Hooks the units of `buffers` (`buffers.units`) for per-unit gather, prefetch, release and gradient
    reduce-scatter."""

    def __init__(self, buffers: DataParallelBuffers) -> None:
        self.buffers, self.units = buffers, buffers.units
        units = self.units
        self.prefetch, self.keep = buffers.config.zero3_prefetch, buffers.config.zero3_keep_params
        # Each unit's segment in each part (a unit with no expert parameters has none in the expert part).
        self.segments: list[list[tuple[FlatPart, Segment]]] = [
            [(part, seg) for part in buffers.parts for seg in part.segments if seg.unit == u]
            for u in range(len(units))]
        self.pending: dict[int, list[comm.Pending]] = {}
        self.in_flight: list[tuple[torch.Tensor, Segment, FlatPart, comm.Pending, int]] = []
        self.events: list[tuple[str, int]] = []  # ("gather" | "reduce", unit) launches, for overlap checks
        self.size = [len(u.names) for u in units]
        index = {name: k for k, u in enumerate(units) for name in u.names}
        for name, p in buffers.named:
            p.register_post_accumulate_grad_hook(partial(self._on_grad, index[name]))
        for unit in units:
            if unit.enter is not None:
                unit.enter.register_forward_pre_hook(partial(self._enter_forward, unit.index))
                unit.enter.register_forward_hook(partial(self._leave_forward, unit.index))
        self.sync = True
        self.defer = buffers.held_to_step  # the units' reduce-scatters wait for `sum_partials` at the step
        self._end_backward()

    # ---- gathering --------------------------------------------------------------------------------

    def gathered(self, u: int) -> bool:
        return all(part.is_gathered(seg) for part, seg in self.segments[u])

    def start(self, u: int) -> None:
        """Start gathering unit `u` unless it is gathered or on its way."""
        if u < 0 or u >= len(self.units) or u in self.pending or self.gathered(u):
            return
        self.events.append(("gather", u))
        pending = []
        for part, seg in self.segments[u]:
            self.buffers.transient.add("gathered_params", seg.padded * seg.flat.element_size())
            pending.append(part.gather_start(seg))
        self.pending[u] = pending

    def ready(self, u: int) -> None:
        """Unit `u`'s parameters are gathered when this returns."""
        self.start(u)
        for pending in self.pending.pop(u, []):
            pending.wait()

    def release(self, u: int) -> None:
        self.ready(u)  # a prefetch still in flight must land before its buffer goes
        for part, seg in self.segments[u]:
            if part.is_gathered(seg):
                self.buffers.transient.add("gathered_params", -seg.padded * seg.flat.element_size())
                part.release(seg)

    def gather_all(self) -> None:
        for u in range(len(self.units)):
            self.ready(u)

    def release_all(self) -> None:
        for u in range(len(self.units)):
            self.release(u)

    # ---- forward ------------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        for unit in self.units:
            if unit.enter is None:
                self.ready(unit.index)
        if self.prefetch:
            first = next((u.index for u in self.units if u.enter is not None), None)
            if first is not None:
                self.start(first)

    def _enter_forward(self, u: int, module: nn.Module, args: Any) -> None:
        self.ready(u)
        if self.prefetch:
            self.start(u + 1)

    def _leave_forward(self, u: int, module: nn.Module, args: Any, out: Any) -> None:
        if not self.units[u].bounded:
            return
        if torch.is_grad_enabled():
            outputs = [t for t in _tensors(out) if t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(outputs, partial(self._enter_backward, u), mode="any")
            if self.keep and outputs:
                return
        self.release(u)

    def end_forward(self, out: Any) -> None:
        outputs = [t for t in _tensors(out) if t.requires_grad] if torch.is_grad_enabled() else []
        for unit in self.units:
            if not (unit.bounded or (self.keep and outputs)):
                self.release(unit.index)
        if outputs:  # whichever output's gradient arrives first starts backward with the unbounded units
            torch.autograd.graph.register_multi_grad_hook(outputs, self._begin_backward, mode="any")

    # ---- backward -----------------------------------------------------------------------------------

    def _begin_backward(self, grad: torch.Tensor) -> None:
        self._watch_backward()
        for unit in self.units:
            if not unit.bounded:
                self.ready(unit.index)
        if self.prefetch:
            last = max((u.index for u in self.units if u.bounded), default=None)
            if last is not None:
                self.start(last)

    def _enter_backward(self, u: int, grad: torch.Tensor) -> None:
        self._watch_backward()
        self.ready(u)
        if self.prefetch:
            self.start(u - 1)

    def _watch_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_grad(self, u: int, param: torch.Tensor) -> None:
        self.arrived[u] += 1
        if self.arrived[u] == self.size[u]:
            self._unit_done(u)

    def _unit_done(self, u: int) -> None:
        if u in self.done:
            return
        self.done.add(u)
        if self.sync and not self.defer:
            self.reduce(u)
        self.release(u)

    def _finish_backward(self) -> None:
        for u in range(len(self.units)):  # units some of whose parameters got no gradient
            self._unit_done(u)
        self.retire()
        self._end_backward()

    def _end_backward(self) -> None:
        self.in_backward = False
        self.arrived = [0] * len(self.units)
        self.done: set[int] = set()

    # ---- gradient reduce-scatter --------------------------------------------------------------------

    def reduce(self, u: int) -> None:
        """Reduce-scatter unit `u`'s gradients into this rank's main gradients; frees their `.grad`."""
        self.events.append(("reduce", u))
        wire_dtype = DTYPES[self.buffers.config.wire_dtype]
        for part, seg in self.segments[u]:
            self.retire()  # one wire buffer at a time
            wire = torch.zeros(seg.padded, dtype=wire_dtype, device=part.device)  # padded to a multiple of n
            for (name, p), unit in zip(part.named, part.unit_of, strict=True):
                if unit == u and p.grad is not None:
                    at = part.offsets[name] - seg.start
                    wire[at:at + p.numel()].copy_(p.grad.reshape(-1))
                    self.buffers.param_grads.free(p)  # the wire holds it now
            nbytes = (seg.padded + seg.shard_numel) * wire.element_size()  # the wire and its reduced slice
            self.buffers.transient.add("grad_buckets", nbytes)
            self.in_flight.append((wire, seg, part, comm.reduce_scatter_start(wire, part.group), nbytes))

    def retire(self) -> None:
        """Wait for the reduce-scatters in flight and add their slices into the main gradients."""
        for _wire, seg, part, pending, nbytes in self.in_flight:
            owned = pending.wait()
            part.main_grads[seg.shard_start:seg.shard_start + seg.shard_numel].add_(owned)
            self.buffers.transient.add("grad_buckets", -nbytes)
        self.in_flight = []

    def reduce_all(self) -> None:
        """The deferred reduction (partial tp gradients are summed first): every unit, one at a time."""
        for u in range(len(self.units)):
            self.reduce(u)
        self.retire()


def _tensors(out: Any) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _tensors(item)]
    return []
