"""Host syncs per training step within budget: none in any attention block (every CP mode and the plain model),
one per expert dispatch, which sizes the transfers and the expert groups at once (every dispatcher, token
chunks too), counted on CPU by the operations that would sync a GPU (`orangetron.host_syncs.count_host_syncs`);
docs/runtime.md, "Host syncs", lists the counts. The same launch checks the order of each MoE layer's shared
expert and its combine: the shared expert computes while the combine travels.
"""

from __future__ import annotations

import functools

import pytest
import torch

from orangetron import comm
from orangetron.host_syncs import Sync, count_host_syncs
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.model.moe import LocalDispatcher, MoE
from orangetron.parallel import ParallelConfig, context, parallelize
from orangetron.parallel.expert.dispatcher import Dispatcher
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
DENSE = ModelConfig(**BASE)
# The router's losses and bias on, as training runs them: their global sums ride on each dispatch too.
MOE = ModelConfig(**{**BASE, "aux_loss_coef": 0.01}, n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1,
                  router_z_loss_coef=0.001, router_bias_rate=0.001)
SEQ, ROWS = 16, 2
DENSE_CASES = {  # name: (layout, parallel options), world 2
    "plain": (Layout(dp=2), {}),
    **{mode: (Layout(cp=2), {"cp_mode": mode}) for mode in ("ring", "allgather", "ulysses", "rsa")},
    "usp": (Layout(cp=2), {"cp_mode": "usp", "ulysses_degree": 2}),
}
EP = Layout(dp=2, ep=2)
MOE_CASES = {  # name: (layout, parallel options)
    "ragged": (EP, {"dispatcher": "ragged"}),
    "capacity": (EP, {"dispatcher": "capacity", "capacity_factor": 1.0}),
    "allgather": (EP, {"dispatcher": "allgather"}),
    "ragged, 2 chunks": (EP, {"dispatcher": "ragged", "ep_overlap_chunks": 2}),
    "one device": (None, {}),  # the plain model: `LocalDispatcher` and the model's own router losses
}
DTYPES = ("float64", "float32")  # float32 runs the experts through grouped GEMMs


