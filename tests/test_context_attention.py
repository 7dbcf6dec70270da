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


def ring_events(cp: int) -> list[str]:
    """On this rank: the order of ring transfers (start/wait, by exchange) and block computations through one
    ring attention forward and backward."""
    from orangetron import comm
    from orangetron.parallel.context import ring

    events: list[str] = []
    start, wait, backward = comm.RingExchange.start, comm.RingExchange.wait, ring.block_backward

    def logged_start(self, x):
        events.append(f"start {id(self)}")
        return start(self, x)

    def logged_wait(self):
        events.append(f"wait {id(self)}")
        return wait(self)

    def logged_backward(*args):
        events.append("block")
        return backward(*args)

    comm.RingExchange.start, comm.RingExchange.wait, ring.block_backward = logged_start, logged_wait, logged_backward
    try:
        mesh = init_mesh(Layout(cp=cp))
        q, k, v, weight = (context.shard(t, mesh).requires_grad_() for t in inputs(cp, "mha"))
        out = context.attention(q, k, v, mesh, mode="ring", causal=True)
        events.append("backward")
        (out * weight.detach()).sum().backward()
    finally:
        comm.RingExchange.start, comm.RingExchange.wait, ring.block_backward = start, wait, backward
    return events[events.index("backward"):]


def _exposed(events: list[str]) -> int:
    """Transfers waited for with no block computed since they started."""
    started: dict[str, int] = {}
    exposed = 0
    for at, event in enumerate(events):
        kind, _, exchange = event.partition(" ")
        if kind == "start":
            started[exchange] = at
        elif kind == "wait":
            exposed += "block" not in events[started.pop(exchange):at]
    return exposed


def test_ring_backward_waits_for_each_gradient_one_block_later():
    # Backward sends K,V (cp-1 times) and the K,V gradient accumulator (cp times). Each travels while a block
    # computes, except the accumulator's last trip home, which has no block left to hide behind.
    cp = 4
    for events in run_distributed(ring_events, cp, args=(cp,)):
        assert events.count("block") == cp
        assert _exposed(events) == 1, events
