"""A run folder belongs to one run: the record, resume restoring it, refusals, --overwrite, --config repeats.

Workflow tests, as a user meets them: through `orangetron train` (cli.main, in this process) on tiny runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from orangetron import cli
from orangetron.train.config import TrainConfig
from orangetron.train.trainer import train

torch.set_num_threads(1)

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n" * 60
SMALL = ["--seq-len", "16", "--batch-size", "4", "--warmup", "1", "--eval-batches", "1", "--quiet", "--json"]
CUSTOM_MODEL = """# a model no preset has: one expert per token out of three, no shared expert
hidden_size = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
vocab_size = 256
ffn_hidden_size = 48
num_experts = 3
top_k = 1
moe_ffn_hidden_size = 24
aux_loss_coef = 0.02
max_seq_len = 64
"""


def _train(capsys, *argv: str) -> tuple[int, dict | None, str]:
    """Exit code, the --json object (None on failure) and standard error of `orangetron train argv`."""
    code = cli.main(["train", *argv])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, json.loads(lines[-1]) if code == 0 and lines else None, captured.err


def _losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def data(tmp_path) -> Path:
    path = tmp_path / "mine.txt"
    path.write_text(TEXT)
    return path


def test_resume_restores_the_record_and_refuses_what_may_not_change(tmp_path, data, capsys) -> None:
    whole, run = tmp_path / "whole", tmp_path / "run"
    options = ["--model", "tiny", "--data", str(data), "--steps", "6", "--lr", "0.003", "--save-every", "2", *SMALL]
    code, uninterrupted, _ = _train(capsys, *options, "--out", str(whole))
    assert code == 0
    code, _, err = _train(capsys, *options, "--out", str(run), "--stop-after", "3")
    # under --quiet too: the way to continue was hidden with the log (a trial's SIGINT exited 130 without a word)
    assert code == 0 and "orangetron train: stopped after step 3 of 6; continue with --resume" in err
    # Records written before directives were left out of them held `stop_after`: never restored.
    recorded = (run / "config.toml").read_text()
    (run / "config.toml").write_text("stop_after = 3\n" + recorded)

    # Every option the resume does not give comes back from the record: the data, --lr, --save-every.
    code, resumed, _ = _train(capsys, "--out", str(run), "--resume", "--quiet", "--json")
    assert code == 0 and resumed["losses"] == uninterrupted["losses"]
    assert (run / "checkpoints" / "step-00000004").is_dir()  # --save-every 2 was restored
    assert (run / "config.toml").read_text() == recorded  # nothing changed, nothing rewritten differently
    assert not (run / "changes.jsonl").exists()

    # A flag that would change the run is refused by name; a changeable one is taken and logged.
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--lr", "0.01", "--steps", "8", "--extend")
    assert code == 2 and "lr=0.01 (--lr): the run in" in err and "recorded with lr=0.003" in err
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--seed", "3", "--steps", "8", "--extend")
    assert code == 2 and "seed=3 (--seed)" in err
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--model", "tiny-moe", "--steps", "8", "--extend")
    assert code == 2 and "model num_experts=0" in err
    code, _, _ = _train(capsys, "--out", str(run), "--resume", "--steps", "8", "--extend", "--dp", "2",
                        "--quiet", "--json")
    assert code == 0
    change = json.loads((run / "changes.jsonl").read_text().splitlines()[-1])
    assert change == {"from_step": 7, "changed": {"steps": [6, 8], "schedule_steps": [None, 6], "dp": [1, 2]}}
    saved = tomllib.loads((run / "config.toml").read_text())
    kept = ("steps", "schedule_steps", "dp", "lr", "save_every")
    assert tuple(saved[name] for name in kept) == (8, 6, 2, 0.003, 2)


def test_resume_on_changed_data_is_refused_unless_new_data_is_given(tmp_path, data, capsys) -> None:
    run = tmp_path / "run"
    assert _train(capsys, "--model", "tiny", "--data", str(data), "--steps", "4", "--stop-after", "2", *SMALL,
                  "--out", str(run))[0] == 0
    data.write_text(TEXT.replace("fox", "cat"))  # same path, other text
    code, _, err = _train(capsys, "--out", str(run), "--resume")
    assert code == 2 and "data (--data): differs from the run's record" in err and "--new-data" in err
    other = tmp_path / "other.txt"
    other.write_text(TEXT.upper())
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--data", str(other))
    assert code == 2 and "differs from the run's record" in err
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--new-data")  # the data must be named
    assert code == 2 and "new_data=True (--new-data): give the new data with --data" in err
    assert _train(capsys, "--out", str(run), "--resume", "--data", str(other), "--new-data", "--quiet")[0] == 0
    change = json.loads((run / "changes.jsonl").read_text())
    assert change["from_step"] == 3 and change["changed"]["data"] == [[str(data)], [str(other)]]
    old, new = change["changed"]["data_record"]
    assert new["files"][0]["path"] == str(other) and old["sha256"] != new["sha256"]
    assert new["sha256"] == hashlib.sha256(TEXT.upper().encode()).hexdigest()  # the text the model read


def test_a_folder_another_train_runs_in_is_refused_until_it_ends(tmp_path, capsys) -> None:
    """Two processes once trained in one folder at once (a resume started beside the running run): both wrote
    checkpoints and metrics.jsonl, which ended torn. The running one holds the folder's lock; a resume and an
    --overwrite are refused while it does, nothing moved, and run once it is gone."""
    import fcntl
    import os

    run = tmp_path / "run"
    base = ["--model", "tiny", "--steps", "2", "--corpus-bytes", "50000", *SMALL, "--out", str(run)]
    assert _train(capsys, *base)[0] == 0
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    fd = os.open(run / ".lock", os.O_RDWR)  # as the running process holds it: its own open file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, b"4242  \n", 0)
        for extra in (("--resume", "--steps", "3", "--extend"), ("--seed", "1", "--overwrite")):
            code, _, err = _train(capsys, *base, *extra)
            assert code == 2 and err == (f"orangetron train: error: out={str(run)!r} (--out): another `orangetron "
                                         "train` is running in this folder (process 4242); wait for it to end, or "
                                         "stop it first\n"), extra
            assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
            assert not (tmp_path / "run.previous-1").exists()
    finally:
        os.close(fd)
    assert _train(capsys, *base, "--resume", "--steps", "3", "--extend")[0] == 0


def test_the_lock_holds_for_ranks_already_in_a_group_for_a_folder_still_setting_up_and_not_after_a_refusal(
        tmp_path, capsys, monkeypatch) -> None:
    """Found by review: ranks that call `train` inside their own process group (no RANK set) each took themselves
    for the one to lock, and refused each other; a run still setting up (its lock only) was not named to a
    resume beside it; and a run refused once it held a new folder left the folder behind, holding `.lock`."""
    import fcntl
    import os

    from orangetron.train import folder_lock
    from orangetron.train.launch import launch_local

    monkeypatch.delenv("RANK", raising=False)
    cfg = TrainConfig(model="tiny", steps=1, seq_len=16, batch_size=4, warmup=0, corpus_bytes=50_000, dp=2,
                      out=str(tmp_path / "group"))
    results = launch_local(train, 2, args=(cfg, False))
    assert len(results) == 2 and (tmp_path / "group" / "config.toml").is_file()
    setting_up = tmp_path / "setting-up"
    setting_up.mkdir()
    fd = os.open(setting_up / folder_lock.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = _train(capsys, "--model", "tiny", "--steps", "1", *SMALL, "--out", str(setting_up), "--resume")
        assert code == 2 and "another `orangetron train` is running in this folder" in err and "checkpoint" not in err
    finally:
        os.close(fd)
    (tmp_path / "few.txt").write_text("hello world\n")
    code, _, err = _train(capsys, "--model", "tiny", "--steps", "1", "--seq-len", "64", "--batch-size", "8",
                          "--data", str(tmp_path / "few.txt"), "--out", str(tmp_path / "refused"))
    assert code == 2 and "only 0 samples" in err and not (tmp_path / "refused").exists()
    (tmp_path / "mine").mkdir()  # the user's own empty folder stays, empty
    code, _, err = _train(capsys, "--model", "tiny", "--steps", "1", "--seq-len", "64", "--batch-size", "8",
                          "--data", str(tmp_path / "few.txt"), "--out", str(tmp_path / "mine"))
    assert code == 2 and list((tmp_path / "mine").iterdir()) == []


def test_a_lock_file_swapped_under_the_lock_is_refused_and_a_filesystem_without_locks_runs_with_a_warning(
        tmp_path, capsys, monkeypatch) -> None:
    """A process that opened the lock file just before the holder moved the folder aside (`--overwrite`) and
    then locked the old file must not take the new folder; and where flock is not supported at all (ENOLCK on
    NFS without a lock daemon) a run still runs, saying a second one would not be refused."""
    import errno
    import fcntl

    from orangetron.train import folder_lock

    folder = tmp_path / "run"
    real_flock = fcntl.flock

    def swapped(fd, op):  # the holder's move and new lock file, between this process's open and its lock
        real_flock(fd, op)
        (folder / folder_lock.LOCK_FILE).unlink()
        (folder / folder_lock.LOCK_FILE).write_text("")

    monkeypatch.setattr(folder_lock.fcntl, "flock", swapped)
    with pytest.raises(folder_lock.TrainConfigError, match=r"another `orangetron train` is running in this folder "
                                                           r"\(it took the folder just now\)"):
        folder_lock.take(folder)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_locks)
    code, _, err = _train(capsys, "--model", "tiny", "--steps", "1", *SMALL, "--out", str(tmp_path / "nfs"))
    assert code == 0 and f"warning: the filesystem of {tmp_path / 'nfs'} takes no locks (No locks available): a " \
        "second `orangetron train` into it would not be refused" in err


def test_an_out_that_cannot_be_written_is_one_line_before_any_rank_starts(capsys) -> None:
    out = Path("/sys/kernel/orangetron-run")  # sysfs makes no folder, for root too: once rank 0's traceback
    if not out.parent.is_dir():
        pytest.skip("no /sys/kernel here")
    code, _, err = _train(capsys, "--model", "tiny", "--steps", "1", "--dp", "2", *SMALL, "--out", str(out))
    assert code == 2 and err.startswith(f"orangetron train: error: out={str(out)!r} (--out): cannot write there (")
    assert err.endswith(("(Operation not permitted)\n", "(Permission denied)\n")) and len(err.splitlines()) == 1


def test_a_folder_whose_run_saved_no_checkpoint_says_so_to_a_resume_and_a_new_run(tmp_path, capsys) -> None:
    """A run stopped before its first save (a rank crash, a NaN) leaves its record and metrics: a new run was told
    to resume it, and the resume that there was no checkpoint, round in a circle."""
    run = tmp_path / "run"
    base = ["--model", "tiny", "--steps", "2", "--corpus-bytes", "50000", *SMALL, "--out", str(run)]
    assert _train(capsys, *base)[0] == 0
    shutil.rmtree(run / "checkpoints")
    code, _, err = _train(capsys, *base)
    assert code == 2 and "the folder holds a run that saved no checkpoint (config.toml, metrics.jsonl), so nothing " \
        "to resume; choose another folder, or add --overwrite to move it aside" in err and "--resume" not in err
    code, _, err = _train(capsys, *base, "--resume")
    assert code == 2 and err.strip().endswith("; the run there saved none: start afresh with --overwrite (it moves the "
                                              "folder aside)")
    assert _train(capsys, *base, "--overwrite")[0] == 0


def test_a_folder_holding_another_run_is_refused_and_overwrite_moves_it_aside(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    base = ["--model", "tiny", "--steps", "2", "--corpus-bytes", "50000", *SMALL, "--out", str(run)]
    assert _train(capsys, *base)[0] == 0
    # A resume with no step left is refused in one line before any rank starts (no placement, no rank prefix).
    for extra, why in ((), "resume=True (--resume): "), (("--steps", "5", "--extend", "--stop-after", "1"),
                                                          "stop_after=1 (--stop-after): "):
        code, _, err = _train(capsys, "--out", str(run), "--resume", "--dp", "2", *extra)
        assert code == 2 and err.startswith(f"orangetron train: error: {why}") and len(err.splitlines()) == 1
        assert "is already at step 2" in err
    first = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, _, err = _train(capsys, *base, "--seed", "1")
    assert code == 2 and "the folder holds another run" in err and "--overwrite" in err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == first  # untouched
    code, _, err = _train(capsys, *base, "--seed", "1", "--overwrite")
    aside = tmp_path / "run.previous-1"
    assert code == 0 and f"moved the former run in {run} to {aside}" in err  # said, not only done
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == first
    assert tomllib.loads((run / "config.toml").read_text())["seed"] == 1
    assert _train(capsys, *base, "--overwrite")[0] == 0
    assert (tmp_path / "run.previous-2").is_dir() and aside.is_dir()  # never deleted, never reused
    with pytest.raises(ValueError, match=r"overwrite=True \(--overwrite\): for a new run"):
        TrainConfig(out=str(run), resume=True, overwrite=True)
    with pytest.raises(ValueError, match=r"overwrite=True \(--overwrite\): it needs --out: for a new run"):
        TrainConfig(overwrite=True)
    (run / "corpus.txt").write_text(TEXT)  # the new run's data inside the old run: moving it aside took it along
    code, _, err = _train(capsys, *base, "--data", str(run / "corpus.txt"), "--overwrite")
    assert code == 2 and f"holds the run's data ({run / 'corpus.txt'})" in err and (run / "corpus.txt").is_file()
    # A repeat on another --corpus-bytes is asked for; on another Python's library, said (no flag undoes it).
    code, _, err = _train(capsys, "--config", str(run / "config.toml"), "--out", str(tmp_path / "fewer"),
                          "--corpus-bytes", "40000", "--steps", "1")
    assert code == 0 and "built-in corpus" not in err, err
    record = (run / "config.toml").read_text()
    sha = tomllib.loads(record)["data_record"]["sha256"]
    (tmp_path / "other.toml").write_text(record.replace(sha, "0" * 64))
    code, _, err = _train(capsys, "--config", str(tmp_path / "other.toml"), "--out", str(tmp_path / "py"),
                          "--steps", "1")
    assert code == 0 and "the built-in corpus differs from the one --config" in err and "another Python's" in err
    nested = run / "checkpoints" / "step-99999999"  # taken as the newest checkpoint, it broke the resume of run
    code, _, err = _train(capsys, "--model", "tiny", "--steps", "1", *SMALL, "--out", str(nested))
    assert code == 2 and f"inside the folder of another run, {run}, which holds that run alone" in err
    assert not nested.exists()
    project = tmp_path / "project"  # a config.toml of one's own beside a checkpoints folder is not a run
    (project / "checkpoints").mkdir(parents=True)
    (project / "config.toml").write_text("steps = 1\n")
    for out in (project / "checkpoints" / "run1", run / ".." / "sibling"):  # `..` leaves the run's folder
        code, _, err = _train(capsys, "--model", "tiny", "--steps", "1", *SMALL, "--out", str(out), "--quiet")
        assert code == 0, err


def test_config_of_a_run_repeats_a_custom_model_run_bitwise(tmp_path, data, capsys) -> None:
    model = tmp_path / "custom.toml"
    model.write_text(CUSTOM_MODEL)
    code, first, _ = _train(capsys, "--model", str(model), "--data", str(data), "--steps", "4", *SMALL,
                            "--out", str(tmp_path / "a"))
    assert code == 0
    model.unlink()  # the record alone must hold the model
    code, again, _ = _train(capsys, "--config", str(tmp_path / "a" / "config.toml"), "--out", str(tmp_path / "b"),
                            "--quiet", "--json")
    assert code == 0 and again["losses"] == first["losses"]
    a, b = (tomllib.loads((tmp_path / x / "config.toml").read_text()) for x in "ab")
    assert a["model"] == b["model"] and a["model"]["num_experts"] == 3 and a["model"]["aux_loss_coef"] == 0.02
    assert a["data_record"] == b["data_record"] and a["data_record"]["files"][0]["bytes"] == len(TEXT)
    assert a["data_record"]["tokenizer"] == "byte"
    state = json.loads(next((tmp_path / "a" / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["tokenizer"] == "byte"  # `orangetron sample` decodes with the tokenizer the run recorded
    assert {k: v for k, v in a.items() if k != "out"} == {k: v for k, v in b.items() if k != "out"}
    # Data edited since: the repeat would not be one (it trained on the edit, unsaid); named again, it is this run's
    data.write_text(TEXT.replace("e", "E"))
    code, _, err = _train(capsys, "--config", str(tmp_path / "a"), "--out", str(tmp_path / "c"))  # the folder
    assert code == 2 and not (tmp_path / "c").exists()  # stands for its config.toml (it raised IsADirectoryError)
    assert f"repeats a run on 1 file(s), {len(TEXT):,} bytes, sha256 {a['data_record']['sha256'][:12]}; the data " \
        "is now 1 file(s)" in err and "give --data on the command line to train on it as it is now" in err
    code, _, err = _train(capsys, "--config", str(tmp_path / "a" / "config.toml"), "--out", str(tmp_path / "c"),
                          "--data", str(data), "--steps", "1", "--quiet")
    assert code == 0, err


def test_config_of_an_extended_run_repeats_it_bitwise(tmp_path, data, capsys) -> None:
    """An extended run keeps its first cosine's span and then holds min_lr; its record keeps that span
    (`schedule_steps`), so `--config` repeats it rather than decaying over the new total. A resume may not
    change the span."""
    run, again = tmp_path / "run", tmp_path / "again"
    assert _train(capsys, "--model", "tiny", "--data", str(data), "--steps", "4", *SMALL, "--out", str(run))[0] == 0
    code, extended, err = _train(capsys, "--out", str(run), "--resume", "--extend", "--steps", "6", "--json", "--quiet")
    assert code == 0, err
    assert tomllib.loads((run / "config.toml").read_text())["schedule_steps"] == 4
    code, repeated, err = _train(capsys, "--config", str(run / "config.toml"), "--out", str(again), "--json",
                                 "--quiet")
    assert code == 0 and repeated["losses"] == extended["losses"], err
    assert cli.main(["estimate", "--config", str(run / "config.toml")]) == 0  # a run's record, whatever it holds
    lrs = [json.loads(line)["lr"] for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert lrs[3:] == [TrainConfig().lr / 10] * 3  # min_lr from step 4 on, as in the extended run
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--extend", "--steps", "8", "--schedule-steps", "7")
    assert code == 2 and "schedule_steps=7 (--schedule-steps): the run in" in err and "schedule_steps=4" in err
    (run / "config.toml").unlink()  # the checkpoint's schedule refuses it too
    code, _, err = _train(capsys, "--model", "tiny", "--data", str(data), *SMALL, "--out", str(run), "--resume",
                          "--extend", "--steps", "8", "--schedule-steps", "8")
    assert code == 2 and "whose schedule spans 4 steps; a resumed run keeps its schedule" in err


def test_a_warmup_that_leaves_no_cosine_is_warned_of(tmp_path, data, capsys) -> None:
    """With the default warmup (20 steps) a 10-step run only climbs to half the peak rate and never decays; an
    extension of it then holds that rate, not min_lr. Nothing but the rates told a user. A cosine needs two
    steps: a warmup of 9 of 10 steps ends at the peak and stays there."""
    code, _, err = _train(capsys, "--model", "tiny", "--data", str(data), "--steps", "10", "--seq-len", "16",
                          "--batch-size", "4", "--eval-batches", "1", "--json", "--out", str(tmp_path / "run"))
    assert code == 0
    assert "warning: warmup=20 (--warmup) leaves the schedule's 10 steps no cosine: the rate rises to 0.001 and " \
        "never decays to min_lr" in err
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[-1] == 0.001
    short = ["--model", "tiny", "--data", str(data), "--steps", "10", "--seq-len", "16", "--batch-size", "4",
             "--eval-batches", "1"]
    code, _, err = _train(capsys, *short, "--warmup", "9")
    assert code == 0 and "warmup=9 (--warmup) leaves the schedule's 10 steps no cosine: the rate rises to 0.002" in err
    code, _, err = _train(capsys, *short, "--warmup", "8")
    assert code == 0 and "warmup=" not in err


def test_a_model_table_in_a_config_file_is_checked_like_a_model_file(tmp_path, capsys) -> None:
    path = tmp_path / "run.toml"
    path.write_text("steps = 2\n[model]\n" + CUSTOM_MODEL.replace("num_heads = 4", "num_heads = 4\nwidth = 3"))
    code, _, err = _train(capsys, "--config", str(path))
    assert code == 2 and "unknown key(s) width" in err and len(err.strip().splitlines()) == 1
    path.write_text("[model]\n" + CUSTOM_MODEL.replace("num_kv_heads = 2", "num_kv_heads = 3"))
    code, _, err = _train(capsys, "--config", str(path))
    assert code == 2 and "num_kv_heads" in err and len(err.strip().splitlines()) == 1


def test_comm_per_step_splits_training_from_evaluation(tmp_path) -> None:
    cfg = TrainConfig(model="tiny-moe", steps=3, seq_len=16, batch_size=4, warmup=1, eval_batches=1, eval_every=1,
                      corpus_bytes=60_000, dp=2, zero_stage=3)
    result = train(cfg, progress=False)
    for total, split in zip(result["comm"], result["comm_per_step"], strict=True):
        assert split["train_steps"] == 3 and split["evaluations"] == 3 and not split["steps_differ"]
        assert split["eval"] and set(split["eval"]) <= set(split["train"])  # evaluation gathers, never reduces
        assert "reduce_scatter/dp_cp" not in split["eval"]
        keys = set(total) - {"rank"}
        assert {k: 3 * split["train"].get(k, 0) + 3 * split["eval"].get(k, 0) for k in keys} == \
            {k: total[k] for k in keys}
        assert split["train_total"] == {k: 3 * v for k, v in split["train"].items()}
        assert split["eval_total"] == {k: 3 * v for k, v in split["eval"].items()}
    memory = result["memory"][0]
    assert memory["gathered_params"] > 0 and memory["grad_buckets"] > 0  # ZeRO-3's transients are reported


def test_zero1_steps_differ_by_their_lazy_gather_and_the_totals_still_add_up(tmp_path) -> None:
    """ZeRO-1 gathers parameters at the next forward: the first step sends no all-gather and the final
    evaluation sends the last step's, so `train_steps x train` overcounts; the totals add up to `comm`."""
    cfg = TrainConfig(model="tiny", steps=3, seq_len=16, batch_size=4, warmup=1, eval_batches=1,
                      corpus_bytes=60_000, dp=2, zero_stage=1)
    result = train(cfg, progress=False)
    total, split = result["comm"][0], result["comm_per_step"][0]
    gather = split["train"]["all_gather/dp_cp"]
    assert split["steps_differ"] and split["eval"] == {"all_gather/dp_cp": gather}
    assert split["train_total"]["all_gather/dp_cp"] == 2 * gather  # steps 2 and 3 gather; step 1 did not
    keys = set(total) - {"rank"}
    assert {k: split["train_total"].get(k, 0) + split["eval_total"].get(k, 0) for k in keys} == \
        {k: total[k] for k in keys}


