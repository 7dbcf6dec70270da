"""The load-balancing loss over the global batch (Megatron's global auxiliary loss).

The single-device loss is `E * sum_e f_e * P_e` over all T tokens: f_e the fraction of the T*k assignments
routed to e, P_e the mean normalized score of e. Each rank sees only its tokens, so one all-reduce per group
sums the expert counts, the normalized scores and the token count over the ranks that split the batch
(dp x cp, and tp under sequence parallelism). Every rank's value is then the global loss, and its gradient
is this rank's share scaled by `grad_ranks` (the divisor the data-parallel average applies), so that the
averaged (and, under SP, tp-summed) gradients equal the single device's.

The router z-loss is a mean over the same tokens: a second all-reduce per group sums the squared
logsumexps and the token count (2 values), and its gradient is scaled the same way.

`GlobalRouterLosses` computes both in the router's loss seam (`Router.aux_losses`, `orangetron/model/moe.py`),
put there by `replace_module`.
"""

from __future__ import annotations

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import MeshGroup, ParallelMesh
from orangetron.model.autograd import z_loss_grad
from orangetron.model.moe import MoE
from orangetron.parallel.replace import replace_module


class GlobalLoadBalancingLoss(torch.autograd.Function):
    """Global `load_balancing_loss` forward (one all-reduce per group); this rank's share backward."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, topk_idx: torch.Tensor, token_mask: torch.Tensor | None,
                groups: list[MeshGroup], grad_ranks: int) -> torch.Tensor:
        experts, k = scores.shape[1], topk_idx.shape[1]
        # Padding weighs 0, where selecting the valid rows and `bincount` would read sizes from the device.
        valid = scores.new_ones(scores.shape[0]) if token_mask is None else token_mask.to(scores.dtype)  # [T]
        counts = scores.new_zeros(experts).scatter_add_(0, topk_idx.reshape(-1),
                                                        valid[:, None].expand_as(topk_idx).reshape(-1))  # [E]
        normalized = (scores / scores.sum(-1, keepdim=True) * valid[:, None]).sum(0)  # [E]
        totals = torch.cat((counts, normalized, valid.sum().view(1)))
        for group in groups:
            totals = comm.all_reduce(totals, group)
        n = totals[-1].clone()  # its own storage: a view would keep the whole 2E+1 sums for backward
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


class GlobalRouterZLoss(torch.autograd.Function):
    """Global `RouterZLoss` forward (one all-reduce of 2 values per group); this rank's share backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_mask: torch.Tensor | None, groups: list[MeshGroup],
                grad_ranks: int) -> torch.Tensor:
        squares = logits.logsumexp(-1).square()  # [T]
        valid = logits.new_ones(logits.shape[0]) if token_mask is None else token_mask.to(logits.dtype)  # [T]
        totals = torch.stack(((squares * valid).sum(), valid.sum()))  # padding weighs 0: no size read
        for group in groups:
            totals = comm.all_reduce(totals, group)
        n = totals[1].clone()  # its own storage, as in GlobalLoadBalancingLoss
        ctx.save_for_backward(logits, token_mask, n)
        ctx.grad_ranks = grad_ranks
        return totals[0] / n.clamp(min=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, token_mask, n = ctx.saved_tensors
        # The global mean divides by the global count; the data-parallel mean divides again by grad_ranks.
        return z_loss_grad(logits, token_mask, grad * ctx.grad_ranks / n.clamp(min=1)), None, None, None


def global_router_losses(aux_coef: float, z_coef: float, logits: torch.Tensor, scores: torch.Tensor,
                         topk_idx: torch.Tensor, token_mask: torch.Tensor | None, groups: list[MeshGroup],
                         grad_ranks: int) -> torch.Tensor:
    """A router's scaled balancing loss plus its z-loss, each over the global batch (0-d)."""
    loss = scores.new_zeros(())
    if aux_coef:
        balance = GlobalLoadBalancingLoss.apply(scores, topk_idx, token_mask, groups, grad_ranks)
        loss = aux_coef * balance
    if z_coef:
        loss = loss + z_coef * GlobalRouterZLoss.apply(logits, token_mask, groups, grad_ranks)
    return loss


class GlobalRouterLosses(nn.Module):
    """`RouterLosses` over the global batch: the tokens of every rank of `groups` (`grad_ranks`: the
    data-parallel averaging divisor, dp x cp). Same signature, so it takes the place of `Router.aux_losses`."""

    def __init__(self, groups: list[MeshGroup], grad_ranks: int) -> None:
        super().__init__()
        self.groups, self.grad_ranks = groups, grad_ranks

    def forward(self, logits: torch.Tensor, scores: torch.Tensor, topk_idx: torch.Tensor,
                token_mask: torch.Tensor | None, aux_coef: float, z_coef: float) -> torch.Tensor:
        return global_router_losses(aux_coef, z_coef, logits, scores, topk_idx, token_mask, self.groups,
                                    self.grad_ranks)


def balancing_groups(mesh: ParallelMesh, sequence_parallel: bool) -> list[MeshGroup]:
    """The groups whose ranks split the batch's tokens: dp x cp, and tp under sequence parallelism."""
    sp = sequence_parallel and mesh["tp"].size > 1
    return [mesh["dp_cp"]] + ([mesh["tp"]] if sp else [])


def balance_globally(model: nn.Module, mesh: ParallelMesh, sequence_parallel: bool) -> None:
    """Give every MoE router of `model` (experts not sharded) the global balancing loss, in place, when
    its ranks split the tokens and the loss is on; otherwise each rank's loss is already the global one."""
    groups = balancing_groups(mesh, sequence_parallel)
    if all(g.size == 1 for g in groups):
        return
    for i, block in enumerate(model.layers):
        ff = block.feed_forward
        if isinstance(ff, MoE) and (ff.router.aux_loss_coef or ff.router.z_loss_coef):
            replace_module(model, f"layers.{i}.feed_forward.router.aux_losses",
                           GlobalRouterLosses(groups, mesh["dp_cp"].size))
