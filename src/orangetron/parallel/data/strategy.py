"""`DataParallelStrategy`: how the d = dp x cp ranks keep one model, behind one interface.

What each strategy keeps and sends (docs/data_parallel.md has the full tables):

| strategy (module) | params | main grads | main params, optimizer | after backward | parameter sync |
|---|---|---|---|---|---|
| DDP (`replicated.py`) | full | full | full | all-reduce | none |
| ZeRO-1, ZeRO-2 (`sharded.py`) | full | full / 1/d | 1/d | reduce-scatter | all-gather before the next forward |
| distributed optimizer (`sharded.py`) | full | full | 1/d | reduce-scatter | all-gather right after the step |
| ZeRO-3 by unit (`zero3.py`) | 1/d | 1/d | 1/d | reduce-scatter | all-gather before forward and backward |

`parallel.data.choose.strategy_for` picks one from `ParallelConfig` (zero_stage, distributed_optimizer), once.
The parallel model (`parallel.parallel_model.ParallelModel`) drives it: `before_forward` and `after_forward` around
every forward (a pipeline stage's chunks included), `no_sync` around the backward passes of a step's earlier
micro-batches, `reduce_gradients` when the step wants the averaged gradients, `after_step` after the optimizer's
update, `state_loaded` after a checkpoint was written into the main parameters. Everything a strategy needs about
the model comes from the `DataParallelBuffers` it is given; the hooks it registers are its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from orangetron.parallel.data.buffers import DataParallelBuffers

if TYPE_CHECKING:
    from orangetron.parallel.data.units import Unit


class DataParallelStrategy(ABC):
    """One way to keep a model over the dp x cp ranks: when parameters are gathered, how gradients are reduced."""

    def __init__(self, buffers: DataParallelBuffers) -> None:
        self.buffers = buffers
        self.grads_pending = False  # a training forward ran since the last reduction

    @classmethod
    def units(cls, module: nn.Module) -> list[Unit]:
        """The units `module`'s flat buffers are cut into (each padded and sharded alone); none by default."""
        return []

    def before_forward(self) -> None:  # noqa: B027 (DDP has nothing to gather)
        """Make the parameters the next forward computes with whole on this rank."""

    def after_forward(self, out: Any) -> None:
        """The forward that returned `out` ran; gradients come next unless it ran without grad (evaluation)."""
        self.grads_pending |= torch.is_grad_enabled()  # an evaluation forward leaves nothing to reduce

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (the earlier micro-batches of a step)."""
        yield

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp x cp ranks into the main gradients (once per step; the optimizer's
        `step` and `clip_grad_norm_` call this)."""
        if not self.grads_pending:
            return
        self.reduce()
        self.grads_pending = False

    @abstractmethod
    def reduce(self) -> None:
        """The reduction `reduce_gradients` runs when a training forward left gradients to average."""

    def after_step(self) -> None:
        """The optimizer updated this rank's main parameters: bring the model's parameters in line."""
        self.buffers.copy_main_params()

    def zero_grad(self) -> None:
        """Forget the step's gradients before the next one."""
        self.buffers.free_grads()

    def state_loaded(self) -> None:
        """A checkpoint was written into the main parameters: bring the model's parameters in line."""
        self.buffers.copy_main_params()

    @abstractmethod
    def gather_params(self) -> None:
        """Every parameter of the model whole on this rank now (to read them outside a forward)."""

    @abstractmethod
    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter buffers this rank keeps between steps (the `params` memory category)."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps between steps, by memory category (see `orangetron.memory`)."""
        parts = self.buffers.parts
        return {
            "params": self.param_tensors(),
            "grads": [part.main_grads for part in parts],
            "main_params": [part.main_params for part in parts] if self.buffers.config.mixed_precision else [],
        }