def test_metrics_keep_running_and_per_step_throughput_apart(tmp_path) -> None:
    out = tmp_path / "run"
    train(TrainConfig(model="tiny", steps=4, seq_len=16, batch_size=4, warmup=1, corpus_bytes=60_000,
                      out=str(out)), progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = 4 * 16
    assert records[0]["tokens_per_s"] is None and records[0]["mfu"] is None  # step 1 measures memory
    seconds = 0.0
    for r in records[1:]:
        seconds += tokens / r["step_tokens_per_s"]
        assert r["tokens_per_s"] == pytest.approx(tokens * (r["step"] - 1) / seconds, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] / r["step_tokens_per_s"] * r["step_mfu"], rel=1e-9)


@pytest.mark.parametrize(("flags", "warning"), [
    (dict(sequence_parallel=True), "sequence_parallel=True (--sequence-parallel) has no effect: needs --tp > 1"),
    (dict(cp_mode="allgather"), "cp_mode='allgather' (--cp-mode) has no effect: needs --cp > 1"),
    (dict(cp_mode="usp", ulysses_degree=2), "ulysses_degree=2 (--ulysses-degree) has no effect: needs --cp > 1"),
    (dict(capacity_factor=2.0, dp=2, ep=2), "capacity_factor=2.0 (--capacity-factor) has no effect"),
    (dict(zero3_keep_params=True), "zero3_keep_params=True (--zero3-keep-params) has no effect: needs --zero-stage 3"),
    (dict(eval_every=9), "eval_every=9 (--eval-every) has no effect"),
    (dict(zero_stage=2), "zero_stage=2 (--zero-stage) has no effect: needs --dp or --cp > 1"),
    (dict(recompute="full", recompute_layers=2),  # tiny-moe's two layers: it was accepted without a word
     "recompute_layers=2 (--recompute-layers) has no effect: is not below the 2 layers of the longest pipeline chunk"),
    (dict(cp=2, cp_mode="usp"),  # ran as ring without a word
     "cp_mode='usp' (--cp-mode) with ulysses_degree=1 runs as ring attention over all cp ranks"),
])
def test_options_that_do_nothing_are_named(flags: dict, warning: str) -> None:
    cfg = TrainConfig(model="tiny-moe", steps=4, seq_len=16, batch_size=4, corpus_bytes=60_000, **flags)
    assert [w for w in cfg.ineffective_options() if w.startswith(warning)]
    assert TrainConfig(model="tiny", steps=4, tp=2, sequence_parallel=True).ineffective_options() == []
    assert TrainConfig(model="tiny-moe", recompute="full", recompute_layers=1).ineffective_options() == []
    assert TrainConfig(model="tiny-moe", cp=4, cp_mode="usp", ulysses_degree=2).ineffective_options() == []
    # ZeRO-3 on one replica still gathers and frees unit by unit: its memory is not DDP's (measured on `tiny`:
    # gathered_params 394,240 B and param_grads 197,120 B where DDP has 0 and 525,568 B), so it is not idle
    assert TrainConfig(model="tiny-moe", zero_stage=3).ineffective_options() == []


