"""The expert-parallel MoE layer: the reference `MoE` with this rank's block of experts and a dispatcher.

Parameter names stay the reference's (`...feed_forward.experts.w1` holds experts r*E/ep ... (r+1)*E/ep - 1
on ep rank r). Under tensor parallelism the experts stay whole on each tp rank (etp = 1): without SP every tp
rank routes the same tokens through its own ep group, with SP each routes its sequence shard, and the
tensor-parallel gradient sum over tp adds those shards' expert gradients.
"""

from __future__ import annotations

import torch

from orangetron.mesh import MeshGroup
from orangetron.model.moe import MoE
from orangetron.parallel.expert.balance import global_router_losses
from orangetron.parallel.expert.dispatcher import Dispatcher


class ExpertParallelMoE(MoE):
    """`moe` (its router, experts and shared expert, taken over) with experts sharded by `dispatcher`.

    `balance_groups`: the groups whose ranks split the batch; the balancing loss is computed over all of
    their tokens; `grad_ranks`: the data-parallel averaging divisor (dp x cp).
    """

    def __init__(self, moe: MoE, dispatcher: Dispatcher, balance_groups: list[MeshGroup], grad_ranks: int) -> None:
        torch.nn.Module.__init__(self)
        self.router, self.experts, self.shared_expert = moe.router, moe.experts, moe.shared_expert
        self.last_aux_loss: torch.Tensor | None = None
        self.dispatcher, self.balance_groups, self.grad_ranks = dispatcher, balance_groups, grad_ranks
        first, local = dispatcher.first_expert, dispatcher.local_experts
        with torch.no_grad():
            for w in (self.experts.w1, self.experts.w3, self.experts.w2):
                w.data = w.data[first:first + local].clone()

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        x_flat = x.reshape(-1, x.shape[-1])  # [T, dim]
        mask = None if token_mask is None else token_mask.reshape(-1)
        logits, scores, topk_idx, topk_weights = self.router.route(x_flat, mask)
        self.last_aux_loss = global_router_losses(self.router, logits, scores, topk_idx, mask, self.balance_groups,
                                                  self.grad_ranks)
        y = self.dispatcher.dispatch_compute_combine(x_flat, topk_idx, topk_weights, self.experts)  # [T, dim]
        if self.shared_expert is not None:
            y = y + self.shared_expert(x_flat)
        return y.view_as(x)
