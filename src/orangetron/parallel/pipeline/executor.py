"""One executor for every schedule: it runs `spec.schedule.actions`, the lists `orangetron schedule` draws.

Each pipeline rank walks its own action list. A forward of (chunk, micro-batch) receives its input from the
previous virtual stage (or embeds the tokens), runs the chunk, and queues the output for the next virtual
stage; a backward receives the output's gradient from the next virtual stage (or starts from the loss),
runs autograd through the chunk and queues the input's gradient back. Every rank posts its transfers in one
order derived from the same action lists (`spec/transfers.py`), so no send can wait on a receive that waits
on it. Receives block, sends do not, so a rank waits only for what its next action needs: the dependencies
`spec.schedule.simulate` replays, which never deadlock. A micro-batch's saved activations are dropped as
soon as its backward has run. Gradients accumulate in `.grad` over the micro-batches; every micro-batch's
loss is scaled so that their sum is the step's objective.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from orangetron import comm
from orangetron.model.documents import Documents
from orangetron.parallel.pipeline.stage import Chunk, chunk_forward, hidden_shape
from orangetron.spec.schedule import Action, actions
from orangetron.spec.transfers import Transfer, transfer_order

if TYPE_CHECKING:
    from orangetron.parallel.parallel_model import ParallelModel


@dataclass
class MicroBatch:
    """One micro-batch as this rank sees it: tokens [B, S], labels [B, S] and positions ([S] or [B, S]) of
    its share of the sequence, the MoE padding mask, and the weights of its cross entropy and
    load-balancing loss in the step's objective (1/m each, times the rank's token share under CP), and the
    documents of packed rows (every stage attends within them), else None."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    token_mask: torch.Tensor | None
    loss_scale: float
    aux_scale: float
    ignore_index: int = -100
    documents: Documents | None = None


class _Transfers:
    """Sends and receives between neighbouring virtual stages over mesh["pp"], tagged by
    (virtual stage, micro-batch, direction) so that no two transfers between a pair of ranks can match.

    Every call goes out in the order `spec.transfers.transfer_order` gives this rank, which every rank derives
    from the same action lists: backends that match calls in posting order and block a send until its receive
    (NCCL) cannot stall on it. A produced tensor waits until its send is next in that order; a pass's input is
    received when its receive is next, which it is by then (the order follows a timeline of the same passes).
    """

    def __init__(self, model: ParallelModel, plan: list[list[Action]], microbatches: int, virtual_stages: int) -> None:
        self.group, self.m = model.mesh["pp"], microbatches
        self.dtype = next(model.module.parameters()).dtype
        self.device = model.device
        self.calls = transfer_order(plan, virtual_stages)[self.group.rank]
        self.next_call = 0
        self.produced: dict[tuple[int, int, int], torch.Tensor] = {}  # (from, to, micro-batch) -> tensor
        self.pending: list[comm.PendingP2P] = []

    def _tag(self, transfer: Transfer) -> int:
        return 2 * (transfer.low_stage * self.m + transfer.microbatch) + int(transfer.backward)

    def _rank_of(self, stage: int) -> int:
        return stage % self.group.size

    def send(self, x: torch.Tensor, from_stage: int, to_stage: int, microbatch: int) -> None:
        """Hand over `x` for the next virtual stage; it goes out when its turn in the order comes."""
        self.produced[(from_stage, to_stage, microbatch)] = x.detach()
        self._post_due()

    def recv(self, shape: tuple[int, ...], from_stage: int, to_stage: int, microbatch: int) -> torch.Tensor:
        """The tensor a pass needs from a neighbouring virtual stage, once it has arrived."""
        received = self._post_due(need=(from_stage, to_stage, microbatch), shape=shape)
        if received is None:
            raise RuntimeError(f"pipeline transfer {from_stage}->{to_stage} of micro-batch {microbatch} is not next "
                               "in this rank's order (spec/transfers.py): the action lists and the order disagree")
        return received

    def _post_due(self, need: tuple[int, int, int] | None = None, shape: tuple[int, ...] = ()) -> torch.Tensor | None:
        """Post calls in order while the next one is a produced send or the receive `need`; return what that
        receive brought (None when `need` was not reached)."""
        received = None
        while self.next_call < len(self.calls):
            op, transfer = self.calls[self.next_call]
            key = (transfer.source, transfer.target, transfer.microbatch)
            if op == "send" and key in self.produced:
                x = self.produced.pop(key)
                self.pending.append(comm.post_p2p([(x, self._rank_of(transfer.target), self._tag(transfer))], [],
                                                  self.group))
            elif op == "recv" and key == need:
                received = torch.empty(shape, dtype=self.dtype, device=self.device)
                comm.post_p2p([], [(received, self._rank_of(transfer.source), self._tag(transfer))], self.group).wait()
            else:
                break
            self.next_call += 1
        return received

    def finish(self) -> None:
        self._post_due()
        if self.next_call != len(self.calls):
            raise RuntimeError(f"pipeline transfers left unposted: {self.calls[self.next_call:]}")
        for batch in self.pending:
            batch.wait()
        self.pending.clear()