def test_inputs_that_used_to_pass_silently_are_refused(tmp_path, capsys) -> None:
    code, _, err = _train(capsys, "--steps", "3", "--stop-after", "3", "--out", str(tmp_path / "r"))
    assert code == 2 and "stop_after=3 (--stop-after): the run ends at --steps=3 anyway" in err
    for empty in ("", " "):  # an unset $RUN_DIR: the run was written into the current folder
        code, _, err = _train(capsys, "--steps", "3", "--out", empty)
        assert code == 2 and f"error: out (--out): {empty!r} is an empty path; give the run's folder" in err
    code, _, err = _train(capsys, "--data", str(tmp_path))
    assert code == 2 and "a folder, not a text file" in err
    code, _, err = _train(capsys, "--model", "tiny", "--steps", "2", "--warmup", "0", "--corpus-bytes", "50000",
                          "--seq-len", "16", "--batch-size", "4", "--sequence-parallel")
    assert code == 0 and "warning: sequence_parallel=True (--sequence-parallel) has no effect" in err
    start, recap = err.split("1 warning of the start, again:\n")  # the end of the summary names it once more
    assert "has no effect" in start and recap.startswith("  warning: sequence_parallel=True (--sequence-parallel)")


def test_a_model_too_large_for_memory_is_refused_before_anything_is_allocated(tmp_path, capsys) -> None:
    from orangetron.train import admission

    # A rank's estimated peak: the whole float32 reference copy it builds first, plus what a real step holds
    # (measured here, every category of one rank's step: the planner predicts each to the byte).
    one = TrainConfig(model="tiny", steps=1, seq_len=16, batch_size=4, corpus_bytes=60_000)
    measured = train(one, progress=False)["memory"][0]
    step_bytes = sum(v for k, v in measured.items() if k != "rank")
    assert admission.rank_peak_bytes(one) == 4 * one.model_config().total_params() + step_bytes

    cfg = TrainConfig(model="small-moe", seq_len=16, batch_size=4, dp=2, corpus_bytes=60_000)
    per_rank = admission.rank_peak_bytes(cfg)
    admission.check_fits(cfg, available=2 * per_rank)  # two local ranks fit exactly
    with pytest.raises(ValueError, match=r"model='small-moe' \(--model\): needs about .* on each of 2 local rank"):
        admission.check_fits(cfg, available=2 * per_rank - 1)
    huge = tmp_path / "huge.toml"
    huge.write_text("hidden_size = 65536\nnum_layers = 96\nnum_heads = 128\nvocab_size = 256\nffn_hidden_size = "
                    "262144\n")  # about 5e12 parameters: no machine this test runs on holds 100 TB
    code, _, err = _train(capsys, "--model", str(huge), "--out", str(tmp_path / "run"))
    assert code == 2 and "more than the" in err and "GiB this machine has available" in err
    assert not (tmp_path / "run").exists()  # refused before the run folder, let alone a tensor


