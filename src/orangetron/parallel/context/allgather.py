"""All-gather attention (Llama 3's context parallelism): gather every rank's K,V once, attend locally.

Forward all-gathers K,V over cp (one tensor); backward gathers them again rather than keep them (the
gathered K,V is cp times this rank's), and reduce-scatters their gradients home. Queries stay local.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.context.blocks import block_backward, block_forward, pack, positions_of


class _AllGatherAttention(torch.autograd.Function):
    """All-gather K,V then attend (forward); re-gather, attend back, reduce-scatter dK,dV (backward)."""

    @staticmethod
    def forward(ctx, q, k, v, group: MeshGroup, causal: bool, scale: float):
        seq_len = q.shape[1] * group.size
        kv = comm.all_gather(pack(k, v), group, dim=1)  # [B, S, Hk, 2D], rank order
        kb, vb = kv.split(k.shape[-1], dim=-1)
        q_pos = positions_of((seq_len, group.size, group.rank), q.device)
        out, lse = block_forward(q, kb, vb, q_pos, positions_of((seq_len, group.size, None), q.device), causal, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, seq_len = ctx.group, q.shape[1] * ctx.group.size
        kv = comm.all_gather(pack(k, v), group, dim=1)
        kb, vb = kv.split(k.shape[-1], dim=-1)
        q_pos = positions_of((seq_len, group.size, group.rank), q.device)
        k_pos = positions_of((seq_len, group.size, None), q.device)
        dq, dk, dv = block_backward(q, kb, vb, out, lse, grad_out, q_pos, k_pos, ctx.causal, ctx.scale)
        dkv = comm.reduce_scatter(pack(dk, dv).to(k.dtype), group, dim=1)
        dk, dv = dkv.split(k.shape[-1], dim=-1)
        return dq.to(q.dtype), dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: MeshGroup, causal: bool,
              scale: float) -> torch.Tensor:
    """All-gather attention of this rank's head-tail shard -> out [B, L, Hq, D]."""
    return _AllGatherAttention.apply(q, k, v, group, causal, scale)
