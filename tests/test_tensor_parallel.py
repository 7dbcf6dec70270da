"""Tensor parallelism (with and without sequence parallelism) against one device, and against the planner.

The reference is the plain single-device model with F.cross_entropy, torch.optim.AdamW and torch's
clipping. Each layout trains several steps in float64; losses, every gradient (gathered to whole tensors)
and the final parameters must agree to 1e-9 relative. In the same run each rank's ledger and memory of
one step must equal `plan.bridge.predicted_step` record for record and byte for byte.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orangetron import comm, memory
from orangetron.layout import Layout, LayoutError
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.plan.bridge import predicted_step
from orangetron.testing import run_distributed

SEQ, PER_RANK, STEPS, LR, CLIP = 8, 2, 3, 3e-2, 0.5
BASE = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
MODELS = {
    "dense-gqa": ModelConfig(**BASE),
    "dense-mha-tied": ModelConfig(**{**BASE, "n_kv_heads": 4, "tied_embeddings": True}),
    "dense-mqa": ModelConfig(**{**BASE, "n_kv_heads": 1}),
    "moe-shared": ModelConfig(**BASE, n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1),
    "moe-every-other": ModelConfig(**BASE, n_experts=4, top_k=1, moe_ffn_dim=8, moe_layer_freq=2),
}
# (model, layout, sequence parallel, data-parallel options); one launch per world size runs them all.
CASES = {
    2: [(m, Layout(tp=2), sp, {}) for m in MODELS for sp in (False, True)],
    4: [("dense-gqa", Layout(tp=4), True, {}), ("dense-gqa", Layout(tp=4), False, {}),
        ("moe-shared", Layout(tp=4), True, {}), ("dense-mqa", Layout(tp=4), True, {}),
        ("moe-shared", Layout(tp=2, dp=2), True, {"zero_stage": 1}),
        ("dense-gqa", Layout(tp=2, dp=2), True, {"zero_stage": 3}),
        ("moe-every-other", Layout(tp=2, dp=2), False, {"distributed_optimizer": True}),
        ("dense-mha-tied", Layout(tp=2, dp=2), True, {"zero_stage": 2})],
}


def batch(step: int, rows: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, SEQ + 1), generator=torch.Generator().manual_seed(step))


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), foreach=False)


def reference(cfg: ModelConfig, dp: int):
    """One device, the whole batch: losses, gradients by name per step, final parameters by name."""
    model = Transformer(cfg, seed=0, dtype=torch.float64)
    opt = adamw(model)
    losses, grads = [], []
    for step in range(STEPS):
        tokens = batch(step, dp * PER_RANK, cfg.vocab_size)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def tp_run(model_name: str, layout: Layout, sp: bool, dp_options: dict):
    """STEPS steps on this rank; losses, whole gradients and parameters, step 2's ledger and memory."""
    cfg = MODELS[model_name]
    mesh = init_mesh(layout)
    pc = ParallelConfig(param_dtype="float64", sequence_parallel=sp, **dp_options)
    dp = parallelize(Transformer(cfg, seed=0, dtype=torch.float64), mesh, pc)
    opt = dp.optimizer(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g = mesh["dp"]
    losses, grads, records, peak = [], [], [], 0
    for step in range(STEPS):
        rows = batch(step, g.size * PER_RANK, cfg.vocab_size)[g.rank * PER_RANK:(g.rank + 1) * PER_RANK]
        with comm.measure() as step_records, memory.track_activations(dp.module) as meter:
            logits = dp(rows[:, :-1], token_mask=rows[:, 1:] >= 0)  # as the trainer calls it
            loss = dp.module.loss_from_logits(logits, rows[:, 1:])
            if step == 0:  # every tensor kept for backward must be one the activation meter sees
                kept = memory.tensors_kept_on_ctx(loss)
                functions = {type(node).__name__ for node in memory.custom_function_nodes(loss)}
            loss.backward()
            dp.reduce_gradients()
            with comm.unmeasured():
                grads.append(dp.full_grads())
            opt.clip_grad_norm_(CLIP)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        if step == 1:
            records, peak = step_records, meter.peak_bytes
    state = memory.model_state_bytes(dp, opt) | {"activations": peak}
    params = dp.full_state(opt)["params"]
    ledger = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records)
    whole = mesh.rank == 0  # tensors are the same on every rank; send them once
    return losses, grads if whole else None, params if whole else None, ledger, state, (kept, functions)


