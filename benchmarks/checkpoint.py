"""Saving a checkpoint: every rank writing its own shards (DCP) against gathering the whole state first.

Four ranks on gloo, dp=4 ZeRO-3, a dense model of about 5M parameters in float32 (main parameters and two
AdamW moments: the state S). "sharded" is the trainer's checkpoint (`sharded_state` + `save_checkpoint`);
"gathered" is the earlier design: `full_state` on every rank (the whole state gathered), then rank 0
writes one file with torch.save. Per rank, the peak of torch's allocations (the profiler's allocation
events) plus Python's (tracemalloc) while saving, the largest over ranks; and the median wall time of 3
saves. Ratios are sharded over gathered (below 1: sharded smaller or faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from orangetron import comm, memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers
from orangetron.train.checkpoint import save_checkpoint

CFG = ModelConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=8, vocab_size=256, ffn_dim=768)
RANKS, REPEATS = 4, 3


def _peak_bytes(fn) -> int:
    """Peak bytes allocated while `fn()` runs, above what was live before: torch's plus Python's."""
    with memory.peak_allocations() as peak:
        fn()
    return peak.total


def _rank(folder: str) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    dp = parallelize(Transformer(CFG, seed=0), init_mesh(Layout(dp=RANKS)), ParallelConfig(zero_stage=3))
    opt = dp.optimizer(lr=1e-4)
    world = comm.world_group()
    count = iter(range(1_000))

    def sharded() -> None:
        save_checkpoint(Path(folder) / "sharded", next(count), dp.sharded_state(opt), world)

    def gathered() -> None:
        with comm.unmeasured():
            state = dp.full_state(opt)
        if world.rank == 0:
            torch.save(state, Path(folder) / f"gathered-{next(count)}.pt")
        comm.all_gather_objects(None, world)  # the checkpoint is written when every rank goes on

    out: dict[str, list[float]] = {"sharded_s": [], "gathered_s": []}
    for _ in range(REPEATS):
        for name, fn in (("sharded", sharded), ("gathered", gathered)):
            start = time.perf_counter()
            fn()
            out[f"{name}_s"].append(time.perf_counter() - start)
    # Peaks last: measuring leaves Python's allocation tracing on (memory.peak_allocations), which slows what follows.
    out["sharded_peak"] = [_peak_bytes(sharded)]
    out["gathered_peak"] = [_peak_bytes(gathered)]
    return out


def _line(metric: str, value: float, unit: str, baseline: float) -> str:
    state = 3 * 4 * Transformer(CFG).num_parameters()
    config = {"model": "dense dim 256, 6 layers", "params": Transformer(CFG).num_parameters(), "ranks": RANKS,
              "layout": "dp=4 ZeRO-3", "dtype": "float32", "state_bytes": state, "backend": "gloo",
              "baseline": "full_state on every rank, torch.save on rank 0"}
    return json.dumps({"name": "checkpoint_save", "config": config, "metric": metric, "value": round(value, 5),
                       "unit": unit, "baseline": round(baseline, 5), "ratio": round(value / baseline, 3)})


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    shutdown_workers()
    with tempfile.TemporaryDirectory() as folder:
        results = run_distributed(_rank, RANKS, args=(folder,))
    shutdown_workers()
    peak = {k: max(r[f"{k}_peak"][0] for r in results) for k in ("sharded", "gathered")}
    seconds = {k: statistics.median(max(r[f"{k}_s"][i] for r in results) for i in range(REPEATS))
               for k in ("sharded", "gathered")}
    print(_line("save_peak_bytes_per_rank", peak["sharded"], "B", peak["gathered"]), flush=True)
    state = 3 * 4 * Transformer(CFG).num_parameters()
    print(_line("save_peak_over_state", peak["sharded"] / state, "x", peak["gathered"] / state), flush=True)
    print(_line("save_s", seconds["sharded"], "s", seconds["gathered"]), flush=True)


if __name__ == "__main__":
    main()
