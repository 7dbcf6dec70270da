"""The per-parameter `.grad` tensors, counted as a memory category from the moment autograd fills one until
the data-parallel strategy has moved it into its flat buffers (`plan.param_grads` predicts the peak)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from orangetron.parallel.data.transient import TransientPeaks


class ParamGrads:
    """Hooks `params` (before any other post-accumulate hook, so a gradient is counted before it is freed) and
    keeps `transient`'s `param_grads` equal to the bytes of the `.grad` tensors alive."""

    def __init__(self, params: list[torch.Tensor], transient: TransientPeaks) -> None:
        self.transient = transient
        # id(parameter) -> bytes of its .grad counted. Per wrapper, not per process; the parameters belong to the
        # wrapped module, which lives as long as the wrapper, so an id is never reused while its entry exists.
        self.counted: dict[int, int] = {}
        for p in params:
            p.register_post_accumulate_grad_hook(self._filled)

    def _filled(self, p: torch.Tensor) -> None:
        nbytes = p.grad.numel() * p.grad.element_size()  # later micro-batches accumulate into the same tensor
        counted = self.counted.get(id(p), 0)
        if nbytes != counted:
            self.transient.add("param_grads", nbytes - counted)
            self.counted[id(p)] = nbytes

    def free(self, p: torch.Tensor) -> None:
        """Drop `p.grad` (its values live on in the flat buffers)."""
        p.grad = None
        self.transient.add("param_grads", -self.counted.pop(id(p), 0))
