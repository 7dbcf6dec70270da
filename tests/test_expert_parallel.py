"""Expert parallelism on the whole model against one device, and against the planner.

The reference is the plain single-device `Transformer` (its per-batch load-balancing loss on) with
F.cross_entropy, torch.optim.AdamW and torch's clipping. Each layout trains several float64 steps with the
global balancing loss; losses, every gradient (gathered whole) and the final parameters must agree to 1e-9.
Each rank's records outside the ep group and its model-state bytes must equal `plan.bridge.predicted_step`;
the ep records themselves are checked against counted routing in tests/test_expert_dispatch.py and against
the planner for exactly balanced routing below.
"""

from __future__ import annotations

import pytest
import torch
from layout_check import CLIP, LR, PER_RANK, SEQ, STEPS, assert_equals_reference, batch

from orangetron import comm, memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer, moe
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.plan.bridge import predicted_step
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.05)
MODELS = {
    "moe-shared": ModelConfig(**BASE, n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1),
    "moe-every-other": ModelConfig(**BASE, n_experts=8, top_k=3, moe_ffn_dim=8, moe_layer_freq=2),
}
# (model, layout, parallel options); one launch per world size runs them all.
CASES = {
    2: [("moe-shared", Layout(dp=2, ep=2), {"dispatcher": "ragged"}),
        ("moe-shared", Layout(dp=2, ep=2), {"dispatcher": "allgather", "zero_stage": 1}),
        ("moe-every-other", Layout(dp=2, ep=2), {"dispatcher": "capacity", "capacity_factor": 16.0,
                                                  "zero_stage": 2}),
        ("moe-shared", Layout(dp=2, ep=2), {"dispatcher": "ragged", "ep_overlap_chunks": 3, "grad_bucket_numel": 300})],
    4: [("moe-shared", Layout(dp=4, ep=2), {"dispatcher": "ragged", "zero_stage": 1}),
        ("moe-every-other", Layout(dp=4, ep=4), {"dispatcher": "allgather", "distributed_optimizer": True}),
        ("moe-shared", Layout(tp=2, dp=2, ep=2), {"dispatcher": "ragged", "sequence_parallel": True}),
        # Gradient buckets over both buffers (edp = 2), and after the tp sum that sequence parallel needs.
        ("moe-every-other", Layout(dp=4, ep=2), {"dispatcher": "ragged", "distributed_optimizer": True,
                                                 "grad_bucket_numel": 300}),
        ("moe-shared", Layout(tp=2, dp=2, ep=2), {"dispatcher": "ragged", "sequence_parallel": True,
                                                  "zero_stage": 2, "grad_bucket_numel": 300}),
        ("moe-every-other", Layout(dp=4, ep=2), {"dispatcher": "ragged", "grad_bucket_numel": 300}),  # DDP
        ("moe-shared", Layout(tp=2, dp=2, ep=2), {"dispatcher": "ragged", "sequence_parallel": True,
                                                  "grad_bucket_numel": 300}),
        ("moe-every-other", Layout(dp=4, ep=4), {"dispatcher": "ragged", "ep_overlap_chunks": 2, "zero_stage": 3})],
    8: [("moe-shared", Layout(tp=2, dp=4, ep=2), {"dispatcher": "ragged", "sequence_parallel": True,
                                                   "zero_stage": 1}),
        ("moe-every-other", Layout(tp=2, dp=4, ep=2), {"dispatcher": "allgather", "zero_stage": 3})],
}


def ep_run(model_name: str, layout: Layout, options: dict):
    cfg = MODELS[model_name]
    mesh = init_mesh(layout)
    pc = ParallelConfig(param_dtype="float64", **options)
    dp = parallelize(Transformer(cfg, seed=0, dtype=torch.float64), mesh, pc)
    opt = dp.optimizer(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g = mesh["dp"]
    losses, grads, records = [], [], []
    for step in range(STEPS):
        rows = batch(step, g.size * PER_RANK, cfg.vocab_size)[g.rank * PER_RANK:(g.rank + 1) * PER_RANK]
        with comm.measure() as step_records:
            logits = dp(rows[:, :-1], token_mask=rows[:, 1:] >= 0)
            loss = dp.module.loss_from_logits(logits, rows[:, 1:])
            loss.backward()
            dp.reduce_gradients()
            with comm.unmeasured():
                grads.append(dp.full_grads())
            opt.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        if step == 1:
            records = step_records
    state = memory.model_state_bytes(dp, opt)
    params = dp.full_state(opt)["params"]
    ledger = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records)
    whole = mesh.rank == 0
    return losses, grads if whole else None, params if whole else None, ledger, state


