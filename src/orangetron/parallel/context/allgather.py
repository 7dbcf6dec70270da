"""All-gather attention (Llama 3's context parallelism): gather every rank's K,V once, attend locally.

Forward all-gathers K,V over cp (one tensor); backward gathers them again rather than keep them (the
gathered K,V is cp times this rank's), and reduce-scatters their gradients home. Queries stay local.
The gathered K,V arrive in rank order (head and tail chunks interleaved); `blocks.attend` puts them in
order of position, so each local chunk is one unmasked call over the keys before it and one causal call
over its own range.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.model.documents import Documents
from orangetron.parallel.context.blocks import attend, attend_backward, pack
from orangetron.parallel.context.calls import cuts_of, spec_runs


class _AllGatherAttention(torch.autograd.Function):
    """All-gather K,V then attend (forward); re-gather, attend back, reduce-scatter dK,dV (backward)."""

    @staticmethod
    def forward(ctx, q, k, v, group: MeshGroup, causal: bool, scale: float, impl: str, documents: Documents | None):
        kv = comm.all_gather(pack(k, v), group, dim=1)  # [B, S, Hk, 2D], rank order
        kb, vb = kv.split(k.shape[-1], dim=-1)
        out, lse = attend(q, kb, vb, *_runs(group, q.shape[1], documents), causal, scale, impl, documents)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.impl = group, causal, scale, impl
        ctx.documents = None if documents is None else documents.kept_for(impl)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        kv = comm.all_gather(pack(k, v), group, dim=1)
        kb, vb = kv.split(k.shape[-1], dim=-1)
        dq, dk, dv = attend_backward(q, kb, vb, out, lse, grad_out, *_runs(group, q.shape[1], ctx.documents),
                                     ctx.causal, ctx.scale, ctx.impl, ctx.documents)
        dkv = comm.reduce_scatter(pack(dk, dv).to(k.dtype), group, dim=1)
        dk, dv = dkv.split(k.shape[-1], dim=-1)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


def _runs(group: MeshGroup, length: int, documents: Documents | None) -> tuple:
    """(this rank's query runs, the gathered keys' runs in rank order), of the sharding `documents` take."""
    seq_len, cuts = length * group.size, cuts_of(documents)
    return spec_runs((seq_len, group.size, group.rank, cuts)), spec_runs((seq_len, group.size, None, cuts))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: MeshGroup, causal: bool,
              scale: float, impl: str = "fused", documents: Documents | None = None) -> torch.Tensor:
    """All-gather attention of this rank's shard -> out [B, L, Hq, D]; `impl` and `documents` as
    `blocks.attend`'s."""
    return _AllGatherAttention.apply(q, k, v, group, causal, scale, impl, documents)
