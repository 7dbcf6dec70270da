"""`ParallelModel`: a reference model with a layout applied, as `parallelize` returns it; what the trainer, the
pipeline executor and the checkpoint code talk to.

It owns the module (sharded in place over tp, cp, ep and pp), the mesh, the `ParallelConfig`, this pipeline
rank's chunks, and the data-parallel strategy that `config` names (`parallel.data`, chosen once here). Call it
like the model; build the optimizer with `optimizer()`. Every forward runs between the strategy's
`before_forward` and `after_forward` (ZeRO gathers parameters there); the optimizer asks the strategy for the
averaged gradients and tells it about the update.

Every rank must build the model from the same seed (orangetron's initialization depends only on the seed and
the config): nothing broadcasts the initial weights. Gradients are averaged over the d = dp x cp ranks, so
each rank's loss must be the mean over an equal share of the batch.

`DataParallel` is this class under its earlier name (`ot.DataParallel`), kept for its users.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from orangetron.mesh import MeshGroup, ParallelMesh
from orangetron.parallel import state
from orangetron.parallel.config import ParallelConfig, check_runnable
from orangetron.parallel.data import DataParallelBuffers, ShardedAdamW, strategy_for, whole
from orangetron.parallel.data.flat import FlatPart
from orangetron.parallel.data.transient import TransientPeaks
from orangetron.parallel.state import Shards

if TYPE_CHECKING:
    from orangetron.parallel.pipeline.stage import Chunk


class ParallelModel(nn.Module):
    """`module` with every dimension of `mesh.layout` applied and data parallelism over `mesh["dp_cp"]`.

    `pipeline_chunks`: under pp > 1, the chunks this pipeline rank runs (`pipeline.split_stages`); None otherwise.
    """

    def __init__(self, module: nn.Module, mesh: ParallelMesh, config: ParallelConfig | None = None,
                 pipeline_chunks: list[Chunk] | None = None) -> None:
        super().__init__()
        self.config = config or ParallelConfig()
        check_runnable(self.config)
        self.module = module
        self.mesh = mesh
        self.pipeline_chunks = pipeline_chunks
        strategy = strategy_for(self.config)
        self.dp_buffers = DataParallelBuffers(module, mesh, self.config, strategy.units(module))
        self.strategy = strategy(self.dp_buffers)

    @property
    def device(self) -> torch.device:
        return self.dp_buffers.device

    # ---- forward and backward ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.module, *args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` as a forward of the module: parameters gathered first where the strategy asks,
        gradients expected afterwards (a pipeline stage runs each of its chunks this way)."""
        self.strategy.before_forward()
        out = fn(*args, **kwargs)
        self.strategy.after_forward(out)
        return out

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside only accumulate gradients (the earlier micro-batches of a step)."""
        return self.strategy.no_sync()

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp x cp ranks into the main gradients (the optimizer's step calls this)."""
        self.strategy.reduce_gradients()

    def optimizer(self, lr: float, **adamw: Any) -> ShardedAdamW:
        """AdamW over this rank's shard (the whole buffer under DDP): `betas`, `eps`, `weight_decay`,
        `decay_matrices_only`."""
        return ShardedAdamW(self.dp_buffers, self.strategy, lr=lr, **adamw)

    def gather_params(self) -> None:
        """Every parameter of the module whole on this rank now, to read them outside a forward (a collective
        under ZeRO: every rank of the data-parallel group calls it)."""
        self.strategy.gather_params()

    # ---- memory -------------------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps between steps, by memory category (see `orangetron.memory`)."""
        return self.strategy.state_tensors()

    def transient_peaks(self) -> dict[str, int]:
        """Peak bytes, since the last `reset_transient_peaks()`, of ZeRO-3's gathered parameters
        (`gathered_params`) and of the gradient reduction's buffers (`grad_buckets`): ZeRO-3's unit and the
        sharded stages' bucket in flight (wire buffer, reduced slice), bucketed DDP's wire copies (held until
        the step), and without buckets each flat buffer's temporary or wire copy with the collective's result
        (`plan.memory.grad_bucket_bytes` predicts them); and of the per-parameter `.grad` tensors not yet moved
        into the flat buffers (`param_grads`, predicted by `plan.param_grads.param_grad_bytes`)."""
        return dict(self.dp_buffers.transient.peak)

    def reset_transient_peaks(self) -> None:
        self.dp_buffers.transient.reset()

    # ---- layout-independent state (checkpoints) -----------------------------------------------------

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Whole averaged gradients by parameter name, on every rank (after `reduce_gradients`)."""
        return whole.full_grads(self.dp_buffers)

    def full_state(self, optimizer: ShardedAdamW) -> dict[str, Any]:
        """Whole (unsharded) main parameters and AdamW moments by parameter name, on every rank.

        The same on any layout, so a run can resume on another one. Gathers over dp_cp (edp) when sharded.
        """
        return whole.full_state(self.dp_buffers, optimizer)

    def sharded_state(self, optimizer: ShardedAdamW, writing: bool = False) -> dict[str, dict[str, Shards]]:
        """This rank's pieces of the whole main parameters, AdamW moments and buffers, by parameter name: views
        of its own buffers, no copies (`orangetron.parallel.state`). A checkpoint saves them (`writing`: a tied
        embedding's last-stage copy names no pieces); loading writes into them, followed by `state_loaded`."""
        return state.sharded_state(self.dp_buffers, optimizer, writing)

    def state_loaded(self, optimizer: ShardedAdamW, optimizer_steps: int) -> None:
        """Bring the copies derived from the main parameters in line after `sharded_state` was loaded into:
        the model-dtype parameters, gathered where ZeRO-1/2 keep them whole, and AdamW's step count."""
        self.strategy.state_loaded()
        optimizer.steps = optimizer_steps

    # ---- the earlier wrapper's views of its buffers, which tests and benchmarks read -------------------

    @property
    def zero3(self) -> bool:
        return self.config.zero_stage == 3

    @property
    def group(self) -> MeshGroup:
        """The data-parallel group of the dense parameters, dp x cp."""
        return self.dp_buffers.group

    @property
    def parts(self) -> list[FlatPart]:
        return self.dp_buffers.parts

    @property
    def transient(self) -> TransientPeaks:
        return self.dp_buffers.transient

    @property
    def numel(self) -> int:
        """Elements of the dense flat buffer (before padding)."""
        return self.parts[0].numel

    def owned_grads(self) -> torch.Tensor:
        """This rank's averaged dense main gradients, aligned with its main parameters (after `reduce_gradients`)."""
        return self.parts[0].owned_grads()

    @property
    def buckets(self) -> Any:
        """The gradient buckets of DDP and the sharded strategies (None without `grad_bucket_numel`)."""
        return self.strategy.buckets

    @property
    def schedule(self) -> Any:
        """ZeRO-3's per-unit schedule."""
        return self.strategy.schedule


DataParallel = ParallelModel  # the earlier name of the same class (a stable contract)
