"""Ring attention: K,V blocks travel around the cp ring while the block at hand computes.

Forward: cp steps; at step i this rank attends to the K,V of cp rank r-i, received while step i-1
computed (cp-1 transfers). Backward: the K,V go around again (cp-1 transfers) with an accumulator of
their gradients that ends back home (cp transfers); dq stays local. Each accumulator is sent after its
block and waited for only after the next block has computed, so every transfer but its last trip home
travels behind a block (`tests/test_context_attention.py` checks the order).

Under head-tail causal sharding (rank r holds chunks r and 2cp-1-r) every step after the first does the
same work on every rank, as zigzag ring attention does: of the K,V of an earlier rank (j < r) only its
head chunk is early enough, and both local chunks attend to it; the K,V of a later rank (j > r) is seen
only by the local tail chunk, which attends to all of it. `blocks.attend` finds these calls from the
positions (`calls.plan`): one unmasked kernel call per step after the first, and the first step's
diagonal as two causal calls and one unmasked one.

Over packed documents a block may hold nothing some members can see (`block_needs`): those members skip it,
and a block goes on round the ring only while a member it has still to visit sees some of it, in forward and
in backward alike (`_passes`; sender and receiver decide from the same documents). The dK,dV accumulators
still go all the way home.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.model.attention import Runs
from orangetron.model.documents import Documents
from orangetron.parallel.context import calls
from orangetron.parallel.context.blocks import attend, attend_backward, merge, pack
from orangetron.parallel.context.calls import head_tail_runs


def ring_runs(layout: tuple, member: int) -> Runs:
    """Global positions, as runs, of the tokens ring member `member` holds.

    layout ("head_tail", seq_len, cp): member r holds its head-tail shard. ("usp", seq_len, cp, u): ring
    member r holds the shards of cp ranks r*u ... r*u+u-1, gathered by Ulysses, in that order.
    """
    if layout[0] == "head_tail":
        _, seq_len, cp = layout
        return head_tail_runs(seq_len, cp, member)
    _, seq_len, cp, u = layout
    return tuple(run for j in range(u) for run in head_tail_runs(seq_len, cp, member * u + j))


class _RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (see the module docstring); saves q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, group: MeshGroup, causal: bool, scale: float, overlap: bool, layout: tuple,
                impl: str, documents: Documents | None):
        length, cp, r = q.shape[1], group.size, group.rank
        runs = [ring_runs(layout, j) for j in range(cp)]
        needs = block_needs(runs, causal, documents)
        out = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], length), float("-inf"), dtype=out.dtype, device=q.device)
        ring, home = comm.RingExchange(group), pack(k, v)
        kv = home
        for step in range(cp):
            last = step == cp - 1
            source = (r - step) % cp
            if not last:
                ring.start(home if kv is None else kv, *_passes(needs, r, step))  # travels while this one computes
                arrived = None if overlap else ring.wait()  # serial, for comparison: transfer, then compute
            if kv is not None and needs[r][source]:
                kb, vb = kv.split(k.shape[-1], dim=-1)
                block_out, block_lse = attend(q, kb, vb, runs[r], runs[source], causal, scale, impl, documents)
                merge(out, lse, block_out, block_lse)
            if not last:
                kv = ring.wait() if overlap else arrived
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.layout, ctx.impl = group, causal, scale, layout, impl
        ctx.documents, ctx.needs = documents, needs
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, needs = ctx.group, ctx.causal, ctx.scale, ctx.needs
        cp, r, d = group.size, group.rank, k.shape[-1]
        runs = [ring_runs(ctx.layout, j) for j in range(cp)]
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv_ring, grad_ring = comm.RingExchange(group), comm.RingExchange(group)
        home = pack(k, v)
        kv = home
        for step in range(cp):
            if step < cp - 1:
                kv_ring.start(home if kv is None else kv, *_passes(needs, r, step))
            source = (r - step) % cp
            block = None
            if kv is not None and needs[r][source]:
                kb, vb = kv.split(d, dim=-1)
                dq_b, dk_b, dv_b = attend_backward(q, kb, vb, out, lse, grad_out, runs[r], runs[source], causal,
                                                   scale, ctx.impl, ctx.documents)
                dq += dq_b
                block = torch.cat((dk_b, dv_b), dim=-1)
            # The accumulator of these K,V gradients left the previous rank after its last step: it travelled
            # while this block computed, and is waited for only now.
            dkv = torch.zeros_like(home) if step == 0 else grad_ring.wait()
            if block is not None:
                dkv += block.to(dkv.dtype)
            grad_ring.start(dkv)  # on to the next rank, with its K,V; it ends at their owner
            if step < cp - 1:
                kv = kv_ring.wait()
        dkv = grad_ring.wait()
        dk, dv = dkv.split(d, dim=-1)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


def block_needs(runs: list[Runs], causal: bool, documents: Documents | None) -> list[list[bool]]:
    """needs[p][j]: whether member p's queries see any key member j holds. Every pair does, but under packed
    documents, where a query sees only its own document: then the kernel calls `calls.plan` would make decide."""
    cp = len(runs)
    if documents is None or not causal:
        return [[True] * cp for _ in range(cp)]
    starts = [tuple(a for a, _ in spans) for _, spans in documents.row_groups()]
    ordered = [calls.sort_runs(member)[0] for member in runs]
    return [[any(calls.plan(ordered[p], ordered[j], True, s) for s in starts) for j in range(cp)] for p in range(cp)]


def _passes(needs: list[list[bool]], rank: int, step: int) -> tuple[bool, bool]:
    """(send, receive) of this rank's transfer after `step`: block j visits members j, j+1, ... (mod cp) at
    steps 0, 1, ..., and goes on only while a member it has still to visit sees some of it. The sender and the
    receiver decide alike, from the same `needs`."""
    cp = len(needs)

    def wanted(block: int) -> bool:
        return any(needs[(block + visit) % cp][block] for visit in range(step + 1, cp))

    return wanted((rank - step) % cp), wanted((rank - 1 - step) % cp)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: MeshGroup, causal: bool,
              scale: float, impl: str = "fused", overlap: bool = True, layout: tuple | None = None,
              documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this rank's head-tail shard; (out [B, L, Hq, D], lse [B, Hq, L]).

    `impl` is the block kernel (`blocks.attend`). `overlap=False` waits for each forward transfer before
    computing (a serial ring, for comparison). `layout` says whose tokens each ring member holds
    (`ring_runs`; default: head-tail over `group`). `documents`: those of packed rows over the global sequence.
    """
    layout = ("head_tail", q.shape[1] * group.size, group.size) if layout is None else layout
    return _RingAttention.apply(q, k, v, group, causal, scale, overlap, layout, impl, documents)
