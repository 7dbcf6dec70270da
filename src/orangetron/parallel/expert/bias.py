"""Auxiliary-loss-free balancing (DeepSeek-V3): the router biases move towards balance after each step.

Each router with a bias counts the (token, expert) assignments of the non-padding tokens it routes. After
the optimizer step one all-reduce per token-splitting group (dp x cp, and tp under sequence parallelism)
sums every router's counts, so the load is the whole global batch's as one device counts it, and each bias
moves by `rate * sign(mean load - load_e)`: under-loaded experts become more likely to be chosen.
"""

from __future__ import annotations

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import ParallelMesh
from orangetron.model.moe import Router
from orangetron.parallel.expert.balance import balancing_groups


def biased_routers(model: nn.Module) -> list[Router]:
    """The routers of `model` that carry an `expert_bias`, in module order."""
    return [m for m in model.modules() if isinstance(m, Router) and m.expert_bias is not None]


def update_router_bias(model: nn.Module, mesh: ParallelMesh | None = None, sequence_parallel: bool = False) -> None:
    """Move every router bias of `model` by its rate towards the balanced load, then restart the counts.

    Call once after each optimizer step, on every rank. `mesh` None: one device. Each micro-batch's routing is
    counted once, also under activation recompute (`Router`): the update reads the counts, and the tests read them
    too (tests/test_recompute.py), since doubling every count would not change the update's signs.
    """
    routers = biased_routers(model)
    if not routers:
        return
    loads = torch.cat([r.expert_load for r in routers])  # [routers * E] int64: exact in any sum
    for group in balancing_groups(mesh, sequence_parallel) if mesh is not None else []:
        loads = comm.all_reduce(loads, group)
    for router, load in zip(routers, loads.split(routers[0].n_experts), strict=True):
        load = load.to(router.expert_bias.dtype)
        with torch.no_grad():
            router.expert_bias += router.bias_rate * torch.sign(load.mean() - load)
        router.expert_load = torch.zeros_like(router.expert_load)
