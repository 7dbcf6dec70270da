"""Every context-parallel attention mode against single-device attention, in float64.

Each rank takes its head-tail shard of the same q, k, v (and of a fixed output weighting), runs one mode
forward and backward, and hands back its shard of the output and of dq, dk, dv; reassembled, they must
equal plain PyTorch attention on one device to 1e-9 relative. One launch per cp size runs every mode,
causal and not, multi-head and grouped-query.
"""

from __future__ import annotations

import pytest
import torch

from orangetron.mesh import init_mesh
from orangetron.parallel import context
from orangetron.parallel.context.sharding import head_tail_indices
from orangetron.spec.layout import Layout
from orangetron.spec.variants import CONTEXT_MODES
from orangetron.testing import run_distributed

CHUNK, BATCH, HEAD_DIM = 3, 2, 4
CP_SIZES = (2, 3, 4, 8)


def heads(cp: int) -> dict[str, tuple[int, int]]:
    """(query heads, kv heads) that every mode, Ulysses included, can split over cp."""
    q = 6 if cp == 3 else 8
    return {"mha": (q, q), "gqa": (q, 3 if cp == 3 else 2)}


def inputs(cp: int, kind: str) -> tuple[torch.Tensor, ...]:
    hq, hk = heads(cp)[kind]
    seq = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(cp * 10 + hk)
    q = torch.randn(BATCH, seq, hq, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(BATCH, seq, hk, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, seq, hk, HEAD_DIM, generator=g, dtype=torch.float64)
    weight = torch.randn(BATCH, seq, hq, HEAD_DIM, generator=g, dtype=torch.float64)  # loss = sum(out * weight)
    return q, k, v, weight


def reference(cp: int, kind: str, causal: bool) -> tuple[torch.Tensor, ...]:
    """Plain attention on one device: out, dq, dk, dv."""
    q, k, v, weight = inputs(cp, kind)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = q.transpose(1, 2) @ kh.transpose(-1, -2) / HEAD_DIM**0.5
    if causal:
        seq = q.shape[1]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ vh).transpose(1, 2)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def variants(cp: int) -> list[tuple[str, int | None]]:
    """Every mode; USP with each proper factor of cp as its Ulysses degree, and 1."""
    usp = [("usp", u) for u in range(1, cp) if cp % u == 0]
    return [(mode, None) for mode in CONTEXT_MODES.names(runtime=True) if mode != "usp"] + usp


def all_modes(cp: int) -> dict:
    mesh = init_mesh(Layout(cp=cp))
    results = {}
    for kind in heads(cp):
        for causal in (True, False):
            for mode, degree in variants(cp):
                q, k, v, weight = (context.shard(t, mesh).requires_grad_() for t in inputs(cp, kind))
                out = context.attention(q, k, v, mesh, mode=mode, causal=causal, ulysses_degree=degree)
                (out * weight.detach()).sum().backward()
                results[kind, causal, f"{mode}{degree or ''}"] = (out.detach(), q.grad, k.grad, v.grad)
    return results


def _whole(shards: list[torch.Tensor], cp: int) -> torch.Tensor:
    seq = shards[0].shape[1] * cp
    full = torch.empty(shards[0].shape[0], seq, *shards[0].shape[2:], dtype=shards[0].dtype)
    for rank, part in enumerate(shards):
        full[:, head_tail_indices(seq, cp, rank)] = part
    return full


@pytest.mark.parametrize("cp", CP_SIZES)
def test_every_mode_equals_one_device(cp):
    per_rank = run_distributed(all_modes, cp, args=(cp,))
    for key in per_rank[0]:
        kind, causal, mode = key
        want = reference(cp, kind, causal)
        for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = _whole([r[key][i] for r in per_rank], cp)
            gap = ((got - want[i]).abs().max() / want[i].abs().max()).item()
            assert gap < 1e-9, f"cp={cp} {mode} {kind} causal={causal}: {name} off by {gap:.2e}"


def test_ulysses_names_heads_it_cannot_split():
    from orangetron.spec.rules import RuleError, heads_split_by_all_to_all

    with pytest.raises(RuleError, match=r"ulysses degree 4: needs heads per tp rank \(6\) divisible by it and kv heads "
                       r"per tp rank \(2\)"):
        heads_split_by_all_to_all(4, 6, 2)
    with pytest.raises(RuleError, match=r"kv heads per tp rank \(3\) divisible by it or dividing it"):
        heads_split_by_all_to_all(2, 8, 3)
    heads_split_by_all_to_all(4, 8, 2)  # kv heads dividing the degree: replicated
    heads_split_by_all_to_all(4, 8, 8)  # divisible: split
