"""Tensor parallelism through the product: `train`, `verify` and checkpoints that change layout."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from orangetron.cli import main
from orangetron.model import model_preset
from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint
from orangetron.train.trainer import TrainConfig, train

NO_AUX = dataclasses.replace(model_preset("tiny-moe"), aux_loss_coef=0.0)  # per-rank balancing differs by layout
SMALL = dict(model=NO_AUX, seq_len=32, batch_size=4, warmup=2, eval_batches=2, corpus_bytes=200_000,
             param_dtype="float64")


def _run(**overrides) -> dict:
    return train(TrainConfig(**{**SMALL, **overrides}), progress=False)


def _final_params(folder) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(folder / "checkpoints"))["params"]


@pytest.mark.parametrize("saved, resumed", [
    (dict(tp=2, sequence_parallel=True), dict(dp=2, zero_stage=3)),
    (dict(), dict(tp=2, dp=2, zero_stage=1, sequence_parallel=True)),
    # Bucketed shards: each rank owns a slice of every bucket, yet the checkpoint holds whole tensors.
    (dict(dp=2, zero_stage=2, grad_bucket_numel=7000), dict(tp=2, dp=2, distributed_optimizer=True,
                                                             sequence_parallel=True, grad_bucket_numel=5000)),
])
def test_checkpoint_moves_between_tensor_parallel_layouts(tmp_path, saved, resumed):
    """Save at step 3 on one layout, resume to step 5 on another: the one-rank run's losses and weights."""
    straight = _run(steps=5, out=str(tmp_path / "straight"), save_every=5)
    first = _run(steps=5, stop_after=3, out=str(tmp_path / "moved"), **saved)
    torch.testing.assert_close(first["losses"], straight["losses"][:3], rtol=1e-9, atol=0)
    state = load_checkpoint(latest_checkpoint(tmp_path / "moved" / "checkpoints"))
    ref_shapes = {n: p.shape for n, p in _final_params(tmp_path / "straight").items()}
    assert {n: p.shape for n, p in state["params"].items()} == ref_shapes  # whole tensors, not shards
    second = _run(steps=5, out=str(tmp_path / "moved"), resume=True, **resumed)
    torch.testing.assert_close(second["losses"], straight["losses"], rtol=1e-9, atol=0)
    ref = _final_params(tmp_path / "straight")
    for name, value in _final_params(tmp_path / "moved").items():
        torch.testing.assert_close(value, ref[name], rtol=1e-9, atol=1e-12, msg=name)


def test_bfloat16_tensor_parallel_trains_close_to_float64():
    """bf16 parameters with fp32 main copies under tp=2 and SP: finite, falling, and within bf16 rounding
    (2e-2 relative: a bf16 mantissa of 8 bits is 4e-3 per rounding, a few roundings deep) of float64."""
    f64 = _run(steps=6, lr=1e-2)
    bf16 = _run(steps=6, lr=1e-2, tp=2, sequence_parallel=True, param_dtype="bfloat16")
    assert bf16["losses"][-1] < bf16["losses"][0]
    torch.testing.assert_close(bf16["losses"], f64["losses"], rtol=2e-2, atol=0)
    per_rank = bf16["memory"]
    assert len(per_rank) == 2 and per_rank[0]["main_params"] == per_rank[0]["params"] * 2  # fp32 copy of bf16


def _verify(capsys, *flags: str) -> dict:
    code = main(["verify", "--steps", "2", "--json", *flags])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == (0 if result["ok"] else 1)
    return result


def test_verify_command_tensor_parallel(capsys):
    f64 = _verify(capsys, "--tp", "2", "--sequence-parallel", "--param-dtype", "float64")
    assert f64["ok"] and f64["max_grad_rel_diff"] < 1e-12 and f64["layout"]["tp"] == 2
    f32 = _verify(capsys, "--tp", "2", "--dp", "2", "--zero-stage", "3", "--dtype", "float32")  # the old spelling
    assert f32["ok"] and f32["tolerance"] == 1e-5 and f32["max_grad_rel_diff"] < 1e-5


def test_verify_of_one_rank_is_bitwise_and_its_tolerance_follows_the_reduce_dtype(capsys):
    """The one-rank reference ran on torch's default threads while the launched rank ran on one, so one rank
    against itself differed (9e-8 in float32); and gradients reduced in bfloat16 were held to float64's 1e-9."""
    import subprocess
    import sys

    from signalled_runs import env

    from orangetron.train.config import TrainConfig
    from orangetron.train.verify import default_tolerance

    # A command of its own, started as a user starts it: torch's default threads, not this test process's one.
    started = {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "orangetron", "verify", "--param-dtype", "float32", "--json"],
                          env=started, capture_output=True, text=True, timeout=300)
    one = json.loads(done.stdout.strip().splitlines()[-1])
    assert one["ok"] and one["max_grad_rel_diff"] == 0.0 and one["max_loss_rel_diff"] == 0.0
    assert default_tolerance(TrainConfig(model="tiny", dp=2, param_dtype="float64", reduce_dtype="bfloat16")) == 5e-2
    assert default_tolerance(TrainConfig(model="tiny", dp=2, param_dtype="float64")) == 1e-9


def test_train_refuses_a_layout_the_model_cannot_split(capsys):
    assert main(["train", "--model", "tiny-moe", "--tp", "3", "--steps", "1"]) == 2
    assert "tp=3 (--tp): n_heads=4 is not divisible by tp" in capsys.readouterr().err
    assert main(["train", "--tp", "2", "--sequence-parallel", "--seq-len", "33", "--steps", "1"]) == 2
    assert "sequence_parallel needs seq_len/cp=33 divisible by tp" in capsys.readouterr().err


def test_every_layout_reports_the_whole_model_parameter_count():
    from orangetron.model import Transformer

    whole = sum(p.numel() for p in Transformer(NO_AUX).parameters())
    result = _run(steps=1, tp=2, dp=2, ep=2, sequence_parallel=True)  # each rank holds a fraction
    assert result["params"] == whole
    assert result["memory"][0]["params"] < 0.6 * whole * 8  # float64 shards: about half (norms stay whole)


def test_readme_python_example_runs_as_a_script(tmp_path):
    """The README's "Using the pieces" snippet, saved to a file and run as a user would."""
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("```python\n", readme.index("## Using the pieces")) + len("```python\n")
    script = tmp_path / "example.py"
    script.write_text(readme[start:readme.index("```", start)])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["0", "1", "2", "3"]
    assert all("'reduce_scatter/tp'" in line and "'reduce_scatter/dp_cp'" in line for line in lines)


def test_verify_refuses_a_negative_tolerance(capsys):
    assert main(["verify", "--tolerance", "-1"]) == 2  # one rank: its warning came first, the refusal second
    assert capsys.readouterr().err == "orangetron verify: error: tolerance=-1.0 (--tolerance): must be a finite " \
        "number >= 0\n"
