"""Checkpoints: bitwise resume, resume on another layout, export, and corrupt or partial checkpoints refused."""

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
from orangetron.train import trainer
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


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory) -> dict:
    """float64 runs of 6 steps: straight on one rank and on dp=2 ZeRO-3, and runs stopped after step 3 on
    each, resumed on the same layout and on the other (one launch of two ranks per dp=2 run)."""
    root = tmp_path_factory.mktemp("resume")
    one, two = dict(param_dtype="float64"), dict(param_dtype="float64", dp=2, zero_stage=3)
    runs = {"one": _run(steps=6, out=str(root / "one"), **one), "two": _run(steps=6, out=str(root / "two"), **two)}
    runs["stopped two"] = _run(steps=6, stop_after=3, out=str(root / "two->two"), **two)
    shutil.copytree(root / "two->two", root / "two->one")
    runs["stopped one"] = _run(steps=6, stop_after=3, out=str(root / "one->two"), **one)
    runs["two->two"] = _run(steps=6, out=str(root / "two->two"), resume=True, **two)
    runs["two->one"] = _run(steps=6, out=str(root / "two->one"), resume=True, **one)
    runs["one->two"] = _run(steps=6, out=str(root / "one->two"), resume=True, **two)
    return {"root": root, **runs}


def test_stop_and_resume_is_bitwise_on_the_same_layout_and_1e12_on_another(dp2_runs) -> None:
    """k = 3 of 2k = 6 steps, stopped and resumed: bitwise the straight run's losses on the same layout (dp=2
    ZeRO-3), within 1e-12 relative of both straight runs after moving dp=2 ZeRO-3 -> 1 rank and back; every
    step's learning rate is the straight run's."""
    runs, root = dp2_runs, dp2_runs["root"]
    assert runs["stopped two"]["losses"] == runs["two"]["losses"][:3]
    assert runs["two->two"]["losses"] == runs["two"]["losses"]
    assert runs["two->two"]["eval_loss"] == runs["two"]["eval_loss"]
    for moved in ("two->one", "one->two"):
        for straight in ("one", "two"):
            assert _max_rel(runs[moved]["losses"], runs[straight]["losses"]) <= 1e-12, (moved, straight)
    straight_lrs = [r["lr"] for r in _records(root / "one")]
    assert straight_lrs == [r["lr"] for r in _records(root / "two")]
    for moved in ("two->two", "two->one", "one->two"):
        records = _records(root / moved)
        assert [r["step"] for r in records] == list(range(1, 7)), moved
        assert [r["lr"] for r in records] == straight_lrs, moved