def run_cases(world: int):
    return [tp_run(*case) for case in CASES[world]]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


@pytest.mark.parametrize("world", sorted(CASES))
def test_tensor_parallel_matches_one_device_and_the_planner(world):
    results = run_distributed(run_cases, world, args=(world,))
    for i, (model_name, layout, sp, dp_options) in enumerate(CASES[world]):
        where = f"{model_name} {layout} sp={sp} {dp_options}"
        cfg = MODELS[model_name]
        ref_losses, ref_grads, ref_params = reference(cfg, layout.dp)
        _, grads, params, _, _, _ = results[0][i]
        dp_losses = [r[i][0] for r in results[:: layout.tp]]  # one rank per data-parallel share
        losses = [sum(step) / layout.dp for step in zip(*dp_losses, strict=True)]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=0, msg=where)
        assert set(params) == set(ref_params), where
        for step in range(STEPS):
            for name, ref in ref_grads[step].items():
                assert _rel(grads[step][name], ref) < 1e-9, f"{where} step {step} grad {name}"
        for name, ref in ref_params.items():
            assert _rel(params[name], ref) < 1e-9, f"{where} param {name}"
        pc = ParallelConfig(param_dtype="float64", sequence_parallel=sp, **dp_options)
        want_records, want_mem = predicted_step(cfg, layout, pc, seq_len=SEQ, micro_batch=PER_RANK, clip_grad=True)
        want = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in want_records)
        for rank, per_rank in enumerate(results):
            rank_losses, _, _, ledger, state, (kept, functions) = per_rank[i]
            assert kept == [], f"{where} rank {rank}"
            tp_function = "_GatheredLinearBackward" if sp else "_VocabParallelCrossEntropyBackward"
            assert tp_function in functions, f"{where}: the ctx check must see the tensor-parallel Functions"
            tp_peer = results[rank - rank % layout.tp][i][0]
            assert rank_losses == tp_peer, f"{where} rank {rank}: every tp rank reports the same loss"
            assert ledger == want, f"{where} rank {rank}"
            assert state == {k: want_mem[k] for k in state}, f"{where} rank {rank}"


def test_layout_errors_name_the_rule():
    cfg = ModelConfig(**{**BASE, "n_kv_heads": 4, "n_heads": 4})
    with pytest.raises(LayoutError, match=r"tp=3: n_heads=4 is not divisible by tp"):
        Layout(tp=3).validate(cfg)
    with pytest.raises(LayoutError, match=r"n_kv_heads=2 must divide tp or be divisible by it"):
        Layout(tp=3).validate(ModelConfig(**{**BASE, "n_heads": 6, "dim": 24, "n_kv_heads": 2}))
    with pytest.raises(LayoutError, match=r"tp=2: sequence_parallel needs seq_len/cp=7 divisible by tp"):
        Layout(tp=2).validate(cfg, seq_len=7, sequence_parallel=True)
    with pytest.raises(LayoutError, match=r"tp=4: ffn_dim=6 is not divisible by tp"):
        Layout(tp=4).validate(ModelConfig(**{**BASE, "ffn_dim": 6}))


LONG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=32, ffn_dim=64)


def activation_peak(tp: int) -> int:
    dp = parallelize(Transformer(LONG, seed=0), init_mesh(Layout(tp=tp)), ParallelConfig(sequence_parallel=tp > 1))
    tokens = torch.randint(0, LONG.vocab_size, (2, 513), generator=torch.Generator().manual_seed(0))
    with memory.track_activations(dp.module) as meter:
        dp.module.loss_from_logits(dp(tokens[:, :-1]), tokens[:, 1:]).backward()
    return meter.peak_bytes


def test_sequence_parallel_divides_the_activation_peak():
    """Activations dominate at 512 tokens: SP's peak per rank is within 10% of one device's over tp."""
    [one] = run_distributed(activation_peak, 1, args=(1,))
    for peak in run_distributed(activation_peak, 2, args=(2,)):
        assert one / 2 <= peak <= 1.1 * one / 2
