"""One training step on one rank: its share of the batch, forward and backward of every micro-batch (or the
pipeline's schedule), clipping and the update; and held-out evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from orangetron import comm, memory
from orangetron.model import Transformer
from orangetron.parallel import ParallelModel, ShardedAdamW, context, pipeline
from orangetron.parallel.expert import update_router_bias
from orangetron.train import faults

IGNORE_INDEX = -100


class TrainingDiverged(ValueError):
    """A step's loss or gradient norm is not finite; the run stopped before updating with it."""


def _rank_share(model: ParallelModel, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                  float]:
    """(inputs, labels, positions, share) of samples [B, S+1] as this rank sees them: under cp its head-tail
    share of the (padded) sequence with global positions, and the weight of its mean loss (see below)."""
    inputs, labels = samples[:, :-1], samples[:, 1:]  # [B, S] each
    positions, share = None, 1.0
    cp = model.mesh["cp"].size
    if cp > 1:  # this rank's head-tail share of the (padded) sequence, with its global positions
        multiple = context.shard_multiple(model.mesh.layout, model.config.sequence_parallel)
        inputs, labels = context.pad_sequence(inputs, labels, multiple, IGNORE_INDEX)
        positions = context.position_ids(inputs.shape[1], model.mesh)
        valid = int((labels != IGNORE_INDEX).sum())
        inputs, labels = context.shard(inputs, model.mesh), context.shard(labels, model.mesh)
        # Padding leaves the cp ranks unequal token counts: weight this rank's mean by its share of the
        # real tokens (times cp, as gradients are averaged over the ranks), so the mean is over all of them.
        share = int((labels != IGNORE_INDEX).sum()) * cp / max(valid, 1)
    return inputs, labels, positions, share