def test_verify_measures_a_dropping_dispatcher_at_a_capacity_that_drops_nothing(capsys) -> None:
    from orangetron.train.verify import without_drops

    cfg = TrainConfig(model="tiny-moe", steps=2, seq_len=32, batch_size=8, warmup=0, dp=2, ep=2,
                      dispatcher="capacity", capacity_factor=0.5, param_dtype="float64", corpus_bytes=60_000)
    assert without_drops(cfg).capacity_factor == 4 / 2  # experts / top_k: every token fits
    assert without_drops(dataclasses.replace(cfg, capacity_factor=3.0)).capacity_factor == 3.0
    code = cli.main(["verify", "--dp", "2", "--ep", "2", "--dispatcher", "capacity", "--capacity-factor", "0.5",
                     "--steps", "2", "--json"])
    captured = capsys.readouterr()
    result = json.loads(captured.out.splitlines()[-1])
    assert code == 0 and result["ok"] and result["capacity_factor"] == 2.0
    assert ("--capacity-factor 2 instead of 0.5, which drops no token (dropped tokens differ from one rank by "
            "design)") in captured.err


def test_the_embedded_corpus_changed_on_resume_is_refused_with_a_hint_that_applies(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert _train(capsys, "--model", "tiny", "--steps", "4", "--stop-after", "2", "--corpus-bytes", "50000", *SMALL,
                  "--out", str(run))[0] == 0
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--corpus-bytes", "60000")
    assert code == 2 and "differs from the run's record" in err and "give the recorded --corpus-bytes" in err
    assert "--new-data" not in err  # no --data names the embedded corpus


def test_a_resume_may_evaluate_more_often_and_trains_as_if_it_had_not(tmp_path, capsys) -> None:
    """--eval-every was refused on resume although evaluation touches no training state: a run stopped at step 2
    and resumed evaluating every step takes the losses of the run never stopped, evaluated at its end only."""
    base = ["--model", "tiny-moe", "--steps", "4", "--corpus-bytes", "50000", *SMALL]
    assert _train(capsys, *base, "--out", str(tmp_path / "straight"))[0] == 0
    assert _train(capsys, *base, "--out", str(tmp_path / "run"), "--stop-after", "2")[0] == 0
    code, _, err = _train(capsys, "--out", str(tmp_path / "run"), "--resume", "--eval-every", "1",
                          "--eval-batches", "2")
    assert code == 0, err
    assert _losses(tmp_path / "run") == _losses(tmp_path / "straight")
    evaluated = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evaluated if "eval_loss" in r] == [3, 4]
    changes = [json.loads(line) for line in (tmp_path / "run" / "changes.jsonl").read_text().splitlines()]
    assert changes[-1]["from_step"] == 3 and {"eval_every", "eval_batches"} <= set(changes[-1]["changed"])


