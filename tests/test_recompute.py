"""Activation recompute (`ParallelConfig.recompute`, `recompute_layers`) against one device and the planner.

Every mode trains float64 steps through `ot.parallelize` on tp2 x cp2 x pp2 (every schedule, four cp modes, SP,
ZeRO-1/2/3 and the distributed optimizer), with experts over data parallelism (dp2 x ep2, dp4 x ep2 and
tp2 x dp2 x ep2; every dispatcher, overlap chunks, ZeRO-1/2/3, gradient buckets), on cp4 with USP,
on an interleaved pp2 x dp2 that keeps a layer of each chunk and on an interleaved pp2 of four micro-batches:
losses, every gradient, the final parameters and the routers' biases must equal the plain single-device model
to 1e-9 (`layout_check`), and every rank's ledger (the replayed forward's collectives included) and model states
must equal `plan.bridge.predicted_step`, and so must the activation peak, to the byte, in every mode: under full
recompute the replay runs on the kept layer input itself, and on the last stage the loss's backward frees the
output layer's buffers before any layer replays (the planner counts both so, and each chunk's replay on what its
backward finds held).
"""

from __future__ import annotations

import pytest
import torch
from layout_check import SEQ, batch, check_layout, layout_run

from orangetron import memory
from orangetron.model import ModelConfig, Transformer, moe
from orangetron.model.transformer import KeepActivations
from orangetron.parallel import ParallelConfig
from orangetron.parallel.recompute import Recompute, apply_recompute
from orangetron.plan.activations import stage_activation_bytes
from orangetron.plan.bridge import predicted_step
from orangetron.spec.layout import Layout
from orangetron.spec.options import Job
from orangetron.spec.stages import replayed_layers
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
MODELS = {
    "dense": ModelConfig(**BASE),
    "dense-8": ModelConfig(**{**BASE, "n_layers": 8}),  # two layers in each of pp2 x 2 chunks: one kept
    # The bias update on: the replay must not count the loads twice. (The pipeline reports the cross entropy
    # alone, and the balancing loss of micro-batches is not the whole batch's: under pp both losses stay off, as
    # in tests/test_pipeline_parallel.py.)
    "moe": ModelConfig(**{**BASE, "n_kv_heads": 4}, n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1,
                       router_bias_rate=0.01),
    # Every token to both experts, one on each ep rank: routing is balanced, so the planner's dispatch records hold.
    "moe-ep": ModelConfig(**{**BASE, "aux_loss_coef": 0.05}, n_experts=2, top_k=2, moe_ffn_dim=8, n_shared_experts=1,
                          router_z_loss_coef=0.01),
}
ROWS = 4  # sequences per data-parallel rank and step (two micro-batches of two under pp)
# (model, layout, parallel options): one launch per world size runs them all.
CASES = {
    8: [("moe", Layout(tp=2, cp=2, pp=2), {"recompute": "selective", "cp_mode": "ring", "sequence_parallel": True,
                                           "pp_schedule": "1f1b", "microbatches": 2, "distributed_optimizer": True}),
        ("moe", Layout(tp=2, cp=2, pp=2), {"recompute": "full", "cp_mode": "allgather", "sequence_parallel": True,
                                           "pp_schedule": "1f1b", "microbatches": 2, "zero_stage": 3}),
        ("dense", Layout(tp=2, cp=2, pp=2), {"recompute": "full", "recompute_layers": 1, "cp_mode": "ulysses",
                                             "pp_schedule": "gpipe", "microbatches": 2, "zero_stage": 2}),
        ("dense", Layout(tp=2, cp=2, pp=2), {"recompute": "full", "cp_mode": "rsa", "sequence_parallel": True,
                                             "pp_schedule": "interleaved", "virtual_stages": 2, "microbatches": 2,
                                             "zero_stage": 1})],
    2: [("moe-ep", Layout(dp=2, ep=2), {"recompute": "full", "dispatcher": "ragged", "zero_stage": 3}),
        # More micro-batches than stages: the last stage's peak is an earlier chunk's replay, before the head's
        # chunk holds any micro-batch (the planner read it 32 bytes short, one micro-batch's padding mask).
        ("moe", Layout(pp=2), {"recompute": "full", "pp_schedule": "interleaved", "virtual_stages": 2,
                               "microbatches": 4})],
    4: [("moe-ep", Layout(dp=4, ep=2), {"recompute": "selective", "dispatcher": "ragged", "zero_stage": 1}),
        ("moe-ep", Layout(dp=4, ep=2), {"recompute": "full", "dispatcher": "ragged", "ep_overlap_chunks": 2,
                                        "zero_stage": 3}),
        ("moe-ep", Layout(dp=4, ep=2), {"recompute": "full", "recompute_layers": 1, "dispatcher": "capacity",
                                        "capacity_factor": 2.0, "zero_stage": 2}),
        ("moe-ep", Layout(tp=2, dp=2, ep=2), {"recompute": "full", "dispatcher": "allgather", "sequence_parallel": True,
                                              "grad_bucket_numel": 300}),
        ("moe-ep", Layout(tp=2, dp=2, ep=2), {"recompute": "none", "dispatcher": "allgather", "sequence_parallel": True,
                                              "grad_bucket_numel": 300}),
        ("dense", Layout(cp=4), {"recompute": "full", "cp_mode": "usp", "ulysses_degree": 2, "zero_stage": 1}),
        ("dense-8", Layout(pp=2, dp=2), {"recompute": "full", "recompute_layers": 1, "pp_schedule": "interleaved",
                                         "virtual_stages": 2, "microbatches": 2, "zero_stage": 2})],
}


