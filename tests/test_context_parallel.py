"""Context parallelism through the whole model: every mode against one device and against the planner.

Each rank trains on its head-tail shard of every sequence with global RoPE positions (`layout_check`);
losses, every gradient and the final parameters must equal the plain single-device model in float64, and
each rank's ledger and memory (activation peak included) must equal `plan.bridge.predicted_step`.
"""

from __future__ import annotations

import pytest
from layout_check import check_layout, layout_run

from orangetron.model import ModelConfig
from orangetron.parallel import ParallelConfig
from orangetron.spec.layout import Layout, LayoutError
from orangetron.spec.variants import CONTEXT_MODES
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
MODELS = {
    "dense-gqa": ModelConfig(**BASE),
    "moe-mha": ModelConfig(**{**BASE, "n_kv_heads": 4}, n_experts=4, top_k=2, moe_ffn_dim=8, n_shared_experts=1),
    # The balancing loss on: every layout computes it over the whole batch, as one device does.
    "moe-aux": ModelConfig(**{**BASE, "aux_loss_coef": 0.05}, n_experts=4, top_k=2, moe_ffn_dim=8),
}
SEQ = 16
BUILT_IN_MODES = CONTEXT_MODES.names(runtime=True)
CASES = {
    2: [(m, Layout(cp=2), {"cp_mode": mode}) for m in MODELS for mode in BUILT_IN_MODES if mode != "usp"]
    + [("moe-aux", Layout(tp=2), {"sequence_parallel": True}), ("moe-aux", Layout(dp=2), {"zero_stage": 3})],
    4: [("dense-gqa", Layout(cp=4), {"cp_mode": mode}) for mode in BUILT_IN_MODES if mode != "usp"]
    + [("moe-mha", Layout(tp=2, cp=2), {"cp_mode": "ring", "sequence_parallel": True}),
       ("dense-gqa", Layout(cp=2, dp=2), {"cp_mode": "ring", "zero_stage": 1}),
       ("dense-gqa", Layout(cp=2, dp=2), {"cp_mode": "ulysses", "zero_stage": 3}),
       ("moe-mha", Layout(cp=4), {"cp_mode": "usp", "ulysses_degree": 2}),
       ("moe-aux", Layout(tp=2, cp=2), {"cp_mode": "ring", "sequence_parallel": True}),
       ("moe-aux", Layout(cp=2, dp=2), {"cp_mode": "ulysses", "zero_stage": 1}),
       ("dense-gqa", Layout(cp=4), {"cp_mode": "usp", "ulysses_degree": 1}),
       ("dense-gqa", Layout(tp=2, cp=2), {"cp_mode": "usp", "ulysses_degree": 2, "sequence_parallel": True})],
}


def _config(options: dict) -> ParallelConfig:
    return ParallelConfig(param_dtype="float64", **options)


def run_cases(world: int) -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts), seq=SEQ) for m, layout, opts in CASES[world]]


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_matches_one_device_and_the_planner(world):
    results = run_distributed(run_cases, world, args=(world,))
    for i, (model_name, layout, options) in enumerate(CASES[world]):
        check_layout([r[i] for r in results], MODELS[model_name], layout, _config(options),
                     f"{model_name} {layout} {options}", seq=SEQ)


DOC_LENGTHS = (1, 3, 9, 3)  # one row of SEQ tokens: one token, shorter than 2*cp, longer than a rank's share
PACKED = [("dense-gqa", Layout(cp=4), {"cp_mode": "ring"}), ("dense-gqa", Layout(cp=4), {"cp_mode": "allgather"}),
          ("moe-mha", Layout(tp=2, cp=2), {"cp_mode": "ring", "sequence_parallel": True}),
          ("dense-gqa", Layout(cp=2, dp=2), {"cp_mode": "ulysses", "zero_stage": 1}),
          ("moe-mha", Layout(cp=4), {"cp_mode": "usp", "ulysses_degree": 2})]


def run_packed() -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts), seq=SEQ, doc_lengths=DOC_LENGTHS)
            for m, layout, opts in PACKED]


def test_packed_documents_match_one_device_and_the_planner():
    """Rows of packed documents, sharded in balance: one device under the documents' masks, and each rank's
    ledger (the trimmed ring's transfers, per rank) and memory (activation peak included) equal to the
    planner's for the same lengths."""
    assert sum(DOC_LENGTHS) == SEQ
    results = run_distributed(run_packed, 4)
    for i, (model_name, layout, options) in enumerate(PACKED):
        check_layout([r[i] for r in results], MODELS[model_name], layout, _config(options),
                     f"packed {model_name} {layout} {options}", seq=SEQ, doc_lengths=DOC_LENGTHS)


def test_cp_layout_rules():
    with pytest.raises(LayoutError, match=r"cp=3: seq_len 16 is not divisible by 2\*cp=6"):
        Layout(cp=3).validate(seq_len=16)


def test_padding_to_whole_chunks_never_changes_the_training(tmp_path):
    """seq_len 30 on cp=2 (and tp=2 with SP: a multiple of 8) pads with ignored labels; losses, held-out
    loss and final weights equal the unpadded one-rank run."""
    import dataclasses

    import torch

    from orangetron.model import model_preset
    from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint
    from orangetron.train.trainer import TrainConfig, train

    model = dataclasses.replace(model_preset("tiny-moe"), aux_loss_coef=0.0)
    base = dict(model=model, seq_len=30, batch_size=4, steps=3, warmup=1, eval_batches=2, corpus_bytes=200_000,
                param_dtype="float64", save_every=3)
    runs = {}
    for name, layout in (("one", {}), ("cp2", {"cp": 2, "cp_mode": "ulysses"}),
                         ("tp2cp2", {"cp": 2, "tp": 2, "sequence_parallel": True})):
        result = train(TrainConfig(**base, out=str(tmp_path / name), **layout), progress=False)
        params = load_checkpoint(latest_checkpoint(tmp_path / name / "checkpoints"))["params"]
        runs[name] = (result["losses"] + [result["eval_loss"]], params)
    for name in ("cp2", "tp2cp2"):
        torch.testing.assert_close(runs[name][0], runs["one"][0], rtol=1e-9, atol=0, msg=name)
        for key, value in runs["one"][1].items():
            torch.testing.assert_close(runs[name][1][key], value, rtol=1e-9, atol=1e-12, msg=f"{name} {key}")


def test_verify_command_context_parallel(capsys):
    import json

    from orangetron.cli import main

    code = main(["verify", "--cp", "2", "--tp", "2", "--sequence-parallel", "--cp-mode", "allgather", "--steps", "2",
                 "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["ok"] and result["layout"]["cp"] == 2 and result["max_grad_rel_diff"] < 1e-12
