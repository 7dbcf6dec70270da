"""Data parallelism over the dp x cp ranks: DDP, ZeRO-1/2/3 and Megatron's distributed optimizer.

Every parameter lives in one flat buffer, padded so that each of the d = dp * cp ranks owns an equal slice.
What each stage keeps and sends (docs/data_parallel.md has the full tables):

| stage | params | main grads | main params, optimizer | after backward | parameter sync |
|---|---|---|---|---|---|
| DDP (0) | full | full | full | all-reduce | none |
| ZeRO-1, ZeRO-2 | full | full / 1/d | 1/d | reduce-scatter | all-gather before the next forward (lazy) |
| distributed optimizer | full | full | 1/d | reduce-scatter | all-gather right after the step (eager) |
| ZeRO-3 | 1/d | 1/d | 1/d | reduce-scatter | all-gather before forward and before backward |

Gradients are averaged over the d ranks, so each rank's loss must be the mean over an equal share of the
batch. Every rank must build the model from the same seed (orangetron's initialization depends only on the
seed and the config), because the wrapper does not broadcast the initial weights.

A tensor-parallel module (one `orangetron.parallel.tensor` sharded; `tensor.tp_placements` gives the layout of
its parameters) holds shards: its partial gradients are summed over tp before the data-parallel reduction, the
gradient norm counts every distinct element once across tp, and `full_state` (gathered) and `sharded_state`
(this rank's pieces) speak of whole tensors. Any other module is whole on every tp rank.

Under expert parallelism (ep > 1) the routed experts' parameters (each rank holds its ep block) live in a
second flat buffer sharded over edp = dp x cp / ep. Their gradients are summed over edp only (the all-to-all
backward already brought every ep rank's tokens to them) and divided by dp x cp like the dense ones, since
the loss is the mean over all dp x cp ranks; whole tensors gather the ep blocks back together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import ParallelMesh
from orangetron.parallel.buckets import GradBuckets, ShardedGradBuckets
from orangetron.parallel.config import ParallelConfig, ParallelConfigError
from orangetron.parallel.flat import FlatPart
from orangetron.parallel.optim import FlatAdamW
from orangetron.parallel.param_grads import ParamGrads
from orangetron.parallel.state import Shards, sharded_state
from orangetron.parallel.tensor import gather_tensor, sync_grads, tp_placements
from orangetron.parallel.units import TransientPeaks, Zero3Schedule, find_units


class DataParallel(nn.Module):
    """Wrap `module` for data parallelism over `mesh["dp_cp"]`; build the optimizer with `optimizer()`."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, config: ParallelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ParallelConfig()
        if self.config.recompute != "none":
            raise ParallelConfigError(
                f"recompute={self.config.recompute!r}: the runtime keeps every activation for backward (it does not "
                "recompute yet); the planner prices recomputation (`orangetron estimate --recompute`)")
        self.module = module
        self.mesh = mesh
        self.group = mesh["dp_cp"]
        self.placements = tp_placements(module)  # by parameter name, under tensor parallelism
        self.tp = mesh["tp"] if self.placements is not None and mesh["tp"].size > 1 else None
        self.ep = mesh["ep"] if mesh["ep"].size > 1 else None
        self.pp = mesh["pp"] if mesh["pp"].size > 1 else None  # each stage holds other parameters
        self.zero3 = self.config.zero_stage == 3
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.device = next(iter(module.parameters())).device
        dense = [(n, p) for n, p in self._named if not self._is_expert(n)]
        experts = [(n, p) for n, p in self._named if self._is_expert(n)]
        units = find_units(module, [n for n, _ in self._named]) if self.zero3 else []
        unit_of = {name: unit.index for unit in units for name in unit.names}
        self.parts = [FlatPart(dense, self.group, self.config, self.device, unit_of)]
        if experts:
            self.parts.append(FlatPart(experts, mesh["edp"], self.config, self.device, unit_of))
        self.transient = TransientPeaks()
        self.param_grads = ParamGrads([p for _, p in self._named], self.transient)  # hooked before the others
        self.schedule = Zero3Schedule(self, units) if self.zero3 else None
        self._params_stale = False
        self._grads_pending = False
        self.buckets = self._grad_buckets(self.config.grad_bucket_numel)

    def _grad_buckets(self, bucket_numel: int) -> GradBuckets | ShardedGradBuckets | None:
        if not bucket_numel:
            return None
        # Partial gradients summed over tp first (sequence parallel, kv heads fewer than tp): the buckets wait.
        tp_sums = self.tp is not None and any(p.needs_sync() for p in self.placements.values())
        if self.config.shards_optimizer:  # ZeRO-3 never gets here (ParallelConfig refuses it)
            return ShardedGradBuckets(self, defer=tp_sums)
        return GradBuckets(self, bucket_numel, defer=tp_sums)

    def _is_expert(self, name: str) -> bool:
        return self.ep is not None and ".experts." in name

    # The dense part, by the names single-buffer callers (gradient buckets, tests) know.
    @property
    def flat_params(self) -> torch.Tensor:
        return self.parts[0].flat_params

    @property
    def main_params(self) -> torch.Tensor:
        return self.parts[0].main_params

    @property
    def main_grads(self) -> torch.Tensor:
        return self.parts[0].main_grads

    @property
    def numel(self) -> int:
        return self.parts[0].numel

    @property
    def shards(self) -> int:
        return self.parts[0].shards

    # ---- buffers ---------------------------------------------------------------------------------

    def _release_params(self) -> None:
        if self.schedule is not None:
            self.schedule.release_all()

    def _gather_params(self) -> None:
        if self.schedule is not None:
            self.schedule.gather_all()
        else:
            for part in self.parts:
                part.gather()
        self._params_stale = False

    def transient_peaks(self) -> dict[str, int]:
        """Peak bytes, since the last `reset_transient_peaks()`, of ZeRO-3's gathered parameters
        (`gathered_params`) and of the gradient reduction's buffers (`grad_buckets`): ZeRO-3's unit and the
        sharded stages' bucket in flight (wire buffer, reduced slice), bucketed DDP's wire copies (held until
        the step), and without buckets each flat buffer's temporary or wire copy with the collective's result
        (`plan.memory.grad_bucket_bytes` predicts them); and of the per-parameter `.grad` tensors not yet moved
        into the flat buffers (`param_grads`, predicted by `plan.param_grads.param_grad_bytes`)."""
        return dict(self.transient.peak)

    def reset_transient_peaks(self) -> None:
        self.transient.reset()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps between steps, by memory category (see `orangetron.memory`)."""
        mixed = self.config.mixed_precision
        return {
            "params": [part.param_shard if self.zero3 else part.flat_params for part in self.parts],
            "grads": [part.main_grads for part in self.parts],
            "main_params": [part.main_params for part in self.parts] if mixed else [],
        }

    # ---- forward and backward ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.module, *args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` as a forward of the wrapped module: parameters gathered first where the ZeRO
        stage asks, gradients expected afterwards (a pipeline stage runs each of its chunks this way)."""
        if self.schedule is not None:
            self.schedule.begin_forward()
        elif self._params_stale:
            self._gather_params()
        out = fn(*args, **kwargs)
        if self.schedule is not None:
            self.schedule.end_forward(out)
        self._grads_pending |= torch.is_grad_enabled()  # an evaluation forward leaves nothing to reduce
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (the earlier micro-batches of a step)."""
        hooks = self.buckets if self.buckets is not None else self.schedule
        if hooks is None or self.config.zero3_reduce_every_microbatch:  # .grad waits anyway, or reduce each one
            yield
            return
        hooks.sync = False
        try:
            yield
        finally:
            hooks.sync = True

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp x cp ranks into the main gradients (the step calls this)."""
        if not self._grads_pending:
            return
        if self.buckets is not None:  # already summed bucket by bucket during backward
            self.buckets.finish()
            for part in self.parts:  # the loss is the mean over dp x cp, experts included
                part.owned_grads().div_(self.group.size)
            self._grads_pending = False
            return
        if self.schedule is not None:  # ZeRO-3: reduce-scattered unit by unit during backward
            if self.schedule.defer:
                self.sync_tp_grads()
                self.schedule.reduce_all()
            self.schedule.retire()
            for part in self.parts:
                part.main_grads.div_(self.group.size)
            self._grads_pending = False
            return
        if self.tp is not None:
            self.sync_tp_grads()
        for part in self.parts:
            # the loss is the mean over dp x cp, experts included
            part.reduce(self.group.size, self.transient, self.param_grads.free)
        self._grads_pending = False

    def sync_tp_grads(self) -> None:
        """Sum the tensor-parallel partial gradients over tp (`tensor.sync_grads`), before the reduction."""
        sync_grads(self.module, self.placements, self.tp, self.transient)

    def owned_grads(self) -> torch.Tensor:
        """This rank's averaged dense main gradients, aligned with `main_params` (after `reduce_gradients`)."""
        return self.parts[0].owned_grads()

    def after_step(self) -> None:
        """Copy updated main params into the model dtype, then sync parameters as the stage prescribes."""
        if self.config.mixed_precision:
            with torch.no_grad():
                for part in self.parts:
                    part.param_shard.copy_(part.main_params)
        if self.config.distributed_optimizer:
            self._gather_params()
        elif self.config.shards_optimizer and not self.zero3:
            self._params_stale = True

    def decay_mask(self, part: FlatPart) -> torch.Tensor:
        """True for the owned elements of matrices (weight decay applies), False for norms and biases."""
        return part.owned_mask(lambda name, p: p.dim() >= 2)

    def norm_mask(self, part: FlatPart) -> torch.Tensor | None:
        """True for the owned elements that enter the global gradient norm on this rank (None: all of them);
        under tensor parallelism each distinct element counts on exactly one tp rank."""
        if self.tp is None:
            return None
        return part.owned_mask(lambda name, p: self.placements[name].counts_in_norm(self.tp.rank))

    # ---- layout-independent state (checkpoints) -----------------------------------------------------

    def _whole(self, part: FlatPart, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Whole tensors by parameter name from a part's full flat buffer (gathered over tp and ep)."""
        out = {}
        for name, local in part.locals_by_name(flat).items():
            if self.tp is not None:
                local = gather_tensor(local, self.placements[name], self.tp)
            if self._is_expert(name):
                local = comm.all_gather(local.contiguous(), self.ep, dim=0)  # the ep blocks, in rank order
            out[name] = local
        return out

    def _by_name(self, owned: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for part, tensor in zip(self.parts, owned, strict=True):
            out |= self._whole(part, part.gather_owned(tensor))
        if self.pp is not None:  # every stage's tensors, so the result names the whole model on every rank
            out = {name: t for stage in comm.all_gather_objects(out, self.pp) for name, t in stage.items()}
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Whole averaged gradients by parameter name, on every rank (after `reduce_gradients`)."""
        return self._by_name([part.owned_grads() for part in self.parts])

    def full_state(self, optimizer: ShardedAdamW) -> dict[str, Any]:
        """Whole (unsharded) main parameters and AdamW moments by parameter name, on every rank.

        The same on any layout, so a run can resume on another one. Gathers over dp_cp (edp) when sharded.
        """
        return {
            "params": self._by_name([part.main_params for part in self.parts]),
            "exp_avg": self._by_name([a.exp_avg for a in optimizer.adamws]),
            "exp_avg_sq": self._by_name([a.exp_avg_sq for a in optimizer.adamws]),
            "optimizer_steps": optimizer.adamw.steps,
            "buffers": self._buffers_by_name(),
        }

    def _buffers_by_name(self) -> dict[str, torch.Tensor]:
        # Buffers (the routers' balancing biases) are whole and the same on every rank of a stage.
        out = {name: b.detach().clone() for name, b in self.module.named_buffers()}
        if self.pp is not None:
            out = {name: t for stage in comm.all_gather_objects(out, self.pp) for name, t in stage.items()}
        return out

    def sharded_state(self, optimizer: ShardedAdamW) -> dict[str, dict[str, Shards]]:
        """This rank's pieces of the whole main parameters, AdamW moments and buffers, by parameter name: views
        of its own buffers, no copies (`orangetron.parallel.state`). A checkpoint saves them; loading writes
        into them, followed by `state_loaded`."""
        return sharded_state(self, optimizer)

    def state_loaded(self, optimizer: ShardedAdamW, optimizer_steps: int) -> None:
        """Bring the copies derived from the main parameters in line after `sharded_state` was loaded into:
        the model-dtype parameters, gathered where ZeRO-1/2 keep them whole, and AdamW's step count."""
        with torch.no_grad():
            if self.config.mixed_precision:
                for part in self.parts:
                    part.param_shard.copy_(part.main_params)
        if not self.zero3 and any(part.shards > 1 for part in self.parts):
            self._gather_params()
        for adamw in optimizer.adamws:
            adamw.steps = optimizer_steps
        self._params_stale = False

    def optimizer(self, lr: float, **adamw: Any) -> ShardedAdamW:
        """AdamW over this rank's shard (the whole buffer under DDP)."""
        return ShardedAdamW(self, lr=lr, **adamw)


class ShardedAdamW:
    """AdamW on the slices of the flat parameters a rank owns (one per part); `step()` reduces gradients first."""

    def __init__(self, dp: DataParallel, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay_matrices_only: bool = True) -> None:
        self.dp = dp
        self.norm_masks = [dp.norm_mask(part) for part in dp.parts]
        self.adamws = [
            FlatAdamW(part.main_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                      decay_mask=dp.decay_mask(part) if weight_decay and decay_matrices_only else None)
            for part in dp.parts]

    @property
    def adamw(self) -> FlatAdamW:
        """The dense part's AdamW (the only one without expert parallelism)."""
        return self.adamws[0]

    @property
    def lr(self) -> float:
        return self.adamw.lr

    @lr.setter
    def lr(self, value: float) -> None:
        for adamw in self.adamws:
            adamw.lr = value

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping.

        Each part's sum of squares is summed over its shard group when sharded; the experts' also over ep
        (each ep rank holds other experts); then everything over tp, counting each element once, and over
        pp (each stage holds other layers).
        """
        self.dp.reduce_gradients()
        total = None
        for part, mask in zip(self.dp.parts, self.norm_masks, strict=True):
            counted = part.owned_grads().square()
            if mask is not None:  # tensor parallel: each distinct element once over tp
                counted.masked_fill_(~mask, 0)
            squares = counted.sum().reshape(1)
            if part.shards > 1:
                squares = comm.all_reduce(squares, part.group)
            if part is not self.dp.parts[0]:
                squares = comm.all_reduce(squares, self.dp.ep)
            total = squares if total is None else total + squares
        if self.dp.tp is not None:
            total = comm.all_reduce(total, self.dp.tp)
        if self.dp.pp is not None:
            total = comm.all_reduce(total, self.dp.pp)
        norm = total.sqrt()[0]
        if max_norm < float("inf"):  # "no clipping" must not multiply an infinite norm's grads by inf/inf
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for part in self.dp.parts:
                part.owned_grads().mul_(scale)
        return norm

    def step(self) -> None:
        self.dp.reduce_gradients()
        for part, adamw in zip(self.dp.parts, self.adamws, strict=True):
            adamw.step(part.owned_grads())
        self.dp.after_step()

    def zero_grad(self) -> None:
        for _, p in self.dp._named:
            self.dp.param_grads.free(p)
        if self.dp.buckets is not None:  # gradients accumulate in the flat buffers themselves
            for part in self.dp.parts:
                part.main_grads.zero_()
        if self.dp.schedule is not None:  # and in the owned slices, unit by unit
            for part in self.dp.parts:
                part.main_grads.zero_()

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for adamw in self.adamws for t in adamw.state_tensors()]

