"""Checkpoints: bitwise resume, resume on another layout, and corrupt or partial checkpoints refused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from trainer_reference import assert_matches_reference, reference_training, written_run

from orangetron.model import model_preset
from orangetron.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from orangetron.train.config import TrainConfig, TrainConfigError
from orangetron.train.schedule import lr_at
from orangetron.train.trainer import train

torch.set_num_threads(1)
NO_AUX = dataclasses.replace(model_preset("tiny-moe"), aux_loss_coef=0.0)  # per-rank balancing differs on dp > 1
SMALL = dict(model=NO_AUX, seq_len=32, batch_size=4, warmup=2, eval_batches=2, corpus_bytes=200_000)
SMALL_MIN_LR = TrainConfig.min_lr


def _run(**overrides) -> dict:
    return train(TrainConfig(**{**SMALL, **overrides}), progress=False)


def test_resume_continues_bitwise(tmp_path) -> None:
    straight = _run(steps=6, out=str(tmp_path / "straight"))
    first = _run(steps=6, stop_after=3, out=str(tmp_path))
    assert first["losses"] == straight["losses"][:3]
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-00000003"
    resumed = _run(steps=6, out=str(tmp_path), resume=True)
    assert resumed["losses"] == straight["losses"]  # bitwise: parameters, moments, step count and data order
    assert resumed["eval_loss"] == straight["eval_loss"]
    ends = written_run(tmp_path), written_run(tmp_path / "straight")
    assert ends[0]["grad_norms"] == ends[1]["grad_norms"]
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(ends[0][key][name], value) for name, value in ends[1][key].items()), key
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-00000006"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6  # the resumed run appended its steps


def test_resume_on_another_layout(tmp_path) -> None:
    """Saved by two ZeRO-3 ranks (sharded state gathered), resumed on one rank: the trajectory of plain
    one-device torch, step for step (gradient norms) and in the final parameters and moments."""
    saved = _run(steps=5, stop_after=3, dtype="float64", dp=2, zero_stage=3, out=str(tmp_path))
    resumed = _run(steps=5, dtype="float64", out=str(tmp_path), resume=True)
    reference = reference_training(TrainConfig(**{**SMALL, "steps": 5, "dtype": "float64"}))
    assert_matches_reference(resumed, tmp_path, reference, rtol=1e-9)
    # Saving gathers the shards and averages the losses, but that is not training traffic: the run's
    # ledger holds only 2 parameter gathers per step (a stopped run does not evaluate) and one clipping scalar
    # per step.
    shard = -(-saved["params"] // 2) * 8
    assert saved["comm"][0]["all_gather/dp_cp"] == 2 * 3 * shard
    assert saved["comm"][0]["all_reduce/dp_cp"] == 3 * 8


def test_checkpoint_round_trip_and_refusals(tmp_path) -> None:
    state = {"params": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4, "losses": [1.5, 1.25]}
    path = save_checkpoint(tmp_path, 4, state)
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["params"]["w"], state["params"]["w"]) and loaded["losses"] == [1.5, 1.25]
    (tmp_path / ".step-00000009.partial-abcd").mkdir()  # what a crash mid-save leaves: never picked
    assert latest_checkpoint(tmp_path) == path

    blob = bytearray((path / "state.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (path / "state.pt").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"state.pt: size or checksum differs from the manifest"):
        load_checkpoint(path)
    (path / "manifest.json").write_text('{"format": 1, "step": 4, "files": {}}')  # verifies nothing
    with pytest.raises(CheckpointError, match=r"lists no state.pt"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no manifest.json; not a complete checkpoint"):
        load_checkpoint(path)


def test_resume_needs_a_matching_checkpoint(tmp_path) -> None:
    with pytest.raises(TrainConfigError, match=r"resume=True \(--resume\): needs --out DIR"):
        TrainConfig(**SMALL, resume=True)
    with pytest.raises(TrainConfigError, match=r"no checkpoint under"):
        _run(steps=2, out=str(tmp_path), resume=True)
    _run(steps=2, out=str(tmp_path), save_every=2)
    with pytest.raises(TrainConfigError, match=r"holds a model with dim=64, this run builds dim=128"):
        _run(steps=4, out=str(tmp_path), resume=True, model=dataclasses.replace(NO_AUX, dim=128))
    with pytest.raises(TrainConfigError, match=r"already at step 2; raise --steps and add --extend"):
        _run(steps=2, out=str(tmp_path), resume=True)


# ---- the run's schedule, stopping, and what a resumed run writes ----------------------------------------


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_stopped_and_resumed_run_is_the_straight_run(tmp_path) -> None:
    """k of 2k steps, stopped, then resumed: bitwise the losses of 2k straight steps, and every step's lr."""
    straight = _run(steps=6, dtype="float64", out=str(tmp_path / "straight"))
    stopped = _run(steps=6, stop_after=3, dtype="float64", out=str(tmp_path / "run"))
    assert len(stopped["losses"]) == 3
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step-00000003"
    resumed = _run(steps=6, dtype="float64", out=str(tmp_path / "run"), resume=True)
    assert resumed["losses"] == straight["losses"]
    lrs = [r["lr"] for r in _records(tmp_path / "run")]
    assert lrs == [r["lr"] for r in _records(tmp_path / "straight")]
    assert lrs[:3] == [lr_at(s, TrainConfig(**SMALL, steps=6)) for s in range(3)]  # not a 3-step schedule


