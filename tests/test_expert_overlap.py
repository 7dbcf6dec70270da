"""Overlapped (chunked) ragged dispatch against the plain single-device MoE layer, its ledger counted by hand,
the planner for balanced routing, and the launch order that makes the overlap real.

The reference layer is tests/test_expert_dispatch.py's plain loop over each token's experts. Each rank holds
TOKENS = 7 tokens (2 and 3 chunks do not divide them).
"""

from __future__ import annotations

import pytest
import torch
from test_expert_dispatch import (
    DIM,
    HIDDEN,
    TOKENS,
    _rel,
    expected_ledger,
    layer_on_rank,
    rank_share,
    reference_layer,
)

from orangetron import comm, memory
from orangetron.mesh import MeshGroup, init_mesh
from orangetron.model.moe import GroupedExperts
from orangetron.parallel.config import ParallelConfig, ParallelConfigError
from orangetron.parallel.expert import Dispatcher, run_local_experts
from orangetron.plan.traffic import expert_parallel_records
from orangetron.spec.layout import Layout
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.rules import RuleError
from orangetron.testing import run_distributed

# (experts per rank, top_k, chunks)
CASES = [(2, 2, 2), (2, 3, 3), (1, 1, 3), (3, 2, 2)]


def _records(records) -> list[tuple]:
    return [(r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records]


def overlapped_layer(mesh, local: int, k: int, chunks: int):
    """One overlapped layer pass forward and backward; also the ledger length each expert compute saw."""
    g = mesh["ep"]
    experts = g.size * local
    gate, mine, x, probe, idx, w = rank_share(g, local, k)
    d = Dispatcher(mesh, experts, "ragged", overlap_chunks=chunks)
    launched_before_compute, launched_before_backward = [], []

    def compute(experts, recv_x, recv_idx, recv_w, per_expert):
        launched_before_compute.append(_records(records))
        out = run_local_experts(experts, recv_x, recv_idx, recv_w, per_expert)
        # Fires when this chunk's expert backward begins (its output gradient has arrived).
        out.register_hook(lambda grad: launched_before_backward.append(_records(records)))
        return out

    with comm.measure() as records:
        y = d.dispatch_compute_combine(x, idx, w, mine, compute)
        forward = len(records)
        kept = memory.tensors_kept_on_ctx(y)  # everything kept for backward is visible to the activation meter
        (y * probe[g.rank * TOKENS:(g.rank + 1) * TOKENS]).sum().backward()
    return (y.detach(), x.grad, gate.grad, {n: getattr(mine, n).grad for n in ("w1", "w3", "w2")},
            _records(records), forward, (launched_before_compute, launched_before_backward), kept)


def balanced(mesh, chunks: int, k: int = 2, local: int = 2):
    """Exactly balanced routing in every chunk (2*ep tokens per chunk, token t's slot j on rank (t+j) % ep)."""
    g = mesh["ep"]
    n = 2 * g.size * chunks
    idx = torch.tensor([[((t + j) % g.size) * local + t % local for j in range(k)] for t in range(n)])
    experts = GroupedExperts(local, DIM, HIDDEN).to(torch.float64)
    x = torch.randn(n, DIM, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    d = Dispatcher(mesh, g.size * local, "ragged", overlap_chunks=chunks)
    with comm.measure() as records:
        d.dispatch_compute_combine(x, idx, w, experts).sum().backward()
    return sorted(_records(records))


def extremes(mesh) -> dict[str, torch.Tensor]:
    """Identity experts, 3 chunks: every token to expert 0; rank 0 with no tokens; top_k = experts."""
    g = mesh["ep"]
    experts = 2 * g.size
    x = torch.arange(TOKENS * DIM, dtype=torch.float64).view(TOKENS, DIM) + 100 * g.rank
    d = Dispatcher(mesh, experts, "ragged", overlap_chunks=3)
    identity = lambda _, rows, *rest: rows  # noqa: E731 - each row comes back as it went

    def round_trip(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return d.dispatch_compute_combine(x, idx, torch.ones(idx.shape, dtype=torch.float64), torch.nn.Identity(),
                                          identity)
    empty = TOKENS if g.rank else 0
    return {"one": round_trip(x, torch.zeros(TOKENS, 1, dtype=torch.int64)),
            "empty": round_trip(x[:empty], torch.ones(empty, 2, dtype=torch.int64) * torch.tensor([0, experts - 1])),
            "every": round_trip(x, torch.arange(experts).repeat(TOKENS, 1))}


def all_checks(world: int):
    mesh = init_mesh(Layout(dp=world, ep=world))
    return ([overlapped_layer(mesh, *case) for case in CASES], {c: balanced(mesh, c) for c in (2, 3)},
            extremes(mesh))


def chunk_ranges(chunks: int) -> list[range]:
    base, extra = divmod(TOKENS, chunks)
    sizes = [base + (c < extra) for c in range(chunks)]
    starts = [sum(sizes[:c]) for c in range(chunks)]
    return [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def count_record(world: int, local: int, chunks: int) -> tuple:
    per_peer = 8 * chunks * (1 + local)
    return ("all_to_all", "ep", per_peer * world, per_peer * (world - 1), per_peer * (world - 1))


def hand_ledger(world: int, rank: int, idx: torch.Tensor, local: int, chunks: int) -> list[tuple]:
    """The records counted from the routing: one count exchange of `chunks * (1 + local)` int64 per peer (per
    chunk, the rows and the assignments to each of the peer's experts), then per chunk the rows (one per token
    and destination rank) of x, ids and weights, the combine, and their backward."""
    row, ids = DIM * 8, idx.shape[1] * 8  # float64 rows, int64 ids
    wts = ids  # float64 weights
    recs = [count_record(world, local, chunks)]
    for part in chunk_ranges(chunks):
        rows = [[0] * world for _ in range(world)]  # rows[s][r]: rank s's chunk tokens with a slot on rank r
        for s in range(world):
            for t in part:
                for r in {int(e) // local for e in idx[s * TOKENS + t]}:
                    rows[s][r] += 1
        send, recv = rows[rank], [rows[s][rank] for s in range(world)]
        out_s = sum(n for r, n in enumerate(send) if r != rank)
        in_r = sum(n for s, n in enumerate(recv) if s != rank)
        for per_row in (row, ids, wts, row):  # dispatch's three tensors, combine's backward
            recs.append(("all_to_all", "ep", sum(send) * per_row, out_s * per_row, in_r * per_row))
        for per_row in (row, wts, row):  # dispatch's backward (x and weights), combine
            recs.append(("all_to_all", "ep", sum(recv) * per_row, in_r * per_row, out_s * per_row))
    return sorted(recs)


_RESULTS: dict[int, list] = {}


def run(world: int) -> list:
    """One launch per world size serves every test of this file."""
    if world not in _RESULTS:
        _RESULTS[world] = run_distributed(all_checks, world, args=(world,))
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_dispatch_equals_one_device_and_counted_routing(world):
    results = run(world)
    for i, (local, k, chunks) in enumerate(CASES):
        where = f"ep={world} local={local} k={k} chunks={chunks}"
        y, x_grad, grads, idx, _ = reference_layer(world, "ragged", local, k, 1.0, "probs")
        gate_grad = sum(r[0][i][2] for r in results)
        assert _rel(gate_grad, grads["gate"]) < 1e-9, where
        for rank, (layers, _, _) in enumerate(results):
            y_r, xg_r, _, expert_grads, ledger, forward, _, kept = layers[i]
            assert kept == [], f"{where} rank {rank}"
            mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
            assert _rel(y_r, y[mine]) < 1e-9, f"{where} rank {rank} output"
            assert _rel(xg_r, x_grad[mine]) < 1e-9, f"{where} rank {rank} input grad"
            for name, g in expert_grads.items():
                assert _rel(g, grads[name][rank * local:(rank + 1) * local]) < 1e-9, f"{where} rank {rank} {name}"
            assert sorted(ledger) == hand_ledger(world, rank, idx, local, chunks), f"{where} rank {rank}"
            # Chunking moves the same rows as the serial dispatch: equal bytes once the count exchange is set aside.
            serial = expected_ledger(world, rank, "ragged", idx, local, 1.0, None)
            serial.remove(count_record(world, local, 1))  # its counts
            assert ledger[0] == count_record(world, local, chunks), f"{where} rank {rank}: counts first"
            for column in (2, 3, 4):
                assert sum(r[column] for r in ledger[1:]) == sum(r[column] for r in serial), f"{where} rank {rank}"
            assert forward == 1 + 4 * chunks, f"{where} rank {rank}: forward records"


@pytest.mark.parametrize("world", [2, 4])
def test_next_chunk_is_in_flight_while_a_chunk_computes(world):
    """Launch order, not time. Forward: before chunk c's experts run, chunk c+1's three all-to-alls have been
    started (and every earlier chunk's combine). Backward: before chunk c's experts' backward runs, chunk
    c+1's output gradients are on their way (and every earlier chunk's input gradients)."""
    results = run(world)
    for i, (_, _, chunks) in enumerate(CASES):
        for rank, (layers, _, _) in enumerate(results):
            ledger, forward, (seen, seen_backward) = layers[i][4], layers[i][5], layers[i][6]
            where = f"ep={world} chunks={chunks} rank {rank}"
            assert len(seen) == len(seen_backward) == chunks, where
            for c, before in enumerate(seen):
                started = 1 + 3 * min(c + 2, chunks) + c  # counts, dispatches, combines
                assert before == ledger[:started], f"{where} forward chunk {c}"
            for c, before in enumerate(seen_backward):
                started = forward + min(c + 2, chunks) + 2 * c  # output grads out; rows' and weights' grads home
                assert before == ledger[:started], f"{where} backward chunk {c}"


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_chunked_routing_equals_the_planner(world):
    results = run(world)
    spec = ModelSpec(name="t", hidden_size=DIM, num_layers=1, num_heads=1, vocab_size=8, num_experts=2 * world,
                     top_k=2, moe_ffn_hidden_size=HIDDEN)
    for chunks in (2, 3):
        job = Job(seq_len=2 * world * chunks, param_dtype="float64", ep_overlap_chunks=chunks)
        want = sorted(_records(expert_parallel_records(spec, Degrees(dp=world, ep=world), job)))
        for rank, (_, planned, _) in enumerate(results):
            assert planned[chunks] == want, f"ep={world} chunks={chunks} rank {rank}"


@pytest.mark.parametrize(("tokens", "chunks"), [(16, 1), (16, 3), (16, 16), (15, 1), (15, 4)])
def test_chunks_send_the_serial_rows_however_few_each_holds(tokens, chunks):
    """Every token is one row per destination rank in whichever chunk holds it, so the chunks together send the
    serial dispatch's rows (counted here by hand) and only the count exchange grows with them. (Each chunk's rows
    were rounded down to a multiple of ep: 3 chunks of 16 tokens at ep 4 priced 12.5% too few bytes, 16 chunks
    none but the counts.)"""
    hidden, experts, k, ep = 8, 8, 2, 4
    spec = ModelSpec(name="t", hidden_size=hidden, num_layers=1, num_heads=1, vocab_size=8, num_experts=experts,
                     top_k=k, moe_ffn_hidden_size=4)
    job = Job(seq_len=tokens, param_dtype="float64", ep_overlap_chunks=chunks)
    records = expert_parallel_records(spec, Degrees(dp=ep, ep=ep), job)
    row, ids, weights = 8 * hidden, 8 * k, 8 * k
    per_row = 4 * row + ids + 2 * weights  # forward: x, ids, weights, combine; backward: x, weights, combine
    counts = 8 * ep * chunks * (1 + experts // ep)
    assert sum(r.payload_bytes for r in records) == tokens * min(k, ep) * per_row + counts
    assert len(records) == 1 + 7 * chunks


EP8 = [("ragged", 1, 2), ("allgather", 1, 2)]  # (mode, experts per rank, top_k): 8 experts


def ep8_checks():
    mesh = init_mesh(Layout(dp=8, ep=8))
    serial = [layer_on_rank(mesh, mode, local, k, 1.0, "probs") for mode, local, k in EP8]
    return serial, overlapped_layer(mesh, 1, 2, 3)


def test_ep8_layer_equals_one_device():
    """ep = 8 in one launch: ragged, all-gather and overlapped (3 chunks) against the plain layer."""
    results = run_distributed(ep8_checks, 8)
    cases = [(mode, i, mode) for i, (mode, _, _) in enumerate(EP8)] + [("overlapped ragged", None, "ragged")]
    for where, i, mode in cases:
        y, x_grad, grads, idx, _ = reference_layer(8, mode, 1, 2, 1.0, "probs")
        per_rank = [r[0][i] if i is not None else r[1] for r in results]
        assert _rel(sum(r[2] for r in per_rank), grads["gate"]) < 1e-9, where
        for rank, r in enumerate(per_rank):
            mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
            assert _rel(r[0], y[mine]) < 1e-9, f"{where} rank {rank} output"
            assert _rel(r[1], x_grad[mine]) < 1e-9, f"{where} rank {rank} input grad"
            for name, g in r[3].items():
                assert _rel(g, grads[name][rank:rank + 1]) < 1e-9, f"{where} rank {rank} {name}"
        if i is None:
            for rank, r in enumerate(per_rank):
                assert sorted(r[4]) == hand_ledger(8, rank, idx, 1, 3), f"{where} rank {rank} ledger"


@pytest.mark.parametrize("world", [2, 4])
def test_extreme_routing_round_trips(world):
    """combine(dispatch(x)) with identity experts is x times its number of destination ranks, in 3 chunks."""
    for rank, (_, _, out) in enumerate(run(world)):
        x = torch.arange(TOKENS * DIM, dtype=torch.float64).view(TOKENS, DIM) + 100 * rank
        assert torch.equal(out["one"], x), f"rank {rank}"
        assert torch.equal(out["every"], x * world), f"rank {rank}"
        assert torch.equal(out["empty"], x[:TOKENS if rank else 0] * 2), f"rank {rank}"  # experts on ranks 0, last


def test_overlap_configuration_errors():
    group = MeshGroup("ep", None, (0, 1), 0)
    with pytest.raises(ParallelConfigError, match=r"overlap_chunks=0: must be a positive integer"):
        Dispatcher(group, 4, overlap_chunks=0)
    with pytest.raises(RuleError, match=r"overlap_chunks=2 with dispatcher='allgather'"):
        Dispatcher(group, 4, mode="allgather", overlap_chunks=2)
    with pytest.raises(RuleError, match=r"ep_overlap_chunks=2 with dispatcher='capacity'"):
        ParallelConfig(dispatcher="capacity", ep_overlap_chunks=2)
    with pytest.raises(ParallelConfigError, match=r"ep_overlap_chunks=0: must be a positive integer"):
        ParallelConfig(ep_overlap_chunks=0)
