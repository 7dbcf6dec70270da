"""Bytes a rank keeps: model state by category, and activations saved for backward.

Every figure is read off the actual tensors; storages shared by several tensors (tied embeddings, views,
a flat gradient buffer) are counted once.
"""

from __future__ import annotations

import tracemalloc
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from orangetron.spec.categories import CATEGORIES, TRANSIENT  # the cost model's categories, measured here


@dataclass
class _Report:
    """The figures `report()` returns, all measured on one model (`model` is a weak reference to it)."""

    model: weakref.ref | None = None
    values: dict[str, int] = field(default_factory=dict)


# What `report()` returns: per process, as the ledger, since measurements happen wherever a model runs. It holds
# the last measured model weakly and starts over whenever another model is measured.
_report = _Report()


def _measured_model(model: nn.Module | None) -> nn.Module | None:
    # A wrapper that exposes the wrapped model as `.module` (ParallelModel, torch's DDP) counts as that model,
    # so its model state and the activations of the module it wraps make one report.
    while model is not None and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _note(model: nn.Module | None, values: dict[str, int]) -> None:
    """Add a measurement to the report; a measurement of another model (or of none) starts a new one."""
    global _report
    model = _measured_model(model)
    same = model is not None and _report.model is not None and _report.model() is model
    if not same:
        _report = _Report(weakref.ref(model) if model is not None else None)
    _report.values.update(values)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # The storage object's identity, not its data pointer: ZeRO-3 frees and re-allocates a parameter
    # buffer's memory between forward and backward, and its weights must still be recognized as such.
    return str(t.device), t.untyped_storage()._cdata


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage reached twice counts once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        seen[_storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    if hasattr(optimizer, "state_tensors"):
        yield from optimizer.state_tensors()
        return
    for state in optimizer.state.values():
        for value in state.values():
            # Scalar step counters are bookkeeping, not state that scales with the model.
            if torch.is_tensor(value) and value.dim() > 0:
                yield value


def model_state_bytes(
    model: nn.Module,
    optimizer: Any = None,
    main_params: Iterable[torch.Tensor] = (),
) -> dict[str, int]:
    """Bytes of params, grads, fp32 main params and optimizer state held by this rank.

    A wrapper with `transient_peaks()` (`ParallelModel`) adds the peaks of what exists only during a step:
    `gathered_params` (ZeRO-3's full units), `grad_buckets` (gradient wire buffers in flight) and `param_grads`
    (per-parameter `.grad` tensors not yet moved into the flat buffers).

    `main_params` are the fp32 master copies a mixed-precision optimizer keeps; when the model itself
    trains in fp32 there are none and the category is 0, as in the cost model. A wrapper that owns its
    buffers (`ParallelModel`) reports them through `state_tensors()`; an optimizer may do the same.
    """
    if hasattr(model, "state_tensors"):
        owned = model.state_tensors()
        params, grads, main_params = owned["params"], owned["grads"], [*owned["main_params"], *main_params]
    else:
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
    report = {
        "params": unique_storage_bytes(params),
        "grads": unique_storage_bytes(grads),
        "main_params": unique_storage_bytes(main_params),
        "optimizer": unique_storage_bytes(_optimizer_tensors(optimizer)),
    }
    if hasattr(model, "transient_peaks"):  # buffers that live only during a step, at their peak
        report |= model.transient_peaks()
    _note(model, report)
    return report


@dataclass
class ActivationMeter:
    """Live and peak bytes of distinct storages that autograd holds for backward."""

    excluded: set[tuple[str, int]] = field(default_factory=set)
    live_bytes: int = 0
    peak_bytes: int = 0
    _refcounts: dict[tuple[str, int], int] = field(default_factory=dict)

    def _pack(self, t: torch.Tensor) -> object:
        key = _storage_key(t)
        if key in self.excluded or t.numel() == 0:
            return t
        if self._refcounts.get(key, 0) == 0:
            self.live_bytes += t.untyped_storage().nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refcounts[key] = self._refcounts.get(key, 0) + 1
        holder = _SavedTensor(t)
        # Autograd drops the holder when it frees the graph; that is when the bytes are released.
        weakref.finalize(holder, self._release, key, t.untyped_storage().nbytes())
        return holder

    def _release(self, key: tuple[str, int], nbytes: int) -> None:
        self._refcounts[key] -= 1
        if self._refcounts[key] == 0:
            del self._refcounts[key]
            self.live_bytes -= nbytes

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _SavedTensor) else saved


