"""`expert_parallel`: shard the routed experts of every MoE layer of a (tensor-parallel) reference model."""

from __future__ import annotations

from torch import nn

from orangetron.mesh import ParallelMesh
from orangetron.model.moe import MoE
from orangetron.parallel.config import ParallelConfig
from orangetron.parallel.expert.balance import balancing_groups
from orangetron.parallel.expert.dispatcher import Dispatcher
from orangetron.parallel.expert.layer import expert_parallel_moe


def expert_parallel(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig) -> nn.Module:
    """Shard the routed experts of `model` in place over `mesh["ep"]`; returns `model`.

    The balancing loss is computed over the tokens of every dp x cp rank (and tp rank under SP).
    """
    groups = balancing_groups(mesh, config.sequence_parallel)
    for block in model.layers:
        ff = block.feed_forward
        if isinstance(ff, MoE):
            dispatcher = Dispatcher(mesh, ff.router.n_experts, config.dispatcher, config.capacity_factor,
                                    config.drop_policy, config.ep_overlap_chunks)
            expert_parallel_moe(ff, dispatcher, groups, mesh["dp_cp"].size)
    return model
