"""`FlatAdamW`: torch's fused AdamW over views of one flat shard, against torch.optim.AdamW.

The shard holds several parameters, some decayed (matrices) and some not (norms, biases), in runs; laid out
flat, or in rows of buckets as ZeRO with gradient buckets lays it. Three steps must equal
torch.optim.AdamW (foreach=False, two parameter groups) in float64 and float32, and the moments must stay
the two flat tensors a checkpoint stores.

Tolerance: the fused kernel forms the second moment with a fused multiply-add, so an element may differ by
one rounding (half an ulp of its magnitude) per step from the unfused update, and the parameter inherits it
through the step size; over three steps we allow 8 units of the dtype's epsilon times the largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

from orangetron.parallel.data.optim import FlatAdamW, decay_runs

SIZES = [(6, True), (3, False), (5, True), (2, False), (4, False), (8, True)]  # (numel, decays), in order
LR, BETAS, EPS, WD = 0.05, (0.9, 0.95), 1e-8, 0.1


def _reference(params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> tuple[list, torch.optim.AdamW]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [{"params": [p for p, (_, d) in zip(ps, SIZES, strict=True) if d], "weight_decay": WD},
              {"params": [p for p, (_, d) in zip(ps, SIZES, strict=True) if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return ps, opt


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_flat_adamw_equals_torch_adamw(dtype, rows, monkeypatch):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g, dtype=dtype) for n, _ in SIZES]
    grads = [[torch.randn(n, generator=g, dtype=dtype) for n, _ in SIZES] for _ in range(3)]
    mask = torch.cat([torch.full((n,), d) for n, d in SIZES])
    shape = (rows, mask.numel() // rows)
    flat = torch.cat(params).reshape(shape)
    opt = FlatAdamW(flat, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decay_mask=mask.reshape(shape))
    calls = []
    fused = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(k["weight_decay"]) or fused(*a, **k))
    for step_grads in grads:
        opt.step(torch.cat(step_grads).reshape(shape))
    assert calls == [WD, 0.0] * 3  # one fused call per group and step
    want, ref = _reference(params, grads)
    moments = [torch.cat([ref.state[p][key] for p in want]) for key in ("exp_avg", "exp_avg_sq")]
    for got, expected in zip([flat, *opt.state_tensors()], [torch.cat([p.detach() for p in want]), *moments],
                             strict=True):
        assert got.shape == shape
        bound = 8 * torch.finfo(dtype).eps * expected.abs().max().item()
        assert (got.reshape(-1) - expected).abs().max().item() <= bound


def test_decay_runs_cut_the_mask_where_it_changes():
    mask = torch.tensor([True, True, False, False, False, True, False])
    assert decay_runs(mask, 7) == [(0, 2, True), (2, 5, False), (5, 6, True), (6, 7, False)]
    assert decay_runs(None, 4) == [(0, 4, True)]
    assert decay_runs(torch.tensor([False] * 3), 3) == [(0, 3, False)]


SCHEDULE = [0.05, 0.02, 0.08, 0.01, 0.04]  # one lr per step, set between steps as a scheduler does


@pytest.mark.parametrize("kernel", ["fused", "fallback"])
def test_flat_adamw_follows_an_lr_schedule_in_float64_for_both_groups(kernel, monkeypatch):
    """Five float64 steps under a changing lr, against torch.optim.AdamW (foreach=False) within 1e-12
    relative, decayed and undecayed parameters checked apart; "fallback" runs without torch's kernel."""
    if kernel == "fallback":
        monkeypatch.delattr(torch, "_fused_adamw_")
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=g, dtype=torch.float64) for n, _ in SIZES]
    grads = [[torch.randn(n, generator=g, dtype=torch.float64) for n, _ in SIZES] for _ in SCHEDULE]
    flat = torch.cat(params)
    mask = torch.cat([torch.full((n,), d) for n, d in SIZES])
    opt = FlatAdamW(flat, lr=SCHEDULE[0], betas=BETAS, eps=EPS, weight_decay=WD, decay_mask=mask)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    ref = torch.optim.AdamW([{"params": [p for p, (_, d) in zip(ps, SIZES, strict=True) if d], "weight_decay": WD},
                             {"params": [p for p, (_, d) in zip(ps, SIZES, strict=True) if not d],
                              "weight_decay": 0.0}], lr=SCHEDULE[0], betas=BETAS, eps=EPS, foreach=False)
    for lr, step_grads in zip(SCHEDULE, grads, strict=True):
        opt.lr = lr
        opt.step(torch.cat(step_grads))
        for group in ref.param_groups:
            group["lr"] = lr
        for p, grad in zip(ps, step_grads, strict=True):
            p.grad = grad.clone()
        ref.step()
        want = torch.cat([p.detach() for p in ps])
        for decays in (True, False):
            got, expected = flat[mask == decays], want[mask == decays]
            assert (got - expected).abs().max().item() <= 1e-12 * expected.abs().max().item(), (lr, decays)
    # the schedule moved the parameters well beyond the tolerance, decayed ones by their decay too
    assert (flat - torch.cat(params)).abs().min().item() > 1e-6


def test_flat_adamw_resumes_from_moments_and_a_step_count_written_elsewhere():
    """A checkpoint holds the two flat moments and the step count (the layout from before the fused kernel too):
    state taken from two steps of torch.optim.AdamW and loaded into a fresh FlatAdamW continues as torch does."""
    g = torch.Generator().manual_seed(2)
    params = [torch.randn(n, generator=g, dtype=torch.float64) for n, _ in SIZES]
    grads = [[torch.randn(n, generator=g, dtype=torch.float64) for n, _ in SIZES] for _ in range(5)]
    want, ref = _reference(params, grads[:2])
    mask = torch.cat([torch.full((n,), d) for n, d in SIZES])
    flat = torch.cat([p.detach() for p in want])
    opt = FlatAdamW(flat, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decay_mask=mask)
    for mine, key in zip(opt.state_tensors(), ("exp_avg", "exp_avg_sq"), strict=True):
        mine.copy_(torch.cat([ref.state[p][key] for p in want]))
    opt.steps = 2
    for step_grads in grads[2:]:
        opt.step(torch.cat(step_grads))
    expected = torch.cat([p.detach() for p in _reference(params, grads)[0]])
    assert (flat - expected).abs().max().item() <= 1e-12 * expected.abs().max().item()
