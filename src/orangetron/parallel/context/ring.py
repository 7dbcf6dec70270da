"""Ring attention: K,V blocks travel around the cp ring while the block at hand computes.

Forward: cp steps; at step i this rank attends to the K,V of cp rank r-i, received while step i-1
computed (cp-1 transfers). Backward: the K,V go around again (cp-1 transfers) with an accumulator of
their gradients that ends back home (cp transfers); dq stays local. Each accumulator is sent after its
block and waited for only after the next block has computed, so every transfer but its last trip home
travels behind a block (`tests/test_context_attention.py` checks the order).

Under head-tail causal sharding (rank r holds chunks r and 2cp-1-r) every step after the first does the
same work on every rank, as zigzag ring attention does: the K,V of an earlier rank (j < r) is seen
whole by both local chunks but only its head chunk is early enough, so the queries attend to its first
half; the K,V of a later rank (j > r) is seen only by the local tail chunk, which attends to all of it.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.context.blocks import block_backward, block_forward, merge, pack
from orangetron.parallel.context.sharding import head_tail_indices


def ring_positions(layout: tuple, member: int, device: torch.device) -> torch.Tensor:
    """Global positions of the tokens ring member `member` holds.

    layout ("head_tail", seq_len, cp): member r holds its head-tail shard. ("usp", seq_len, cp, u): ring
    member r holds the shards of cp ranks r*u ... r*u+u-1, gathered by Ulysses, in that order.
    """
    if layout[0] == "head_tail":
        _, seq_len, cp = layout
        return head_tail_indices(seq_len, cp, member).to(device)
    _, seq_len, cp, u = layout
    return torch.cat([head_tail_indices(seq_len, cp, member * u + j) for j in range(u)]).to(device)


def _visible(step: int, rank: int, source: int, length: int, causal: bool,
             zigzag: bool) -> tuple[slice, slice, bool]:
    """(query rows, key columns, needs a mask) of this rank's queries against `source`'s keys."""
    everything = slice(0, length)
    if not causal:
        return everything, everything, False
    if step == 0 or not zigzag:
        return everything, everything, True  # the diagonal: causal within this rank's own chunks
    half = length // 2
    if source < rank:
        return everything, slice(0, half), False  # only the earlier rank's head chunk is early enough
    return slice(half, length), everything, False  # only this rank's tail chunk is late enough


class _RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (see the module docstring); saves q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, group: MeshGroup, causal: bool, scale: float, overlap: bool, layout: tuple):
        length, cp, r = q.shape[1], group.size, group.rank
        positions = [ring_positions(layout, j, q.device) for j in range(cp)]
        zigzag = layout[0] == "head_tail"
        out = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], length), float("-inf"), dtype=out.dtype, device=q.device)
        ring, kv = comm.RingExchange(group), pack(k, v)
        for step in range(cp):
            last = step == cp - 1
            if not last:
                ring.start(kv)  # the next block travels while this one computes
                arrived = None if overlap else ring.wait()  # serial, for comparison: transfer, then compute
            source = (r - step) % cp
            rows, cols, masked = _visible(step, r, source, length, causal, zigzag)
            kb, vb = kv[:, cols].split(k.shape[-1], dim=-1)
            block_out, block_lse = block_forward(q[:, rows], kb, vb, positions[r][rows], positions[source][cols],
                                                 masked, scale)
            merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
            if not last:
                kv = ring.wait() if overlap else arrived
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.layout = group, causal, scale, layout
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        length, cp, r, d = q.shape[1], group.size, group.rank, k.shape[-1]
        positions = [ring_positions(ctx.layout, j, q.device) for j in range(cp)]
        zigzag = ctx.layout[0] == "head_tail"
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv_ring, grad_ring = comm.RingExchange(group), comm.RingExchange(group)
        kv = pack(k, v)
        for step in range(cp):
            if step < cp - 1:
                kv_ring.start(kv)
            source = (r - step) % cp
            rows, cols, masked = _visible(step, r, source, length, causal, zigzag)
            kb, vb = kv[:, cols].split(d, dim=-1)
            dq_b, dk_b, dv_b = block_backward(q[:, rows], kb, vb, out[:, rows], lse[:, :, rows], grad_out[:, rows],
                                              positions[r][rows], positions[source][cols], masked, scale)
            dq[:, rows] += dq_b
            # The accumulator of these K,V gradients left the previous rank after its last step: it travelled
            # while this block computed, and is waited for only now.
            dkv = torch.zeros_like(kv) if step == 0 else grad_ring.wait()
            dkv[:, cols] += torch.cat((dk_b, dv_b), dim=-1).to(dkv.dtype)
            grad_ring.start(dkv)  # on to the next rank, with its K,V; it ends at their owner
            if step < cp - 1:
                kv = kv_ring.wait()
        dkv = grad_ring.wait()
        dk, dv = dkv.split(d, dim=-1)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: MeshGroup, causal: bool,
              scale: float, overlap: bool = True, layout: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this rank's head-tail shard; (out [B, L, Hq, D], lse [B, Hq, L]).

    `overlap=False` waits for each forward transfer before computing (a serial ring, for comparison).
    `layout` says whose tokens each ring member holds (`ring_positions`; default: head-tail over `group`).
    """
    layout = ("head_tail", q.shape[1] * group.size, group.size) if layout is None else layout
    return _RingAttention.apply(q, k, v, group, causal, scale, overlap, layout)
