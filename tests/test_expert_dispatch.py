"""Expert-parallel dispatch and combine against a plain single-device MoE layer, and DeepEP's invariants.

The reference is written here with plain torch ops (a loop over each token's experts), never with the code
under test. Every rank of one launch per world size runs every check; the ranks hold disjoint token slices
of one batch and the experts in contiguous blocks.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from orangetron import comm
from orangetron.mesh import init_mesh
from orangetron.model.moe import GroupedExperts
from orangetron.parallel.config import ParallelConfigError
from orangetron.parallel.expert import Dispatcher, run_local_experts
from orangetron.plan.traffic import expert_parallel_records
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.rules import RuleError
from orangetron.testing import run_distributed

DIM, HIDDEN, TOKENS = 6, 5, 7  # tokens per rank (odd on purpose)
# (mode, experts per rank, top_k, capacity_factor, drop_policy)
CASES = [("ragged", 2, 2, 1.0, "probs"), ("allgather", 2, 2, 1.0, "probs"), ("ragged", 1, 1, 1.0, "probs"),
         ("allgather", 3, 3, 1.0, "probs"), ("capacity", 2, 2, 64.0, "probs"),
         ("capacity", 2, 2, 0.5, "probs"), ("capacity", 2, 3, 0.7, "position")]


def weights(experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(experts, DIM, generator=g, dtype=torch.float64),
            "w1": torch.randn(experts, DIM, HIDDEN, generator=g, dtype=torch.float64) * 0.3,
            "w3": torch.randn(experts, DIM, HIDDEN, generator=g, dtype=torch.float64) * 0.3,
            "w2": torch.randn(experts, HIDDEN, DIM, generator=g, dtype=torch.float64) * 0.3}


def tokens(world: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * TOKENS, DIM, generator=g, dtype=torch.float64)
    return x, torch.randn(world * TOKENS, DIM, generator=g, dtype=torch.float64)  # inputs, output probe


def route(x: torch.Tensor, gate: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (x @ gate.t()).softmax(-1)
    idx = torch.topk(scores.detach(), k, dim=-1).indices
    return idx, scores.gather(-1, idx)


# ---- the plain reference --------------------------------------------------------------------------
def kept_reference(idx: torch.Tensor, w: torch.Tensor, experts: int, factor: float, policy: str) -> torch.Tensor:
    """Per expert, the first `capacity` assignments in the policy's order (loops over plain lists)."""
    t, k = idx.shape
    cap = math.ceil(t * k / experts * factor)
    keep = torch.zeros(t, k, dtype=torch.bool)
    for e in range(experts):
        slots = [(i, j) for i in range(t) for j in range(k) if idx[i, j] == e]
        if policy == "probs":
            slots.sort(key=lambda s: -w[s].item())  # sort is stable: ties keep token order
        for i, j in slots[:cap]:
            keep[i, j] = True
    return keep


def reference_layer(world: int, mode: str, local: int, k: int, factor: float, policy: str):
    """Outputs, input, gate and expert gradients of the whole batch on one device."""
    experts = world * local
    p = {n: t.clone().requires_grad_() for n, t in weights(experts).items()}
    x, probe = tokens(world)
    x.requires_grad_()
    idx, w = route(x, p["gate"], k)
    keep = torch.ones_like(idx, dtype=torch.bool)
    if mode == "capacity":  # each rank drops among its own tokens
        keep = torch.cat([kept_reference(idx[r * TOKENS:(r + 1) * TOKENS], w[r * TOKENS:(r + 1) * TOKENS].detach(),
                                         experts, factor, policy) for r in range(world)])
    y = torch.zeros_like(x)
    rows = []
    for t in range(x.shape[0]):
        out = torch.zeros(DIM, dtype=torch.float64)
        for j in range(k):
            if keep[t, j]:
                e = idx[t, j]
                h = F.silu(x[t] @ p["w1"][e]) * (x[t] @ p["w3"][e])
                out = out + w[t, j] * (h @ p["w2"][e])
        rows.append(out)
    y = torch.stack(rows)
    (y * probe).sum().backward()
    dropped = [torch.bincount(idx[r * TOKENS:(r + 1) * TOKENS][~keep[r * TOKENS:(r + 1) * TOKENS]],
                              minlength=experts) for r in range(world)]
    return y.detach(), x.grad, {n: t.grad for n, t in p.items()}, idx, dropped