def test_resume_keeps_the_schedule_and_extends_only_when_asked(tmp_path) -> None:
    out = str(tmp_path / "run")
    _run(steps=4, stop_after=2, out=out)
    with pytest.raises(TrainConfigError, match=r"lr=0.001 \(--lr\): .* with lr=0.002; a resumed run keeps its"):
        _run(steps=4, lr=1e-3, min_lr=1e-4, out=out, resume=True)
    with pytest.raises(TrainConfigError, match=r"steps=6 \(--steps\): .* run of 4 steps; add --extend"):
        _run(steps=6, out=out, resume=True)
    with pytest.raises(TrainConfigError, match=r"steps=3 \(--steps\): .* give --steps 4, with --stop-after"):
        _run(steps=3, out=out, resume=True)
    _run(steps=7, out=out, resume=True, extend=True, stop_after=5)
    _run(steps=7, out=out, resume=True)  # the extended run's checkpoint keeps the 4-step cosine
    straight = _run(steps=4, out=str(tmp_path / "straight"))
    lrs = [r["lr"] for r in _records(out)]
    assert lrs[:4] == [r["lr"] for r in _records(tmp_path / "straight")] and len(straight["losses"]) == 4
    assert lrs[3:] == [SMALL_MIN_LR] * 4  # the cosine ended at step 4; then min_lr holds


def test_out_checkpoints_the_last_step_and_resume_rewrites_later_metrics(tmp_path, capsys) -> None:
    _run(steps=2, out=str(tmp_path / "plain"))  # no --save-every
    assert latest_checkpoint(tmp_path / "plain" / "checkpoints").name == "step-00000002"

    _run(steps=5, save_every=2, out=str(tmp_path))
    before = _records(tmp_path)
    for step in (4, 5):  # the newer checkpoints are gone: the run resumes from step 2
        shutil.rmtree(tmp_path / "checkpoints" / f"step-{step:08d}")
    capsys.readouterr()
    train(TrainConfig(**SMALL, steps=5, out=str(tmp_path), resume=True), progress=True)
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000002'} at step 2 of 5" in capsys.readouterr().err
    after = _records(tmp_path)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert [(r["loss"], r["lr"]) for r in after] == [(r["loss"], r["lr"]) for r in before]


def test_checksummed_random_bytes_are_one_line_checkpoint_error(tmp_path) -> None:
    path = save_checkpoint(tmp_path, 1, {"step": 1})
    (path / "state.pt").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    manifest = json.loads((path / "manifest.json").read_text())  # rewritten to match, as a careless copy would
    manifest["files"]["state.pt"] = {"bytes": 4096, "sha256": hashlib.sha256((path / "state.pt").read_bytes())
                                     .hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"state.pt: matches its manifest but is not a state") as err:
        load_checkpoint(path)
    assert "\n" not in str(err.value) and "weights_only" not in str(err.value)
