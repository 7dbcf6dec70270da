"""Packed documents on one device, in float64: block-diagonal causal attention from document ids against an
explicit dense mask in plain torch, rotary positions restarting in each document, and the whole model on a
packed row against the same documents run one by one."""

from __future__ import annotations

import pytest
import torch

from orangetron.model import ModelConfig, Transformer
from orangetron.model.attention import document_attention
from orangetron.model.documents import DocumentIdsError, Documents
from orangetron.parallel.recompute import apply_recompute

HEAD_DIM = 4
# Two rows of 16 tokens with different boundaries: one-token documents, short ones and a long one.
ROW_LENGTHS = ((1, 3, 2, 9, 1), (7, 1, 8))


def ids_of(lengths_per_row: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Document ids [B, S] from each row's document lengths (ids 10, 11, ...: only equality matters)."""
    return torch.stack([torch.cat([torch.full((n,), 10 + d) for d, n in enumerate(row)]) for row in lengths_per_row])


def dense_block_causal(ids: torch.Tensor) -> torch.Tensor:
    """visible [B, S, S]: key j to query i iff j <= i and both carry the same document id."""
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return causal & (ids.unsqueeze(2) == ids.unsqueeze(1))


def plain_attention(q, k, v, visible):
    group = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    scores = q.transpose(1, 2) @ kh.transpose(-1, -2) / HEAD_DIM**0.5  # [B, H, S, S]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(1, 2)


def qkv_weight(ids: torch.Tensor, hq: int, hk: int):
    g = torch.Generator().manual_seed(hq * 7 + hk)
    b, s = ids.shape
    shapes = ((b, s, hq, HEAD_DIM), (b, s, hk, HEAD_DIM), (b, s, hk, HEAD_DIM), (b, s, hq, HEAD_DIM))
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]


def grads(fn, q, k, v, weight):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize(("hq", "hk"), [(4, 4), (4, 2)])
@pytest.mark.parametrize("rows", [ROW_LENGTHS, (ROW_LENGTHS[0], ROW_LENGTHS[0])])
def test_document_attention_matches_a_dense_block_diagonal_mask(impl, hq, hk, rows):
    ids = ids_of(rows)
    q, k, v, weight = qkv_weight(ids, hq, hk)
    documents = Documents.from_ids(ids)
    got = grads(lambda q, k, v: document_attention(q, k, v, documents, impl=impl)[0], q, k, v, weight)
    want = grads(lambda q, k, v: plain_attention(q, k, v, dense_block_causal(ids)), q, k, v, weight)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)


def test_document_attention_lse_is_that_of_each_document():
    ids = ids_of(ROW_LENGTHS)
    q, k, v, _ = qkv_weight(ids, 2, 2)
    _, lse = document_attention(q, k, v, Documents.from_ids(ids))
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / HEAD_DIM**0.5
    want = scores.masked_fill(~dense_block_causal(ids).unsqueeze(1), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, want, rtol=1e-9, atol=1e-12)


def test_positions_restart_in_each_document_and_split_documents_are_refused():
    documents = Documents.from_ids(torch.tensor([[5, 5, 2, 7, 7, 7], [1, 1, 1, 1, 1, 1]]))
    assert documents.positions().tolist() == [[0, 1, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert documents.spans == (((0, 2), (2, 3), (3, 6)), ((0, 6),))
    with pytest.raises(DocumentIdsError, match="split"):
        Documents.from_ids(torch.tensor([3, 3, 4, 3]))


MODEL = ModelConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, max_seq_len=32)


@pytest.mark.parametrize(("impl", "recompute"), [("fused", "none"), ("reference", "none"), ("fused", "full")])
def test_model_on_a_packed_row_equals_each_document_alone(impl, recompute):
    """Logits and every gradient of a packed row equal those of its documents run as separate sequences (each
    from position 0, plain causal attention): no document leaks into another, in either direction. Replayed
    blocks (activation recompute) replay with the same documents."""
    tokens = torch.randint(0, 32, (1, 16), generator=torch.Generator().manual_seed(3))
    ids = ids_of(ROW_LENGTHS[:1])
    weight = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    packed, alone = (Transformer(MODEL, seed=1, dtype=torch.float64) for _ in range(2))
    for model in (packed, alone):
        for layer in model.layers:
            layer.attention.kernel_impl = impl
    apply_recompute(packed, 1, 1, recompute, 0)
    logits = packed(tokens, documents=Documents.from_ids(ids))
    (logits * weight).sum().backward()
    pieces, start = [], 0
    for n in ROW_LENGTHS[0]:
        piece = alone(tokens[:, start : start + n])
        (piece * weight[:, start : start + n]).sum().backward()
        pieces.append(piece)
        start += n
    torch.testing.assert_close(logits, torch.cat(pieces, dim=1), rtol=1e-9, atol=1e-12)
    for (name, p), q in zip(packed.named_parameters(), alone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
