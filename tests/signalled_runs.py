"""`orangetron train` as a process of its own, to be signalled or stopped from outside (tests/test_stop.py,
tests/test_faults.py): start it, wait for its first step, find its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_MOE = ["--model", "tiny-moe", "--seq-len", "32", "--batch-size", "4"]
# Far more steps than a test waits for: the schedule's length only, each run is stopped early.
LONG = ["--steps", "1000"]


def env() -> dict[str, str]:
    """This tree's src first (the mutation script's copy, when it runs the tests), one thread, gloo on loopback."""
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


@contextmanager
def started(args: list[str], cwd: Path, module: tuple[str, ...] = ("-m", "orangetron")) -> Iterator[subprocess.Popen]:
    """`python -m orangetron ARGS` (or another module) in a session of its own, so that a signal sent to its
    process group, as a terminal's Ctrl-C is, reaches nothing else; killed with its children if a test leaves
    it running."""
    proc = subprocess.Popen([sys.executable, *module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(), cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            _kill(proc)


def _kill(proc: subprocess.Popen) -> str:
    for pid in [*children(proc.pid), proc.pid]:  # the ranks first: they leave the launcher's process group
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return proc.communicate()[1]


def wait_for_step(metrics: Path, proc: subprocess.Popen, limit_s: float = 300.0) -> int:
    """Wait until the run has written a step to `metrics` (metrics.jsonl); the number of steps written."""
    deadline = time.monotonic() + limit_s
    while not (metrics.exists() and (lines := metrics.read_text().count("\n"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            err = _kill(proc) if proc.poll() is None else proc.communicate()[1]
            raise AssertionError(f"the run ended or stalled before its first step: {err[-3000:]}")
        time.sleep(0.02)
    return lines


def finish(proc: subprocess.Popen, limit_s: float = 300.0) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); the limit only keeps a broken build from hanging the suite."""
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {limit_s:g} s: {_kill(proc)[-3000:]}") from None
    return proc.returncode, out, err


def children(pid: int) -> list[int]:
    """The processes `pid` started (the launcher's ranks, torchrun's workers), in start order: rank order."""
    return sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == pid)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