def test_help_refusal_and_docs_name_every_option_a_resume_may_change(capsys) -> None:
    """The list a user reads (train --help, the refusal, docs/training.md) names each non-layout option the
    resume check lets change: a flag added to CHANGEABLE_ON_RESUME and not to the text, or the reverse, fails."""
    from orangetron.spec.layout import Layout
    from orangetron.spec.parallel_config import ParallelConfig
    from orangetron.train.config import _flag
    from orangetron.train.run_folder import CHANGEABLE_ON_RESUME, CHANGEABLE_ON_RESUME_TEXT

    layout_and_parallel = {f.name for f in (*dataclasses.fields(Layout), *dataclasses.fields(ParallelConfig))}
    others = [_flag(name) for name in CHANGEABLE_ON_RESUME if name not in layout_and_parallel]
    assert "--deterministic" in others and "--device" in others
    named = {word.strip(",") for word in CHANGEABLE_ON_RESUME_TEXT.split() if word.startswith("--")}
    assert named == {*others, "--extend", "--param-dtype", "--microbatches"}
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    paragraph = docs[docs.index("one a resume may change"):docs.index("`--quiet` and `--json` are not options")]
    for flag in others:
        assert f"`{flag}`" in paragraph, flag
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--deterministic" in " ".join(capsys.readouterr().out.split())


def test_a_moe_run_keeps_its_micro_batches_on_resume_and_a_dense_one_need_not(tmp_path, capsys) -> None:
    """A MoE balancing loss is a product of means over each micro-batch's tokens: a resume at --microbatches 2 of
    a run at 1 trained another objective (5.1e-6 apart in float64 by step 12) without a word, logged as a layout
    change. It is refused, naming the recorded value; a dense model's split changes only the sums' order."""
    flags = ["--steps", "3", "--warmup", "1", "--seq-len", "16", "--batch-size", "4", "--corpus-bytes", "60000",
             "--quiet", "--stop-after", "1"]
    for model in ("tiny-moe", "tiny"):
        assert _train(capsys, "--model", model, *flags, "--out", str(tmp_path / model))[0] == 0
    code, _, err = _train(capsys, "--out", str(tmp_path / "tiny-moe"), "--resume", "--microbatches", "2")
    assert code == 2 and "microbatches=2 (--microbatches): the run in" in err
    assert "was recorded with microbatches=1, and its MoE balancing loss (aux_loss_coef=0.01) is computed per " \
        "micro-batch, so another split trains another objective; resume with --microbatches 1" in err
    assert _train(capsys, "--out", str(tmp_path / "tiny"), "--resume", "--microbatches", "2")[0] == 0
    changes = (tmp_path / "tiny" / "changes.jsonl").read_text()
    assert '"microbatches": [1, 2]' in changes


