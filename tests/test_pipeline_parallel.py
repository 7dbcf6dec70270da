"""Pipeline parallelism: every schedule against one device and against the planner.

Each stage runs `plan.schedule.actions` for its rank; losses, every gradient and the final parameters must
equal the plain single-device model in float64, and each stage's ledger and model-state memory must equal
`plan.bridge.predicted_step(..., stage=s)`.
"""

from __future__ import annotations

import pytest
from layout_check import check_layout, layout_run

from orangetron.model import ModelConfig
from orangetron.parallel import ParallelConfig
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed

BASE = dict(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=24, aux_loss_coef=0.0)
MODELS = {
    "dense": ModelConfig(**BASE),
    "moe": ModelConfig(**{**BASE, "n_layers": 8, "n_kv_heads": 4}, n_experts=4, top_k=2, moe_ffn_dim=8,
                       n_shared_experts=1),
    # The head reads the embedding's matrix: the last stage keeps a copy, the two gradients are summed.
    "tied": ModelConfig(**BASE, tied_embeddings=True),
}
ROWS = 4  # sequences per data-parallel rank and step
CASES = {
    2: [("dense", Layout(pp=2), {"pp_schedule": s, "microbatches": 4}) for s in ("gpipe", "1f1b")]
    + [("dense", Layout(pp=2), {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2}),
       ("moe", Layout(pp=2), {"pp_schedule": "interleaved", "microbatches": 4, "virtual_stages": 2}),
       ("tied", Layout(pp=2), {"pp_schedule": "1f1b", "microbatches": 4})],
    4: [("dense", Layout(pp=4), {"pp_schedule": s, "microbatches": 4}) for s in ("gpipe", "1f1b")]
    + [("moe", Layout(pp=4), {"pp_schedule": "interleaved", "microbatches": 4, "virtual_stages": 2}),
       ("moe", Layout(tp=2, pp=2), {"pp_schedule": "1f1b", "microbatches": 2, "sequence_parallel": True}),
       ("dense", Layout(cp=2, pp=2), {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2}),
       ("moe", Layout(pp=2, dp=2, ep=2), {"pp_schedule": "gpipe", "microbatches": 2, "zero_stage": 2}),
       # Gradient buckets: each chunk's last backward of the step starts them.
       ("moe", Layout(pp=2, dp=2, ep=2), {"pp_schedule": "1f1b", "microbatches": 2, "zero_stage": 2,
                                          "grad_bucket_numel": 200}),
       ("dense", Layout(pp=2, dp=2), {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2,
                                      "zero_stage": 1, "grad_bucket_numel": 150}),
       # ZeRO-2 keeps .grad until a bucket fills: with as many micro-batches as stages, a chunk's last backward
       # frees its gradients before the other chunk's first one (plan.param_grads replays the schedule).
       ("dense", Layout(pp=2, dp=2), {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2,
                                      "zero_stage": 2, "grad_bucket_numel": 150}),
       # ZeRO-3 by unit on each stage: gathered per micro-batch, reduce-scattered after a chunk's last backward.
       ("dense", Layout(pp=2, dp=2), {"pp_schedule": "1f1b", "microbatches": 2, "zero_stage": 3}),
       ("dense", Layout(pp=2, dp=2), {"pp_schedule": "1f1b", "microbatches": 2, "zero_stage": 3,
                                      "zero3_reduce_every_microbatch": True}),
       ("moe", Layout(pp=2, dp=2, ep=2), {"pp_schedule": "gpipe", "microbatches": 2, "zero_stage": 3,
                                          "zero3_keep_params": True}),
       # Tied embeddings: the copies' sum holds every reduction to the step; pp 4 sums over the ends' own group.
       ("tied", Layout(pp=4), {"pp_schedule": "gpipe", "microbatches": 4}),
       ("tied", Layout(tp=2, pp=2), {"pp_schedule": "1f1b", "microbatches": 2, "sequence_parallel": True}),
       ("tied", Layout(pp=2, dp=2), {"pp_schedule": "interleaved", "microbatches": 2, "virtual_stages": 2,
                                     "zero_stage": 2, "grad_bucket_numel": 150}),
       ("tied", Layout(pp=2, dp=2), {"pp_schedule": "1f1b", "microbatches": 2, "zero_stage": 3})],
    8: [("moe", Layout(tp=2, cp=2, pp=2), {"pp_schedule": "1f1b", "microbatches": 2, "sequence_parallel": True,
                                             "distributed_optimizer": True}),
        ("moe", Layout(tp=2, pp=2, dp=2, ep=2), {"pp_schedule": "interleaved", "microbatches": 2,
                                                  "virtual_stages": 2, "zero_stage": 1})],
}


