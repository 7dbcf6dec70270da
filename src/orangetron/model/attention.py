"""Single-device attention kernels that return `(out, lse)`.

The log-sum-exp lets partial results over key chunks be merged exactly (context parallelism), so every
kernel returns it next to the output. Layout follows the rest of the library: `[batch, seq, heads, dim]`.
"""

from __future__ import annotations

import torch

from . import varlen
from .autograd import CPUFlashAttention, expand_kv
from .documents import Documents, Spans

KERNEL_IMPLS = ("fused", "reference")
Runs = tuple[tuple[int, int], ...]  # global positions as [start, stop) ranges, in tensor order


class MaskNotExpressible(ValueError):
    """A call whose position mask the fused kernels cannot express (neither no mask nor plain causal)."""


def attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    impl: str = "fused",
    positions: tuple[Runs, Runs] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention returning the output and the log-sum-exp of the scores.

    q: [B, Sq, Hq, D]; k, v: [B, Sk, Hk, D] with Hq % Hk == 0 (grouped-query: kv head g serves query heads
    g*Hq/Hk .. (g+1)*Hq/Hk - 1). `causal=True` lets query i see keys j <= i and requires Sq == Sk.
    `scale` defaults to D ** -0.5.

    Returns out: [B, Sq, Hq, D] in q's dtype, and lse: [B, Hq, Sq], the natural-log log-sum-exp over keys
    of the scaled (masked) scores, float64 for float64 inputs and float32 otherwise.

    impl "fused" calls PyTorch's fused flash / memory-efficient op (falling back to "reference" where the
    device or dtype has none); its lse is detached and carries no gradient. On CPU it keeps for backward
    q, the unexpanded k and v, out and lse, and nothing else (`CPUFlashAttention`). impl "reference" is plain
    PyTorch accumulating in float32 (float64 for float64) and its lse is differentiable. Both are
    differentiable in q, k, v through `out`.

    `positions` (query runs, key runs) states that the intended mask is "key j visible to query i iff its
    global position is at most i's" (context parallelism); the call is refused (`MaskNotExpressible`) unless
    `causal` expresses that mask exactly, as the fused kernels would: no mask when every key is at or
    before every query, causal when queries and keys hold the same contiguous increasing range.
    """
    _check_inputs(q, k, v, causal)
    if positions is not None:
        check_expressible(positions, causal, q.shape[1], k.shape[1])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if impl == "fused":
        return _fused(q, k, v, causal, scale)
    if impl == "reference":
        return _reference(q, k, v, causal, scale)
    raise ValueError(f"impl={impl!r}: must be one of {', '.join(KERNEL_IMPLS)}")


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, *, scale: float | None = None,
    impl: str = "fused",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal causal attention over packed documents: `attention_kernel`'s (out, lse) where query i
    sees key j iff j <= i and both lie in the same document of `documents` (whose rows match q's).

    Each document is one causal call over its own contiguous range (rows with the same spans share calls), so
    the fused kernels compute no masked-out pair, and a one-token document sees itself alone. On CUDA in 16
    bits, impl "fused" makes one variable-length call over all of them instead (`model/varlen.py`). Backward makes
    the same calls from the whole output and log-sum-exp, which are kept once, with q, k and v: what one causal
    call over the rows keeps. lse carries no gradient.
    """
    if tuple(documents.ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"documents {tuple(documents.ids.shape)} do not match q {tuple(q.shape)}: expected [B, S]")
    _check_inputs(q, k, v, True)
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {', '.join(KERNEL_IMPLS)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    found = varlen.kernel(q) if impl == "fused" else None
    result = None if found is None else varlen.attention(q, k, v, documents, scale, *found)
    if result is not None:  # CUDA in 16 bits: every document of every row in one variable-length call
        return result
    out, lse = _DocumentAttention.apply(q, k, v, documents, scale, impl)
    return out, lse


class _DocumentAttention(torch.autograd.Function):
    """One causal kernel call per document forward, the kernel's backward per document backward."""

    @staticmethod
    def forward(ctx, q, k, v, documents: Documents, scale: float, impl: str):
        out = torch.empty_like(q)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_lse_dtype(q.dtype))  # [B, Hq, S]
        for rows, spans in _row_groups(documents, q.device):
            for a, b in spans:
                piece, piece_lse = attention_kernel(*(_rows(t, rows)[:, a:b] for t in (q, k, v)), causal=True,
                                                    scale=scale, impl=impl)
                _put_rows(out, rows, (slice(None), slice(a, b)), piece)
                _put_rows(lse, rows, (slice(None), slice(None), slice(a, b)), piece_lse.to(lse.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.documents, ctx.scale, ctx.impl = documents.spans_only(), scale, impl  # backward reads the spans
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for rows, spans in _row_groups(ctx.documents, q.device):
            for a, b in spans:
                seq = (slice(None), slice(a, b))
                grads = attention_kernel_backward(
                    *(_rows(t, rows)[seq] for t in (grad_out, q, k, v, out)), _rows(lse, rows)[:, :, a:b],
                    causal=True, scale=ctx.scale, impl=ctx.impl)
                for whole, piece in zip((dq, dk, dv), grads, strict=True):
                    _put_rows(whole, rows, seq, piece.to(whole.dtype))
        return dq, dk, dv, None, None, None


def _row_groups(documents: Documents, device: torch.device) -> list[tuple[torch.Tensor | None, Spans]]:
    """(row index, or None for every row; their spans) per group of rows with the same documents."""
    groups = documents.row_groups()
    if len(groups) == 1:
        return [(None, groups[0][1])]
    return [(torch.tensor(rows, device=device), spans) for rows, spans in groups]


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _put_rows(whole: torch.Tensor, rows: torch.Tensor | None, where: tuple, piece: torch.Tensor) -> None:
    if rows is None:
        whole[where] = piece
    else:
        whole[(rows, *where[1:])] = piece


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    (b, sq, hq, d), (bk, sk, hk, dk) = q.shape, k.shape
    if b != bk or d != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head_dim")
    if hq % hk != 0:
        raise ValueError(f"q heads {hq} are not divisible by kv heads {hk}")
    if sk == 0:
        raise ValueError("k and v have no keys (Sk == 0)")
    if causal and sq != sk:
        raise ValueError(f"causal attention requires Sq == Sk; got Sq={sq}, Sk={sk}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reference(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _lse_dtype(q.dtype)
    hq = q.shape[2]
    qh = q.transpose(1, 2).to(acc)  # [B, Hq, Sq, D]
    kh = expand_kv(k, hq).transpose(1, 2).to(acc)  # [B, Hq, Sk, D]
    vh = expand_kv(v, hq).transpose(1, 2).to(acc)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    if causal:
        sq, sk = scores.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, Sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(probs, vh).transpose(1, 2).to(q.dtype)  # [B, Sq, Hq, D]
    return out, lse


def _fused(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu" and q.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        # Takes [B, S, H, D] and grouped kv heads itself; keeps k and v unexpanded for backward.
        return CPUFlashAttention.apply(q, k, v, causal, scale)
    op = _fused_op(q)
    if op is None:
        out, lse = _reference(q, k, v, causal, scale)
        return out, lse.detach()
    hq, sq = q.shape[2], q.shape[1]
    # The fused ops take [B, H, S, D] and equal head counts (under GQA autograd keeps the expanded k, v).
    qh = q.transpose(1, 2)
    kh = expand_kv(k, hq).transpose(1, 2)
    vh = expand_kv(v, hq).transpose(1, 2)
    out, lse = op(qh, kh, vh, causal, scale)
    # Memory-efficient attention pads lse along the query axis to a multiple of its block size.
    lse = lse[..., :sq].to(_lse_dtype(q.dtype)).detach()
    return out.transpose(1, 2), lse


def _fused_op(q: torch.Tensor):
    """The CUDA fused op for q's device and dtype as f(q, k, v, causal, scale) -> (out, lse), or None."""
    d = q.shape[-1]
    if q.device.type != "cuda" or d % 8 != 0:
        return None
    flash_ok = torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(q.device) >= (8, 0)
    if q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and flash_ok:
        return _cuda_flash
    if q.dtype in (torch.float32, torch.float16, torch.bfloat16) and torch.backends.cuda.mem_efficient_sdp_enabled():
        return _cuda_efficient
    return None


def _cuda_flash(q, k, v, causal: bool, scale: float):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _cuda_efficient(q, k, v, causal: bool, scale: float):
    res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return res[0], res[1]


def attention_kernel_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    impl: str = "fused",
    positions: tuple[Runs, Runs] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention of q over k, v, given the output and log-sum-exp of the queries' rows.

    `out` [B, Sq, Hq, D] (q's dtype) and `lse` [B, Hq, Sq] may be those of a larger attention over more keys
    than k holds (the flash-attention backward): the result is then this block's share of the gradients.
    dk, dv come summed over each kv head's group of query heads. impl "fused" on CPU runs PyTorch's CPU flash
    backward op and returns q's dtype; elsewhere, and for impl "reference", plain PyTorch in the accumulate
    dtype. `positions` is checked as in `attention_kernel`.
    """
    _check_inputs(q, k, v, causal)
    if positions is not None:
        check_expressible(positions, causal, q.shape[1], k.shape[1])
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {', '.join(KERNEL_IMPLS)}")
    if impl == "fused" and q.device.type == "cpu":
        return _cpu_flash_backward(grad_out, q, k, v, out, lse, causal, scale)
    return _reference_backward(grad_out, q, k, v, out, lse, causal, scale)


def _cpu_flash_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    (b, sk, hk, d), hq = k.shape, q.shape[2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.transpose(1, 2), q.transpose(1, 2), expand_kv(k, hq).transpose(1, 2),
        expand_kv(v, hq).transpose(1, 2), out.transpose(1, 2), lse.to(_lse_dtype(q.dtype)), 0.0, causal, scale=scale)
    dk = dk.transpose(1, 2).reshape(b, sk, hk, hq // hk, d).sum(3)  # [B, Sk, Hk, D]
    dv = dv.transpose(1, 2).reshape(b, sk, hk, hq // hk, d).sum(3)
    return dq.transpose(1, 2), dk, dv


def _reference_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    acc, hq, (b, sk, hk, d) = _lse_dtype(q.dtype), q.shape[2], k.shape
    qh, do, oh = (t.transpose(1, 2).to(acc) for t in (q, grad_out, out))  # [B, Hq, Sq, D]
    kh, vh = (expand_kv(t, hq).transpose(1, 2).to(acc) for t in (k, v))  # [B, Hq, Sk, D]
    scores = qh @ kh.transpose(-1, -2) * scale  # [B, Hq, Sq, Sk]
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    delta = (do * oh).sum(-1, keepdim=True)  # [B, Hq, Sq, 1]
    dscores = probs * (do @ vh.transpose(-1, -2) - delta) * scale
    dk = (dscores.transpose(-1, -2) @ qh).transpose(1, 2).reshape(b, sk, hk, hq // hk, d).sum(3)
    dv = (probs.transpose(-1, -2) @ do).transpose(1, 2).reshape(b, sk, hk, hq // hk, d).sum(3)
    return (dscores @ kh).transpose(1, 2), dk, dv


def check_expressible(positions: tuple[Runs, Runs], causal: bool, sq: int, sk: int) -> None:
    """Raise `MaskNotExpressible` unless `causal` is exactly the position mask of these query and key runs."""
    q_runs, k_runs = (coalesce_runs(runs) for runs in positions)
    held = (sum(stop - start for start, stop in q_runs), sum(stop - start for start, stop in k_runs))
    if held != (sq, sk):
        raise MaskNotExpressible(f"positions cover {held[0]} queries and {held[1]} keys; the call has {sq} and {sk}")
    if causal:
        honest = len(q_runs) == 1 and q_runs == k_runs
    else:
        honest = max(stop for _, stop in k_runs) - 1 <= min(start for start, _ in q_runs)
    if not honest:
        kind = "causal" if causal else "unmasked"
        raise MaskNotExpressible(f"a {kind} kernel call cannot express the position mask of queries {q_runs} "
                                 f"over keys {k_runs}")


def coalesce_runs(runs: Runs) -> Runs:
    """The same positions with touching runs joined ((0, 2), (2, 4) -> (0, 4)) and empty ones dropped."""
    joined: list[tuple[int, int]] = []
    for start, stop in runs:
        if joined and joined[-1][1] == start:
            joined[-1] = (joined[-1][0], stop)
        elif stop > start:
            joined.append((start, stop))
    return tuple(joined)
