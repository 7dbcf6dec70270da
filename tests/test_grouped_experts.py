"""`GroupedExperts` through `torch._grouped_mm` (float32, bfloat16) against a plain per-expert loop.

The reference is written here with plain torch: for each expert, `(silu(x_e @ w1[e]) * (x_e @ w3[e]) * weight_e)
@ w2[e]`, in the same dtype. Tolerances, relative to the largest reference magnitude: float32 1e-5 (the
kernels accumulate in a different order), bfloat16 2e-2 (a few roundings to 8 bits of mantissa). Experts 1
and 3 receive no tokens, so the offsets have repeated values and those experts' weight gradients must be
exactly zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orangetron import memory
from orangetron.model import grouped_mm
from orangetron.model.moe import GroupedExperts

COUNTS = [3, 0, 6, 0, 5]  # tokens per expert; experts 1 and 3 get none
DIM, HIDDEN = 16, 24
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(dtype: torch.dtype, dim: int = DIM, hidden: int = HIDDEN, counts: list[int] = COUNTS):
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(len(counts), dim, hidden)
    for w in experts.parameters():
        w.data = torch.randn(w.shape, generator=g).div(dim**0.5).to(dtype)
    x = torch.randn(sum(counts), dim, generator=g).to(dtype).requires_grad_()
    weights = torch.rand(sum(counts), generator=g).requires_grad_()  # routing weights stay float32
    grad_out = torch.randn(sum(counts), dim, generator=g).to(dtype)
    return experts, x, weights, grad_out


def _reference(experts: GroupedExperts, x, weights, grad_out, counts: list[int] = COUNTS):
    """Outputs and gradients (x, routing weights, w1, w3, w2) of the per-expert loop, in plain torch."""
    w1, w3, w2 = (w.detach().clone().requires_grad_() for w in (experts.w1, experts.w3, experts.w2))
    x, weights = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    outs = []
    for e, (x_e, p_e) in enumerate(zip(x.split(counts), weights.split(counts), strict=True)):
        h = F.silu(x_e @ w1[e]) * (x_e @ w3[e]) * p_e.to(x.dtype)[:, None]
        outs.append(h @ w2[e])
    y = torch.cat(outs)
    y.backward(grad_out)
    return y.detach(), [x.grad, weights.grad, w1.grad, w3.grad, w2.grad]


def _run(experts: GroupedExperts, x, weights, grad_out, counts: list[int] = COUNTS):
    y = experts(x, torch.tensor(counts), weights)
    y.backward(grad_out)
    return y.detach(), [x.grad, weights.grad, experts.w1.grad, experts.w3.grad, experts.w2.grad]


def _calls(monkeypatch) -> list[tuple]:
    """Record the shapes of every torch._grouped_mm call (the offsets as a list)."""
    calls, original = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: calls.append(
        (tuple(a.shape), tuple(b.shape), offs.tolist())) or original(a, b, offs=offs))
    return calls


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.dtype == want.dtype, what
    scale = want.float().abs().max().item()
    assert scale > 0, what
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * scale, f"{what}: {err} > {tol} * {scale}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_loop_forward_and_backward(dtype, monkeypatch):
    experts, x, weights, grad_out = _inputs(dtype)
    want, want_grads = _reference(experts, x, weights, grad_out)
    assert grouped_mm.grouped_mm_accepts(x, experts.w1, experts.w3, experts.w2)  # probes the device once
    calls = _calls(monkeypatch)
    got, grads = _run(experts, x, weights, grad_out)
    ends = [3, 3, 9, 9, 14]
    # gate and up, then down; backward: down's two gradients, then gate's and up's (two each)
    assert len(calls) == 9 and all(offs == ends for *_, offs in calls)
    assert calls[:3] == [((14, DIM), (5, DIM, HIDDEN), ends)] * 2 + [((14, HIDDEN), (5, HIDDEN, DIM), ends)]
    _assert_close(got, want, TOL[dtype], "output")
    for name, g, w in zip(["x", "routing weights", "w1", "w3", "w2"], grads, want_grads, strict=True):
        _assert_close(g, w, TOL[dtype], name)
    for w in grads[2:]:
        assert torch.count_nonzero(w[1]) == 0 and torch.count_nonzero(w[3]) == 0  # experts without tokens
        assert torch.count_nonzero(w[0]) > 0


def test_float64_and_misaligned_shapes_keep_the_loop(monkeypatch):
    calls = _calls(monkeypatch)
    for dtype, dim in [(torch.float64, DIM), (torch.float32, 6), (torch.bfloat16, 12)]:  # 6*4, 12*2: not 16 B
        experts, x, weights, grad_out = _inputs(dtype, dim=dim)
        want, want_grads = _reference(experts, x, weights, grad_out)
        got, grads = _run(experts, x, weights, grad_out)
        tol = 1e-12 if dtype == torch.float64 else TOL[dtype]
        _assert_close(got, want, tol, f"{dtype} output")
        for g, w in zip(grads, want_grads, strict=True):
            _assert_close(g, w, tol, f"{dtype} gradient")
    assert calls == []


def test_without_torch_grouped_mm_the_loop_runs(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm")
    experts, x, weights, grad_out = _inputs(torch.float32)
    want, _ = _reference(experts, x, weights, grad_out)
    _assert_close(_run(experts, x, weights, grad_out)[0], want, TOL[torch.float32], "output")


def test_no_tokens_at_all_and_the_bytes_kept_for_backward(monkeypatch):
    """With no rows, outputs are empty and every weight gradient zero. With rows, the grouped path keeps what the
    loop keeps (the rows, gate, up, routing weights and the hidden product), no offsets tensor, nothing on ctx."""
    experts, x, weights, grad_out = _inputs(torch.float32, counts=[0, 0, 0])
    got, grads = _run(experts, x, weights, grad_out, counts=[0, 0, 0])
    assert got.shape == (0, DIM) and all(torch.count_nonzero(g) == 0 for g in grads[2:])
    kept = {}
    for path in ("grouped", "loop"):
        if path == "loop":
            monkeypatch.setattr(grouped_mm, "_runs_on", lambda device, dtype: False)
        experts, x, weights, grad_out = _inputs(torch.float32)
        with memory.track_activations(experts) as meter:
            y = experts(x, torch.tensor(COUNTS), weights)
        assert memory.tensors_kept_on_ctx(y) == []
        kept[path] = meter.peak_bytes
    n = sum(COUNTS)
    assert kept["grouped"] == kept["loop"] == 4 * (n * DIM + 3 * n * HIDDEN + n)
