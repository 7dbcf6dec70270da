"""The load-balancing loss over the global batch (Megatron's global auxiliary loss).

The single-device loss is `E * sum_e f_e * P_e` over all T tokens: f_e the fraction of the T*k assignments
routed to e, P_e the mean normalized score of e. Each rank sees only its tokens, so one all-reduce per group
sums the expert counts, the normalized scores and the token count over the ranks that split the batch
(dp x cp, and tp under sequence parallelism). Every rank's value is then the global loss, and its gradient
is this rank's share scaled by `grad_ranks` (the divisor the data-parallel average applies), so that the
averaged (and, under SP, tp-summed) gradients equal the single device's.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup


class GlobalLoadBalancingLoss(torch.autograd.Function):
    """Global `load_balancing_loss` forward (one all-reduce per group); this rank's share backward."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, topk_idx: torch.Tensor, token_mask: torch.Tensor | None,
                groups: list[MeshGroup], grad_ranks: int) -> torch.Tensor:
        valid_scores, valid_idx = scores, topk_idx
        if token_mask is not None:
            valid_scores, valid_idx = scores[token_mask], topk_idx[token_mask]
        experts, k = scores.shape[1], topk_idx.shape[1]
        counts = torch.bincount(valid_idx.reshape(-1), minlength=experts).to(scores.dtype)  # [E]
        normalized = (valid_scores / valid_scores.sum(-1, keepdim=True)).sum(0)  # [E]
        totals = torch.cat((counts, normalized, scores.new_full((1,), valid_scores.shape[0])))
        for group in groups:
            totals = comm.all_reduce(totals, group)
        n = totals[-1]
        f = totals[:experts] / (n * k).clamp(min=1)
        ctx.save_for_backward(scores, token_mask, f, n)
        ctx.grad_ranks = grad_ranks
        return experts * (f * totals[experts:2 * experts]).sum() / n.clamp(min=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scores, token_mask, f, n = ctx.saved_tensors
        experts = scores.shape[1]
        total = scores.sum(-1, keepdim=True)  # [T, 1]
        # d/ds[t, e] of E/N * sum_e' f_e' s[t, e'] / S_t, times the ranks the data-parallel mean divides by
        scale = grad * experts * ctx.grad_ranks / n.clamp(min=1)
        grad_scores = (f - (scores * f).sum(-1, keepdim=True) / total) / total * scale
        if token_mask is not None:
            grad_scores = grad_scores * token_mask.unsqueeze(-1)
        return grad_scores, None, None, None, None