def test_a_checkpoint_refuses_what_a_missing_or_edited_record_would_let_change(tmp_path, capsys) -> None:
    """With config.toml deleted, a resume took another seq-len, batch size, seed and corpus from its flags, and
    rewrote the record; an edited batch_size resumed too. The checkpoint now holds the run's options and refuses
    a change the record would have refused; the same flags resume."""
    flags = ["--model", "tiny", "--steps", "3", "--warmup", "1", "--seq-len", "16", "--batch-size", "4",
             "--corpus-bytes", "60000", "--quiet"]
    run = tmp_path / "run"
    assert _train(capsys, *flags, "--stop-after", "1", "--out", str(run))[0] == 0
    record = (run / "config.toml").read_text()
    (run / "config.toml").unlink()
    for changed in (["--seq-len", "32"], ["--seed", "3"], ["--corpus-bytes", "70000"], ["--grad-clip", "0.0"]):
        code, _, err = _train(capsys, *flags, *changed, "--out", str(run), "--resume")
        field = changed[0][2:].replace("-", "_")
        assert code == 2 and f"{field}={changed[1]}" in err and "step-00000001 was written by a run with" in err, err
    (run / "config.toml").write_text(record.replace("batch_size = 4", "batch_size = 8"))
    code, _, err = _train(capsys, "--out", str(run), "--resume")
    assert code == 2 and f"batch_size=8 (--batch-size, set by the run's record {run / 'config.toml'}): " in err
    (run / "config.toml").unlink()
    code, result, err = _train(capsys, *flags, "--out", str(run), "--resume", "--json")
    assert code == 0 and len(result["losses"]) == 3 and "cannot tell whether the data's text changed" in err
    # A run on files reads no built-in corpus: its size, typed or from a shared --config file, changes nothing.
    text = tmp_path / "text.txt"
    text.write_text("hello world " * 5000)
    files = [*flags[:-3], "--data", str(text), "--quiet"]
    assert _train(capsys, *files, "--stop-after", "1", "--out", str(tmp_path / "files"))[0] == 0
    assert _train(capsys, "--out", str(tmp_path / "files"), "--resume", "--corpus-bytes", "70000")[0] == 0


@pytest.mark.parametrize("dp", (1, 2))
def test_a_disk_that_refuses_a_write_ends_the_run_in_one_line(tmp_path, capsys, monkeypatch, dp) -> None:
    """A checkpoint folder made read-only mid-run gave 30 to 51 lines of traceback (one rank: the CLI's own; two:
    the failing rank's). An OSError is the machine's, not the code's: one line naming it, exit 1."""
    from orangetron.train import resume

    def refused(folder, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(folder))

    monkeypatch.setattr(resume, "save_checkpoint", refused)  # forked ranks inherit it
    code, _, err = _train(capsys, "--model", "tiny", "--steps", "2", "--warmup", "1", "--seq-len", "16",
                          "--batch-size", "4", "--corpus-bytes", "60000", "--quiet", "--dp", str(dp),
                          "--out", str(tmp_path / "run"))
    assert code == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    rank = "rank 0 failed: " if dp > 1 else ""
    assert lines == [f"orangetron train: error: {rank}PermissionError: [Errno 1] Operation not permitted: "
                     f"'{tmp_path / 'run' / 'checkpoints'}'"], err


def test_a_killed_saves_staging_folder_is_removed_by_the_next_save(tmp_path, capsys) -> None:
    """`kill -9` during a save left `checkpoints/.step-N.partial-XXXX` (40 MB) for good; no resume reads it."""
    flags = ["--model", "tiny", "--steps", "2", "--warmup", "1", "--seq-len", "16", "--batch-size", "4",
             "--corpus-bytes", "60000", "--quiet", "--out", str(tmp_path / "run")]
    assert _train(capsys, *flags, "--stop-after", "1")[0] == 0
    dead = tmp_path / "run" / "checkpoints" / ".step-00000002.partial-0badf00d"
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"half")
    assert _train(capsys, *flags, "--resume")[0] == 0
    assert not dead.exists()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


LLAMA_TOML = ("hidden_size = 32\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nvocab_size = 320\n"
              "ffn_hidden_size = 48\nmax_seq_len = 64\n")


