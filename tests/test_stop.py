"""Stopping a run with SIGINT or SIGTERM (orangetron/train/stopping.py): every rank finishes the step it is taking,
the ranks agree on that step, it is checkpointed, the command exits 130 or 143, and `--resume` continues as if the
run had never stopped. Runs that are signalled are processes of their own (tests/signalled_runs.py); each is
stopped after its first step is written, and one launch checks as much as it can."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from signalled_runs import LONG, ROOT, TINY_MOE, alive, children, finish, started, wait_for_step

from orangetron import cli, comm
from orangetron.testing import run_distributed
from orangetron.train import stopping

STOPPED = re.compile(r"stopped by (SIGINT|SIGTERM) after step (\d+); (.*)")


def _stopped(err: str) -> tuple[str, int, str]:
    """(signal, step, what follows) of the log line `stopped by SIGINT after step 3; continue with --resume`."""
    found = STOPPED.findall(err)
    assert len(found) == 1, err[-3000:]
    name, step, then = found[0]
    return name, int(step), then


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))


def _stopped_at(out: Path, name: str) -> int:
    """The step the run in `out` stopped after: its last record says so, and it is the one checkpoint."""
    records = _records(out)
    step = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, step + 1))
    assert records[-1]["stopped_by"] == name and not any("stopped_by" in r for r in records[:-1])
    assert _checkpoints(out) == [f"step-{step:08d}"]
    return step


# ---- the handlers, in this process ------------------------------------------------------------------------


def test_a_signal_only_asks_a_second_sigint_aborts_and_the_handlers_are_put_back() -> None:
    before = {signum: signal.getsignal(signum) for signum in stopping.SIGNALS}
    with stopping.stop_on_signals():
        assert stopping.requested() == 0
        try:
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)  # the same request again (a scheduler and torchrun's agent)
        except KeyboardInterrupt:
            pytest.fail("a repeated SIGTERM aborted the run")
        assert stopping.requested() == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # Ctrl-C once a stop is asked for: abort at once
    assert {signum: signal.getsignal(signum) for signum in stopping.SIGNALS} == before
    assert stopping.requested() == 0
    with stopping.stop_on_signals():
        signal.raise_signal(signal.SIGINT)
        with stopping.stop_on_signals():  # a run inside a launched rank's block shares its request
            assert stopping.requested() == signal.SIGINT
        assert stopping.requested() == signal.SIGINT
    assert stopping.requested() == 0
    assert [stopping.exit_code(name) for name in ("SIGINT", "SIGTERM")] == [130, 143]


def _agree(signalled: int) -> tuple[int, list, str]:
    """(agreed signal, records of a measure scope around the check, op of the ledger's last record) on a rank;
    the rank `signalled` has received SIGTERM."""
    comm.reset_ledger()
    with stopping.stop_on_signals():
        if torch.distributed.get_rank() == signalled:
            signal.raise_signal(signal.SIGTERM)
        with comm.measure() as records:
            agreed = stopping.agreed(comm.world_group())
    return agreed, records, comm.ledger()[-1].op


def test_a_ctrl_c_while_train_imports_is_not_lost(monkeypatch, capsys) -> None:
    """A KeyboardInterrupt raised inside `import torch` can be caught and dropped by the import machinery (with
    numpy half imported): the run then went on as if never interrupted. Simulated by a module whose import
    swallows it, as C code would: the interrupt is held until the imports are done, then ends the command."""
    import importlib
    import time
    import types

    real = importlib.import_module("orangetron.train.launch")

    class Swallowing(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            if name == "LaunchError":
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)  # the handler runs here
                except KeyboardInterrupt:
                    pass
            return getattr(real, name)

    monkeypatch.setitem(sys.modules, "orangetron.train.launch", Swallowing("orangetron.train.launch"))
    handler = signal.getsignal(signal.SIGINT)
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--seq-len", "8", "--quiet"]) == 130
    assert "orangetron train: interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_ctrl_c_before_the_ranks_start_is_not_lost_where_sigint_was_ignored(monkeypatch, capsys) -> None:
    """A background job of a script starts with SIGINT ignored. The launcher takes SIGINT as a stop request all
    the same, but one sent between the imports and the launcher's handler was dropped: the run went on to its
    end and exited 0. Simulated by a `train` that is sent SIGINT as it starts."""
    import time

    from orangetron.train import trainer

    def interrupted_as_it_starts(cfg, progress=True):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here
        return {"stopped": None}

    monkeypatch.setattr(trainer, "train", interrupted_as_it_starts)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert cli.main(["train", "--model", "tiny", "--steps", "1", "--seq-len", "8", "--quiet"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "orangetron train: interrupted" in capsys.readouterr().err


def test_ranks_not_yet_started_are_passed_over_when_the_launch_is_cut_short() -> None:
    """A Ctrl-C during the launch (before the last rank started) ended in AttributeError from killing a process
    never started, which hid the interrupt."""
    import multiprocessing as mp
    import time

    from orangetron.train.launch import _kill

    ctx = mp.get_context("fork")
    started, never = ctx.Process(target=time.sleep, args=(30,)), ctx.Process(target=time.sleep, args=(30,))
    started.start()
    _kill([started, never])
    assert started.exitcode == -signal.SIGKILL and never.pid is None


def test_ranks_agree_on_a_signal_one_of_them_received_outside_the_measured_traffic() -> None:
    assert run_distributed(_agree, 2, args=(1,)) == [(signal.SIGTERM, [], "all_reduce")] * 2
    assert [agreed for agreed, _, _ in run_distributed(_agree, 2, args=(-1,))] == [0, 0]


# ---- runs signalled from outside ---------------------------------------------------------------------------


def test_ctrl_c_stops_every_rank_after_one_step_with_a_checkpoint_and_resume_is_bitwise(tmp_path, capsys) -> None:
    """dp=2 under the local launcher, SIGINT to the launcher's process group as a terminal's Ctrl-C sends it.
    The ranks, in process groups of their own, get it once, from the launcher (twice would abort them)."""
    out = tmp_path / "run"
    with started(["train", *TINY_MOE, *LONG, "--dp", "2", "--out", str(out)], tmp_path) as proc:
        wait_for_step(out / "metrics.jsonl", proc)
        # Checked directly: the two copies a rank in the launcher's group would get may come close enough
        # together to count as one, so the abort they should cause is not seen every time.
        ranks = children(proc.pid)
        assert len(ranks) == 2 and all(os.getpgid(pid) not in (proc.pid, os.getpgid(0)) for pid in ranks)
        # A resume beside the running run (which has saved no checkpoint yet) is told the run is there.
        assert cli.main(["train", *TINY_MOE, *LONG, "--dp", "2", "--quiet", "--out", str(out), "--resume"]) == 2
        assert capsys.readouterr().err == (f"orangetron train: error: out={str(out)!r} (--out): another `orangetron "
                                           f"train` is running in this folder (process {proc.pid}); wait for it to "
                                           "end, or stop it first\n")
        os.killpg(proc.pid, signal.SIGINT)
        code, _, err = finish(proc)
    assert code == 130, err[-3000:]
    name, step, then = _stopped(err)
    assert (name, then) == ("SIGINT", "continue with --resume")
    assert _stopped_at(out, "SIGINT") == step
    # Two more steps from the checkpoint, against the same steps never interrupted.
    flags = ["train", *TINY_MOE, *LONG, "--dp", "2", "--quiet", "--json", "--stop-after", str(step + 2)]
    assert cli.main([*flags, "--out", str(out), "--resume"]) == 0
    resumed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert cli.main([*flags, "--out", str(tmp_path / "straight")]) == 0
    straight = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(straight["losses"]) == step + 2 and resumed["losses"] == straight["losses"]
    assert resumed["stopped"] is None and [r["step"] for r in _records(out)] == list(range(1, step + 3))


def test_sigterm_reaching_one_rank_stops_both_after_the_same_step(tmp_path) -> None:
    """A signal may reach the ranks at different times, here only one of them: they agree after each step."""
    out = tmp_path / "run"
    with started(["train", *TINY_MOE, *LONG, "--dp", "2", "--out", str(out), "--quiet"], tmp_path) as proc:
        wait_for_step(out / "metrics.jsonl", proc)
        ranks = children(proc.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGTERM)
        code, _, err = finish(proc)
    assert code == 143, err[-3000:]
    assert _stopped_at(out, "SIGTERM") >= 1
    assert not any(alive(pid) for pid in ranks)


def test_one_rank_without_out_stops_after_a_step_and_writes_nothing(tmp_path) -> None:
    with started(["train", *TINY_MOE, *LONG, "--json"], tmp_path) as proc:
        assert proc.stderr.readline().startswith("orangetron train: model tiny-moe")  # the handlers are in place
        os.kill(proc.pid, signal.SIGINT)  # during setup or a step: either way the run stops after a step
        code, out, err = finish(proc)
    assert code == 130, err[-3000:]
    name, step, then = _stopped(err)
    assert (name, then) == ("SIGINT", "nothing was saved (no --out)")
    result = json.loads(out.splitlines()[-1])
    assert result["stopped"] == {"signal": "SIGINT", "step": step} and len(result["losses"]) == step
    assert list(tmp_path.iterdir()) == []


def test_torchrun_passes_sigterm_on_and_every_worker_exits_143_after_the_same_step(tmp_path) -> None:
    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    command = ["--standalone", "--nproc-per-node", "2", str(ROOT / "tests" / "torchrun_fault.py"), "0", "0", "none",
               str(pids), "--", "train", *TINY_MOE, *LONG, "--dp", "2", "--out", str(out)]
    with started(command, tmp_path, module=("-m", "torch.distributed.run")) as proc:
        wait_for_step(out / "metrics.jsonl", proc)
        os.kill(proc.pid, signal.SIGTERM)  # torchrun's agent sends SIGTERM to each worker and waits for them
        _, _, err = finish(proc)
    assert sorted(p.read_text() for p in pids.iterdir()) == ["143", "143"], err[-3000:]
    name, step, then = _stopped(err)
    assert (name, then) == ("SIGTERM", "continue with --resume")
    assert _stopped_at(out, "SIGTERM") == step
