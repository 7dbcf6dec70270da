"""Attention over one block of keys, forward and backward, and the log-sum-exp merge of partial results.

Every context-parallel mode computes a query shard's attention as a sum over key blocks that arrive from
other ranks. A block's partial output and log-sum-exp merge exactly (`merge`), and a block's gradients
need only the final output and log-sum-exp (the flash-attention backward), so no mode keeps a score matrix
for backward. Which keys a query may see is decided by global positions, given as runs (`calls.py`), so
any sharding (head-tail, gathered in rank order, a ring step's block) masks correctly.

`attend` and `attend_backward` take an `impl`: "fused" cuts the block into honest calls of the fused
kernel seam (`orangetron/model/attention.py`, `calls.plan`); "reference" is plain matmuls masked by
position over the whole block (`block_forward`, `block_backward`), for tests and as a fallback.

Shapes: q [B, Sq, Hq, D], k and v [B, Sk, Hk, D] (Hq % Hk == 0), positions [Sq] and [Sk]; out like q;
lse [B, Hq, Sq]. Arithmetic in float32 (float64 for float64 inputs).

Packed rows (`documents`, `orangetron/model/documents.py`, over the whole global sequence) mask by document too:
"reference" compares the document ids at both positions; "fused" plans each group of rows with the same
documents apart (`calls.plan` with their starts), and rows whose block sees nothing make no call.
"""

from __future__ import annotations

import torch

from orangetron.model.attention import KERNEL_IMPLS, Runs, attention_kernel, attention_kernel_backward
from orangetron.model.autograd import accumulate_dtype, expand_kv
from orangetron.model.documents import Documents
from orangetron.parallel.context import calls


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
            scale: float, ids: torch.Tensor | None = None) -> torch.Tensor:
    acc = accumulate_dtype(q.dtype)
    qh = q.transpose(1, 2).to(acc)  # [B, Hq, Sq, D]
    kh = expand_kv(k, q.shape[2]).transpose(1, 2).to(acc)  # [B, Hq, Sk, D]
    scores = qh @ kh.transpose(-1, -2) * scale  # [B, Hq, Sq, Sk]
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    if ids is not None:  # document ids [B, S] of the global sequence
        other = ids[:, q_pos].unsqueeze(2) != ids[:, k_pos].unsqueeze(1)  # [B, Sq, Sk]
        scores = scores.masked_fill(other.unsqueeze(1), float("-inf"))
    return scores


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  causal: bool, scale: float, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over this block of keys; rows that see no key get out 0 and lse -inf. `ids`: the document
    id [B, S] of every global position (packed rows), else None."""
    scores = _scores(q, k, q_pos, k_pos, causal, scale, ids)
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
                   scale: float, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) this block contributes, from the final out and lse of the queries.

    Returned in the accumulate dtype; dk, dv summed over each kv head's group of query heads. `ids` as
    `block_forward`'s.
    """
    scores = _scores(q, k, q_pos, k_pos, causal, scale, ids)
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


def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V side by side, [B, S, Hk, 2D]: one transfer instead of two."""
    return torch.cat((k, v), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_runs: Runs, k_runs: Runs, causal: bool,
           scale: float, impl: str, documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over this block of keys in the accumulate dtype; rows that see no key get 0 and -inf.
    `documents`: those of packed rows over the global sequence, whose boundaries mask too (None: one each)."""
    if impl == "reference":
        return block_forward(q, k, v, runs_positions(q_runs, q.device), runs_positions(k_runs, q.device), causal,
                             scale, None if documents is None else documents.ids)
    _check_impl(impl)

    def fused(q, k, v, starts):
        return _attend_fused(q, k, v, q_runs, k_runs, causal, scale, starts)

    return _by_documents(fused, documents, q, k, v)


