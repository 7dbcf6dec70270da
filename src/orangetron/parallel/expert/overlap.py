"""Overlapped ragged dispatch: the tokens in chunks, one chunk's all-to-all in flight while another's experts
compute, forward and backward (DeepEP's communication behind compute, without its kernels).

The T tokens split into `chunks` contiguous ranges (sizes differ by at most one; a range may be empty). The
counts of every chunk travel first in one all-to-all ([ep, chunks, 1 + E/ep] int64: the rows, then the
assignments to each of the receiver's experts), and are read on the host once, so no later exchange waits for
a size and no chunk's experts read their group sizes. Then, on every rank in the same order:

    forward:  start dispatch 0; for c: start dispatch c+1 | wait dispatch c | experts on c | start combine c
    backward: start grads 0;    for c: start grads c+1    | wait grads c    | experts' backward on c |
              start the rows' and weights' gradients of c home

so one chunk's transfer runs while another chunk computes, in both directions. Each chunk sends exactly
the rows the serial dispatch would send for its tokens (one per token and destination rank), so the bytes per
layer equal the serial path's; only the count exchange grows, to `chunks * (1 + E/ep)` int64 per peer.

One autograd Function runs the pipeline. Its forward builds each chunk's expert graph from the received
rows; its backward runs those graphs one by one (parameter gradients accumulate as usual) between the
asynchronous all-to-alls. Everything kept for backward goes through `save_for_backward`, so the activation
meter sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.expert.routing import (
    assignments_per_expert,
    count_message,
    destinations,
    read_counts,
    rows_of,
    slot_ranks,
    split_received,
)
from orangetron.spec.sharding import token_chunks

# (experts, recv_x [R, dim], recv_topk_idx [R, k], recv_topk_weights [R, k], tokens_per_expert [E/ep] as a tensor
# or as a list read on the host already) -> [R, dim]
ExpertCompute = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | list[int]],
                         torch.Tensor]


def chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous [start, end) token ranges, sized as the planner's `token_chunks`."""
    ends = [0]
    for n in token_chunks(tokens, chunks):
        ends.append(ends[-1] + n)
    return list(zip(ends[:-1], ends[1:], strict=True))


