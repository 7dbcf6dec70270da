"""One training step on one rank: its share of the batch, forward and backward of every micro-batch (or the
pipeline's schedule), clipping and the update; and held-out evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple

import torch

from orangetron import comm, memory
from orangetron.model import Transformer
from orangetron.model.documents import Documents
from orangetron.parallel import ParallelModel, ShardedAdamW, context, pipeline
from orangetron.parallel.expert import update_router_bias
from orangetron.train import faults
from orangetron.train.data import label_count, packed_inputs

IGNORE_INDEX = -100


class TrainingDiverged(ValueError):
    """A step's loss or gradient norm is not finite; the run stopped before updating with it."""


def _rank_share(model: ParallelModel, samples: torch.Tensor) -> RankShare:
    """(inputs, labels, positions, share, documents) of samples [B, S+1] (packed: [B, S+1, 2]) as this rank sees
    them: under cp its share of the (padded) sequence with global positions (head-tail, or balanced over packed
    documents), and the weight of its mean
    loss (see below); the documents of packed samples (`data.packed_inputs`), else None."""
    inputs, labels, documents = packed_inputs(samples, IGNORE_INDEX)  # [B, S] each
    positions, share = None, 1.0
    cp = model.mesh["cp"].size
    if cp > 1:  # this rank's share of the (padded) sequence, with its global positions
        multiple = context.shard_multiple(model.mesh.layout, model.config.sequence_parallel)
        inputs, labels = context.pad_sequence(inputs, labels, multiple, IGNORE_INDEX)
        if documents is None:  # head-tail, global positions
            positions, cuts = context.position_ids(inputs.shape[1], model.mesh), None
        else:  # the whole (padded) sequence's documents, balanced; positions in them
            documents = padded_documents(documents, inputs.shape[1])
            cuts = documents.cuts
            positions = context.shard(documents.positions(), model.mesh, cuts=cuts)
        valid = int((labels != IGNORE_INDEX).sum())
        inputs, labels = context.shard(inputs, model.mesh, cuts=cuts), context.shard(labels, model.mesh, cuts=cuts)
        # Padding leaves the cp ranks unequal token counts: weight this rank's mean by its share of the
        # real tokens (times cp, as gradients are averaged over the ranks), so the mean is over all of them.
        share = int((labels != IGNORE_INDEX).sum()) * cp / max(valid, 1)
    return RankShare(inputs, labels, positions, share, documents)


def padded_documents(documents: Documents, seq_len: int) -> Documents:
    """`documents` of a sequence padded at its end to `seq_len`: the padding is a document of its own."""
    ids = documents.ids
    extra = seq_len - ids.shape[1]
    if extra == 0:
        return documents
    return Documents.from_ids(torch.nn.functional.pad(ids, (0, extra), value=int(ids.max()) + 1))


class RankShare(NamedTuple):
    inputs: torch.Tensor  # [B, S/cp]
    labels: torch.Tensor  # [B, S/cp]
    positions: torch.Tensor | None  # global positions under cp, else None
    share: float  # the weight of this rank's mean loss
    documents: Documents | None  # of packed samples