def _lm_loss(model: ParallelModel, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, language-model loss) of samples [B, S+1].

    The objective is the model's own loss (mean next-token cross entropy plus the MoE aux loss), so
    every layout optimizes the same definition; the language-model loss drops the aux term for reporting.
    """
    module: Transformer = model.module  # or its tensor-parallel shard, which speaks the same interface
    inputs, labels, positions, share = _rank_share(model, samples)
    # Through the parallel model: ZeRO gathers parameters.
    logits = model(inputs, position_ids=positions, token_mask=labels != IGNORE_INDEX)
    objective = module.loss_from_logits(logits, labels, ignore_index=IGNORE_INDEX)
    aux = module.aux_loss()
    if share != 1.0:
        objective = (objective - aux) * share + aux
    return objective, objective.detach() - aux.detach()


def _pipeline_step(model: ParallelModel, microbatches: list[torch.Tensor], train: bool = True) -> float:
    """Forwards (and backwards) of every micro-batch [b, S+1] through the pipeline; the language-model loss,
    which the last stage computes and sends to the other stages as a report (not training traffic)."""
    m, mbs = len(microbatches), []
    for samples in microbatches:
        inputs, labels, positions, share = _rank_share(model, samples)
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        mbs.append(pipeline.MicroBatch(inputs, labels, positions, labels != IGNORE_INDEX, share / m, 1 / m,
                                       IGNORE_INDEX))
    cfg = model.config
    loss = pipeline.run_pipeline(model, mbs, cfg.pp_schedule, cfg.virtual_stages, train=train)
    group = model.mesh["pp"]
    with comm.unmeasured():
        report = comm.host_tensor([0.0 if loss is None else loss], torch.float64)
        return float(comm.broadcast(report, group, src=group.size - 1)[0])


def _forward_backward(model: ParallelModel, microbatches: list[torch.Tensor]) -> float:
    """Every micro-batch's forward and backward, gradients accumulated; the step's language-model loss.

    Each micro-batch's objective is divided by their number, so the sum is the mean over the step's rows.
    """
    if model.mesh["pp"].size > 1:
        faults.enter("forward and backward (pipeline)")
        return _pipeline_step(model, microbatches)
    m, total = len(microbatches), 0.0
    for j, samples in enumerate(microbatches):
        with model.no_sync() if j < m - 1 else nullcontext():  # reduce once, after the last backward
            faults.enter("forward")
            objective, lm_loss = _lm_loss(model, samples)
            faults.enter("backward")
            (objective / m if m > 1 else objective).backward()
        total += float(lm_loss) / m
    return total


def _eval_loss(model: ParallelModel, batch: torch.Tensor) -> float:
    if model.mesh["pp"].size > 1:
        return _pipeline_step(model, [batch], train=False)
    return float(_lm_loss(model, batch)[1])


@torch.no_grad()
def evaluate(model: ParallelModel, samples: torch.Tensor, batch_size: int, max_batches: int) -> float | None:
    """Mean next-token cross entropy (no aux loss) over the first max_batches batches of samples
    [n, S+1], in order; None when there are no samples. Every rank evaluates the same samples."""
    n = min(samples.shape[0], batch_size * max_batches)
    if n == 0:
        return None
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, n, batch_size):
        batch = samples[start : min(start + batch_size, n)].to(model.device)
        total += _eval_loss(model, batch) * batch.shape[0]  # equal-length rows: weight by rows
    model.train(was_training)
    return total / n


def train_step(
    model: ParallelModel, optimizer: ShardedAdamW, batch: list[torch.Tensor], lr: float, grad_clip: float, *,
    measure: bool, on_grads: Callable[[ParallelModel], None] | None = None,
) -> tuple[float, float, dict[str, int]]:
    """Forward and backward of every micro-batch [b, S+1] in `batch`, then one update -> (loss, grad norm,
    memory by category).

    Raises TrainingDiverged ("loss is nan", "gradient norm is inf") before the update when the loss on any
    rank or the global gradient norm is not finite, on every rank alike. The memory dict is empty unless
    `measure`; then it holds the model state after the update (params, grads, main_params, optimizer), the
    peak of activations saved for backward, and the transient peaks (`memory.model_state_bytes`).
    The loss is the whole batch's (see `_global_loss_unless_diverged`).
    `on_grads(model)` sees the averaged gradients before clipping (`orangetron verify` reads them there).
    """
    with memory.track_activations(model.module) if measure else nullcontext() as meter:
        lm_loss = _forward_backward(model, batch)
    if on_grads is not None:
        model.reduce_gradients()
        on_grads(model)
    optimizer.lr = lr
    faults.enter("gradient reduction")
    grad_norm = optimizer.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf)
    loss = _global_loss_unless_diverged(lm_loss, grad_norm)
    faults.enter("optimizer step")
    optimizer.step()
    update_router_bias(model.module, model.mesh, model.config.sequence_parallel)
    mem: dict[str, int] = {}
    if measure:
        state = memory.model_state_bytes(model, optimizer)
        # The transient peaks (ZeRO-3's gathered units, gradient buckets, per-parameter .grad) come after the
        # model state: what exists only during a step, at its peak, as the planner prices it.
        transient = {k: v for k, v in state.items() if k not in ("params", "grads", "main_params", "optimizer")}
        mem = {**{k: state[k] for k in ("params", "grads", "main_params", "optimizer")},
               "activations_peak": meter.peak_bytes, **transient}
    optimizer.zero_grad()
    return loss, float(grad_norm), mem


def _global_loss_unless_diverged(lm_loss: float, grad_norm: torch.Tensor) -> float:
    """The whole batch's loss, the same on every rank; TrainingDiverged on every rank when any rank's loss or
    the gradient norm is not finite.

    Each rank's loss is the mean over its share of the batch, weighted so that the data- and context-parallel
    ranks' mean is the batch's; tensor-parallel ranks and pipeline stages hold copies of their group's, so
    the mean over every rank is the batch's too. One sum over every rank also decides divergence for all of
    them: a non-finite term makes it non-finite. The gradient norm is global already; it rides along.
    """
    verdict = comm.host_tensor([lm_loss, float(grad_norm)], torch.float64)
    with comm.unmeasured():  # a check, not training traffic
        loss_sum, norm_sum = comm.all_reduce(verdict, comm.world_group()).tolist()
    if not math.isfinite(loss_sum):
        raise TrainingDiverged(f"loss is {loss_sum}")
    if not math.isfinite(norm_sum):
        raise TrainingDiverged(f"gradient norm is {norm_sum}")
    return loss_sum / comm.world_group().size
