"""AdamW over one flat tensor, the update torch.optim.AdamW (foreach=False) makes, element for element.

Sharded optimizers own a contiguous slice of a flat parameter buffer; a per-element decay mask lets norms
and biases skip weight decay inside that one slice.
"""

from __future__ import annotations

import torch


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
        self.decay_mask = decay_mask
        self.steps = 0

    def step(self, grad: torch.Tensor) -> None:
        self.steps += 1
        beta1, beta2 = self.betas
        if self.weight_decay:
            if self.decay_mask is None:
                self.param.mul_(1 - self.lr * self.weight_decay)
            else:
                decayed = self.param * (1 - self.lr * self.weight_decay)  # the rounding of torch's mul_
                self.param.copy_(torch.where(self.decay_mask, decayed, self.param))
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1**self.steps)
        # ** 0.5, as torch; divided in place (the same rounding) so one temporary the size of the shard exists
        denom = self.exp_avg_sq.sqrt().div_((1 - beta2**self.steps) ** 0.5).add_(self.eps)
        self.param.addcdiv_(self.exp_avg, denom, value=-step_size)

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.exp_avg, self.exp_avg_sq]