def step_syncs(cfg: ModelConfig, layout: Layout | None, options: dict, dtype: str) -> dict:
    """Forward and backward of one training step on this rank: the syncs, attention blocks and dispatches.
    `layout` None: the plain model on this rank alone."""
    model = Transformer(cfg, seed=0, dtype=getattr(torch, dtype))
    mesh = None if layout is None else init_mesh(layout)
    run = model if mesh is None else parallelize(model, mesh, ParallelConfig(param_dtype=dtype, **options))
    rows = torch.randint(0, cfg.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels, positions = rows[:, :-1], rows[:, 1:], None
    if mesh is not None and mesh["cp"].size > 1:
        positions = context.position_ids(SEQ, mesh)
        inputs, labels = context.shard(inputs, mesh), context.shard(labels, mesh)
    calls, events = {"dispatches": 0}, []
    original, local, wait = Dispatcher.dispatch_compute_combine, LocalDispatcher.forward, comm.Pending.wait

    def counted(self, *args, **kwargs):
        calls["dispatches"] += 1
        return original(self, *args, **kwargs)

    def counted_locally(self, *args, **kwargs):
        calls["dispatches"] += 1
        return local(self, *args, **kwargs)

    def waited(self):
        events.append(("wait", None))
        return wait(self)

    Dispatcher.dispatch_compute_combine, LocalDispatcher.forward, comm.Pending.wait = counted, counted_locally, waited
    for moe in (m for m in model.modules() if isinstance(m, MoE) and m.shared_expert is not None):
        moe.shared_expert.register_forward_hook(lambda *_: events.append(("shared", records and records[-1].op)))
    try:
        with count_host_syncs() as syncs, comm.measure() as records:
            loss = model.loss_from_logits(run(inputs, position_ids=positions, token_mask=labels >= 0), labels)
            forward = list(events)
            loss.backward()
    finally:
        Dispatcher.dispatch_compute_combine, LocalDispatcher.forward, comm.Pending.wait = original, local, wait
    return {"syncs": syncs, "blocks": cfg.n_layers, "forward": forward, **calls}


def all_cases() -> dict:
    found = {}
    for name, (layout, options) in DENSE_CASES.items():
        found[f"dense {name}"] = step_syncs(DENSE, layout, options, "float64")
    for name, (layout, options) in MOE_CASES.items():
        for dtype in DTYPES:
            found[f"moe {name} {dtype}"] = step_syncs(MOE, layout, options, dtype)
    return found


@functools.cache
def results() -> list[dict]:
    return run_distributed(all_cases, 2)


def _by_region(syncs: list[Sync], region: str) -> list[Sync]:
    return [s for s in syncs if s.region == region]


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_no_host_sync_in_any_attention_block(name):
    for rank, per_case in enumerate(results()):
        got = per_case[f"dense {name}"]
        assert _by_region(got["syncs"], "attention") == [], f"{name} rank {rank}"
        assert _by_region(got["syncs"], "experts") == [], f"{name} rank {rank}"


@pytest.mark.parametrize("name", list(MOE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_host_syncs_per_expert_dispatch_within_budget(name, dtype):
    """Per dispatch, forward and backward: one read (`routing.read_counts`, after the count exchange) sizes every
    transfer and the expert groups of every token chunk; the experts, the combine and every backward read
    nothing. On one device the experts' one read of their group sizes is the layer's only sync."""
    for rank, per_case in enumerate(results()):
        got = per_case[f"moe {name} {dtype}"]
        where = f"{name} {dtype} rank {rank}"
        assert got["dispatches"] == MOE.n_layers, f"{where}: one dispatch per MoE layer"
        # Every sync of the step counts (the router's losses' backward runs outside the experts' files).
        assert len(got["syncs"]) <= got["dispatches"], f"{where}: {got['syncs']}"
        if name != "one device":
            assert all("read_counts" in s.site for s in got["syncs"]), f"{where}: {got['syncs']}"
        assert _by_region(got["syncs"], "attention") == [], where


@pytest.mark.parametrize("name", ["ragged", "capacity", "allgather"])
def test_shared_experts_compute_while_the_combine_travels(name):
    """In forward, each layer's shared expert runs after its combine's collective started (the last record is
    the combine's) and before that collective is waited for (the next wait), in every dtype."""
    combine = "reduce_scatter" if name == "allgather" else "all_to_all"
    for rank, per_case in enumerate(results()):
        for dtype in DTYPES:
            got = per_case[f"moe {name} {dtype}"]["forward"]
            assert got == [("shared", combine), ("wait", None)] * MOE.n_layers, f"{name} {dtype} rank {rank}"


def test_the_counter_sees_each_kind_of_sync():
    x = torch.arange(6.0)
    with count_host_syncs() as syncs:
        x.sum().item()
        x.tolist()
        bool(x[0] > 1)
        int(x[1])
        torch.nonzero(x)
        x[x > 2]
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]))
        torch.bincount(x.long())
        x.to("cpu"), torch.tensor([1, 2], device="cpu"), x.new_tensor([1.0])
        x[:2], x.to(torch.float32), torch.arange(3), x.repeat_interleave(2)  # none of these
        x.masked_fill(x > 2, 0), torch.where(x > 2, x, 0), torch.tensor([1, 2])
        x.repeat_interleave(torch.tensor([1, 2, 1, 1, 1, 1]), output_size=7)  # nor this
    assert [s.op for s in syncs] == ["item", "tolist", "__bool__", "__int__", "nonzero", "mask index",
                                     "repeat_interleave", "bincount", *["copy to device"] * 3]
    assert torch.Tensor.item is torch._C.TensorBase.item  # the patches are gone