def balanced_choice(ep: int):
    """A stand-in for the router's top-k choice that routes exactly evenly: token t's slot j goes to rank
    (t + j) % ep (distinct experts on one rank when top_k > ep), so every rank sends and receives equally."""
    def choose(scores: torch.Tensor, top_k: int, *args, **kwargs) -> torch.Tensor:
        tokens, experts = scores.shape
        local = experts // ep
        t, j = torch.arange(tokens)[:, None], torch.arange(top_k)[None, :]
        return ((t + j) % ep) * local + (t + j // ep) % local  # [T, k]
    return choose


def balanced_activations(model_name: str, layout: Layout, options: dict) -> int:
    """Peak bytes saved for backward in one training step with exactly balanced routing."""
    cfg = MODELS[model_name]
    mesh = init_mesh(layout)
    dp = parallelize(Transformer(cfg, seed=0, dtype=torch.float64), mesh, ParallelConfig(param_dtype="float64",
                                                                                         **options))
    g = mesh["dp"]
    rows = batch(0, g.size * PER_RANK, cfg.vocab_size)[g.rank * PER_RANK:(g.rank + 1) * PER_RANK]
    real_choice = moe.choose_experts
    moe.choose_experts = balanced_choice(layout.ep)
    try:
        with memory.track_activations(dp.module) as meter:
            logits = dp(rows[:, :-1], token_mask=rows[:, 1:] >= 0)
            dp.module.loss_from_logits(logits, rows[:, 1:]).backward()
    finally:
        moe.choose_experts = real_choice
    return meter.peak_bytes


# Capacity that drops copies (cf 0.5: 4 slots an expert for 8 copies of each rank's 16 tokens): no longer one
# device's model, so only its activations are checked, in the same launch.
DROPPING = {2: [("moe-shared", Layout(dp=2, ep=2), {"dispatcher": "capacity", "capacity_factor": 0.5})]}


def run_cases(world: int):
    return ([(*ep_run(*case), balanced_activations(*case)) for case in CASES[world]],
            [balanced_activations(*case) for case in DROPPING.get(world, [])])


@pytest.mark.parametrize("world", sorted(CASES))
def test_expert_parallel_matches_one_device_and_the_planner(world):
    launched = run_distributed(run_cases, world, args=(world,))
    results = [cases for cases, _ in launched]
    for i, (model_name, layout, options) in enumerate(DROPPING.get(world, [])):
        pc = ParallelConfig(param_dtype="float64", **options)
        _, want_mem = predicted_step(MODELS[model_name], layout, pc, seq_len=SEQ, micro_batch=PER_RANK)
        for rank, (_, dropping) in enumerate(launched):  # a dropped copy keeps no row or slot
            assert dropping[i] == want_mem["activations"], f"{model_name} {layout} {options} rank {rank}"
    for i, (model_name, layout, options) in enumerate(CASES[world]):
        where = f"{model_name} {layout} {options}"
        cfg = MODELS[model_name]
        _, grads, params, _, _, _ = results[0][i]
        dp_losses = [r[i][0] for r in results[:: layout.tp]]
        losses = [sum(step) / layout.dp for step in zip(*dp_losses, strict=True)]
        assert_equals_reference(losses, grads, params, cfg, layout.dp, where)
        pc = ParallelConfig(param_dtype="float64", **options)
        want_records, want_mem = predicted_step(cfg, layout, pc, seq_len=SEQ, micro_batch=PER_RANK, clip_grad=True)
        want = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in want_records
                      if r.dim != "ep" or r.op == "all_reduce")
        for rank, per_rank in enumerate(results):
            rank_losses, _, _, ledger, state, activations = per_rank[i]
            assert activations == want_mem["activations"], f"{where} rank {rank}: balanced routing's activations"
            assert rank_losses == results[rank - rank % layout.tp][i][0], f"{where} rank {rank}: tp ranks agree"
            outside_dispatch = [r for r in ledger if r[1] != "ep" or r[0] == "all_reduce"]
            assert outside_dispatch == want, f"{where} rank {rank}"
            assert state == {k: want_mem[k] for k in state}, f"{where} rank {rank}"
