"""Ring self-attention (ColossalAI's sequence parallelism, Li et al. 2021), kept for comparison.

A K ring fills this rank's [S/N, S] score rows block by block; after the softmax a V ring accumulates
the output. Backward runs a V ring (with the dV accumulators travelling home behind it) for the
probabilities' gradient, then a K ring (with dK) for the queries and keys. Unlike ring attention it keeps
the [S/N, S] probabilities for backward, as Li et al. describe (arXiv:2105.13120), and sends K and V separately.
Those kept probabilities are the method, so it has only the matmul form: `impl` is accepted, as every
mode's is, and does not change what it computes.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.model.attention import KERNEL_IMPLS
from orangetron.model.autograd import accumulate_dtype, expand_kv
from orangetron.model.documents import Documents
from orangetron.parallel.context.blocks import positions_of
from orangetron.parallel.context.calls import cuts_of


def _heads(x: torch.Tensor, n_heads: int, acc: torch.dtype) -> torch.Tensor:
    return expand_kv(x, n_heads).transpose(1, 2).to(acc)  # [B, H, S, D]


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape  # [B, Hq, S, D] -> [B, S, Hk, D]
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(2).transpose(1, 2)


def _ring(x: torch.Tensor, group: MeshGroup, visit, carry: torch.Tensor | None = None) -> torch.Tensor | None:
    """Pass `x` around the ring, calling visit(block, source rank, carry) at each step; `carry` (if any)
    travels with the block and ends at its owner. Returns the carry that came home."""
    ring, carry_ring = comm.RingExchange(group), comm.RingExchange(group)
    n = group.size
    for step in range(n):
        if step < n - 1:
            ring.start(x)
        visit(x, (group.rank - step) % n, carry)
        if step < n - 1:
            x = ring.wait()
        if carry is not None:
            carry = carry_ring.exchange(carry)
    return carry


class _RingSelfAttention(torch.autograd.Function):
    """K ring then V ring forward; V ring (dV home) then K ring (dK home) backward. Saves q, k, v, probs."""

    @staticmethod
    def forward(ctx, q, k, v, group: MeshGroup, causal: bool, scale: float, documents: Documents | None):
        acc, hq, length = accumulate_dtype(q.dtype), q.shape[2], q.shape[1]
        seq_len = length * group.size
        cuts = cuts_of(documents)
        q_pos = positions_of((seq_len, group.size, group.rank, cuts), q.device)
        qh = q.transpose(1, 2).to(acc)
        scores = q.new_empty((q.shape[0], hq, length, seq_len), dtype=acc)  # [B, H, L, S], sources in rank order

        def fill(k_block, source, _):
            block = qh @ _heads(k_block, hq, acc).transpose(-1, -2) * scale
            k_pos = positions_of((seq_len, group.size, source, cuts), q.device)
            if causal:
                block = block.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
            if documents is not None:  # another document's keys: masked as later ones are
                other = documents.ids[:, q_pos].unsqueeze(2) != documents.ids[:, k_pos].unsqueeze(1)  # [B, L, L]
                block = block.masked_fill(other.unsqueeze(1), float("-inf"))
            scores[..., source * length:(source + 1) * length] = block

        _ring(k, group, fill)
        probs = scores.softmax(-1)
        out = torch.zeros_like(qh)

        def accumulate(v_block, source, _):
            out.add_(probs[..., source * length:(source + 1) * length] @ _heads(v_block, hq, acc))

        _ring(v, group, accumulate)
        ctx.save_for_backward(q, k, v, probs)
        ctx.group, ctx.scale = group, scale
        return out.transpose(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, probs = ctx.saved_tensors
        group, scale, length, hq = ctx.group, ctx.scale, q.shape[1], q.shape[2]
        acc = probs.dtype
        do = grad_out.transpose(1, 2).to(acc)  # [B, H, L, D]
        dprobs = torch.empty_like(probs)

        def probs_grad(v_block, source, dv_home):
            cols = slice(source * length, (source + 1) * length)
            dprobs[..., cols] = do @ _heads(v_block, hq, acc).transpose(-1, -2)
            dv_home.add_(_sum_groups(probs[..., cols].transpose(-1, -2) @ do, k.shape[2]).to(dv_home.dtype))

        dv = _ring(v, group, probs_grad, torch.zeros_like(v))
        dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True)) * scale
        qh, dq = q.transpose(1, 2).to(acc), torch.zeros(q.shape[0], hq, length, q.shape[3], dtype=acc, device=q.device)

        def query_key_grads(k_block, source, dk_home):
            cols = slice(source * length, (source + 1) * length)
            dq.add_(dscores[..., cols] @ _heads(k_block, hq, acc))
            dk_home.add_(_sum_groups(dscores[..., cols].transpose(-1, -2) @ qh, k.shape[2]).to(dk_home.dtype))

        dk = _ring(k, group, query_key_grads, torch.zeros_like(k))
        return dq.transpose(1, 2).to(q.dtype), dk, dv, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: MeshGroup, causal: bool,
              scale: float, impl: str = "fused", documents: Documents | None = None) -> torch.Tensor:
    """Ring self-attention of this rank's shard -> out [B, L, Hq, D] (matmuls whatever `impl`);
    `documents`: those of packed rows over the global sequence, whose boundaries mask too."""
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {', '.join(KERNEL_IMPLS)}")
    return _RingSelfAttention.apply(q, k, v, group, causal, scale, documents)