def run_pipeline(model: ParallelModel, microbatches: list[MicroBatch], schedule: str, virtual_stages: int = 1,
                 train: bool = True, timeline: list[tuple[str, int, int, float, float]] | None = None) -> float | None:
    """Run one step's forwards (and backwards when `train`) of `schedule` on this pipeline rank, with the
    chunks `model` (from `parallelize` over pp > 1) holds.

    Returns the sum over micro-batches of loss_scale * cross entropy on the last stage, None elsewhere.
    Without `train`, only the forwards run, micro-batch by micro-batch, under no_grad. `timeline`, when
    given, receives (kind, chunk, micro-batch, start, end) per action in `time.perf_counter` seconds, from
    the moment its input has arrived to the moment its output is posted (waiting is not work).
    """
    group = model.mesh["pp"]
    chunks = model.pipeline_chunks
    if chunks is None:
        raise ValueError("run_pipeline: the model holds no pipeline chunks; parallelize it over pp > 1")
    if train:
        plans = actions(group.size, len(microbatches), schedule, virtual_stages)
    else:  # forwards only: every rank in micro-batch order, chunk by chunk (any count of micro-batches)
        forwards = [Action("F", c, i) for i in range(len(microbatches)) for c in range(virtual_stages)]
        plans = [forwards] * group.size
    plan = plans[group.rank]
    runner = _Runner(model, microbatches, chunks, _Transfers(model, plans, len(microbatches), virtual_stages))
    runner.timeline = timeline
    # Gradient buckets start with a chunk's last backward of the step; the earlier ones only accumulate.
    last_backward = {act.chunk: at for at, act in enumerate(plan) if act.kind == "B"}
    with torch.set_grad_enabled(train and torch.is_grad_enabled()):
        for at, act in enumerate(plan):
            if act.kind == "F":
                runner.forward(chunks[act.chunk], act.microbatch)
                continue
            with model.no_sync() if at != last_backward[act.chunk] else nullcontext():
                runner.backward(chunks[act.chunk], act.microbatch)
    runner.transfers.finish()
    return runner.loss if chunks[-1].last else None


class _Runner:
    """The state of one step on one rank: what each in-flight (chunk, micro-batch) keeps until its backward."""

    def __init__(self, model: ParallelModel, microbatches: list[MicroBatch], chunks: list[Chunk],
                 transfers: _Transfers) -> None:
        self.model, self.mbs, self.chunks, self.transfers = model, microbatches, chunks, transfers
        self.saved: dict[tuple[int, int], tuple] = {}
        self.loss = 0.0
        self.timeline: list | None = None

    def _busy(self, kind: str, chunk: Chunk, i: int, start: float) -> None:
        if self.timeline is not None:
            self.timeline.append((kind, chunk.index, i, start, time.perf_counter()))

    def forward(self, chunk: Chunk, i: int) -> None:
        mb, module = self.mbs[i], self.model.module
        if chunk.first:
            x = mb.inputs
        else:
            x = self.transfers.recv(hidden_shape(module, mb.inputs), chunk.stage - 1, chunk.stage, i)
            x.requires_grad_(torch.is_grad_enabled())
        start = time.perf_counter()
        out, aux = self.model.run(chunk_forward, module, chunk, x, mb.positions, mb.token_mask,
                                  mb.documents)
        if chunk.last:
            ce = module.cross_entropy(out, mb.labels, mb.ignore_index) * mb.loss_scale
            self.loss += float(ce.detach())
            objective = ce if aux is None else ce + aux * mb.aux_scale
            self.saved[(chunk.index, i)] = (x, objective, None)
        else:
            self.transfers.send(out, chunk.stage, chunk.stage + 1, i)
            self.saved[(chunk.index, i)] = (x, out, aux)
        if not torch.is_grad_enabled():
            del self.saved[(chunk.index, i)]
        self._busy("F", chunk, i, start)

    def backward(self, chunk: Chunk, i: int) -> None:
        x, out, aux = self.saved.pop((chunk.index, i))  # its activations go once this backward is done
        if chunk.last:
            start = time.perf_counter()
            out.backward()
        else:
            grad = self.transfers.recv(tuple(out.shape), chunk.stage + 1, chunk.stage, i)
            start = time.perf_counter()
            tensors, grads = [out], [grad]
            if aux is not None and aux.requires_grad:
                tensors.append(aux)
                grads.append(torch.full_like(aux, self.mbs[i].aux_scale))
            torch.autograd.backward(tensors, grads)
        if not chunk.first:
            self.transfers.send(x.grad, chunk.stage, chunk.stage - 1, i)
        self._busy("B", chunk, i, start)