def _config(options: dict) -> ParallelConfig:
    return ParallelConfig(param_dtype="float64", **options)


def run_cases(world: int) -> list[dict]:
    return [layout_run(MODELS[m], layout, _config(opts), per_rank=ROWS) for m, layout, opts in CASES[world]]


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_parallel_matches_one_device_and_the_planner(world):
    results = run_distributed(run_cases, world, args=(world,))
    for i, (model_name, layout, options) in enumerate(CASES[world]):
        check_layout([r[i] for r in results], MODELS[model_name], layout, _config(options),
                     f"{model_name} {layout} {options}", rows=ROWS)


def test_pipeline_settings_that_cannot_run_are_refused():
    from orangetron.parallel import ParallelConfigError
    from orangetron.parallel.pipeline import check_pipeline
    from orangetron.spec.layout import LayoutError
    from orangetron.spec.rules import RuleError
    from orangetron.train.config import TrainConfig, TrainConfigError

    with pytest.raises(LayoutError, match=r"pp=4: num_layers=4 < pp\*virtual_stages=8"):
        check_pipeline(MODELS["dense"], 4, ParallelConfig(pp_schedule="interleaved", virtual_stages=2))
    with pytest.raises(ParallelConfigError, match=r"zero_stage=3 with pp=2 and virtual_stages=2: ZeRO-3 is "
                       r"pipelined with one model chunk per rank only"):
        check_pipeline(MODELS["dense"], 2, ParallelConfig(zero_stage=3, pp_schedule="interleaved", virtual_stages=2))
    with pytest.raises(RuleError, match=r"virtual_stages=2: needs pp_schedule 'interleaved' \(not '1f1b'\)"):
        TrainConfig(model="small-moe", pp=2, virtual_stages=2)
    with pytest.raises(RuleError, match=r"microbatches=3: the interleaved schedule needs a multiple of pp=2"):
        TrainConfig(model="small-moe", pp=2, pp_schedule="interleaved", virtual_stages=2, microbatches=3, batch_size=6)
    with pytest.raises(TrainConfigError, match=r"batch_size=8 \(--batch-size\): must divide by dp\*microbatches=6"):
        TrainConfig(model="small-moe", pp=2, dp=2, microbatches=3)


def test_checkpoints_move_between_pipelined_and_plain_layouts(tmp_path):
    """A pipelined run writes whole tensors by name: the same checkpoint as one rank; a pipelined run resumed
    from a one-rank checkpoint continues exactly as the one-rank run does."""
    import dataclasses
    import shutil

    import torch

    from orangetron.model import model_preset
    from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint
    from orangetron.train.trainer import TrainConfig, train

    model = dataclasses.replace(model_preset("tiny-moe"), aux_loss_coef=0.0)
    base = dict(model=model, seq_len=16, batch_size=4, warmup=1, eval_batches=1, corpus_bytes=200_000,
                param_dtype="float64", microbatches=2)
    one = train(TrainConfig(**base, steps=3, save_every=2, out=str(tmp_path / "one")), progress=False)
    piped = train(TrainConfig(**base, steps=2, save_every=2, pp=2, out=str(tmp_path / "pp")), progress=False)
    step2 = {name: load_checkpoint(tmp_path / name / "checkpoints" / "step-00000002")["params"]
             for name in ("one", "pp")}
    assert set(step2["pp"]) == set(step2["one"])
    torch.testing.assert_close(piped["losses"], one["losses"][:2], rtol=1e-9, atol=0)
    for key, value in step2["one"].items():
        torch.testing.assert_close(step2["pp"][key], value, rtol=1e-9, atol=1e-12, msg=key)
    shutil.copytree(tmp_path / "one", tmp_path / "resumed")
    shutil.rmtree(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))  # keep step 2 only
    resumed = train(TrainConfig(**base, steps=3, pp=2, pp_schedule="gpipe", resume=True,
                                out=str(tmp_path / "resumed")), progress=False)
    torch.testing.assert_close(resumed["losses"], one["losses"], rtol=1e-9, atol=0)
    torch.testing.assert_close(resumed["eval_loss"], one["eval_loss"], rtol=1e-9, atol=0)


