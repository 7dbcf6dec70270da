"""Activation recompute: the bytes a training step keeps for backward under each `--recompute` mode.

One small dense model on one rank (through `ot.parallelize`), float32, one micro-batch. For each mode (none,
selective, full, and full with `recompute_layers` = RECOMPUTE_LAYERS) it prints, as JSON lines:

1. `activation_peak_bytes`: the peak bytes saved for backward during one forward and backward
   (`memory.track_activations`), in BYTES, against none's (ratio: the share that mode keeps);
2. `activation_peak_bytes_vs_planner`: the same bytes against `plan.bridge.predicted_step`'s activations (ratio
   1.0: the planner is exact in every mode, tests/test_recompute.py);
3. `step_seconds`: the median time of a forward and backward, against none's: TIME, the one figure here that is
   not bytes. It shows the replay's extra forward on this CPU only: on a shared 2-core machine nothing runs
   beside anything else, so no overlap can show, and other processes make it noisy.

Selective recompute keeps what none keeps here: every attention kernel the runtime runs already recomputes its
scores in backward (docs/runtime.md, Activation recompute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from orangetron import memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.plan.bridge import predicted_step
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers

MODEL = ModelConfig(dim=128, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=384, aux_loss_coef=0.0)
SEQ, ROWS, STEPS, RECOMPUTE_LAYERS = 256, 4, 5, 2
MODES = [("none", 0), ("selective", 0), ("full", 0), ("full", RECOMPUTE_LAYERS)]


def measure(recompute: str, layers: int) -> dict:
    mesh = init_mesh(Layout())
    model = parallelize(Transformer(MODEL, seed=0), mesh, ParallelConfig(recompute=recompute, recompute_layers=layers))
    rows = torch.randint(0, MODEL.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    times, peak = [], 0
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        with memory.track_activations(model.module) as meter:
            logits = model(rows[:, :-1])
            model.module.loss_from_logits(logits, rows[:, 1:]).backward()
        times.append(time.perf_counter() - start)
        peak = meter.peak_bytes
        model.module.zero_grad()
    return {"peak": peak, "seconds": statistics.median(times[1:])}


def _line(config: dict, metric: str, value: float, unit: str, baseline: float) -> str:
    return json.dumps({"name": "recompute", "config": config, "metric": metric, "value": round(value, 5),
                       "unit": unit, "baseline": round(baseline, 5), "ratio": round(value / baseline, 3)})


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    runs = {mode: run_distributed(measure, 1, args=mode, timeout=600)[0] for mode in MODES}
    shutdown_workers()
    none = runs[("none", 0)]
    for (recompute, layers), got in runs.items():
        config = {"model": "dense dim 128, 8 layers", "seq": SEQ, "rows": ROWS, "dtype": "float32",
                  "recompute": recompute, "recompute_layers": layers}
        pc = ParallelConfig(recompute=recompute, recompute_layers=layers)
        predicted = predicted_step(MODEL, Layout(), pc, seq_len=SEQ, micro_batch=ROWS)[1]["activations"]
        print(_line(config, "activation_peak_bytes", got["peak"], "bytes", none["peak"]))
        print(_line(config, "activation_peak_bytes_vs_planner", got["peak"], "bytes", predicted))
        print(_line(config, "step_seconds", got["seconds"], "s", none["seconds"]))


if __name__ == "__main__":
    main()