# ---- the ranks ------------------------------------------------------------------------------------
def rank_share(g, local: int, k: int):
    """This ep rank's inputs: the router gate, its block of experts, its tokens and their routing."""
    full = weights(g.size * local)
    gate = full["gate"].clone().requires_grad_()
    mine = GroupedExperts(local, DIM, HIDDEN).to(torch.float64)
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            getattr(mine, name).copy_(full[name][g.rank * local:(g.rank + 1) * local])
    x_all, probe = tokens(g.size)
    x = x_all[g.rank * TOKENS:(g.rank + 1) * TOKENS].clone().requires_grad_()
    idx, w = route(x, gate, k)
    return gate, mine, x, probe, idx, w


def layer_on_rank(mesh, mode: str, local: int, k: int, factor: float, policy: str):
    g = mesh["ep"]
    experts = g.size * local
    gate, mine, x, probe, idx, w = rank_share(g, local, k)
    d = Dispatcher(mesh, experts, mode, capacity_factor=factor, drop_policy=policy)
    with comm.measure() as records:
        recv_x, recv_idx, recv_w, per_expert, handle = d.dispatch(x, idx, w)
        counts = handle.tokens_per_expert  # the group sizes, read on the host with the row counts
        y = d.combine(run_local_experts(mine, recv_x, recv_idx, recv_w, counts), handle)
        (y * probe[g.rank * TOKENS:(g.rank + 1) * TOKENS]).sum().backward()
    dropped = handle.dropped if mode == "capacity" else None
    ledger = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records)
    return (y.detach(), x.grad, gate.grad, {n: getattr(mine, n).grad for n in ("w1", "w3", "w2")},
            per_expert, dropped, ledger, counts)


def round_trip(mesh, mode: str, x: torch.Tensor, idx: torch.Tensor, experts: int):
    """combine(dispatch(x)) with the experts' outputs set to the received rows; and the received counts."""
    d = Dispatcher(mesh, experts, mode, capacity_factor=1e6)
    recv_x, _, _, per_expert, handle = d.dispatch(x, idx, torch.ones(idx.shape, dtype=torch.float64))
    return d.combine(recv_x, handle), per_expert


def extremes(mesh):
    """Every token to one expert; a rank with no tokens; top_k = experts. Returns results per case."""
    g = mesh["ep"]
    experts = 2 * g.size
    x = torch.arange(TOKENS * DIM, dtype=torch.float64).view(TOKENS, DIM) + 100 * g.rank
    one = torch.zeros(TOKENS, 1, dtype=torch.int64)
    every = torch.arange(experts).repeat(TOKENS, 1)
    empty = TOKENS if g.rank else 0  # rank 0 routes nothing
    out = {}
    for mode in ("ragged", "capacity", "allgather"):
        out[mode, "one"] = round_trip(mesh, mode, x, one, experts)
        out[mode, "empty"] = round_trip(mesh, mode, x[:empty], (every[:empty, :2] + 1) % experts, experts)
        out[mode, "every"] = round_trip(mesh, mode, x, every, experts)
    return out


def errors(mesh):
    d = Dispatcher(mesh, 4 * mesh["ep"].size)
    x, idx = torch.zeros(3, DIM), torch.tensor([[0], [4 * mesh["ep"].size], [1]])
    try:
        d.dispatch(x, idx, torch.ones(3, 1))
    except ValueError as err:
        return str(err)
    return None