def _attend_fused(q, k, v, q_runs: Runs, k_runs: Runs, causal: bool, scale: float,
                  starts: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    (q_sorted, q_index), (k_sorted, k_index) = _sorted(q_runs, causal, q.device), _sorted(k_runs, causal, q.device)
    qs, ks, vs = _take(q, q_index, 1), _take(k, k_index, 1), _take(v, k_index, 1)
    out = torch.zeros(q.shape, dtype=accumulate_dtype(q.dtype), device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=out.dtype, device=q.device)
    for call in calls.plan(q_sorted, k_sorted, causal, starts):
        where = _where(call, q_sorted, k_sorted, causal)
        block_out, block_lse = attention_kernel(qs[:, call.rows], ks[:, call.cols], vs[:, call.cols],
                                                causal=call.causal, scale=scale, positions=where)
        merge(out[:, call.rows], lse[:, :, call.rows], block_out, block_lse)
    return _put(out, q_index, 1), _put(lse, q_index, 2)


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, q_runs: Runs, k_runs: Runs, causal: bool, scale: float,
                    impl: str, documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) this block contributes, from the queries' final out and lse; accumulate dtype, dk and dv
    summed over each kv head's group of query heads. `documents` as `attend`'s."""
    if impl == "reference":
        return block_backward(q, k, v, out, lse, grad_out, runs_positions(q_runs, q.device),
                              runs_positions(k_runs, q.device), causal, scale,
                              None if documents is None else documents.ids)
    _check_impl(impl)

    def fused(q, k, v, out, lse, grad_out, starts):
        return _attend_backward_fused(q, k, v, out, lse, grad_out, q_runs, k_runs, causal, scale, starts)

    return _by_documents(fused, documents, q, k, v, out, lse, grad_out)


def _attend_backward_fused(q, k, v, out, lse, grad_out, q_runs: Runs, k_runs: Runs, causal: bool, scale: float,
                           starts: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    (q_sorted, q_index), (k_sorted, k_index) = _sorted(q_runs, causal, q.device), _sorted(k_runs, causal, q.device)
    qs, outs, dos = (_take(t, q_index, 1) for t in (q, out, grad_out))
    ks, vs, lses = _take(k, k_index, 1), _take(v, k_index, 1), _take(lse, q_index, 2)
    acc = accumulate_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (qs, ks, vs))
    for call in calls.plan(q_sorted, k_sorted, causal, starts):
        rows, cols = call.rows, call.cols
        grads = attention_kernel_backward(dos[:, rows], qs[:, rows], ks[:, cols], vs[:, cols], outs[:, rows],
                                          lses[:, :, rows], causal=call.causal, scale=scale,
                                          positions=_where(call, q_sorted, k_sorted, causal))
        dq[:, rows] += grads[0]
        dk[:, cols] += grads[1]
        dv[:, cols] += grads[2]
    return _put(dq, q_index, 1), _put(dk, k_index, 1), _put(dv, k_index, 1)


def _by_documents(fn, documents: Documents | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fn(*tensors, starts) for each group of rows with the same documents (batch first), put back in row order."""
    if documents is None:
        return fn(*tensors, None)
    groups = documents.row_groups()
    if len(groups) == 1:
        return fn(*tensors, _starts(groups[0][1]))
    results: list[torch.Tensor] = []
    for rows, spans in groups:
        index = torch.tensor(rows, device=tensors[0].device)
        part = fn(*(t.index_select(0, index) for t in tensors), _starts(spans))
        if not results:
            results = [p.new_empty((tensors[0].shape[0], *p.shape[1:])) for p in part]
        for whole, piece in zip(results, part, strict=True):
            whole.index_copy_(0, index, piece)
    return tuple(results)


def _starts(spans: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    return tuple(start for start, _ in spans)


def _check_impl(impl: str) -> None:
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {', '.join(KERNEL_IMPLS)}")


def _sorted(runs: Runs, causal: bool, device: torch.device) -> tuple[Runs, torch.Tensor | None]:
    if not causal:
        return runs, None  # one unmasked call: the order of the tokens does not matter
    ordered, segments = calls.sort_runs(runs)
    return ordered, calls.take_rows(segments, device)


def _where(call: calls.Call, q_runs: Runs, k_runs: Runs, causal: bool) -> tuple[Runs, Runs] | None:
    """The call's query and key positions, for the kernel to check its mask against (None: nothing masked)."""
    return (calls.slice_runs(q_runs, call.rows), calls.slice_runs(k_runs, call.cols)) if causal else None


def _take(x: torch.Tensor, index: torch.Tensor | None, dim: int) -> torch.Tensor:
    return x if index is None else x.index_select(dim, index)


def _put(x: torch.Tensor, index: torch.Tensor | None, dim: int) -> torch.Tensor:
    """Inverse of `_take`: row i of x goes back to row index[i]."""
    return x if index is None else torch.empty_like(x).index_copy_(dim, index, x)


def runs_positions(runs: Runs, device: torch.device) -> torch.Tensor:
    """The global positions the runs hold, in tensor order ([sum of lengths], int64)."""
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in runs])


class PositionalAttention(torch.autograd.Function):
    """Attention of q over k, v masked by global positions, as one block; saves q, k, v, out and lse.

    The positions come from `calls.spec_runs(spec)` with a spec of plain numbers, recomputed in backward
    rather than kept, so every byte kept is one the activation meter sees and the planner counts. `impl`
    is `attend`'s.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_spec: tuple, k_spec: tuple, causal: bool, scale: float, impl: str = "fused",
                documents: Documents | None = None):
        out, lse = attend(q, k, v, calls.spec_runs(q_spec), calls.spec_runs(k_spec), causal, scale, impl, documents)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.specs, ctx.causal, ctx.scale, ctx.impl = (q_spec, k_spec), causal, scale, impl
        ctx.documents = None if documents is None else documents.kept_for(impl)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        q_runs, k_runs = (calls.spec_runs(spec) for spec in ctx.specs)
        dq, dk, dv = attend_backward(q, k, v, out, lse, grad_out, q_runs, k_runs, ctx.causal, ctx.scale, ctx.impl,
                                     ctx.documents)
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None)
        return grads[:len(ctx.needs_input_grad)]  # `impl` may have been left to its default


def positions_of(spec: tuple, device: torch.device) -> torch.Tensor:
    """Positions of (seq_len, cp, rank[, cuts]) (`calls.spec_runs`): that cp rank's tokens, or all ranks' in
    rank order (rank None).

    Made on `device` from plain numbers: a tensor built on the host and copied would wait for the device in
    every block (tests/test_host_syncs.py)."""
    return runs_positions(calls.spec_runs(spec), device)