def test_a_resume_takes_a_copy_of_its_tokenizer_at_another_path(tmp_path, data, capsys) -> None:
    """The tokenizer is compared by the ids it encodes to, as data is by its text: a copy at another path (the
    one `tokenizer export` writes from the checkpoint, once the recorded folder is gone) resumes the run exactly
    as the original would have, on text and on a prepared dataset; a tokenizer with other ids, or bytes, is
    refused, with new data too."""
    tok, other, copy, model = tmp_path / "tok", tmp_path / "other", tmp_path / "copy", tmp_path / "model.toml"
    assert cli.main(["tokenizer", "train", str(data), "-o", str(tok), "--vocab", "280"]) == 0
    assert cli.main(["tokenizer", "train", str(data), "-o", str(other), "--vocab", "300"]) == 0
    read = {name: (tok / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")}
    model.write_text(LLAMA_TOML)
    run, twin = tmp_path / "run", tmp_path / "twin"
    assert _train(capsys, "--model", str(model), "--data", str(data), "--tokenizer", str(tok), "--steps", "3",
                  "--stop-after", "1", *SMALL, "--out", str(run))[0] == 0
    shutil.copytree(run, twin)
    code, reference, err = _train(capsys, "--out", str(twin), "--resume", "--json", "--quiet")  # the original
    assert code == 0, err
    assert cli.main(["prepare-data", str(data), "-o", str(tmp_path / "ds"), "--tokenizer", str(tok), "--quiet"]) == 0
    packed = tmp_path / "packed"
    assert _train(capsys, "--model", str(model), "--data", str(tmp_path / "ds"), "--steps", "2", "--stop-after", "1",
                  *SMALL, "--out", str(packed))[0] == 0
    shutil.rmtree(tok)

    code, _, err = _train(capsys, "--out", str(run), "--resume")
    assert code == 2 and f"orangetron tokenizer export {run} -o DIR" in err
    assert cli.main(["tokenizer", "export", str(run), "-o", str(copy), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["files"] == sorted(read) and "wrote tokenizer.json, tokenizer_config.json" in out.err
    assert {name: (copy / name).read_text() for name in read} == read  # what the run read, byte for byte
    for given, why in ((other, "which encodes other ids"), ("byte", "recorded with tokenizer=")):
        for extra in ([], ["--data", str(data), "--new-data"]):
            code, _, err = _train(capsys, "--out", str(run), "--resume", "--tokenizer", str(given), *extra)
            assert code == 2 and why in err, (given, extra, err)
    code, resumed, err = _train(capsys, "--out", str(run), "--resume", "--tokenizer", str(copy), "--json", "--quiet")
    assert code == 0, err
    assert resumed["losses"] == reference["losses"] and _losses(run) == _losses(twin)  # the same ids, to the bit
    record = tomllib.loads((run / "config.toml").read_text())
    assert record["tokenizer"] == record["data_record"]["tokenizer"] == str(copy)
    change = json.loads((run / "changes.jsonl").read_text().splitlines()[-1])
    assert change["from_step"] == 2 and change["changed"]["tokenizer"] == [str(tok), str(copy)]

    code, _, err = _train(capsys, "--out", str(packed), "--resume", "--tokenizer", str(other))  # a prepared dataset
    assert code == 2 and f"it encodes other ids than {tok}" in err and "a resumed run keeps the tokenizer it" in err
    old = shutil.copytree(packed, tmp_path / "packed-old")  # recorded before the record kept the ids' hash
    record = (old / "config.toml").read_text()
    (old / "config.toml").write_text("\n".join(line for line in record.splitlines()
                                               if not line.startswith("tokenizer_ids_sha256")) + "\n")
    code, _, err = _train(capsys, "--out", str(old), "--resume", "--tokenizer", str(copy))  # the dataset's hash
    assert code == 0, err
    code, _, err = _train(capsys, "--out", str(packed), "--resume", "--tokenizer", str(copy))
    assert code == 0, err
    (tmp_path / "more.txt").write_text(TEXT.upper())  # new data, prepared with the copy: its ids are the run's
    assert cli.main(["prepare-data", str(tmp_path / "more.txt"), "-o", str(tmp_path / "ds2"), "--tokenizer",
                     str(copy), "--quiet"]) == 0
    code, _, err = _train(capsys, "--out", str(packed), "--resume", "--extend", "--steps", "3", "--data",
                          str(tmp_path / "ds2"), "--new-data")
    assert code == 0, err
    code, _, err = _train(capsys, "--model", str(model), "--data", str(tmp_path / "ds"), "--tokenizer", str(other),
                          "--steps", "1", *SMALL, "--out", str(tmp_path / "new"))
    assert code == 2 and f"it encodes other ids than {tok}, which the prepared dataset" in err


def test_tokenizer_export_refuses_what_it_cannot_write(tmp_path, data, capsys) -> None:
    """A run on bytes keeps no tokenizer files; tokenizer files already in the folder are refused, or moved aside
    with --overwrite; the run's checkpoints are no place to write."""
    tok, run = tmp_path / "tok", tmp_path / "run"
    assert _train(capsys, "--model", "tiny", "--data", str(data), "--steps", "1", *SMALL, "--out", str(run))[0] == 0
    assert cli.main(["tokenizer", "export", str(run), "-o", str(tok)]) == 2
    assert "keeps no tokenizer files: it ran on the byte tokenizer" in capsys.readouterr().err and not tok.exists()
    assert cli.main(["tokenizer", "train", str(data), "-o", str(tok), "--vocab", "280"]) == 0
    (tmp_path / "model.toml").write_text(LLAMA_TOML)
    assert _train(capsys, "--model", str(tmp_path / "model.toml"), "--data", str(data), "--tokenizer", str(tok),
                  "--steps", "1", *SMALL, "--out", str(run), "--overwrite")[0] == 0
    written = (tok / "tokenizer.json").read_text()
    assert cli.main(["tokenizer", "export", str(run), "-o", str(tok)]) == 2
    assert "holds tokenizer.json and tokenizer_config.json already" in capsys.readouterr().err
    assert cli.main(["tokenizer", "export", str(run), "-o", str(tok), "--overwrite"]) == 0
    assert "moved the former files to tokenizer.json.previous-1 and tokenizer_config.json.previous-1" in \
        capsys.readouterr().err
    assert (tok / "tokenizer.json").read_text() == (tok / "tokenizer.json.previous-1").read_text() == written
    (tmp_path / "stale").mkdir()  # a file the run had none of, which the copy would read: its BOS and EOS
    (tmp_path / "stale" / "special_tokens_map.json").write_text('{"bos_token": "a"}')
    assert cli.main(["tokenizer", "export", str(run), "-o", str(tmp_path / "stale")]) == 2
    assert "holds special_tokens_map.json already" in capsys.readouterr().err
    assert cli.main(["tokenizer", "export", str(run), "-o", str(run / "checkpoints" / "tok")]) == 2
    assert f"inside {run / 'checkpoints'}, whose checkpoints' manifests list their files" in capsys.readouterr().err
    alone = shutil.copytree(run / "checkpoints" / "step-00000001", tmp_path / "alone")  # a checkpoint on its own
    assert cli.main(["tokenizer", "export", str(alone), "-o", str(alone / "tok")]) == 2
    assert cli.main(["tokenizer", "export", str(alone), "-o", str(tmp_path / "beside")]) == 0
    assert (tmp_path / "beside" / "tokenizer.json").read_text() == written
    state = run / "checkpoints" / "step-00000001" / "state.json"
    state.write_text(state.read_text().replace("<|endoftext|>", "<|endoftekst|>"))  # as corrupted on disk
    assert cli.main(["tokenizer", "export", str(run), "-o", str(tmp_path / "fresh")]) == 2
    assert "state.json: size or checksum differs from the manifest" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()


def test_data_moved_since_the_run_started_is_given_at_its_new_path(tmp_path, data, capsys) -> None:
    """The record keeps the data's path; moved (with the project, say), the resume names the remedy, and the
    data at its new path, compared by its text, continues the run."""
    run = tmp_path / "run"
    assert _train(capsys, "--model", "tiny", "--data", str(data), "--steps", "3", "--stop-after", "1", *SMALL,
                  "--out", str(run))[0] == 0
    moved = data.rename(tmp_path / "moved.txt")
    code, _, err = _train(capsys, "--out", str(run), "--resume")
    assert code == 2 and "no such file; a resume reads the data at the path its record holds: give --data" in err
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--data", str(moved))
    assert code == 0, err


def test_a_corrupt_latest_checkpoint_names_the_one_before_it(tmp_path, data, capsys) -> None:
    """A resume refuses a corrupt checkpoint and says how to go on from the intact one before it: moving the
    corrupt one out of checkpoints/, after which the run resumes from the earlier step."""
    run = tmp_path / "run"
    assert _train(capsys, "--model", "tiny", "--data", str(data), "--steps", "3", "--save-every", "1",
                  "--stop-after", "2", *SMALL, "--out", str(run))[0] == 0
    latest = run / "checkpoints" / "step-00000002"
    shard = next(latest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err = _train(capsys, "--out", str(run), "--resume")
    assert code == 2 and "checksum differs from the manifest" in err
    assert f"to resume from the checkpoint before it, step-00000001, move step-00000002 out of {latest.parent}" in err
    latest.rename(tmp_path / "corrupt")
    code, result, err = _train(capsys, "--out", str(run), "--resume", "--json", "--quiet")
    assert code == 0 and len(result["losses"]) == 3, err


def test_a_run_given_relative_data_resumes_from_another_folder(tmp_path, monkeypatch, capsys) -> None:
    """The record kept `data` and `out` as typed while hf_model and tokenizer were absolute: resuming from another
    working folder then read `--data` relative to it and found no such file, and its `--config` named ./run."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    assert _train(capsys, "--model", "tiny", "--data", "corpus.txt", "--steps", "3", "--stop-after", "2", *SMALL,
                  "--out", "run")[0] == 0
    recorded = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert recorded["data"] == [str(tmp_path / "corpus.txt")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, result, err = _train(capsys, "--config", str(tmp_path / "run" / "config.toml"), "--resume", "--json",
                               "--quiet")  # the record's out was as typed: that resumed ./run, which is not there
    assert code == 0 and result["steps"] == 3, err
    assert recorded["out"] == str(tmp_path / "run") and list(elsewhere.iterdir()) == []


def test_a_rewritten_tokenizer_is_refused_on_resume_and_kept_by_checkpoints(tmp_path, data, capsys) -> None:
    """The run reads its tokenizer by path; a tokenizer retrained into that folder encodes the same text to
    other ids. Resumed training would silently take them, so it is refused until the tokenizer is restored. The
    checkpoints keep the files the run read: `export --hf` writes those and `sample` decodes with them, whatever
    the folder holds now or if it is gone. An older checkpoint, which keeps none, reads the folder,
    and both refuse a rewritten one."""
    tok = tmp_path / "tok"
    assert cli.main(["tokenizer", "train", str(data), "-o", str(tok), "--vocab", "280"]) == 0
    read = {name: (tok / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")}
    run, model = tmp_path / "run", tmp_path / "model.toml"  # a Llama, which export --hf writes
    model.write_text("hidden_size = 32\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nvocab_size = 320\n"
                     "ffn_hidden_size = 48\nmax_seq_len = 64\n")
    assert _train(capsys, "--model", str(model), "--data", str(data), "--tokenizer", str(tok), "--steps", "3",
                  "--stop-after", "1", *SMALL, "--out", str(run))[0] == 0
    recorded = tomllib.loads((run / "config.toml").read_text())["data_record"]["tokenizer_ids_sha256"]
    assert len(recorded) == 64
    sample = ["sample", str(run), "--prompt", "the quick", "--max-new-tokens", "6", "--json"]

    def sampled() -> dict:
        assert cli.main(sample) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    before = sampled()
    assert cli.main(["tokenizer", "train", str(data), "-o", str(tok), "--vocab", "300", "--overwrite"]) == 0
    assert "; moved the former files to tokenizer.json.previous-1 and tokenizer_config.json.previous-1" in \
        capsys.readouterr().err
    assert (tok / "tokenizer.json").read_text() != read["tokenizer.json"]
    assert (tok / "tokenizer.json.previous-1").read_text() == read["tokenizer.json"]
    code, _, err = _train(capsys, "--out", str(run), "--resume")
    assert code == 2 and "encodes other ids than when the run" in err and recorded[:12] in err
    code, _, err = _train(capsys, "--config", str(run / "config.toml"), "--out", str(tmp_path / "again"))
    assert code == 2 and f"repeats a run whose tokenizer {tok} encoded other ids (sha256 {recorded[:12]} then" in err
    assert cli.main(["export", str(run), "--hf", "-o", str(tmp_path / "hf")]) == 0
    assert {name: (tmp_path / "hf" / name).read_text() for name in read} == read  # what the run read
    assert sampled() == before  # the same ids, decoded by the same tokenizer

    checkpoint = run / "checkpoints" / "step-00000001"  # as a checkpoint of 2026-12-05 was: the hash, no files
    state = json.loads((checkpoint / "state.json").read_text())
    del state["tokenizer_files"]
    (checkpoint / "state.json").write_text(json.dumps(state))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.json"] = {"bytes": (checkpoint / "state.json").stat().st_size,
                                       "sha256": hashlib.sha256((checkpoint / "state.json").read_bytes()).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert cli.main(["export", str(run), "--hf", "-o", str(tmp_path / "hf-old")]) == 2
    assert "restore it before exporting" in capsys.readouterr().err and not (tmp_path / "hf-old").exists()
    assert cli.main(sample) == 2 and "restore it before sampling" in capsys.readouterr().err

    assert cli.main(["tokenizer", "train", str(data), "-o", str(tok), "--vocab", "280", "--overwrite"]) == 0
    assert _train(capsys, "--out", str(run), "--resume")[0] == 0  # restored: resumes, and keeps the files again
    shutil.rmtree(tok)
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--extend", "--steps", "4")
    assert code == 2 and "no such tokenizer; a resume reads the run's tokenizer at the path it recorded: restore " \
        "it there" in err
    tok.mkdir()  # there, but empty: named once
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--extend", "--steps", "4")
    assert code == 2 and err.count("tokenizer=") == 1  # the record gave it: the message says so
    assert f"(--tokenizer, set by the run's record {run / 'config.toml'}): no tokenizer.json" in err
    (tok / "tokenizer.json").write_text(read["tokenizer.json"])  # a config that is not JSON: the option named
    (tok / "tokenizer_config.json").write_text("not json")
    code, _, err = _train(capsys, "--out", str(run), "--resume", "--extend", "--steps", "4")
    assert code == 2 and err.count("tokenizer=") == 1 and "(--tokenizer, set by the run's record" in err
    assert "not a JSON file" in err
    shutil.rmtree(tok)
    assert sampled()["checkpoint"].endswith("step-00000003")
    assert cli.main(["export", str(run), "--hf", "-o", str(tmp_path / "hf-3")]) == 0
    assert {name: (tmp_path / "hf-3" / name).read_text() for name in read} == read


def test_a_resume_by_a_moved_runs_record_continues_that_run(tmp_path, capsys) -> None:
    """`train --config OLD/config.toml --resume` continued the run at the `out` OLD's record names, not OLD: after
    `--overwrite` moved a run aside, it trained the new run in the old place, and a moved folder resumed the run
    left at its old path. The record's own folder is the run it resumes; a move is said."""
    run, aside = tmp_path / "run", tmp_path / "run.previous-1"
    base = ["--model", "tiny", "--steps", "3", "--save-every", "1", "--corpus-bytes", "50000", *SMALL]
    assert _train(capsys, *base, "--out", str(run), "--stop-after", "2")[0] == 0
    assert _train(capsys, *base, "--out", str(run), "--stop-after", "1", "--overwrite")[0] == 0  # the old one aside
    newer = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, _, err = _train(capsys, "--config", str(aside / "config.toml"), "--resume", "--quiet", "--json")
    assert code == 0 and f"continues the run in {aside}; its record names out={run}" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == newer  # the newer run untouched
    assert _train(capsys, *base, "--out", str(tmp_path / "whole"))[0] == 0
    assert _losses(aside) == _losses(tmp_path / "whole")  # the moved run went on as if never stopped
    # A moved run that saved no checkpoint is refused as its own, not continued at its record's old place.
    shutil.rmtree(aside / "checkpoints")
    code, _, err = _train(capsys, "--config", str(aside / "config.toml"), "--resume", "--quiet", "--json")
    assert code == 2 and f"no checkpoint under {aside / 'checkpoints'}" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == newer


def test_a_resume_that_types_a_schedule_without_chunks_leaves_the_recorded_stages(tmp_path, data, capsys) -> None:
    """A run recorded at pp 2 interleaved with 2 virtual stages, resumed with `--pp 1 --pp-schedule 1f1b`, was
    refused until `--virtual-stages 1` was added too (a trial's finding): the recorded stages were the
    interleaved schedule's. Typed, they are still checked."""
    model = tmp_path / "four.toml"
    model.write_text(CUSTOM_MODEL.replace("num_layers = 2", "num_layers = 4").replace("aux_loss_coef = 0.02",
                                                                                      "aux_loss_coef = 0.0"))
    run = str(tmp_path / "run")
    options = ["--model", str(model), "--data", str(data), "--steps", "4", "--microbatches", "2", *SMALL]
    code, _, _ = _train(capsys, *options, "--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2",
                        "--out", run, "--stop-after", "2")
    assert code == 0
    code, _, err = _train(capsys, "--resume", "--out", run, "--pp", "1", "--pp-schedule", "1f1b", "--quiet",
                          "--virtual-stages", "2")
    assert code == 2 and "virtual_stages=2 (--virtual-stages): needs pp_schedule 'interleaved'" in err
    assert "sets to 1" not in err  # the typed value is the run's, not the record's
    code, result, err = _train(capsys, "--resume", "--out", run, "--pp", "1", "--pp-schedule", "1f1b", "--quiet",
                               "--json")
    assert code == 0 and result["steps"] == 4, err
    assert "holds virtual_stages=2, which this run sets to 1" in err
    assert "virtual_stages = 1" in Path(run, "config.toml").read_text()
