"""Pipeline transfers under the rules of a backend that matches point-to-point calls in posting order (NCCL).

The executor's sends and receives are recorded as they are posted (`comm.trace_p2p`) on real gloo ranks at
pp 2, for every schedule the runtime runs, training and forward-only, and replayed by
`spec.rendezvous.replay`: every rank must reach its last call. The same executor runs offline, one rank at a
time with torch's point-to-point calls stubbed out (a rank's posting order depends only on its own action
list), posting exactly what the gloo ranks posted; that is how pp 2 to 8 with fewer, as many and more
micro-batches than stages are replayed without processes. The obvious order (each send right after the pass
that produced it, each receive right before the pass that needs it), built here from the action lists, must
stall at pp 2 with 4 micro-batches under 1F1B, so the replay is shown to catch the order it guards against.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from orangetron import comm
from orangetron.comm import P2PCall
from orangetron.mesh import MeshGroup, init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.parallel.pipeline import Chunk, MicroBatch, run_pipeline
from orangetron.spec.layout import Layout
from orangetron.spec.rendezvous import RendezvousError, replay
from orangetron.spec.schedule import actions
from orangetron.spec.transfers import transfer_order
from orangetron.spec.variants import SCHEDULES
from orangetron.testing import run_distributed

SEQ = 4


def _cases(pp: int) -> list[tuple[str, int, int]]:
    """(schedule, virtual stages, micro-batches) for every schedule the runtime runs."""
    cases = []
    for name in SCHEDULES.names(runtime=True):
        v = 2 if SCHEDULES[name].chunks else 1
        cases += [(name, v, m) for m in sorted({pp, 2 * pp, 4})
                  if not (SCHEDULES[name].chunks and m % pp)]
    return cases


def _microbatches(m: int, vocab: int) -> list[MicroBatch]:
    rows = torch.randint(0, vocab, (m, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [MicroBatch(r[:, :-1], r[:, 1:], torch.arange(SEQ), None, 1 / m, 1 / m) for r in rows.split(1)]


def trace_cases(pp: int) -> list[list[tuple]]:
    """On this rank: the calls posted by one training step and one forward-only pass of every case."""
    traces = []
    for name, v, m in _cases(pp):
        cfg = ModelConfig(dim=8, n_layers=2 * pp, n_heads=2, n_kv_heads=1, vocab_size=16, ffn_dim=8)
        pc = ParallelConfig(pp_schedule=name, virtual_stages=v, microbatches=m)
        model = parallelize(Transformer(cfg, seed=0), init_mesh(Layout(pp=pp)), pc)
        for train in (True, False):
            with comm.trace_p2p() as calls:
                run_pipeline(model, _microbatches(m, cfg.vocab_size), name, v, train=train)
            traces.append([tuple(vars(c).values()) for c in calls])
    return traces


def test_every_schedule_posts_transfers_that_cannot_stall(monkeypatch):
    pp = 2
    per_rank = run_distributed(trace_cases, pp, args=(pp,), timeout=300)
    labels = [(name, v, m, train) for name, v, m in _cases(pp) for train in (True, False)]
    for i, (name, v, m, train) in enumerate(labels):
        calls = [[P2PCall(*c) for c in rank[i]] for rank in per_rank]
        assert all(calls), f"{name, v, m, train}: a rank posted nothing"
        replay(calls)  # raises RendezvousError naming the stalled batches
        # The offline driver below posts what the real ranks posted, so its replays at pp 3..8 speak for them.
        offline = offline_trace(pp, m, name, v, train, monkeypatch)
        assert [[_unsized(c) for c in rank] for rank in offline] == [[_unsized(c) for c in rank] for rank in calls]


def _unsized(call: P2PCall) -> tuple[int, str, int, int]:
    return call.batch, call.op, call.peer, call.tag


def _obvious_order(pp: int, m: int, schedule: str, v: int) -> list[list[P2PCall]]:
    """Each send right after the pass that produced it, each receive right before the pass that needs it."""
    calls: list[list[P2PCall]] = [[] for _ in range(pp)]
    last = v * pp - 1

    def post(rank: int, op: str, peer_stage: int, tag: tuple) -> None:
        calls[rank].append(P2PCall(len(calls[rank]), op, peer_stage % pp, hash(tag), 8))

    for rank, plan in enumerate(actions(pp, m, schedule, v)):
        for act in plan:
            g, i = act.chunk * pp + rank, act.microbatch
            if act.kind == "F" and g > 0:
                post(rank, "recv", g - 1, (g - 1, i, "F"))
            if act.kind == "B" and g < last:
                post(rank, "recv", g + 1, (g, i, "B"))
            if act.kind == "F" and g < last:
                post(rank, "send", g + 1, (g, i, "F"))
            if act.kind == "B" and g > 0:
                post(rank, "send", g - 1, (g - 1, i, "B"))
    return calls


def test_the_obvious_order_stalls_where_the_executor_does_not():
    with pytest.raises(RendezvousError, match="stalled: rank 0 batch 1: send peer 1"):
        replay(_obvious_order(2, 4, "1f1b", 1))
    replay(_obvious_order(2, 4, "gpipe", 1))  # no backward overlaps a forward: nothing crosses


def _call(batch: int, op: str, peer: int, tag: int, nbytes: int = 8) -> P2PCall:
    return P2PCall(batch, op, peer, tag, nbytes)


def test_replay_follows_posting_order_not_tags():
    # Two ranks each post a send, then a receive, one call at a time: both wait in their send.
    crossed = [[_call(0, "send", 1, 1), _call(1, "recv", 1, 2)], [_call(0, "send", 0, 2), _call(1, "recv", 0, 1)]]
    with pytest.raises(RendezvousError, match="rank 0 batch 0: send peer 1 tag 1"):
        replay(crossed)
    # Batched, each call meets its match while both batches are under way.
    replay([[_call(0, "send", 1, 1), _call(0, "recv", 1, 2)], [_call(0, "send", 0, 2), _call(0, "recv", 0, 1)]])
    # A chain: rank 0's second send meets rank 1's receive in a batch that waits on rank 2.
    replay([[_call(0, "send", 1, 1), _call(1, "send", 1, 2)],
            [_call(0, "recv", 0, 1), _call(1, "send", 2, 3), _call(1, "recv", 0, 2)],
            [_call(0, "recv", 1, 3)]])


def test_replay_refuses_calls_that_meet_the_wrong_message():
    # The first send meets the first receive whatever the tags say: a backend that ignores tags mixes them up.
    swapped = [[_call(0, "send", 1, 1), _call(1, "send", 1, 2)], [_call(0, "recv", 0, 2), _call(0, "recv", 0, 1)]]
    with pytest.raises(RendezvousError, match="meets tag 2"):
        replay(swapped)
    with pytest.raises(RendezvousError, match="has no match"):
        replay([[_call(0, "send", 1, 1)], []])
    with pytest.raises(RendezvousError, match="of 4 bytes"):
        replay([[_call(0, "send", 1, 1)], [_call(0, "recv", 0, 1, nbytes=4)]])


# ---- offline: the executor's own calls at every pp from 2 to 8, without processes ----------------------------


class _Model:
    """The part of a `ParallelModel` `run_pipeline` reads, on pipeline rank `rank` of `pp`: each chunk multiplies
    its input by one weight (tokens become ones), so autograd runs every backward the schedule asks for."""

    def __init__(self, pp: int, rank: int, v: int) -> None:
        self.mesh = {"pp": MeshGroup("pp", None, tuple(range(pp)), rank)}
        self.weight = torch.ones((), dtype=torch.float64, requires_grad=True)
        self.device = torch.device("cpu")
        self.pipeline_chunks = [Chunk(c * pp + rank, c, (), c * pp + rank == 0, c * pp + rank == v * pp - 1)
                                for c in range(v)]
        self.module = SimpleNamespace(parameters=lambda: iter([self.weight]), cfg=SimpleNamespace(hidden_size=2),
                                      io=SimpleNamespace(hidden_len=lambda s: s),
                                      cross_entropy=lambda out, labels, ignore_index: out.sum())

    def run(self, fn, module, chunk, x, positions, mask, documents=None):
        h = x if x.is_floating_point() else torch.ones((*x.shape, 2), dtype=torch.float64)
        return h * self.weight, None

    def no_sync(self):
        return nullcontext()


def offline_trace(pp: int, m: int, schedule: str, v: int, train: bool, monkeypatch) -> list[list[P2PCall]]:
    """Every rank's calls, as `run_pipeline` posts them through `comm.post_p2p` and `comm.trace_p2p` records them,
    with torch's point-to-point calls replaced by nothing: a rank's posting order depends only on its own actions
    (a receive returns an empty buffer of the right shape)."""
    monkeypatch.setattr(comm.dist, "P2POp", lambda op, x, peer, group, tag: (op, x, peer, tag))
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: [])
    calls = []
    for rank in range(pp):
        with comm.trace_p2p() as posted:
            run_pipeline(_Model(pp, rank, v), _microbatches(m, 16), schedule, v, train=train)
        calls.append(posted)
    comm.reset_ledger()  # thousands of records no test here reads: later tests in this process start from empty
    return calls


def _offline_cases(pp: int) -> list[tuple[str, int, int]]:
    """(schedule, virtual stages, micro-batches): fewer, as many and more micro-batches than stages."""
    cases = []
    for name in SCHEDULES.names(runtime=True):
        if SCHEDULES[name].chunks:
            cases += [(name, v, m) for v in (2, 3) for m in (pp, 2 * pp, 3 * pp)]
        else:
            cases += [(name, 1, m) for m in sorted({1, 2, 3, pp - 1, pp, pp + 1, 2 * pp})]
    return cases


def _calls_per_rank(pp: int, rank: int, m: int, v: int, train: bool) -> int:
    """Per micro-batch and direction, each virtual stage receives unless it is the first and sends unless it
    is the last; a forward-only pass has no backward transfers."""
    stages = [c * pp + rank for c in range(v)]
    return m * (2 if train else 1) * sum((g > 0) + (g < v * pp - 1) for g in stages)


def test_the_executor_posts_transfers_that_cannot_stall_at_every_pp(monkeypatch):
    for pp in range(2, 9):
        for name, v, m in _offline_cases(pp):
            for train in (True, False):
                calls = offline_trace(pp, m, name, v, train, monkeypatch)
                assert [len(c) for c in calls] == [_calls_per_rank(pp, r, m, v, train) for r in range(pp)]
                replay(calls)


def test_every_registered_schedule_has_an_order_that_cannot_stall():
    """Planner-only schedules too (zb-h1, whose weight-gradient passes move nothing): an executor that runs them
    posts `transfer_order`'s calls, one at a time, and they complete."""
    for name in SCHEDULES.names():
        v = 2 if SCHEDULES[name].chunks else 1
        for pp in range(2, 9):
            for m in (pp, 2 * pp):
                order = transfer_order(actions(pp, m, name, v), v)
                calls = [[P2PCall(k, op, (t.target if op == "send" else t.source) % pp,
                                  hash((t.low_stage, t.microbatch, t.backward)), 8) for k, (op, t) in enumerate(rank)]
                         for rank in order]
                assert sum(map(len, calls)) == 2 * (v * pp - 1) * m * 2, (name, pp, m)
                replay(calls)
