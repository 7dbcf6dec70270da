"""The facts every data-parallel strategy, the optimizer and the checkpoint code share about one model: its
trainable parameters laid into flat parts, the groups each part is reduced over, and the step's transient bytes.

One object holds them so that no piece reads another's private state: `ParallelModel` builds it, hands it to
the strategy it chose (`parallel.data.choose`), to the optimizer and to the state code.

The parts (`FlatPart`): the dense parameters over dp x cp and, under expert parallelism (ep > 1), the routed
experts' (each rank holds its ep block) over edp = dp x cp / ep. The experts' gradients are summed over edp
only (the all-to-all backward already brought every ep rank's tokens to them) and divided by dp x cp like the
dense ones, since the loss is the mean over all dp x cp ranks.

A tensor-parallel module (one with `placements`, from `orangetron.parallel.tensor`) holds shards: its partial
gradients are summed over tp before the data-parallel reduction (`sum_partials`), the gradient norm counts
every distinct element once across tp, and whole tensors gather the tp slices back together.

A tied model under pipeline parallelism keeps its embedding on the first stage and a copy for the head on the
last (`parallel.pipeline.stage`). Each copy's `.grad` holds its stage's share; `sum_partials` adds them over the
two stages (`ParallelMesh.pipeline_ends`) before the data-parallel reduction, so both copies get the one-device
gradient and, from equal values, the same update (up to the order in which each stage's reduction adds: with 3
or more replicas the two flat layouts can round differently, docs/pipeline_parallel.md). The copy is left out
of the gradient norm and of what a checkpoint writes (`counts_in_norm`, `parallel.state.sharded_state`); a
checkpoint loads into both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import ParallelMesh
from orangetron.parallel.config import ParallelConfig
from orangetron.parallel.data.flat import FlatPart
from orangetron.parallel.data.param_grads import ParamGrads
from orangetron.parallel.data.transient import TransientPeaks
from orangetron.parallel.tensor import sync_grads, tp_placements

if TYPE_CHECKING:
    from orangetron.parallel.data.units import Unit

TIED = "tok_embeddings.weight"  # a tied model's embedding, which its head reuses


class DataParallelBuffers:
    """`module`'s trainable parameters in flat parts over `mesh["dp_cp"]` (experts over edp), as `config` says.

    `units` (ZeRO-3's, `parallel.data.units`) are padded, sharded and gathered each on its own; none: one segment
    per part (or the equal gradient buckets of the sharded stages).
    """

    def __init__(self, module: nn.Module, mesh: ParallelMesh, config: ParallelConfig,
                 units: Sequence[Unit] = ()) -> None:
        self.module, self.config = module, config
        self.group = mesh["dp_cp"]
        self.placements = tp_placements(module)  # by parameter name, under tensor parallelism
        self.tp = mesh["tp"] if self.placements is not None and mesh["tp"].size > 1 else None
        self.ep = mesh["ep"] if mesh["ep"].size > 1 else None
        self.pp = mesh["pp"] if mesh["pp"].size > 1 else None  # each stage holds other parameters
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.device = next(iter(module.parameters())).device
        self.units = list(units)
        unit_of = {name: unit.index for unit in self.units for name in unit.names}
        dense = [(n, p) for n, p in self.named if not self.is_expert(n)]
        experts = [(n, p) for n, p in self.named if self.is_expert(n)]
        self.parts = [FlatPart(dense, self.group, config, self.device, unit_of)]
        if experts:
            self.parts.append(FlatPart(experts, mesh["edp"], config, self.device, unit_of))
        self.transient = TransientPeaks()
        # Hooked before any strategy's hooks, so a gradient is counted before a strategy frees it.
        self.param_grads = ParamGrads([p for _, p in self.named], self.transient)
        # Partial gradients must be summed over tp first (sequence parallel, kv heads fewer than tp), and a tied
        # embedding's over the pipeline's ends: every reduction that would overlap backward waits for the step
        # instead (on every stage: `plan.param_grads.held_to_step` states the same rule).
        self.tp_partials = self.tp is not None and any(p.needs_sync() for p in self.placements.values())
        tied = self.pp is not None and bool(getattr(getattr(module, "cfg", None), "tied_embeddings", False))
        self.tied_group = mesh.pipeline_ends() if tied else None  # every rank builds it, even between the ends
        self.tied = dict(self.named).get(TIED) if self.tied_group is not None else None
        self.tied_copy = self.tied is not None and mesh["pp"].rank != 0  # the last stage's copy
        self.held_to_step = self.tp_partials or tied

    def is_expert(self, name: str) -> bool:
        """Whether parameter `name` is a routed expert's, kept in the expert part (only under ep > 1)."""
        return self.ep is not None and ".experts." in name

    def sum_partials(self) -> None:
        """Sum the partial gradients over tp in `.grad`, where the module has any (`tp_partials`), and a tied
        embedding's two copies over the pipeline's ends."""
        if self.tp_partials:
            sync_grads(self.module, self.placements, self.tp, self.transient)
        if self.tied is not None:
            if self.tied.grad is None:  # a stage whose copy took no gradient still joins the sum
                self.tied.grad = torch.zeros_like(self.tied)
            comm.all_reduce_start(self.tied.grad, self.tied_group).wait()

    def counts_in_norm(self, name: str) -> bool:
        """Whether parameter `name`'s gradient on this rank enters the global norm: each distinct element once
        over tp, and a tied embedding on the first stage only."""
        if self.tied_copy and name == TIED:
            return False
        return self.tp is None or self.placements[name].counts_in_norm(self.tp.rank)

    def reduce_parts(self) -> None:
        """One reduction per part after backward: `.grad` summed over the part's group into the main gradients
        and averaged (partial tp gradients summed first)."""
        self.sum_partials()
        for part in self.parts:
            # the loss is the mean over dp x cp, experts included
            part.reduce(self.group.size, self.transient, self.param_grads.free)

    def free_grads(self) -> None:
        """Drop every `.grad` (their values live on in the flat buffers, or are not wanted)."""
        for _, p in self.named:
            self.param_grads.free(p)

    def copy_main_params(self) -> None:
        """Bring this rank's model-dtype parameters in line with its fp32 main parameters (mixed precision only;
        otherwise they are the same tensor)."""
        if not self.config.mixed_precision:
            return
        with torch.no_grad():
            for part in self.parts:
                part.param_shard.copy_(part.main_params)
