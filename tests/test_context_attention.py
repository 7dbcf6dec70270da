"""Every context-parallel attention mode against single-device attention, in float64.

Each rank takes its head-tail shard of the same q, k, v (and of a fixed output weighting), runs one mode
forward and backward, and hands back its shard of the output and of dq, dk, dv; reassembled, they must
equal plain PyTorch attention on one device to 1e-9 relative. One launch per cp size runs every mode,
causal and not, multi-head and grouped-query, with the fused block kernel while the matmul path refuses
to run, and again with the matmul path ("reference"). Every fused kernel call is recorded with the global
positions of its queries and keys, and its mask is checked here against the causal mask by position.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from orangetron import comm
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
    """Per (kind, causal, mode, impl): out, dq, dk, dv of this rank; under "bytes" the same keys' ledger
    records (op, bytes sent); under "calls" the fused kernel calls as (kernel causal, query positions, key
    positions, Sq, Sk), each run of them after the causal flag of the attention that made them."""
    mesh = init_mesh(Layout(cp=cp))
    results, kernel_calls = {"bytes": {}}, []
    with fused_only(kernel_calls):
        run_modes(mesh, cp, "fused", results, kernel_calls)
    run_modes(mesh, cp, "reference", results, [])
    results["calls"] = kernel_calls
    return results


def run_modes(mesh, cp: int, impl: str, results: dict, kernel_calls: list) -> None:
    for kind in heads(cp):
        for causal in (True, False):
            for mode, degree in variants(cp):
                q, k, v, weight = (context.shard(t, mesh).requires_grad_() for t in inputs(cp, kind))
                kernel_calls.append(causal)  # the calls that follow attend with this mask
                with comm.measure() as records:
                    out = context.attention(q, k, v, mesh, mode=mode, causal=causal, ulysses_degree=degree,
                                            impl=impl)
                    (out * weight.detach()).sum().backward()
                name = f"{mode}{degree or ''}"
                results[kind, causal, name, impl] = (out.detach(), q.grad, k.grad, v.grad)
                results["bytes"][kind, causal, name, impl] = [(r.op, r.bytes_sent) for r in records]


@contextlib.contextmanager
def fused_only(kernel_calls: list):
    """The matmul block path and the seam's matmul fallback raise; every fused kernel call is recorded."""
    from orangetron.model import attention as seam
    from orangetron.parallel.context import blocks

    saved = {name: getattr(blocks, name) for name in ("block_forward", "block_backward", "attention_kernel",
                                                      "attention_kernel_backward")}
    saved_seam = seam._reference, seam._reference_backward

    def refuse(*args, **kwargs):
        raise AssertionError("the matmul path ran under impl='fused'")

    def recorded(kernel):
        def call(*args, causal, positions, **kwargs):
            q, k = args[-5:-3] if kernel is saved["attention_kernel_backward"] else args[:2]
            kernel_calls.append((causal, positions, q.shape[1], k.shape[1]))
            return kernel(*args, causal=causal, positions=positions, **kwargs)
        return call

    blocks.block_forward = blocks.block_backward = seam._reference = seam._reference_backward = refuse
    blocks.attention_kernel = recorded(saved["attention_kernel"])
    blocks.attention_kernel_backward = recorded(saved["attention_kernel_backward"])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(blocks, name, value)
        seam._reference, seam._reference_backward = saved_seam


def check_kernel_calls(kernel_calls: list, cp: int) -> None:
    """Every fused call of a causal attention carries its positions, and its mask (none, or causal over equal
    rows and columns) is exactly "key position <= query position"; a call of a plain attention has no mask."""
    assert len(kernel_calls) > 2 * len(variants(cp)) * len(heads(cp)), "no fused kernel calls were recorded"
    causal_attention = None
    for entry in kernel_calls:
        if isinstance(entry, bool):
            causal_attention = entry
            continue
        kernel_causal, positions, sq, sk = entry
        if not causal_attention:
            assert positions is None and not kernel_causal, entry
            continue
        q_pos, k_pos = (torch.cat([torch.arange(a, b) for a, b in runs]) for runs in positions)
        assert (q_pos.numel(), k_pos.numel()) == (sq, sk), entry
        wanted = k_pos[None, :] <= q_pos[:, None]  # [Sq, Sk]
        given = torch.ones(sq, sk, dtype=torch.bool)
        if kernel_causal:
            given = given.tril()
        assert torch.equal(wanted, given), f"cp={cp}: a kernel call's mask is not the position mask: {entry}"


def _whole(shards: list[torch.Tensor], cp: int) -> torch.Tensor:
    seq = shards[0].shape[1] * cp
    full = torch.empty(shards[0].shape[0], seq, *shards[0].shape[2:], dtype=shards[0].dtype)
    for rank, part in enumerate(shards):
        full[:, head_tail_indices(seq, cp, rank)] = part
    return full


@pytest.mark.parametrize("cp", CP_SIZES)
def test_every_mode_equals_one_device(cp):
    per_rank = run_distributed(all_modes, cp, args=(cp,))
    for rank in per_rank:
        check_kernel_calls(rank.pop("calls"), cp)
        ledger = rank.pop("bytes")
        for (kind, causal, mode, impl), records in ledger.items():
            if impl == "fused":  # the kernel changes what is computed, never what travels
                assert records and records == ledger[kind, causal, mode, "reference"], (mode, kind, causal)
    for key in per_rank[0]:
        kind, causal, mode, impl = key
        want = reference(cp, kind, causal)
        for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            got = _whole([r[key][i] for r in per_rank], cp)
            gap = ((got - want[i]).abs().max() / want[i].abs().max()).item()
            assert gap < 1e-9, f"cp={cp} {mode} {impl} {kind} causal={causal}: {name} off by {gap:.2e}"


