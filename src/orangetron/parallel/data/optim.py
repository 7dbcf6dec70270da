"""AdamW over one flat tensor, by torch's fused kernel over views of it.

Sharded optimizers own a contiguous slice of a flat parameter buffer; a per-element decay mask lets norms
and biases skip weight decay inside that one slice. The slice is cut once into runs of equal decay, and each
step hands the runs to `torch._fused_adamw_` in two groups (with and without decay), as views: the moments
stay two flat tensors, the layout checkpoints store. The kernel runs on CPU (float64 included) and CUDA, and
its update is torch.optim.AdamW's (foreach=False) up to one rounding per step, as it fuses the second moment's
multiply-add (`tests/test_flat_adamw.py`). Where a torch build lacks the kernel, the same two groups go
through torch.optim.AdamW's unfused update written out here, on the same views.
"""

from __future__ import annotations

import torch


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    """A shard as 1-D views: itself, or its rows when it is laid out in buckets ([buckets, elements])."""
    return list(t.unbind(0)) if t.dim() == 2 else [t]


def decay_runs(decay_mask: torch.Tensor | None, numel: int) -> list[tuple[int, int, bool]]:
    """(start, end, decays) for each maximal run of equal decay in the mask (None: one run that decays)."""
    if decay_mask is None:
        return [(0, numel, True)] if numel else []
    flags = decay_mask.to(torch.int8)
    bounds = [0, *(torch.nonzero(flags[1:] != flags[:-1]).flatten() + 1).tolist(), numel]
    return [(a, b, bool(decay_mask[a])) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class FlatAdamW:
    """AdamW state and update for one flat tensor `param` (updated in place) and its gradient."""

    def __init__(
        self,
        param: torch.Tensor,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay_mask: torch.Tensor | None = None,  # bool, True where decay applies
    ) -> None:
        self.param, self.lr, self.betas, self.eps, self.weight_decay = param, lr, betas, eps, weight_decay
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)
        # (row, start, end, decays): runs within each row of the shard, whose views the kernel updates in place.
        masks = [None] * len(_rows(param)) if decay_mask is None else _rows(decay_mask)
        self.runs = [(i, a, b, d) for i, (row, mask) in enumerate(zip(_rows(param), masks, strict=True))
                     for a, b, d in decay_runs(mask, row.numel())]
        self._rows = [_rows(t) for t in (param, self.exp_avg, self.exp_avg_sq)]
        self.steps = 0
        # The kernel reads the step count from a tensor on the parameters' device (float32, as torch.optim).
        self._step = torch.zeros((), dtype=torch.float32, device=param.device)

    def step(self, grad: torch.Tensor) -> None:
        self.steps += 1
        self._step.fill_(self.steps)
        beta1, beta2 = self.betas
        (param, exp_avg, exp_avg_sq), grad = self._rows, _rows(grad)
        for decays in (True, False):
            runs = [(i, a, b) for i, a, b, d in self.runs if d == decays]
            if not runs:
                continue
            views = [[t[i][a:b] for i, a, b in runs] for t in (param, grad, exp_avg, exp_avg_sq)]
            adamw_update = getattr(torch, "_fused_adamw_", None) or _unfused_adamw_
            adamw_update(*views, [], [self._step] * len(runs), lr=self.lr, beta1=beta1, beta2=beta2,
                         weight_decay=self.weight_decay if decays else 0.0, eps=self.eps, amsgrad=False,
                         maximize=False)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.exp_avg, self.exp_avg_sq]


def _unfused_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], _max_exp_avg_sqs: list, steps: list[torch.Tensor], *,
                    lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, **_) -> None:
    """`torch._fused_adamw_`'s contract (steps already counted, no amsgrad) by torch.optim.AdamW's
    single-tensor update, for torch builds without the kernel."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
        n = step.item()
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2**n) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**n))