def exchange_chunk_counts(messages: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """messages [chunks, ep, m]: chunk c's `routing.count_message` -> [chunks, ep, m]: what chunk c receives from
    each member (one all-to-all of [ep, chunks * m] int64, on the device)."""
    chunks, ep, m = messages.shape
    ones = [1] * group.size
    sent = messages.transpose(0, 1).reshape(ep, chunks * m)
    return comm.all_to_all(sent, group, ones, ones).view(ep, chunks, m).transpose(0, 1)


@dataclass(frozen=True)
class ChunkPlan:
    """Where every chunk's rows go: token ranges and per-member row counts, both ways."""

    group: MeshGroup
    bounds: list[tuple[int, int]]
    send_rows: list[list[int]]
    recv_rows: list[list[int]]
    tokens_per_expert: list[list[int]]  # per chunk, the received assignments per local expert


def overlapped(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
               num_experts: int, chunks: int, experts: nn.Module, compute: ExpertCompute) -> torch.Tensor:
    """Ragged dispatch, `compute(experts, ...)`, combine, pipelined over `chunks` token chunks: x [T, dim] ->
    y [T, dim], equal to the serial path's result (per token, the sum of its rows' expert outputs).

    `compute` may use no parameters but those of `experts`: their gradients, summed over the chunks, reach
    them once, as the serial path's do (so gradient hooks, such as ZeRO-3's, fire once)."""
    local, ep = num_experts // group.size, group.size
    bounds = chunk_bounds(x.shape[0], chunks)
    dests = [slot_ranks(topk_idx[a:b], local, ep) for a, b in bounds]
    hits = [destinations(dest, ep) for dest in dests]
    send_counts = torch.stack([hit.sum(0) for hit in hits])  # [chunks, ep]
    messages = torch.stack([count_message(hit.sum(0), assignments_per_expert(topk_idx[a:b], num_experts), ep)
                            for (a, b), hit in zip(bounds, hits, strict=True)])  # [chunks, ep, 1 + local]
    # One host read for every chunk's rows, both ways, and the group sizes of every chunk's experts.
    sent, received = read_counts([send_counts, exchange_chunk_counts(messages, group)], topk_idx, num_experts)
    send_rows = [sent[c * ep:(c + 1) * ep] for c in range(chunks)]
    width = ep * (1 + local)
    arrived = [split_received(received[c * width:(c + 1) * width], ep) for c in range(chunks)]
    rows = [rows_of(topk_idx[a:b], dest, hit, local, send_rows[c])
            for c, ((a, b), dest, hit) in enumerate(zip(bounds, dests, hits, strict=True))]
    plan = ChunkPlan(group, bounds, send_rows, [r for r, _ in arrived], [n for _, n in arrived])
    routing = [r.token for r in rows] + [r.local_idx for r in rows]  # backward keeps the ids' mask only
    params = [p for p in experts.parameters() if p.requires_grad]
    return _Overlapped.apply(x, topk_weights, plan, partial(compute, experts), torch.is_grad_enabled(), len(params),
                             *params, *routing)


class _ChunkGrads:
    """Gradients handed between the pipeline's backward and one chunk's expert graph (empty outside it)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # given: the gradient of the chunk's expert outputs
        self.recv_x: torch.Tensor | None = None  # taken: the gradients of its received rows and weights
        self.recv_w: torch.Tensor | None = None


class _Capture(torch.autograd.Function):
    """Identity forward on received rows; backward hands their gradient to `grads.<slot>`."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, received: torch.Tensor, grads: _ChunkGrads, slot: str) -> torch.Tensor:
        ctx.grads, ctx.slot = grads, slot
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        setattr(ctx.grads, ctx.slot, grad)
        return None, None, None, None


class _Root(torch.autograd.Function):
    """An empty tensor standing for a chunk's expert outputs, so backward can start there without keeping
    them: its backward feeds `grads.out` to the outputs' graph."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, grads: _ChunkGrads) -> torch.Tensor:
        ctx.grads = grads
        return out.new_empty(0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.grads.out, None


def _start_dispatch(x: torch.Tensor, topk_weights: torch.Tensor, token: torch.Tensor, local_idx: torch.Tensor,
                    plan: ChunkPlan, c: int) -> list[comm.Pending]:
    a, b = plan.bounds[c]
    picked = topk_weights[a:b][token]
    weights = torch.where(local_idx >= 0, picked, torch.zeros_like(picked))  # [S, k]: 0 in other ranks' slots
    return [comm.all_to_all_start(t, plan.group, plan.send_rows[c], plan.recv_rows[c])
            for t in (x[a:b][token], local_idx, weights)]


def _chunk_graph(compute: Callable[..., torch.Tensor], recv: list[torch.Tensor], counts: list[int],
                 grads: _ChunkGrads, anchor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the experts on one chunk's rows; with `anchor`, record the graph: (outputs, root for backward)."""
    recv_x, recv_idx, recv_w = recv
    with torch.enable_grad() if anchor is not None else nullcontext():
        if anchor is not None:
            recv_x = _Capture.apply(anchor, recv_x, grads, "recv_x")
            recv_w = _Capture.apply(anchor, recv_w, grads, "recv_w")
        out = compute(recv_x, recv_idx, recv_w, counts)  # [R, dim]
        root = _Root.apply(out, grads) if anchor is not None else None
    return out.detach(), root


def _sum_rows(back: torch.Tensor, token: torch.Tensor, tokens: int) -> torch.Tensor:
    return back.new_zeros(tokens, back.shape[-1]).index_add(0, token, back)  # [tokens, dim]


class _Overlapped(torch.autograd.Function):
    """Chunked dispatch, experts and combine forward; the mirror pipeline backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: torch.Tensor, plan: ChunkPlan,
                compute: Callable[..., torch.Tensor], build: bool, n_params: int, *params_routing: torch.Tensor):
        n = len(plan.bounds)
        params, token, local_idx = _split(params_routing, n_params, n)
        anchor = x.new_empty(0, requires_grad=True) if build else None  # a leaf for the chunks' graphs to hang on
        ctx.plan, ctx.grads, ctx.shapes, ctx.n_params = plan, [_ChunkGrads() for _ in range(n)], [], n_params
        dispatches, combines, roots = [_start_dispatch(x, topk_weights, token[0], local_idx[0], plan, 0)], [], []
        for c in range(n):
            if c + 1 < n:  # in flight while chunk c computes
                dispatches.append(_start_dispatch(x, topk_weights, token[c + 1], local_idx[c + 1], plan, c + 1))
            recv = [p.wait() for p in dispatches[c]]
            out, root = _chunk_graph(compute, recv, plan.tokens_per_expert[c], ctx.grads[c], anchor)
            combines.append(comm.all_to_all_start(out, plan.group, plan.recv_rows[c], plan.send_rows[c]))
            roots.append(root)
            ctx.shapes.append((tuple(recv[0].shape), tuple(recv[2].shape)))
        y = [_sum_rows(p.wait(), token[c], b - a) for c, (p, (a, b)) in enumerate(zip(combines, plan.bounds,
                                                                                          strict=True))]
        if build:
            ctx.save_for_backward(*params, *token, *(i >= 0 for i in local_idx), anchor, *roots)
        ctx.x_shape, ctx.w_shape = tuple(x.shape), tuple(topk_weights.shape)
        return torch.cat(y)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        plan, n = ctx.plan, len(ctx.plan.bounds)
        saved = ctx.saved_tensors
        params, token, here = _split(saved[:ctx.n_params + 2 * n], ctx.n_params, n)  # here: slots this rank sent
        anchor, roots = saved[ctx.n_params + 2 * n], saved[ctx.n_params + 2 * n + 1:]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        def start(c: int) -> comm.Pending:  # combine's backward: each row's output gradient to its expert
            a, b = plan.bounds[c]
            return comm.all_to_all_start(grad_y[a:b][token[c]], plan.group, plan.send_rows[c], plan.recv_rows[c])

        pending, returning, grad_params = [start(0)], [], [None] * len(params)
        for c in range(n):
            if c + 1 < n:  # in flight while chunk c runs its experts' backward
                pending.append(start(c + 1))
            grads = ctx.grads[c]
            grads.out = pending[c].wait()
            # The experts' backward on this chunk; the captures hand over the received rows' gradients.
            found = torch.autograd.grad(roots[c], [anchor, *params], roots[c].new_empty(0), allow_unused=True)
            grad_params = [_add(total, g) for total, g in zip(grad_params, found[1:], strict=True)]
            returning.append(_start_return(grads, ctx.shapes[c], want_x, want_w, grad_y, plan, c))
        grad_x = grad_y.new_zeros(ctx.x_shape) if want_x else None
        grad_w = grad_y.new_zeros(ctx.w_shape) if want_w else None
        for c, (a, b) in enumerate(plan.bounds):
            back = iter(returning[c])
            if want_x:
                grad_x[a:b].index_add_(0, token[c], next(back).wait())
            if want_w:
                g = next(back).wait()  # [S, k]
                grad_w[a:b].index_add_(0, token[c], torch.where(here[c], g, torch.zeros_like(g)))
        return grad_x, grad_w, None, None, None, None, *grad_params, *([None] * 2 * n)


def _split(tensors: tuple[torch.Tensor, ...], n_params: int, chunks: int):
    """(params, tokens per chunk, ids (or their mask) per chunk) out of one flat argument list."""
    routing = tensors[n_params:]
    return tensors[:n_params], routing[:chunks], routing[chunks:2 * chunks]


def _add(total: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return total
    return grad if total is None else total + grad


def _start_return(grads: _ChunkGrads, shapes: tuple, want_x: bool, want_w: bool, like: torch.Tensor,
                  plan: ChunkPlan, c: int) -> list[comm.Pending]:
    """Send a chunk's received rows' (and weights') gradients home; rows the experts never used get zeros."""
    back = []
    for wanted, got, shape in ((want_x, grads.recv_x, shapes[0]), (want_w, grads.recv_w, shapes[1])):
        if wanted:
            g = got if got is not None else like.new_zeros(shape)
            back.append(comm.all_to_all_start(g, plan.group, plan.recv_rows[c], plan.send_rows[c]))
    grads.out = grads.recv_x = grads.recv_w = None
    return back