def test_ulysses_names_heads_it_cannot_split():
    from orangetron.spec.rules import RuleError, heads_split_by_all_to_all

    with pytest.raises(RuleError, match=r"cp=4: the Ulysses all-to-all splits heads over 4 ranks, and needs heads "
                       r"per tp rank \(6\) divisible by it and kv heads per tp rank \(2\).*allow cp 1, 2, 6$"):
        heads_split_by_all_to_all(4, 6, 2)
    with pytest.raises(RuleError, match=r"^ulysses_degree=3: .*these heads allow ulysses_degree 1, 2, 4, 8$"):
        heads_split_by_all_to_all(3, 8, 2, "ulysses_degree")
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
    start, wait, backward = comm.RingExchange.start, comm.RingExchange.wait, ring.attend_backward

    def logged_start(self, x, *directions):
        events.append(f"start {id(self)}")
        return start(self, x, *directions)

    def logged_wait(self):
        events.append(f"wait {id(self)}")
        return wait(self)

    def logged_backward(*args):
        events.append("block")
        return backward(*args)

    comm.RingExchange.start, comm.RingExchange.wait, ring.attend_backward = logged_start, logged_wait, logged_backward
    try:
        mesh = init_mesh(Layout(cp=cp))
        q, k, v, weight = (context.shard(t, mesh).requires_grad_() for t in inputs(cp, "mha"))
        out = context.attention(q, k, v, mesh, mode="ring", causal=True)
        events.append("backward")
        (out * weight.detach()).sum().backward()
    finally:
        comm.RingExchange.start, comm.RingExchange.wait, ring.attend_backward = start, wait, backward
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


def test_the_kernel_refuses_a_mask_it_cannot_express():
    """The fused seam, told the global positions of its queries and keys, runs a call only when its own mask
    (none, or causal) is exactly "key position <= query position"."""
    from orangetron.model.attention import MaskNotExpressible, attention_kernel, attention_kernel_backward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(3))
    honest = [(((8, 12),), ((8, 10), (10, 12)), True),  # the same range, cut in two
              (((8, 10), (20, 22)), ((0, 4),), False),  # every key before every query
              (((8, 12),), ((8, 12),), True)]
    for q_runs, k_runs, causal in honest:
        out, lse = attention_kernel(q, k, v, causal=causal, positions=(q_runs, k_runs))
        attention_kernel_backward(q, q, k, v, out, lse, causal=causal, scale=HEAD_DIM**-0.5,
                                  positions=(q_runs, k_runs))
    dishonest = [(((8, 12),), ((9, 13),), True),  # offset: query 8 would see key 9
                 (((8, 10), (2, 4)), ((8, 10), (2, 4)), True),  # equal but not increasing
                 (((8, 12),), ((6, 10),), False),  # keys 9 and 10 come after query 8
                 (((8, 12),), ((12, 16),), False),  # nothing visible
                 (((8, 12),), ((0, 3),), False)]  # positions for 3 keys, the call has 4
    for q_runs, k_runs, causal in dishonest:
        with pytest.raises(MaskNotExpressible):
            attention_kernel(q, k, v, causal=causal, positions=(q_runs, k_runs))
        with pytest.raises(MaskNotExpressible):
            attention_kernel_backward(q, q, k, v, q, lse, causal=causal, scale=1.0, positions=(q_runs, k_runs))


def test_each_layout_needs_few_kernel_calls():
    """Rank-order keys are sorted before the block is cut: Ulysses' whole sequence is one causal call, a
    head-tail rank over all keys four calls, a ring step after the first one call."""
    from orangetron.parallel.context.calls import Call, plan, sort_runs, spec_runs

    seq, cp = 16, 4
    everything = sort_runs(spec_runs((seq, cp, None)))[0]
    assert plan(everything, everything, True) == [Call(slice(0, 16), slice(0, 16), True)]
    rank1 = spec_runs((seq, cp, 1))  # chunks 1 and 6 of 2 tokens
    assert plan(rank1, everything, True) == [Call(slice(0, 2), slice(0, 2), False),
                                             Call(slice(0, 2), slice(2, 4), True),
                                             Call(slice(2, 4), slice(0, 12), False),
                                             Call(slice(2, 4), slice(12, 14), True)]
    assert plan(rank1, spec_runs((seq, cp, 0)), True) == [Call(slice(0, 4), slice(0, 2), False)]
    assert plan(rank1, spec_runs((seq, cp, 3)), True) == [Call(slice(2, 4), slice(0, 4), False)]
    assert plan(rank1, spec_runs((seq, cp, 3)), False) == [Call(slice(0, 4), slice(0, 4), False)]


@pytest.mark.parametrize("causal", [True, False])
def test_the_seams_backward_equals_autograd_of_plain_attention(causal):
    """`attention_kernel_backward`, both impls, against autograd through plain attention in float64 (GQA)."""
    from orangetron.model.attention import attention_kernel_backward

    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(2, 5, 4, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 5, 2, HEAD_DIM, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    q.requires_grad_()
    scores = q.transpose(1, 2) @ k.repeat_interleave(2, dim=2).transpose(1, 2).transpose(-1, -2) * 0.7
    if causal:
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)  # [B, H, S]
    out = (scores.softmax(-1) @ v.repeat_interleave(2, dim=2).transpose(1, 2)).transpose(1, 2)
    want = torch.autograd.grad(out, (q, k, v), do)
    for impl in ("fused", "reference"):
        got = attention_kernel_backward(do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                        causal=causal, scale=0.7, impl=impl)
        for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{impl} {name}")
