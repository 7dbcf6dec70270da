"""Activation recompute: a block keeps only its inputs for backward and replays its forward there.

`ParallelConfig(recompute="full")` puts `Recompute` at the seam `layers.i.recompute` of every replayed block (the
first `recompute_layers` of each pipeline chunk, `spec.stages.replayed_layers`, the planner's rule; 0: all of
them). Its forward runs the block's body without building a graph and keeps the body's inputs through
`save_for_backward`: the layer input [B, S, dim] (the sequence shard under SP), the RoPE tables the chunk's
blocks share and, for an MoE block, the padding mask the micro-batch's blocks share. When the output's gradient
arrives, backward runs the body again with gradients (every collective of the forward again, through
`orangetron.comm`, so the ledger records them) and back-propagates through that replay, as Megatron's
`CheckpointFunction` does. What autograd saves during the replay passes the same saved-tensor hooks as any
forward (`memory.track_activations` counts it), and is freed as the replay's backward goes.

The replay changes no state of the model: the block hands its auxiliary loss back instead of setting it
(`TransformerBlock.body`), so the loss the step already holds stays; and a router counts the loads of forwards
with gradients only (`model.moe.Router`), so each micro-batch is counted once, by the replay, while the forward
without a graph counts nothing. ZeRO-3 gathers a block's parameters when its output's gradient arrives, before
this backward runs, and the replay calls the body, not the block, so no forward hook fires twice.

`recompute="selective"` (Korthikanti et al.'s attention-core recompute) changes nothing here: every attention
the runtime runs already recomputes its scores in backward from what it keeps (docs/runtime.md, Activation
recompute).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from orangetron.model.documents import Documents
from orangetron.parallel.replace import replace_module
from orangetron.spec.stages import replayed_layers

Body = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class Recompute(nn.Module):
    """The recompute seam of a replayed block: forward(body, x, cos, sin, token_mask, documents) -> (out, aux loss
    or None), as `model.transformer.KeepActivations`, keeping only the inputs for backward (the documents of
    packed rows, plain data, go with the body). Without gradients (evaluation) the body just runs."""

    def forward(self, body: Body, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                token_mask: torch.Tensor | None,
                documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not torch.is_grad_enabled():
            return body(x, cos, sin, token_mask, documents)
        # Backward must reach the replay (and the block's parameters) even when the input needs no gradient (a
        # frozen embedding before the first block): then an empty leaf that needs one stands in.
        anchor = None if x.requires_grad else x.new_empty(0, requires_grad=True)
        outputs = _Replay.apply(partial(body, documents=documents), anchor, x, cos, sin, token_mask)
        return (outputs, None) if torch.is_tensor(outputs) else outputs


class _Replay(torch.autograd.Function):
    """The body without a graph forward, keeping its inputs; backward replays it with gradients and runs
    backward through the replay."""

    @staticmethod
    def forward(ctx, body: Body, anchor: torch.Tensor | None, *inputs: torch.Tensor | None):
        ctx.body = body
        ctx.save_for_backward(*inputs)
        out, aux_loss = body(*inputs)  # autograd runs a Function's forward without gradients
        ctx.has_aux = aux_loss is not None
        return (out, aux_loss) if ctx.has_aux else out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_aux: torch.Tensor | None = None):
        inputs = [_leaf(t) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out, aux_loss = ctx.body(*inputs)
        outputs, grads = [out], [grad_out]
        if ctx.has_aux and grad_aux is not None and aux_loss.requires_grad:
            outputs.append(aux_loss)
            grads.append(grad_aux)
        torch.autograd.backward(outputs, grads)  # parameter gradients accumulate as in any backward
        return None, None, *(t.grad if t is not None and t.requires_grad else None for t in inputs)


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """A saved input as a leaf of the replay: the same storage, gradients collected in `.grad`."""
    if t is None:
        return None
    return t.detach().requires_grad_(t.requires_grad)


def apply_recompute(model: nn.Module, pp: int, virtual_stages: int, recompute: str, recompute_layers: int) -> None:
    """Put `Recompute` at the seam of every block of `model` that replays under `recompute` (in place, before the
    pipeline split: every layer of the whole model). "none" and "selective" replay no block."""
    if recompute != "full":
        return
    layers = len(model.layers)
    replayed = set().union(*(replayed_layers(layers, pp, virtual_stages, s, recompute_layers) for s in range(pp)))
    for i in sorted(replayed):
        replace_module(model, f"layers.{i}.recompute", Recompute())
