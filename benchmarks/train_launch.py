"""Rank start time of `orangetron train --dp 4 --steps 1`: ranks forked from the warm parent (the default on
Linux) or from a fork server, against spawn (each rank a fresh interpreter importing torch).

Each rank notes the wall-clock time at which it starts the trainer (after joining the process group); the
rank start time is the latest of those minus the moment `launch_local` was called. The whole launch (start,
one training step, results back) is timed too. Prints one JSON line per (start method, measurement), with
spawn as the baseline: ratio = spawn / this.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from orangetron.train.config import TrainConfig
from orangetron.train.launch import launch_local
from orangetron.train.trainer import _train_rank

CONFIG = dict(dp=4, steps=1, model="tiny-moe", batch_size=8, seq_len=32, eval_batches=1, corpus_bytes=200_000)


def timed_rank(cfg: TrainConfig) -> tuple[float, dict]:
    started = time.time()
    return started, _train_rank(cfg, False)


def measure(method: str, cfg: TrainConfig) -> tuple[float, float]:
    """(rank start s, whole launch s) for one `train` launch with this start method."""
    t0 = time.time()
    results = launch_local(timed_rank, cfg.layout.world_size, args=(cfg,), start_method=method)
    total = time.time() - t0
    return max(started for started, _ in results) - t0, total


def line(method: str, metric: str, value: float, baseline: float) -> str:
    return json.dumps({
        "name": "train_launch", "config": {**CONFIG, "start_method": method, "cores": os.cpu_count()},
        "metric": metric, "value": round(value, 4), "unit": "s", "baseline": round(baseline, 4),
        "ratio": round(baseline / value, 2),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dp", type=int, default=CONFIG["dp"])
    CONFIG["dp"] = parser.parse_args().dp
    cfg = TrainConfig(**CONFIG)
    spawn_start, spawn_total = measure("spawn", cfg)
    print(line("spawn", "rank_start_s_vs_spawn", spawn_start, spawn_start), flush=True)
    print(line("spawn", "launch_s_vs_spawn", spawn_total, spawn_total), flush=True)
    for method in ("forkserver", "fork"):  # the fork server's first launch includes starting the server
        start, total = measure(method, cfg)
        print(line(method, "rank_start_s_vs_spawn", start, spawn_start), flush=True)
        print(line(method, "launch_s_vs_spawn", total, spawn_total), flush=True)


if __name__ == "__main__":
    main()
