"""Every context-parallel mode over packed documents against one device, in float64.

The reference is plain PyTorch attention on one device under the explicit dense block-diagonal causal mask
built from the document ids. Documents are uneven: one token long, shorter than a chunk, longer than a rank's
share; the rows of a batch have different boundaries (so the fused path plans each group of rows apart) or
the same. One launch per cp size runs every mode with the fused block kernel (the matmul paths refusing to
run) and with the matmul blocks; out, dq, dk, dv must match to 1e-9, and the fused kernel calls must compute
exactly the visible query-key pairs, each once per holder of its query (nothing masked, nothing skipped).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_context_attention import HEAD_DIM, _whole, heads, variants

from orangetron.mesh import init_mesh
from orangetron.model.documents import Documents
from orangetron.parallel import context
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

CHUNK = 3


def lengths(seq: int) -> tuple[tuple[int, ...], ...]:
    """Three rows of `seq` tokens: rows 0 and 2 alike (one token, shorter than a chunk, half the sequence, ...),
    row 1 with other boundaries; every row has a document longer than a rank's share (seq / cp)."""
    rest = seq - 4 - seq // 2
    first = (1, 2, seq // 2, 1, 2, rest - 2) if rest > 2 else (1, 2, seq // 2, 1, rest)
    return first, (seq - 5, 1, 1, 3), first


def document_ids(seq: int, rows: int) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths(seq)[:rows]])


def inputs(cp: int, rows: int) -> tuple[torch.Tensor, ...]:
    hq, hk = heads(cp)["gqa"]
    seq = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(cp * 10 + rows)
    shapes = [(rows, seq, h, HEAD_DIM) for h in (hq, hk, hk, hq)]
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes)


def visible(ids: torch.Tensor) -> torch.Tensor:
    """[B, S, S]: key j visible to query i iff j <= i and the same document id."""
    s = ids.shape[1]
    return torch.ones(s, s, dtype=torch.bool).tril() & (ids.unsqueeze(2) == ids.unsqueeze(1))


def reference(cp: int, rows: int) -> tuple[torch.Tensor, ...]:
    q, k, v, weight = (t.requires_grad_() for t in inputs(cp, rows))
    group = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    scores = q.transpose(1, 2) @ kh.transpose(-1, -2) / HEAD_DIM**0.5
    scores = scores.masked_fill(~visible(document_ids(q.shape[1], rows)).unsqueeze(1), float("-inf"))
    out = (scores.softmax(-1) @ vh).transpose(1, 2)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@contextlib.contextmanager