class _SavedTensor:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@contextmanager
def track_activations(model: nn.Module | None = None) -> Iterator[ActivationMeter]:
    """Measure the bytes saved for backward inside the block (forward and backward both).

    Parameters of `model` that autograd saves (a weight kept by a matmul) are model state, not
    activations, and are excluded. The peak covers the whole block; run forward and backward in it.
    """
    meter = ActivationMeter()
    if model is not None:
        meter.excluded = {_storage_key(p) for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(meter._pack, meter._unpack):
        yield meter
    _note(model, {"activations": meter.peak_bytes})


def report() -> dict[str, int | None]:
    """Bytes by category of the model measured last in this process, None where that model has no figure.

    The report belongs to one model: `model_state_bytes` and `track_activations` add to it while they
    measure the same model, and a measurement of another model (or of none) starts a new report, so a
    figure of an earlier model is never returned. Once the measured model is freed every entry is None.
    """
    model = _report.model
    if model is not None and model() is None:
        return dict.fromkeys(CATEGORIES)
    # The transient peaks appear when the model measured has them (a `ParallelModel`).
    names = CATEGORIES + tuple(t for t in TRANSIENT if t in _report.values)
    return {name: _report.values.get(name) for name in names}


# ---- tensors kept outside save_for_backward --------------------------------------------------------


def custom_function_nodes(outputs: Any) -> list[Any]:
    """The nodes of custom `torch.autograd.Function`s in the graph behind `outputs`, outputs first.

    Such a node is the Function's `ctx`, so whatever its forward stored as an attribute lives on it.
    `outputs`: a tensor or any nesting of lists, tuples and dicts of tensors.
    """
    return _custom_nodes_below([t.grad_fn for t in _tensors_within(outputs) if t.grad_fn is not None])


def _custom_nodes_below(roots: list[Any]) -> list[Any]:
    stack = list(roots)
    # Held, not only their ids: torch 2.11 makes a fresh Python object for a built-in node on each access and
    # frees it after, so the id of a node already walked may come back for another and cut the walk short.
    seen: dict[int, Any] = {}
    found = []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            found.append(node)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return found


def tensors_kept_on_ctx(outputs: Any) -> list[str]:
    """Tensors that custom autograd Functions behind `outputs` keep as ctx attributes, e.g.
    `["RMSNormFunctionBackward.x: float32[2, 8]"]`; empty when every Function saves via `save_for_backward`.

    `track_activations` sees only tensors saved through `save_for_backward` (autograd's saved-tensor
    hooks); one stored as `ctx.x = x`, or inside a list, dict or small object on ctx, escapes the count
    while still held until backward. Call this on a forward's outputs (before backward) to prove none did.
    """
    kept = []
    for node in custom_function_nodes(outputs):
        for name, value in vars(node).items():
            kept += [f"{type(node).__name__}.{name}{path}: {_describe(t)}" for path, t in _tensors_inside(value)]
    return kept


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _tensors_within(value: Any) -> list[torch.Tensor]:
    return [t for _, t in _tensors_inside(value)]


def _tensors_inside(value: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in `value`, looking into containers and plain objects' attributes."""
    if torch.is_tensor(value):
        yield path, value
        return
    if depth > 6:  # deep enough for any handle a Function keeps; also stops reference cycles
        return
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    elif _is_plain_object(value):
        items = [(f".{k}", v) for k, v in vars(value).items()]
    else:
        return
    for step, item in items:
        yield from _tensors_inside(item, path + step, depth + 1)


def _is_plain_object(value: Any) -> bool:
    # Look inside the project's own objects (dispatch handles, mesh groups); a module's parameters are model
    # state, and torch's own objects (process groups) hold no activations.
    module = type(value).__module__ or ""
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type))
            and not callable(value) and not module.startswith("torch"))


class AllocationPeak:
    """Peak bytes allocated inside the block above what was live before it: torch's allocations (the
    profiler's allocation events) plus Python's (tracemalloc)."""

    torch_bytes = 0
    python_bytes = 0

    @property
    def total(self) -> int:
        return self.torch_bytes + self.python_bytes


# Python's allocation tracing, once a peak measurement starts it, stays on for the rest of the process:
# tracemalloc.stop() can crash the interpreter when a thread Python did not start (one of gloo's, taking the GIL
# to free a tensor) allocates at that moment (CPython gh-128679, fixed in 3.12.9 and 3.13.2; related races are
# still open upstream). Later measurements clear the traces instead, so the frees of earlier objects never count.
_tracing_ours = False


@contextmanager
def peak_allocations() -> Iterator[AllocationPeak]:
    """Measure the peak bytes the block allocates (torch's and Python's); read the result after the block.

    Python's tracing stays on afterwards (see `_tracing_ours`). Under a tracer someone else started, its peak is
    reset and frees of objects it traced before the block count against the block."""
    global _tracing_ours
    from torch._C._profiler import _EventType  # the profiler loads only where a peak is measured
    from torch.profiler import ProfilerActivity, profile

    peak = AllocationPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if not tracemalloc.is_tracing():
            tracemalloc.start()  # inside the profiler: its own Python records are not the block's
            _tracing_ours = True
        elif _tracing_ours:
            tracemalloc.clear_traces()
        tracemalloc.reset_peak()
        live_before = tracemalloc.get_traced_memory()[0]
        try:
            yield peak
        finally:
            peak.python_bytes = max(0, tracemalloc.get_traced_memory()[1] - live_before)
    events = []

    def walk(event) -> None:
        if event.typed[0] == _EventType.Allocation:
            events.append((event.start_time_ns, event.typed[1].alloc_size))
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = 0
    for _, size in sorted(events):
        live += size
        peak.torch_bytes = max(peak.torch_bytes, live)
