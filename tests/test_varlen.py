"""Packed documents through torch's variable-length attention (`model/varlen.py`), on CPU.

varlen_attn runs on CUDA only, so a plain-torch stand-in with its documented contract (rows laid end to end,
cumulative lengths, causal through `window_size=(-1, 0)` or `is_causal`, lse as [H, T]) takes its place, and
`document_attention` through it must equal the per-document fused calls in float64, forward and backward.
The real kernel is checked by `scripts/gpu_check.py` where a GPU is lent.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from orangetron.model import attention, varlen
from orangetron.model.documents import Documents


@dataclass
class Aux:
    lse: bool = False


def stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False):
    """varlen_attn's contract in plain torch: each segment attends within itself; causal for (-1, 0)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert max_q == max_k == int(cu_seq_q.diff().max())
    assert window_size == (-1, 0)
    heads = query.shape[1]
    if key.shape[1] != heads:
        assert enable_gqa
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    outs, lses = [], []
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))  # [H, n, D]
        scores = q @ k.transpose(-1, -2) * scale
        scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        lses.append(scores.logsumexp(-1))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse) if return_aux is not None and return_aux.lse else out


def old_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """The first release's keywords: causal by flag, no scale, no grouped heads."""
    assert is_causal
    return stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                    scale=query.shape[-1] ** -0.5, window_size=(-1, 0))


def packed_rows() -> Documents:
    ids = torch.tensor([[0, 1, 1, 1, 2, 2, 2, 2, 2, 3], [0, 0, 0, 0, 0, 0, 0, 1, 2, 2]])
    return Documents.from_ids(ids)


def test_cumulative_lengths_lay_the_rows_end_to_end():
    cu, longest = varlen.cumulative_lengths(packed_rows(), torch.device("cpu"))
    assert cu.tolist() == [0, 1, 4, 9, 10, 17, 18, 20] and cu.dtype == torch.int32
    assert longest == 7


def test_keywords_follow_the_functions_signature():
    assert varlen.call_keywords(stand_in, 0.5, 4, gqa=False) == {"window_size": (-1, 0), "scale": 0.5}
    assert varlen.call_keywords(old_stand_in, 0.5, 4, gqa=False) == {"is_causal": True}
    assert varlen.call_keywords(old_stand_in, 0.3, 4, gqa=False) is None  # a scale it cannot take

    def newest(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
               enable_gqa=False):
        return None

    assert varlen.call_keywords(newest, 0.3, 4, gqa=True) == {"window_size": (-1, 0), "scale": 0.3,
                                                              "enable_gqa": True}


def test_cpu_and_float32_make_per_document_calls():
    q = torch.randn(1, 4, 2, 8)
    assert varlen.kernel(q) is None and varlen.kernel(q.bfloat16()) is None


@pytest.mark.parametrize("fn", [stand_in, old_stand_in])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_one_varlen_call_equals_one_call_per_document(monkeypatch, fn, kv_heads):
    documents = packed_rows()
    g = torch.Generator().manual_seed(kv_heads)
    q, k, v, weight = (torch.randn(2, 10, h, 8, generator=g, dtype=torch.float64) for h in (4, kv_heads, kv_heads, 4))

    def run(use_varlen: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        monkeypatch.setattr(varlen, "kernel", (lambda _q: (fn, Aux)) if use_varlen else (lambda _q: None))
        out, lse = attention.document_attention(*leaves, documents)
        (out * weight).sum().backward()
        return out.detach(), lse, *(t.grad for t in leaves)

    got, want = run(True), run(False)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-6 if name == "lse" else 1e-12, atol=1e-12, msg=name)
