"""How soon `orangetron train` names a rank that stops responding. One rank of a local run is stopped (SIGSTOP)
once the first step is written, and the time from the stop until the launcher has exited naming that rank is
measured, for dp=2 (every collective over the world group) and dp=2 x tp=2 (tp and dp subgroups). The promise
(docs/training.md, "Faults") is the timeout plus 5 s; it is the baseline, so a ratio below 1 keeps it.
tests/test_faults.py asserts a loose bound on the same delay.

    python benchmarks/hang_detection.py [--timeout-s 10] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The same helpers the fault tests start, wait on and find a run's ranks with.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from signalled_runs import children, wait_for_step  # noqa: E402

MODEL = ["--model", "tiny-moe", "--seq-len", "32", "--batch-size", "4", "--steps", "100000"]
LAYOUTS = {"dp2": ["--dp", "2"], "dp2_tp2": ["--dp", "2", "--tp", "2"]}
STOPPED_RANK = 1
PROMISE_S = 5.0  # what naming the rank may take beyond the timeout


def measure(layout: list[str], timeout_s: float, folder: Path) -> tuple[float, bool]:
    """(seconds from SIGSTOP to the launcher's exit, whether its error named the stopped rank)."""
    command = [sys.executable, "-m", "orangetron", "train", *MODEL, *layout, "--timeout-s", f"{timeout_s:g}",
               "--quiet", "--out", str(folder)]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    ranks: list[int] = []
    try:
        wait_for_step(folder / "metrics.jsonl", proc)
        ranks = children(proc.pid)
        os.kill(ranks[STOPPED_RANK], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=timeout_s + 600)
        return time.monotonic() - stopped, bool(re.search(rf"rank {STOPPED_RANK} stopped responding", err))
    finally:
        for pid in [*ranks, proc.pid]:
            if proc.poll() is None:
                os.kill(pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    bound = args.timeout_s + PROMISE_S
    for name, layout in LAYOUTS.items():
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="orangetron-hang-") as tmp:
                delay, named = measure(layout, args.timeout_s, Path(tmp))
            print(json.dumps({
                "name": "hang_detection",
                "config": {"layout": name, "timeout_s": args.timeout_s, "stopped_rank": STOPPED_RANK, "named": named,
                           "cores": os.cpu_count()},
                "metric": "hang_named_after_s", "value": round(delay, 2), "unit": "s", "baseline": bound,
                "ratio": round(delay / bound, 3),
            }), flush=True)


if __name__ == "__main__":
    main()
