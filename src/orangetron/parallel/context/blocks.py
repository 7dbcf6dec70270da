"""Attention over one block of keys, forward and backward, and the log-sum-exp merge of partial results.

Every context-parallel mode computes a query shard's attention as a sum over key blocks that arrive from
other ranks. A block's partial output and log-sum-exp merge exactly (`merge`), and a block's gradients
need only the final output and log-sum-exp (`block_backward`, the flash-attention backward), so no mode
keeps a score matrix for backward. Which keys a query may see is decided by global positions, so any
sharding (head-tail, gathered in rank order, a ring step's half block) masks correctly.

Shapes: q [B, Sq, Hq, D], k and v [B, Sk, Hk, D] (Hq % Hk == 0), positions [Sq] and [Sk]; out like q;
lse [B, Hq, Sq]. Arithmetic in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from orangetron.model.autograd import accumulate_dtype, expand_kv


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
            scale: float) -> torch.Tensor:
    acc = accumulate_dtype(q.dtype)
    qh = q.transpose(1, 2).to(acc)  # [B, Hq, Sq, D]
    kh = expand_kv(k, q.shape[2]).transpose(1, 2).to(acc)  # [B, Hq, Sk, D]
    scores = qh @ kh.transpose(-1, -2) * scale  # [B, Hq, Sq, Sk]
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over this block of keys; rows that see no key get out 0 and lse -inf."""
    scores = _scores(q, k, q_pos, k_pos, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Sq]
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))  # masked rows: exp(-inf) = 0
    vh = expand_kv(v, q.shape[2]).transpose(1, 2).to(scores.dtype)
    return (probs @ vh).transpose(1, 2).contiguous(), lse  # out [B, Sq, Hq, D] in the accumulate dtype


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running (out, lse), in place (out [B, S, H, D], lse [B, H, S])."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = new_lse.nan_to_num(neginf=0.0)  # both -inf: keep zeros, not NaN
    old_w = torch.exp(lse - finite).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    new_w = torch.exp(block_lse - finite).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_w).add_(block_out * new_w)
    lse.copy_(new_lse)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) this block contributes, from the final out and lse of the queries.

    Returned in the accumulate dtype; dk, dv summed over each kv head's group of query heads.
    """
    scores = _scores(q, k, q_pos, k_pos, causal, scale)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))  # [B, Hq, Sq, Sk]
    acc, hq = scores.dtype, q.shape[2]
    do = grad_out.transpose(1, 2).to(acc)  # [B, Hq, Sq, D]
    vh = expand_kv(v, hq).transpose(1, 2).to(acc)
    delta = (do * out.transpose(1, 2).to(acc)).sum(-1, keepdim=True)  # [B, Hq, Sq, 1]
    dscores = probs * (do @ vh.transpose(-1, -2) - delta) * scale
    dq = (dscores @ expand_kv(k, hq).transpose(1, 2).to(acc)).transpose(1, 2)
    dk = (dscores.transpose(-1, -2) @ q.transpose(1, 2).to(acc)).transpose(1, 2)  # [B, Sk, Hq, D]
    dv = (probs.transpose(-1, -2) @ do).transpose(1, 2)
    return dq, _sum_groups(dk, k.shape[2]), _sum_groups(dv, k.shape[2])


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, s, hq, d = grad.shape
    return grad.reshape(b, s, kv_heads, hq // kv_heads, d).sum(3)


def rank_order_positions(seq_len: int, cp: int) -> torch.Tensor:
    """Global positions of a sequence gathered from every cp rank in rank order (head-tail shards)."""
    from orangetron.parallel.context.sharding import head_tail_indices

    return torch.cat([head_tail_indices(seq_len, cp, j) for j in range(cp)])


def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V side by side, [B, S, Hk, 2D]: one transfer instead of two."""
    return torch.cat((k, v), dim=-1)


class PositionalAttention(torch.autograd.Function):
    """Attention of q over k, v masked by global positions, as one block; saves q, k, v, out and lse.

    The positions come from `positions_of(spec)` with a spec of plain numbers, recomputed in backward
    rather than kept, so every byte kept is one the activation meter sees and the planner counts.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_spec: tuple, k_spec: tuple, causal: bool, scale: float):
        out, lse = block_forward(q, k, v, positions_of(q_spec, q.device), positions_of(k_spec, q.device), causal,
                                 scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.specs, ctx.causal, ctx.scale = (q_spec, k_spec), causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        q_pos, k_pos = (positions_of(spec, q.device) for spec in ctx.specs)
        dq, dk, dv = block_backward(q, k, v, out, lse, grad_out, q_pos, k_pos, ctx.causal, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def positions_of(spec: tuple[int, int, int | None], device: torch.device) -> torch.Tensor:
    """Positions of (seq_len, cp, rank): that cp rank's head-tail tokens, or all ranks' in rank order (None)."""
    from orangetron.parallel.context.sharding import head_tail_indices

    seq_len, cp, rank = spec
    found = rank_order_positions(seq_len, cp) if rank is None else head_tail_indices(seq_len, cp, rank)
    return found.to(device)