def test_a_tied_model_checkpoints_its_embedding_once_and_resumes_into_both_copies(tmp_path):
    """Under ZeRO-3 the last stage's copy of a tied embedding shares its unit with the final norm, so its shards
    are cut elsewhere than the first stage's: the checkpoint must take the first stage's alone (one device's
    tensors), and a resumed run must load both copies (a head left at its seeded values would change the
    losses)."""
    import dataclasses
    import shutil

    import torch

    from orangetron.model import model_preset
    from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint
    from orangetron.train.trainer import TrainConfig, train

    model = dataclasses.replace(model_preset("tiny"), tied_embeddings=True)
    base = dict(model=model, seq_len=16, batch_size=4, warmup=1, eval_batches=1, corpus_bytes=200_000,
                param_dtype="float64", microbatches=2)
    one = train(TrainConfig(**base, steps=3, save_every=2, out=str(tmp_path / "one")), progress=False)
    piped = train(TrainConfig(**base, steps=2, save_every=2, pp=2, dp=2, zero_stage=3, out=str(tmp_path / "pp")),
                  progress=False)
    torch.testing.assert_close(piped["losses"], one["losses"][:2], rtol=1e-9, atol=0)
    saved = {name: load_checkpoint(tmp_path / name / "checkpoints" / "step-00000002") for name in ("one", "pp")}
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        assert set(saved["pp"][kind]) == set(saved["one"][kind])
        for key, value in saved["one"][kind].items():
            torch.testing.assert_close(saved["pp"][kind][key], value, rtol=1e-9, atol=1e-12, msg=f"{kind} {key}")
    shutil.rmtree(latest_checkpoint(tmp_path / "one" / "checkpoints"))  # keep step 2 only
    resumed = train(TrainConfig(**base, steps=3, pp=2, resume=True, out=str(tmp_path / "one")), progress=False)
    torch.testing.assert_close(resumed["losses"], one["losses"], rtol=1e-9, atol=0)
    torch.testing.assert_close(resumed["eval_loss"], one["eval_loss"], rtol=1e-9, atol=0)


def test_verify_command_pipeline(capsys):
    import json

    from orangetron.cli import main

    code = main(["verify", "--pp", "2", "--dp", "2", "--ep", "2", "--zero-stage", "1", "--microbatches", "2",
                 "--pp-schedule", "gpipe", "--steps", "2", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["ok"] and result["layout"]["pp"] == 2 and result["max_grad_rel_diff"] < 1e-12


def test_schedule_measured_runs_the_drawn_schedule(capsys):
    """`schedule --measured` times a real step: each rank runs the drawn order, and holds what it says at its
    peak (GPipe every micro-batch, 1F1B pp - rank)."""
    import json

    from orangetron.cli import main

    for schedule, peaks in (("gpipe", [4, 4]), ("1f1b", [2, 1])):
        assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", schedule, "--measured",
                     "--json"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["measured"] and result["peak_in_flight"] == peaks, schedule
        assert 0 <= result["bubble_fraction"] < 1 and result["formula_bubble_fraction"] == 1 / 5


def test_a_layer_count_pp_does_not_divide_trains_as_one_device_and_as_predicted(tmp_path):
    """Three layers on two stages (two, then one, as the planner splits them): it was refused as 'not divisible by
    pp' though the planner priced such layouts and the docs describe the split. The losses are one device's and
    each stage's memory and traffic the planner's for that stage."""
    import dataclasses

    import torch

    from orangetron.model import model_preset
    from orangetron.train.trainer import TrainConfig, train

    model = dataclasses.replace(model_preset("tiny-moe"), num_layers=3, aux_loss_coef=0.0)
    base = dict(model=model, seq_len=16, batch_size=4, warmup=1, eval_batches=1, corpus_bytes=200_000,
                param_dtype="float64", microbatches=2, steps=2)
    one = train(TrainConfig(**base), progress=False)
    piped = train(TrainConfig(**base, pp=2), progress=False)
    torch.testing.assert_close(piped["losses"], one["losses"], rtol=1e-9, atol=0)
    torch.testing.assert_close(piped["eval_loss"], one["eval_loss"], rtol=1e-9, atol=0)
    assert piped["memory"][0]["params"] > piped["memory"][1]["params"]  # the first stage holds two of the layers
    for memory, traffic, predicted in zip(piped["memory"], piped["comm_per_step"], piped["predicted"], strict=True):
        assert predicted["memory"] == {k: v for k, v in memory.items() if k != "rank"}
        assert predicted["comm_per_step"] == traffic["train"]