def _lm_loss(model: ParallelModel, samples: torch.Tensor, weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, language-model loss) of samples [B, S+1], the cross entropy weighted by `weight`
    (`_label_weights`).

    The objective is the model's own loss (mean next-token cross entropy plus the MoE aux loss), so
    every layout optimizes the same definition; the language-model loss drops the aux term for reporting.
    """
    module: Transformer = model.module  # or its tensor-parallel shard, which speaks the same interface
    inputs, labels, positions, share, documents = _rank_share(model, samples)
    share *= weight
    # Through the parallel model: ZeRO gathers parameters.
    logits = model(inputs, position_ids=positions, token_mask=labels != IGNORE_INDEX, documents=documents)
    objective = module.loss_from_logits(logits, labels, ignore_index=IGNORE_INDEX)
    aux = module.aux_loss()
    if share != 1.0:
        objective = (objective - aux) * share + aux
    return objective, objective.detach() - aux.detach()


def _pipeline_step(model: ParallelModel, microbatches: list[torch.Tensor], weights: list[float],
                   train: bool = True) -> float:
    """Forwards (and backwards) of every micro-batch [b, S+1] through the pipeline, cross entropies weighted by
    `weights`; the language-model loss, which the last stage computes and sends to the other stages as a report
    (not training traffic)."""
    m, mbs = len(microbatches), []
    for samples, weight in zip(microbatches, weights, strict=True):
        inputs, labels, positions, share, documents = _rank_share(model, samples)
        share *= weight
        if positions is None:
            positions = (torch.arange(inputs.shape[1], device=inputs.device) if documents is None
                         else documents.positions())
        mbs.append(pipeline.MicroBatch(inputs, labels, positions, labels != IGNORE_INDEX, share / m, 1 / m,
                                       IGNORE_INDEX, documents))
    cfg = model.config
    loss = pipeline.run_pipeline(model, mbs, cfg.pp_schedule, cfg.virtual_stages, train=train)
    group = model.mesh["pp"]
    with comm.unmeasured():
        report = comm.host_tensor([0.0 if loss is None else loss], torch.float64)
        return float(comm.broadcast(report, group, src=group.size - 1)[0])


def _label_weights(model: ParallelModel, microbatches: list[torch.Tensor], labels: int | None) -> list[float]:
    """Each micro-batch's weight on its mean cross entropy, so that the step's loss is the mean over the whole
    batch's `labels` counted labels: its share of them, times the micro-batches and dp ranks that average it.
    Plain rows hold equal shares (every weight exactly 1); packed rows ignore a label per document boundary."""
    if labels is None:
        return [1.0] * len(microbatches)
    replicas = len(microbatches) * model.mesh["dp"].size
    return [label_count(samples) * replicas / max(labels, 1) for samples in microbatches]


def _forward_backward(model: ParallelModel, microbatches: list[torch.Tensor], labels: int | None) -> float:
    """Every micro-batch's forward and backward, gradients accumulated; the step's language-model loss.

    Each micro-batch's objective is divided by their number, so the sum is the mean over the step's rows
    (weighted by `_label_weights` when the batch counts `labels` labels).
    """
    weights = _label_weights(model, microbatches, labels)
    if model.mesh["pp"].size > 1:
        faults.enter("forward and backward (pipeline)")
        return _pipeline_step(model, microbatches, weights)
    m, total = len(microbatches), 0.0
    for j, samples in enumerate(microbatches):
        with model.no_sync() if j < m - 1 else nullcontext():  # reduce once, after the last backward
            faults.enter("forward")
            objective, lm_loss = _lm_loss(model, samples, weights[j])
            faults.enter("backward")
            (objective / m if m > 1 else objective).backward()
        total += float(lm_loss) / m
    return total


def _eval_loss(model: ParallelModel, batch: torch.Tensor) -> float:
    if model.mesh["pp"].size > 1:
        return _pipeline_step(model, [batch], [1.0], train=False)
    return float(_lm_loss(model, batch)[1])


@torch.no_grad()
def evaluate(model: ParallelModel, samples: torch.Tensor, batch_size: int, max_batches: int) -> float | None:
    """Mean next-token cross entropy (no aux loss) over the first max_batches batches of samples
    [n, S+1], in order, the same on every rank; None when there are no samples. Every rank evaluates the same
    samples; a context-parallel rank sees an equal share of each one's tokens, so the loss is the mean over
    every rank (tp ranks, pp stages and dp ranks hold copies), as a training step's is."""
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
    share = comm.host_tensor([total / n], torch.float64)
    with comm.unmeasured():  # a report, not evaluation traffic the planner prices
        return comm.all_reduce(share, comm.world_group()).item() / comm.world_group().size


def train_step(
    model: ParallelModel, optimizer: ShardedAdamW, batch: list[torch.Tensor], lr: float, grad_clip: float, *,
    measure: bool, on_grads: Callable[[ParallelModel], None] | None = None, labels: int | None = None,
) -> tuple[float, float, dict[str, int]]:
    """Forward and backward of every micro-batch [b, S+1] in `batch`, then one update -> (loss, grad norm,
    memory by category). `labels`: the counted labels of the whole step's batch over every dp rank
    (`data.label_count`), which makes the loss their mean when micro-batches count unequal shares (packed rows);
    None: every micro-batch counts as many.

    Raises TrainingDiverged ("loss is nan", "gradient norm is inf") before the update when the loss on any
    rank or the global gradient norm is not finite, on every rank alike. The memory dict is empty unless
    `measure`; then it holds the model state after the update (params, grads, main_params, optimizer), the
    peak of activations saved for backward, and the transient peaks (`memory.model_state_bytes`).
    The loss is the whole batch's (see `_global_loss_unless_diverged`).
    `on_grads(model)` sees the averaged gradients before clipping (`orangetron verify` reads them there).
    """
    with memory.track_activations(model.module) if measure else nullcontext() as meter:
        lm_loss = _forward_backward(model, batch, labels)
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
