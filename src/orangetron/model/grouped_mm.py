"""The experts' SwiGLU through `torch._grouped_mm`: every local expert's rows in one call per projection.

`torch._grouped_mm(a [N, k], b [E, k, n], offs=ends)` multiplies rows `ends[e-1]:ends[e]` of `a` by `b[e]`:
`ends` are cumulative row counts (int32, the last one N; rows past it come back uninitialized, so counts in
their place are wrong silently). Given `a [k, N]` and `b [N, n]` it groups along N instead and returns
[E, k, n], the weight gradient. In torch 2.13 on CPU it takes float32, bfloat16 and float16 (not float64)
and needs every stride but the unit one to be a multiple of 16 bytes (dim and hidden multiples of 4 in
float32, of 8 in bfloat16); an expert without rows is allowed and gets a zero weight gradient. Builds and
devices differ (CUDA kernels for some architectures only, torch versions without the op), so each
(device, dtype) is tried once on tiny tensors before the experts use it; anything else keeps the loop over
experts in `model/moe.py`, float64 always.

`GroupedMM` keeps the offsets as Python ints instead of letting torch's own backward save an int32 tensor, so
what a layer keeps for backward stays what `orangetron/plan/activations.py` counts: the rows and, for the
gate and up projections, their outputs.
"""

from __future__ import annotations

import functools
import itertools

import torch

from .autograd import swiglu_activation

GROUPED_DTYPES = (torch.float32, torch.bfloat16)  # float64 keeps the loop: the kernel has no float64


def offsets(ends: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The int32 offsets tensor on `device`. On CUDA the copy goes from pinned memory, asynchronously: a copy
    from pageable memory would wait for the stream, a host sync per matmul."""
    offs = torch.tensor(ends, dtype=torch.int32)
    if device.type == "cuda":
        return offs.pin_memory().to(device, non_blocking=True)
    return offs if device.type == "cpu" else offs.to(device)


class GroupedMM(torch.autograd.Function):
    """rows [N, k] @ weight[e] [k, n] for each expert e over its rows (`ends`: cumulative counts, `offs` the same
    as an int32 tensor on the rows' device) -> [N, n]; grouped forward, grouped backward (rows' and weight's
    gradients)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, ends: tuple[int, ...],
                offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.ends = ends  # ints, rebuilt in backward: a saved tensor would add to the counted bytes
        return torch._grouped_mm(rows, weight, offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad, offs = grad.contiguous(), offsets(ctx.ends, rows.device)
        grad_rows = torch._grouped_mm(grad, weight.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        grad_weight = torch._grouped_mm(rows.t(), grad, offs=offs) if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight, None, None


def grouped_swiglu(x_sorted: torch.Tensor, counts: list[int], weights_sorted: torch.Tensor | None,
                   w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """`GroupedExperts`' forward by three grouped matmuls: x_sorted [N, dim] grouped by expert (counts[e] rows
    for expert e, summing to N), w1, w3 [E, dim, hidden], w2 [E, hidden, dim] -> [N, dim], each row scaled by
    its routing weight. Call only where `grouped_mm_accepts` holds."""
    ends = tuple(itertools.accumulate(counts))
    offs = offsets(ends, x_sorted.device)
    gate = GroupedMM.apply(x_sorted, w1, ends, offs)  # [N, hidden]
    up = GroupedMM.apply(x_sorted, w3, ends, offs)  # [N, hidden]
    return GroupedMM.apply(swiglu_activation(gate, up, weights_sorted), w2, ends, offs)  # [N, dim]


def grouped_mm_accepts(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `grouped_swiglu` can run on `rows` [N, dim] and the expert weights [E, ., .] (E > 0): float32 or
    bfloat16 in one dtype on one device, 16-byte aligned data and strides, and a torch with the op that runs
    it there."""
    tensors = (rows, *weights)
    if rows.dtype not in GROUPED_DTYPES or not weights or weights[0].shape[0] == 0:
        return False
    if any(t.dtype != rows.dtype or t.device != rows.device or not _aligned(t) for t in tensors):
        return False
    return hasattr(torch, "_grouped_mm") and _runs_on(rows.device, rows.dtype)


def _aligned(t: torch.Tensor) -> bool:
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


@functools.cache
def _runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """The three forms `GroupedMM` calls, once per (device, dtype), with an expert that has no rows. No autograd:
    a probe inside a forward must not add to the bytes saved for backward."""
    with torch.no_grad():
        rows = torch.ones(3, 16, dtype=dtype, device=device)
        weight = torch.ones(2, 16, 8, dtype=dtype, device=device)
        try:
            offs = offsets((0, 3), device)
            out = torch._grouped_mm(rows, weight, offs=offs)  # [3, 8]
            torch._grouped_mm(out, weight.transpose(-2, -1), offs=offs)
            torch._grouped_mm(rows.t(), out, offs=offs)
        except (RuntimeError, NotImplementedError, TypeError):
            return False
    return True
