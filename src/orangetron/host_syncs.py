"""Count the host syncs a block of code would make on a GPU, on CPU, by the operations that cause them.

On CUDA a device-to-host sync happens where the host needs a value or a size that only the device knows:
reading a value (`.item`, `.tolist`, `bool`/`int`/`float`/`index` of a tensor, `.cpu`, `.numpy`, `torch.equal`)
or running an op whose output size depends on the data (`nonzero`, `masked_select`, `unique`, `bincount`,
boolean-mask indexing, `repeat_interleave` without `output_size`). A copy from pageable host memory to the
device waits for the stream too (`torch.cuda.set_sync_debug_mode` reports it), so a tensor built on the host
and moved (`.to(device)`, `torch.tensor(..., device=...)`, `.new_tensor`) counts as well: positions and
indices are made on the device (`torch.arange(..., device=...)`) instead. `count_host_syncs()` patches each of those
entry points for the duration of a block and records one `Sync` per call, wherever it comes from, so a CPU run
counts what a GPU run would wait for. Every call counts: host bookkeeping that must not count is kept in
Python numbers, never in tensors (a tensor on CPU here stands for one on the device there).

Each sync is attributed to the region of the code it comes from, by the innermost frame of the call stack
that lies in one of `REGIONS`' folders or files (backward functions run with only their own frames on the
stack, which are in those files too).

tests/test_host_syncs.py holds the budget to this count on CPU ranks; scripts/gpu_check.py reports it for one
step on the device it checks, beside what `torch.cuda.set_sync_debug_mode` sees there.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parent
_HERE = Path(__file__).resolve()
REGIONS = {
    "attention": ("parallel/context/", "model/attention.py"),
    "experts": ("parallel/expert/", "model/moe.py", "model/grouped_mm.py"),
}

# (owner, attribute): every value read or data-dependent size on the host.
READS = [(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                                           "numpy")] + [(torch, "equal")]
SIZED = [(owner, name) for owner in (torch, torch.Tensor)
         for name in ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount")]


@dataclass(frozen=True)
class Sync:
    """One sync: what caused it, the region it is attributed to ("other" outside `REGIONS`), and where."""

    op: str
    region: str
    site: str  # innermost orangetron frame, "path:line function"


def _where() -> tuple[str, str]:
    frame, site, region = sys._getframe(2), "", "other"
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path.is_relative_to(SRC) and path != _HERE:  # this file's own frames are the counter's
            rel = path.relative_to(SRC).as_posix()
            site = site or f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
            found = [name for name, prefixes in REGIONS.items() if rel.startswith(prefixes)]
            if found:
                return found[0], site
        frame = frame.f_back
    return region, site


def _is_mask(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _sized_by_data(x: torch.Tensor, *args, **kwargs) -> bool:
    repeats = args[0] if args else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


def _names_device(x: torch.Tensor, *args, **kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)


@contextmanager
def count_host_syncs() -> Iterator[list[Sync]]:
    """Record every host sync made inside the block (any thread) into the yielded list."""
    syncs: list[Sync] = []
    busy = [False]  # a sync inside a counted one (torch's own Python code) is the same sync

    def counted(op: str, original, when=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if busy[0] or not when(*args, **kwargs):
                return original(*args, **kwargs)
            busy[0] = True
            try:
                syncs.append(Sync(op, *_where()))
                return original(*args, **kwargs)
            finally:
                busy[0] = False
        return wrapper

    patches = [(owner, name, counted(name, getattr(owner, name))) for owner, name in READS + SIZED]
    patches += [(owner, "repeat_interleave", counted("repeat_interleave", owner.repeat_interleave, _sized_by_data))
                for owner in (torch, torch.Tensor)]
    patches.append((torch.Tensor, "to", counted("copy to device", torch.Tensor.to, _names_device)))
    patches.append((torch, "tensor", counted("copy to device", torch.tensor, lambda *a, **k: "device" in k)))
    patches.append((torch.Tensor, "new_tensor", counted("copy to device", torch.Tensor.new_tensor)))
    patches.append((torch.Tensor, "__getitem__", counted("mask index", torch.Tensor.__getitem__,
                                                         lambda x, index: _is_mask(index))))
    patches.append((torch.Tensor, "__setitem__", counted("mask index", torch.Tensor.__setitem__,
                                                         lambda x, index, value: _is_mask(index)
                                                         and isinstance(value, torch.Tensor))))
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    for owner, name, wrapper in patches:
        setattr(owner, name, wrapper)
    try:
        yield syncs
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)  # inherited (torch.Tensor's base class): take the patch off
            else:
                setattr(owner, name, original)