def balanced(mesh, k: int = 2, local: int = 2):
    """Exactly balanced routing: token t's slot j on rank (t + j) % ep; one layer pass per mode, its ledger."""
    g = mesh["ep"]
    n = 2 * g.size
    idx = torch.tensor([[((t + j) % g.size) * local + t % local for j in range(k)] for t in range(n)])
    experts = GroupedExperts(local, DIM, HIDDEN).to(torch.float64)
    out = {}
    for mode, factor in (("ragged", 1.0), ("capacity", 1.5), ("allgather", 1.0)):
        x = torch.randn(n, DIM, dtype=torch.float64, requires_grad=True)
        w = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
        d = Dispatcher(mesh, g.size * local, mode, capacity_factor=factor)
        with comm.measure() as records:
            recv_x, recv_idx, recv_w, per_expert, handle = d.dispatch(x, idx, w)
            d.combine(run_local_experts(experts, recv_x, recv_idx, recv_w, per_expert), handle).sum().backward()
        out[mode] = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records)
    return out


def all_checks(world: int):
    mesh = init_mesh(Layout(dp=world, ep=world))
    layers = [layer_on_rank(mesh, *case) for case in CASES]
    return layers, extremes(mesh), errors(mesh), balanced(mesh)


# ---- the tests ------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def expected_ledger(world: int, rank: int, mode: str, idx: torch.Tensor, local: int, factor: float,
                    keep: torch.Tensor | None) -> list[tuple]:
    """The records of one dispatch, expert pass and combine, forward and backward, counted from the routing."""
    k, row, ids, wts = idx.shape[1], DIM * 8, idx.shape[1] * 8, idx.shape[1] * 8  # float64, int64 ids
    experts = world * local
    if mode == "allgather":
        n = world
        share = lambda full: full * (n - 1) // n  # noqa: E731 - (n-1)/n of the gathered tensor
        counts = 8 * n * (1 + n + experts)  # per rank: its tokens, rows per rank, assignments per expert
        recs = [("all_gather", "ep", counts, share(counts), share(counts))]
        for per_token in (row, ids, wts):
            full = n * TOKENS * per_token
            recs.append(("all_gather", "ep", full, share(full), share(full)))
        for per_token in (row, wts, row):  # backward of x and weights, combine's reduce-scatter
            full = n * TOKENS * per_token
            recs.append(("reduce_scatter", "ep", full, share(full), share(full)))
        full = n * TOKENS * row  # combine's backward
        recs.append(("all_gather", "ep", full, share(full), share(full)))
        return sorted(recs)
    # rows[s][r]: tokens of rank s with a (kept) slot on rank r
    rows = [[0] * world for _ in range(world)]
    for s in range(world):
        for t in range(s * TOKENS, (s + 1) * TOKENS):
            for r in {int(e) // local for j, e in enumerate(idx[t]) if keep is None or keep[t, j]}:
                rows[s][r] += 1
    if mode == "capacity":
        cap = math.ceil(TOKENS * k / experts * factor)
        rows = [[min(local * cap, TOKENS)] * world for _ in range(world)]
    send = rows[rank]
    recv = [rows[s][rank] for s in range(world)]
    out_s = sum(n for r, n in enumerate(send) if r != rank)
    in_r = sum(n for s, n in enumerate(recv) if s != rank)

    def a2a(per_row: int, forward: bool) -> tuple:
        if forward:
            return ("all_to_all", "ep", sum(send) * per_row, out_s * per_row, in_r * per_row)
        return ("all_to_all", "ep", sum(recv) * per_row, in_r * per_row, out_s * per_row)
    per_peer = 8 * (1 + local)  # its rows, then the assignments to each of its local experts
    counts = ("all_to_all", "ep", per_peer * world, per_peer * (world - 1), per_peer * (world - 1))
    recs = [counts, a2a(row, True), a2a(ids, True), a2a(wts, True),  # dispatch
            a2a(row, False), a2a(wts, False),  # its backward: x and weight gradients go home
            a2a(row, False), a2a(row, True)]  # combine and its backward
    return sorted(recs)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_combine_equal_one_device(world):
    results = run_distributed(all_checks, world, args=(world,))
    for i, (mode, local, k, factor, policy) in enumerate(CASES):
        where = f"ep={world} {mode} local={local} k={k} factor={factor} {policy}"
        y, x_grad, grads, idx, dropped = reference_layer(world, mode, local, k, factor, policy)
        keep = None
        if mode == "capacity":
            keep = torch.cat([kept_reference(idx[r * TOKENS:(r + 1) * TOKENS],
                                             route(tokens(world)[0], weights(world * local)["gate"], k)[1]
                                             [r * TOKENS:(r + 1) * TOKENS], world * local, factor, policy)
                              for r in range(world)])
        gate_grad = sum(r[0][i][2] for r in results)
        assert _rel(gate_grad, grads["gate"]) < 1e-9, where
        for rank, (layers, _, _, _) in enumerate(results):
            y_r, xg_r, _, expert_grads, per_expert, dropped_r, ledger, counts = layers[i]
            mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
            assert _rel(y_r, y[mine]) < 1e-9, f"{where} rank {rank} output"
            assert _rel(xg_r, x_grad[mine]) < 1e-9, f"{where} rank {rank} input grad"
            for name, g in expert_grads.items():
                ref = grads[name][rank * local:(rank + 1) * local]
                assert _rel(g, ref) < 1e-9, f"{where} rank {rank} {name} grad"
            # received (token, local expert) pairs: the whole batch's kept assignments to this rank's block
            kept_idx = idx if keep is None else idx[keep]
            want = torch.bincount(kept_idx.reshape(-1), minlength=world * local)[rank * local:(rank + 1) * local]
            assert per_expert.tolist() == want.tolist(), f"{where} rank {rank} tokens_per_expert"
            assert counts == want.tolist(), f"{where} rank {rank}: the group sizes read with the row counts"
            if mode == "capacity":
                assert dropped_r.tolist() == dropped[rank].tolist(), f"{where} rank {rank} dropped"
                if factor < 1:
                    assert sum(dropped[rank].tolist()) > 0, f"{where}: the small factor must drop something"
            assert ledger == expected_ledger(world, rank, mode, idx, local, factor, keep), f"{where} rank {rank}"


def _copies(idx: torch.Tensor, local: int) -> torch.Tensor:
    return torch.tensor([len({int(e) // local for e in row}) for row in idx], dtype=torch.float64)


@pytest.mark.parametrize("world", [2, 4])
def test_round_trip_extreme_routing_and_errors(world):
    results = run_distributed(all_checks, world, args=(world,))
    experts = 2 * world
    every = torch.arange(experts).repeat(TOKENS, 1)
    for rank, (_, extreme, error, _) in enumerate(results):
        assert error == f"dispatch: expert id {experts * 2} is out of range [0, num_experts={experts * 2})"
        x = torch.arange(TOKENS * DIM, dtype=torch.float64).view(TOKENS, DIM) + 100 * rank
        for mode in ("ragged", "capacity", "allgather"):
            y, per_expert = extreme[mode, "one"]  # every token of every rank to expert 0
            assert torch.equal(y, x), f"{mode} rank {rank}"
            assert per_expert.tolist() == ([world * TOKENS, 0] if rank == 0 else [0, 0])
            y, per_expert = extreme[mode, "every"]  # top_k = experts: a copy on every rank
            assert torch.equal(y, x * world), f"{mode} rank {rank}"
            assert per_expert.tolist() == [world * TOKENS] * 2
            y, per_expert = extreme[mode, "empty"]  # rank 0 routes nothing
            idx = (every[:, :2] + 1) % experts
            assert torch.equal(y, x[:TOKENS if rank else 0] * _copies(idx, 2)[:TOKENS if rank else 0, None])
            n = (world - 1) * TOKENS  # every token asks for experts 1 (rank 0) and 2 (rank 1)
            assert per_expert.tolist() == {0: [0, n], 1: [n, 0]}.get(rank, [0, 0]), f"{mode} rank {rank}"


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_routing_equals_the_planner(world):
    """With exactly balanced routing the measured records are `plan.traffic.expert_parallel_records`."""
    results = run_distributed(all_checks, world, args=(world,))
    spec = ModelSpec(name="t", hidden_size=DIM, num_layers=1, num_heads=1, vocab_size=8, num_experts=2 * world,
                     top_k=2, moe_ffn_hidden_size=HIDDEN)
    for mode, factor in (("ragged", 1.0), ("capacity", 1.5), ("allgather", 1.0)):
        job = Job(seq_len=2 * world, param_dtype="float64", dispatcher=mode, capacity_factor=factor)
        want = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received)
                      for r in expert_parallel_records(spec, Degrees(dp=world, ep=world), job))
        for rank, per_rank in enumerate(results):
            assert per_rank[3][mode] == want, f"{mode} rank {rank}"


def test_dispatcher_configuration_errors():
    from orangetron.mesh import MeshGroup
    group = MeshGroup("ep", None, (0, 1), 0)
    with pytest.raises(ParallelConfigError, match=r"num_experts=3: must be a positive multiple of ep=2"):
        Dispatcher(group, 3)
    with pytest.raises(RuleError, match=r"dispatcher='dense': must be one of ragged, capacity, allgather$"):
        Dispatcher(group, 4, mode="dense")
    with pytest.raises(ParallelConfigError, match=r"capacity_factor=0: must be positive and finite"):
        Dispatcher(group, 4, mode="capacity", capacity_factor=0)
    with pytest.raises(ParallelConfigError, match=r"capacity_factor=inf: must be positive and finite"):
        Dispatcher(group, 4, mode="capacity", capacity_factor=float("inf"))


def test_a_huge_capacity_factor_keeps_every_token_instead_of_overflowing():
    """`--capacity-factor 1e300`, a way to ask that nothing drop, overflowed the int64 compare of each
    assignment's place in its expert against the slots (a rank died mid-step); an expert takes each token once
    at most, so its slots stop at the tokens, in the runtime and the planner alike."""
    from orangetron.parallel.expert.capacity import capacity, kept_slots
    from orangetron.spec.dispatchers import capacity_slots

    assert capacity(10, 2, 4, 1e300) == 10 and capacity(10, 2, 4, 1.0) == 5 and capacity(10, 2, 4, 1.5) == 8
    assert capacity(4096, 8, 128, sys.float_info.max) == 4096  # not multiplied out: 1e305 overflowed
    spec = ModelSpec(name="t", hidden_size=DIM, num_layers=1, num_heads=1, vocab_size=8, num_experts=4, top_k=2,
                     moe_ffn_hidden_size=HIDDEN)
    assert capacity_slots(spec, 10, Job(seq_len=8, capacity_factor=1e300)) == 10
    assert capacity_slots(spec, 10, Job(seq_len=8, capacity_factor=1.5)) == 8
    idx = torch.tensor([[0, 1]] * 10)
    keep = kept_slots(idx, torch.rand(10, 2), 4, capacity(10, 2, 4, 1e300), "probs")
    assert bool(keep.all())
    # The planner's padded expert rows stop where the slots do: from num_experts / top_k up, one price.
    from orangetron.plan.timing import step_time
    from orangetron.spec.hardware import make_cluster
    from orangetron.spec.model import load_model

    mixtral, cluster, deg = load_model("mixtral-8x7b"), make_cluster("h100", 8), Degrees(dp=8, ep=8)
    times = [step_time(mixtral, deg, Job(seq_len=4096, dispatcher="capacity", capacity_factor=f), cluster).step_s
             for f in (2.0, 4.0, 8.0, 1e300, sys.float_info.max)]
    assert times[0] < times[1] == times[2] == times[3] == times[4]
