"""`ShardedAdamW`: AdamW on the slices of the flat parameters a rank owns, with the global gradient norm.

It asks the data-parallel strategy for the averaged gradients before it reads them (`reduce_gradients`) and
tells it once the main parameters have changed (`after_step`), so the same optimizer serves DDP, ZeRO-1/2/3
and the distributed optimizer.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.parallel.data.buffers import DataParallelBuffers
from orangetron.parallel.data.flat import FlatPart
from orangetron.parallel.data.optim import FlatAdamW
from orangetron.parallel.data.strategy import DataParallelStrategy


def decay_mask(part: FlatPart) -> torch.Tensor:
    """True for the owned elements of matrices (weight decay applies), False for norms and biases."""
    return part.owned_mask(lambda name, p: p.dim() >= 2)


def norm_mask(buffers: DataParallelBuffers, part: FlatPart) -> torch.Tensor | None:
    """True for the owned elements that enter the global gradient norm on this rank (None: all of them);
    under tensor parallelism each distinct element counts on exactly one tp rank, and a tied embedding on the
    first pipeline stage only (`DataParallelBuffers.counts_in_norm`)."""
    if buffers.tp is None and not buffers.tied_copy:
        return None
    return part.owned_mask(lambda name, p: buffers.counts_in_norm(name))


class ShardedAdamW:
    """AdamW on the slices of the flat parameters a rank owns (one per part); `step()` reduces gradients first."""

    def __init__(self, buffers: DataParallelBuffers, strategy: DataParallelStrategy, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decay_matrices_only: bool = True) -> None:
        self.buffers, self.strategy = buffers, strategy
        self.norm_masks = [norm_mask(buffers, part) for part in buffers.parts]
        self.adamws = [
            FlatAdamW(part.main_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                      decay_mask=decay_mask(part) if weight_decay and decay_matrices_only else None)
            for part in buffers.parts]

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

    @property
    def steps(self) -> int:
        """Updates made so far (AdamW's bias correction counts them); a checkpoint restores it."""
        return self.adamw.steps

    @steps.setter
    def steps(self, value: int) -> None:
        for adamw in self.adamws:
            adamw.steps = value

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping."""
        self.strategy.reduce_gradients()
        norm = self._global_squares().sqrt()[0]
        if max_norm < float("inf"):  # "no clipping" must not multiply an infinite norm's grads by inf/inf
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for part in self.buffers.parts:
                part.owned_grads().mul_(scale)
        return norm

    def _global_squares(self) -> torch.Tensor:
        """The sum of squares of every gradient element of the model, [1], the same on every rank.

        Each part's sum is summed over its shard group when sharded; the experts' also over ep (each ep rank
        holds other experts); then everything over tp, counting each element once, and over pp (each stage
        holds other layers).
        """
        total = None
        for part, mask in zip(self.buffers.parts, self.norm_masks, strict=True):
            counted = part.owned_grads().square()
            if mask is not None:  # each distinct element once (over tp, and a tied embedding's two stages)
                counted.masked_fill_(~mask, 0)
            squares = counted.sum().reshape(1)
            if part.shards > 1:
                squares = comm.all_reduce(squares, part.group)
            if part is not self.buffers.parts[0]:
                squares = comm.all_reduce(squares, self.buffers.ep)
            total = squares if total is None else total + squares
        if self.buffers.tp is not None:
            total = comm.all_reduce(total, self.buffers.tp)
        if self.buffers.pp is not None:
            total = comm.all_reduce(total, self.buffers.pp)
        return total

    def step(self) -> None:
        self.strategy.reduce_gradients()
        for part, adamw in zip(self.buffers.parts, self.adamws, strict=True):
            adamw.step(part.owned_grads())
        self.strategy.after_step()

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for adamw in self.adamws for t in adamw.state_tensors()]