def _config(options: dict) -> ParallelConfig:
    return ParallelConfig(param_dtype="float64", **options)


def run_cases(world: int) -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts), per_rank=ROWS) for m, layout, opts in CASES[world]]


@pytest.mark.parametrize("world", sorted(CASES))
def test_recompute_matches_one_device_and_the_planner(world):
    results = run_distributed(run_cases, world, args=(world,), timeout=900)
    for i, (model_name, layout, options) in enumerate(CASES[world]):
        cfg, pc = MODELS[model_name], _config(options)
        check_layout([r[i] for r in results], cfg, layout, pc, f"{model_name} {layout} {options}", rows=ROWS,
                     balanced_routing=layout.ep > 1, ep_activations=True)


# ---- one device: the replay itself -------------------------------------------------------------------------------
# Every auxiliary loss and the bias update on (one device runs no micro-batches).
ONE_DEVICE = {
    "dense": MODELS["dense"],
    "moe": ModelConfig(**{**BASE, "aux_loss_coef": 0.05}, n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1,
                       router_z_loss_coef=0.01, router_bias_rate=0.01),
}


def _one_device_step(cfg: ModelConfig, recompute: str, layers: int) -> dict:
    model = Transformer(cfg, seed=0, dtype=torch.float64)
    apply_recompute(model, 1, 1, recompute, layers)
    tokens = batch(0, ROWS, cfg.vocab_size)
    with memory.track_activations(model) as meter:
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        kept = memory.tensors_kept_on_ctx(loss)
        aux = [block.feed_forward.last_aux_loss for block in model.layers if cfg.n_experts]
        loss.backward()
    return {"loss": loss, "grads": {n: p.grad for n, p in model.named_parameters()}, "peak": meter.peak_bytes,
            "kept": kept, "aux_before": aux, "aux_after": [block.feed_forward.last_aux_loss for block in model.layers
                                                           if cfg.n_experts],
            "loads": [r.expert_load for r in model.modules() if isinstance(r, moe.Router)],
            "replayed": [isinstance(block.recompute, Recompute) for block in model.layers]}