def test_resumed_on_another_layout_follows_plain_torch(dp2_runs) -> None:
    """Saved by two ZeRO-3 ranks (each writing its shard), resumed on one rank: the trajectory of plain
    one-device torch, step for step (gradient norms) and in the final parameters and moments."""
    reference = reference_training(TrainConfig(**{**SMALL, "steps": 6, "param_dtype": "float64"}))
    assert_matches_reference(dp2_runs["two->one"], dp2_runs["root"] / "two->one", reference, rtol=1e-9)
    # Saving is not training traffic: the stopped run's ledger holds only 2 parameter gathers per step (a
    # stopped run does not evaluate) and one clipping scalar per step.
    saved = dp2_runs["stopped two"]
    shard = -(-saved["params"] // 2) * 8
    assert saved["comm"][0]["all_gather/dp_cp"] == 2 * 3 * shard
    assert saved["comm"][0]["all_reduce/dp_cp"] == 3 * 8


def test_export_is_the_trained_model_for_the_reference_transformer(dp2_runs, capsys) -> None:
    """`orangetron export` of the dp=2 ZeRO-3 run: one file that torch.load(weights_only=True) reads and the
    reference Transformer loads strictly, holding plain torch's parameters after the same 6 steps."""
    from orangetron.cli import main
    from orangetron.model import Transformer

    out = dp2_runs["root"] / "model.pt"
    assert main(["export", str(dp2_runs["root"] / "two"), "-o", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["output"] == str(out) and printed["checkpoint"].endswith("step-00000006")
    exported = torch.load(out, weights_only=True)
    model = Transformer(TrainConfig(**SMALL).model_config(), seed=123, dtype=torch.float64)
    model.load_state_dict(exported, strict=True)
    reference = reference_training(TrainConfig(**{**SMALL, "steps": 6, "param_dtype": "float64"}))
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), reference["params"][name], rtol=1e-9,
                                   atol=1e-9 * reference["params"][name].abs().max().item(), msg=name)
    assert main(["export", str(dp2_runs["root"] / "nowhere"), "-o", str(out)]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_checkpoint_round_trip_and_refusals(tmp_path) -> None:
    state = {"params": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4, "losses": [1.5, 1.25]}
    path = save_checkpoint(tmp_path, 4, state)
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["params"]["w"], state["params"]["w"]) and loaded["losses"] == [1.5, 1.25]
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json", "state.json"]
    (tmp_path / ".step-00000009.partial-abcd").mkdir()  # what a crash mid-save leaves: never picked
    assert latest_checkpoint(tmp_path) == path
    # A run folder or its checkpoints folder given for a checkpoint was called incomplete, as if damaged.
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: a folder of checkpoints, not one; its latest is {path}$"):
        load_checkpoint(tmp_path)
    run = tmp_path / "run"
    in_run = save_checkpoint(run / "checkpoints", 2, state)
    with pytest.raises(CheckpointError, match=rf"{run}: a folder of checkpoints, not one; its latest is {in_run}$"):
        load_checkpoint(run)

    shard = path / "__0_0.distcp"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: size or checksum differs from the manifest"):
        load_checkpoint(path)
    (path / "manifest.json").write_text('{"format": 2, "step": 4, "files": {}}')  # verifies nothing
    with pytest.raises(CheckpointError, match=r"lists no .metadata"):
        load_checkpoint(path)
    (path / "manifest.json").write_text('{"format": 1, "step": 4, "files": {"state.pt": {}}}')
    with pytest.raises(CheckpointError, match=r"format 1 \(one state.pt gathered on rank 0\).* reads format 2 only"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no manifest.json; not a complete checkpoint"):
        load_checkpoint(path)


def _rewrite_manifest(path: Path, name: str) -> None:
    """Make the manifest vouch for `name` as it is now, as a careless copy would."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (path / name).stat().st_size,
                               "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))


class _Planted:
    """Unpickling this calls os.mkdir(folder): code a checkpoint's metadata must never get to run."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __reduce__(self):
        import os

        return os.mkdir, (self.folder,)


def test_metadata_that_would_run_code_is_refused_even_with_a_matching_manifest(tmp_path) -> None:
    import pickle

    path = save_checkpoint(tmp_path, 1, {"w": torch.ones(3)})
    planted = tmp_path / "planted"
    (path / ".metadata").write_bytes(pickle.dumps(_Planted(str(planted))))
    _rewrite_manifest(path, ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata: not checkpoint metadata .*posix.mkdir is not a checkpoint"):
        load_checkpoint(path)
    assert not planted.exists()


def test_resume_needs_a_matching_checkpoint(tmp_path) -> None:
    with pytest.raises(TrainConfigError, match=r"resume=True \(--resume\): needs --out DIR"):
        TrainConfig(**SMALL, resume=True)
    with pytest.raises(TrainConfigError, match=r"no checkpoint under"):
        _run(steps=2, out=str(tmp_path), resume=True)
    _run(steps=2, out=str(tmp_path), save_every=2)
    with pytest.raises(TrainConfigError, match=r"recorded with model hidden_size=64, this one has 128"):
        _run(steps=4, out=str(tmp_path), resume=True, model=NO_AUX.with_changes(hidden_size=128))
    (tmp_path / "config.toml").unlink()  # a folder without its record: the checkpoint's own record refuses
    with pytest.raises(TrainConfigError, match=r"holds a model with hidden_size=64, this run builds hidden_size=128"):
        _run(steps=4, extend=True, out=str(tmp_path), resume=True, model=NO_AUX.with_changes(hidden_size=128))
    finished = (r"^resume=True \(--resume\): .*step-00000002 is already at step 2 of steps=2; to train further, "
                r"raise --steps \(with --extend")
    with pytest.raises(TrainConfigError, match=finished):
        _run(steps=2, out=str(tmp_path), resume=True)


# NO_AUX's record as a checkpoint held it before the one model schema: the runtime's ModelConfig fields.
OLD_RUNTIME_RECORD = {
    "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": 192, "n_experts": 4,
    "top_k": 2, "moe_ffn_dim": 64, "n_shared_experts": 1, "moe_layer_freq": 1, "router_score": "softmax",
    "aux_loss_coef": 0.0, "router_z_loss_coef": 0.0, "n_expert_groups": 1, "topk_groups": 1,
    "router_bias_rate": 0.0, "rope_theta": 10000.0, "norm_eps": 1e-05, "tied_embeddings": False,
    "max_seq_len": 1024, "init_std": 0.02,
}


def test_a_checkpoint_recording_the_old_runtime_names_resumes(tmp_path) -> None:
    straight = _run(steps=4, out=str(tmp_path / "straight"))
    _run(steps=4, stop_after=2, out=str(tmp_path / "run"))
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    state = json.loads((path / "state.json").read_text())
    assert state["model"] == dataclasses.asdict(NO_AUX)  # written by the schema's field names
    state["model"] = OLD_RUNTIME_RECORD
    (path / "state.json").write_text(json.dumps(state))
    _rewrite_manifest(path, "state.json")
    (tmp_path / "run" / "config.toml").unlink()  # as a folder of that time: no [model] in its record
    with pytest.raises(TrainConfigError, match=r"holds a model with hidden_size=64, this run builds hidden_size=128"):
        _run(steps=4, out=str(tmp_path / "run"), resume=True, model=NO_AUX.with_changes(hidden_size=128))
    assert _run(steps=4, out=str(tmp_path / "run"), resume=True)["losses"] == straight["losses"]


# ---- the run's schedule, stopping, and what a resumed run writes ----------------------------------------


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_stopped_and_resumed_run_is_the_straight_run(tmp_path) -> None:
    """k of 2k steps, stopped, then resumed: bitwise the losses of 2k straight steps, and every step's lr."""
    straight = _run(steps=6, param_dtype="float64", out=str(tmp_path / "straight"))
    stopped = _run(steps=6, stop_after=3, param_dtype="float64", out=str(tmp_path / "run"))
    assert len(stopped["losses"]) == 3
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step-00000003"
    resumed = _run(steps=6, param_dtype="float64", out=str(tmp_path / "run"), resume=True)
    assert resumed["losses"] == straight["losses"]
    lrs = [r["lr"] for r in _records(tmp_path / "run")]
    assert lrs == [r["lr"] for r in _records(tmp_path / "straight")]
    assert lrs[:3] == [lr_at(s, TrainConfig(**SMALL, steps=6)) for s in range(3)]  # not a 3-step schedule


def test_resume_keeps_the_schedule_and_extends_only_when_asked(tmp_path, monkeypatch) -> None:
    out = str(tmp_path / "run")
    _run(steps=4, stop_after=2, out=out)
    with monkeypatch.context() as patched:  # refused before any rank starts
        patched.setattr(trainer, "_train", lambda cfg, progress: pytest.fail("a rank started"))
        for steps, says in ((3, "give --steps 4"), (6, "add --extend")):
            with pytest.raises(TrainConfigError, match=says):
                _run(steps=steps, out=out, resume=True)
    with pytest.raises(TrainConfigError, match=r"lr=0.001 \(--lr\): .* recorded with lr=0.002, and a resumed run"):
        _run(steps=4, lr=1e-3, min_lr=1e-4, out=out, resume=True)
    record = (tmp_path / "run" / "config.toml").read_text()
    (tmp_path / "run" / "config.toml").unlink()  # without the record, the checkpoint's schedule refuses it
    with pytest.raises(TrainConfigError, match=r"lr=0.001 \(--lr\): .* with lr=0.002; a resumed run keeps its"):
        _run(steps=4, lr=1e-3, min_lr=1e-4, out=out, resume=True)
    (tmp_path / "run" / "config.toml").write_text(record)
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
    path = save_checkpoint(tmp_path, 1, {"w": torch.ones(3), "step": 1})
    (path / "__0_0.distcp").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    _rewrite_manifest(path, "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: matches its manifest but is not a state") as err:
        load_checkpoint(path)
    assert "\n" not in str(err.value) and "weights_only" not in str(err.value)