def fused_pairs(pairs: list):
    """The matmul paths raise; each fused forward call appends the (query, key) pairs it computes, per row."""
    from orangetron.model import attention as seam
    from orangetron.parallel.context import blocks

    saved = blocks.block_forward, blocks.block_backward, blocks.attention_kernel, seam._reference

    def refuse(*args, **kwargs):
        raise AssertionError("the matmul path ran under impl='fused'")

    def counted(q, k, v, *, causal, **kwargs):
        sq, sk = q.shape[1], k.shape[1]
        pairs.append(q.shape[0] * (sq * (sq + 1) // 2 if causal else sq * sk))
        return saved[2](q, k, v, causal=causal, **kwargs)

    blocks.block_forward = blocks.block_backward = seam._reference = refuse
    blocks.attention_kernel = counted
    try:
        yield
    finally:
        blocks.block_forward, blocks.block_backward, blocks.attention_kernel, seam._reference = saved


def all_modes(cp: int) -> dict:
    """Per (rows, mode, impl): this rank's out, dq, dk, dv; under "pairs" the pairs its fused forwards computed."""
    mesh = init_mesh(Layout(cp=cp))
    results: dict = {"pairs": {}}
    for rows in (3, 1):
        documents = Documents.from_ids(document_ids(2 * cp * CHUNK, rows))
        for impl in ("fused", "reference"):
            for mode, degree in variants(cp):
                q, k, v, weight = (context.shard(t, mesh).requires_grad_() for t in inputs(cp, rows))
                pairs: list[int] = []
                with fused_pairs(pairs) if impl == "fused" else contextlib.nullcontext():
                    out = context.attention(q, k, v, mesh, mode=mode, causal=True, ulysses_degree=degree,
                                            impl=impl, documents=documents)
                    (out * weight.detach()).sum().backward()
                name = f"{mode}{degree or ''}"
                results[rows, name, impl] = (out.detach(), q.grad, k.grad, v.grad)
                results["pairs"][rows, name, impl] = sum(pairs)
    return results


def holders(mode: str, cp: int) -> int:
    """How many ranks compute each visible pair (for their heads): every Ulysses rank holds every query, a USP
    rank those of its Ulysses group."""
    if mode == "ulysses":
        return cp
    return int(mode[3:]) if mode.startswith("usp") else 1


@pytest.mark.parametrize("cp", (2, 3, 4))
def test_every_mode_masks_packed_documents_as_one_device(cp):
    per_rank = run_distributed(all_modes, cp, args=(cp,))
    pairs = [rank.pop("pairs") for rank in per_rank]
    for key in per_rank[0]:
        rows, mode, impl = key
        want = reference(cp, rows)
        for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = _whole([r[key][i] for r in per_rank], cp)
            gap = ((got - want[i]).abs().max() / want[i].abs().max()).item()
            assert gap < 1e-9, f"cp={cp} {mode} {impl} rows={rows}: {name} off by {gap:.2e}"
        if impl == "fused" and mode != "rsa":  # rsa keeps its score rows: matmuls by design
            seen = int(visible(document_ids(2 * cp * CHUNK, rows)).sum())
            computed = sum(p[key] for p in pairs)
            assert computed == seen * holders(mode, cp), (cp, mode, rows, computed, seen)


def ring_traffic(cp: int) -> dict:
    """Ring attention, forward and backward, over one row whose every head-tail chunk is a document of its own,
    and over the same row as one sequence: this rank's output and gradients, and the bytes it sent."""
    from orangetron import comm

    mesh = init_mesh(Layout(cp=cp))
    seq = 2 * cp * CHUNK
    results = {}
    for name, documents in (("chunks", Documents.from_ids(chunk_ids(seq))), ("one", None)):
        q, k, v, weight = (context.shard(t, mesh).requires_grad_() for t in inputs(cp, 1))
        with comm.measure() as records:
            out = context.attention(q, k, v, mesh, mode="ring", documents=documents)
            (out * weight.detach()).sum().backward()
        results[name] = (out.detach(), q.grad, k.grad, v.grad, sum(r.bytes_sent for r in records), k.numel() * 16)
    return results


def chunk_ids(seq: int) -> torch.Tensor:
    return (torch.arange(seq) // CHUNK).unsqueeze(0)  # [1, S]: every chunk its own document


@pytest.mark.parametrize("cp", (2, 3))
def test_ring_sends_no_block_that_no_later_rank_sees(cp):
    """Every head-tail chunk its own document: no rank sees another's keys, so neither K,V ring (forward, and
    again in backward) sends anything; the dK,dV accumulators still go round once (cp hops). One sequence: all
    of it, (cp - 1) + (cp - 1) + cp blocks. The result still equals one device under the dense mask."""
    per_rank = run_distributed(ring_traffic, cp, args=(cp,))
    for rank in per_rank:
        kv_bytes = rank["chunks"][5]  # k and v of this rank, float64
        assert rank["chunks"][4] == cp * kv_bytes
        assert rank["one"][4] == (3 * cp - 2) * kv_bytes
    q, k, v, weight = (t.requires_grad_() for t in inputs(cp, 1))
    group = q.shape[2] // k.shape[2]
    kh, vh = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    scores = q.transpose(1, 2) @ kh.transpose(-1, -2) / HEAD_DIM**0.5
    scores = scores.masked_fill(~visible(chunk_ids(q.shape[1])).unsqueeze(1), float("-inf"))
    want = (scores.softmax(-1) @ vh).transpose(1, 2)
    (want * weight).sum().backward()
    for i, expected in enumerate((want.detach(), q.grad, k.grad, v.grad)):
        got = _whole([r["chunks"][i] for r in per_rank], cp)
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-9, i
