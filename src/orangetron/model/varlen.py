"""Packed documents through torch's variable-length flash attention, where the device has it.

On CUDA in 16 bits `torch.nn.attention.varlen.varlen_attn` attends over every document of every row in one
call: the rows are laid end to end ([B*S, H, D]) and the documents' boundaries become cumulative lengths. It is
the one-device path of `model.attention.document_attention`; its backward is varlen's own. Elsewhere (CPU, float32
and float64) `document_attention` makes one fused causal call per document instead.

The function's keywords changed between PyTorch releases (`is_causal` first; `scale` and `window_size` then;
`enable_gqa` later), so the call is built from its signature, and a call it cannot express (a custom scale
without `scale`) falls back to the per-document calls.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .autograd import expand_kv
from .documents import Documents


def kernel(q: torch.Tensor) -> tuple[Callable[..., Any], type] | None:
    """(varlen_attn, AuxRequest) for q's device, dtype and head size, or None: no CUDA, not 16-bit, a GPU or
    head size flash attention does not take (before sm80, head_dim over 256 or not a multiple of 8), flash
    turned off, or too old a torch."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    d = q.shape[-1]
    if d > 256 or d % 8 or not torch.backends.cuda.flash_sdp_enabled() \
            or torch.cuda.get_device_capability(q.device) < (8, 0):
        return None
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        return None
    return varlen_attn, AuxRequest


def cumulative_lengths(documents: Documents, device: torch.device) -> tuple[torch.Tensor, int]:
    """(int32 [N+1] offsets of the N documents of all rows laid end to end, the longest document's length)."""
    seq, bounds, longest = documents.seq_len, [0], 0
    for row, spans in enumerate(documents.spans):
        for start, stop in spans:
            bounds.append(row * seq + stop)
            longest = max(longest, stop - start)
    return torch.tensor(bounds, dtype=torch.int32, device=device), longest


def call_keywords(fn: Callable[..., Any], scale: float, head_dim: int, gqa: bool) -> dict[str, Any] | None:
    """The keywords that make `fn` causal with `scale` (and grouped kv heads when it can), or None when it has
    no way to take `scale`."""
    params = inspect.signature(fn).parameters
    keywords: dict[str, Any] = {}
    if "window_size" in params:
        keywords["window_size"] = (-1, 0)  # everything before, nothing after: causal
    elif "is_causal" in params:
        keywords["is_causal"] = True
    else:
        return None
    if "scale" in params:
        keywords["scale"] = scale
    elif scale != head_dim ** -0.5:
        return None
    if gqa and "enable_gqa" in params:
        keywords["enable_gqa"] = True
    return keywords


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents, scale: float,
              fn: Callable[..., Any], aux: type) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out [B, S, Hq, D], lse [B, Hq, S] detached) of block-diagonal causal attention in one varlen call, or
    None when `fn` cannot express it."""
    b, s, hq, d = q.shape
    hk = k.shape[2]
    keywords = call_keywords(fn, scale, d, gqa=hk != hq)
    if keywords is None:
        return None
    if hk != hq and "enable_gqa" not in keywords:
        k, v = expand_kv(k, hq), expand_kv(v, hq)
    cu, longest = cumulative_lengths(documents, q.device)
    flat = [t.reshape(b * s, t.shape[2], d) for t in (q, k, v)]
    out, lse = fn(*flat, cu, cu, longest, longest, return_aux=aux(lse=True), **keywords)
    return out.view(b, s, hq, d), _lse_by_row(lse, b, s, hq).detach()


def _lse_by_row(lse: torch.Tensor, b: int, s: int, heads: int) -> torch.Tensor:
    """varlen's log-sum-exp ([H, B*S], or [B*S, H]) as [B, H, S] float32."""
    if lse.shape == (heads, b * s):
        return lse.view(heads, b, s).transpose(0, 1).float()
    if lse.shape == (b * s, heads):
        return lse.view(b, s, heads).transpose(1, 2).float()
    raise ValueError(f"varlen attention returned lse {tuple(lse.shape)}; expected [{heads}, {b * s}]")
