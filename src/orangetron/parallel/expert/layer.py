"""The expert-parallel MoE layer: the reference `MoE` with this rank's block of experts and a dispatcher.

Parameter names stay the reference's (`...feed_forward.experts.w1` holds experts r*E/ep ... (r+1)*E/ep - 1
on ep rank r). Under tensor parallelism the experts stay whole on each tp rank (etp = 1): without SP every tp
rank routes the same tokens through its own ep group, with SP each routes its sequence shard, and the
tensor-parallel gradient sum over tp adds those shards' expert gradients.

The layer stays an `orangetron.model.moe.MoE`: `replace_module` (`orangetron/parallel/replace.py`) fills its
two seams, `dispatcher` with the expert-parallel `Dispatcher` and `router.aux_losses` with the losses over the
global batch.
"""

from __future__ import annotations

import torch

from orangetron.mesh import MeshGroup
from orangetron.model.moe import MoE
from orangetron.parallel.expert.balance import GlobalRouterLosses
from orangetron.parallel.expert.dispatcher import Dispatcher
from orangetron.parallel.replace import replace_module


def expert_parallel_moe(moe: MoE, dispatcher: Dispatcher, balance_groups: list[MeshGroup], grad_ranks: int) -> MoE:
    """Shard `moe`'s routed experts in place by `dispatcher` (this rank keeps its block); returns `moe`.

    `balance_groups`: the groups whose ranks split the batch; the balancing loss is computed over all of
    their tokens; `grad_ranks`: the data-parallel averaging divisor (dp x cp).
    """
    first, local = dispatcher.first_expert, dispatcher.local_experts
    with torch.no_grad():
        for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
            w.data = w.data[first:first + local].clone()
    replace_module(moe, "dispatcher", dispatcher)
    replace_module(moe, "router.aux_losses", GlobalRouterLosses(balance_groups, grad_ranks))
    return moe