@pytest.mark.parametrize("name", sorted(ONE_DEVICE))
def test_replaying_a_block_gives_the_same_step_and_counts_nothing_twice(name):
    """Full recompute of every layer, of the first and of the first three, against keeping everything: the same
    loss and gradients bit for bit; each router's load counts equal (the replay counts, the forward without a
    graph does not); the auxiliary losses the step holds are still the forward's after backward; nothing kept
    on a ctx. The peak equals the planner's to the byte for each."""
    cfg = ONE_DEVICE[name]
    none = _one_device_step(cfg, "none", 0)
    assert sum(int(load.sum()) for load in none["loads"]) == (4 * ROWS * SEQ * cfg.top_k if cfg.n_experts else 0)
    for layers in (0, 1, 3):
        got = _one_device_step(cfg, "full", layers)
        assert got["replayed"] == [i < (layers or 4) for i in range(4)]
        assert torch.equal(got["loss"], none["loss"])
        assert all(torch.equal(g, none["grads"][n]) for n, g in got["grads"].items())
        assert all(torch.equal(a, b) for a, b in zip(got["loads"], none["loads"], strict=True))
        assert all(a is b for a, b in zip(got["aux_after"], got["aux_before"], strict=True))
        assert got["kept"] == []
        pc = ParallelConfig(param_dtype="float64", recompute="full", recompute_layers=layers)
        want = predicted_step(cfg, Layout(), pc, seq_len=SEQ, micro_batch=ROWS, clip_grad=True)[1]["activations"]
        assert got["peak"] == want, f"recompute_layers={layers}"
    planner = stage_activation_bytes(cfg, Layout(), Job(seq_len=SEQ, micro_batch=ROWS, param_dtype="float64"), 0)
    assert none["peak"] == planner


def test_a_frozen_embedding_still_trains_the_replayed_blocks():
    """The first block's input needs no gradient when the embedding is frozen: its parameters still get theirs."""
    cfg = ONE_DEVICE["dense"]
    tokens = batch(0, ROWS, cfg.vocab_size)
    grads = []
    for recompute in ("none", "full"):
        model = Transformer(cfg, seed=0, dtype=torch.float64)
        model.tok_embeddings.weight.requires_grad_(False)
        apply_recompute(model, 1, 1, recompute, 0)
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[1].keys() == grads[0].keys() and all(g is not None for g in grads[1].values())
    assert all(torch.equal(g, grads[0][n]) for n, g in grads[1].items())


def test_the_replayed_blocks_are_the_first_of_each_chunk():
    """10 layers over pp 2 x 2 virtual stages: chunks (0-2), (3-5), (6-7), (8-9); two per chunk replay the first
    two of each, as the planner's `replayed_layers` says; 0 replays every layer; none and selective none."""
    cfg = ModelConfig(**{**BASE, "n_layers": 10})

    def replayed(recompute: str, layers: int) -> set[int]:
        model = Transformer(cfg)
        apply_recompute(model, 2, 2, recompute, layers)
        assert all(isinstance(b.recompute, (Recompute, KeepActivations)) for b in model.layers)
        return {i for i, block in enumerate(model.layers) if isinstance(block.recompute, Recompute)}

    assert replayed("full", 2) == {0, 1, 3, 4, 6, 7, 8, 9}
    assert replayed("full", 2) == set(replayed_layers(10, 2, 2, 0, 2) | replayed_layers(10, 2, 2, 1, 2))
    assert replayed("full", 0) == set(range(10))
    assert replayed("selective", 0) == replayed("none", 0) == set()


def test_an_evaluation_forward_replays_nothing():
    """Without gradients a replayed block just runs (nothing kept, nothing to replay), with the same output."""
    cfg = ONE_DEVICE["moe"]
    tokens = batch(0, ROWS, cfg.vocab_size)[:, :-1]
    plain, replaying = (Transformer(cfg, seed=0, dtype=torch.float64) for _ in range(2))
    apply_recompute(replaying, 1, 1, "full", 0)
    with torch.no_grad():
        assert torch.equal(replaying(tokens), plain(tokens))
    assert all(torch.equal(a.expert_load, b.expert_load) for a, b in
               zip(*([r for r in m.modules() if isinstance(r, moe.Router)] for m in (plain, replaying)), strict=True))


def test_the_flags_reach_the_runtime(capsys):
    """`verify --recompute full --recompute-layers 1` runs (the one-rank reference keeps everything); selective
    warns that it changes nothing here; recompute_layers without full recompute is refused by the shared rule."""
    import json

    from orangetron.cli import main

    flags = ["--steps", "1", "--dp", "2", "--recompute", "full", "--recompute-layers", "1", "--json"]
    assert main(["verify", *flags]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["max_grad_rel_diff"] < 1e-12
    assert main(["verify", "--steps", "1", "--recompute", "selective", "--json"]) == 0
    assert "recompute='selective' (--recompute) has no effect" in capsys.readouterr().err
    assert main(["verify", "--recompute", "selective", "--recompute-layers", "1"]) == 2
    assert "recompute_layers=1 (--recompute-layers) needs recompute='full'" in capsys.readouterr().err
