"""Pipeline parallelism: our schedules against torch.distributed.pipelining, and the measured bubble.

1. Step time: forward and backward of one step (m micro-batches, no optimizer) of the same dense model on
   the same pp ranks, with our executor (`parallel.pipeline.run_pipeline`, the action lists of
   `plan.schedule`) and with PyTorch's `torch.distributed.pipelining` schedule of the same name (GPipe,
   1F1B, interleaved 1F1B) over the same stage modules. Median of STEPS steps after one warm-up; the
   ratio is ours over PyTorch's.
2. Bubble: from our executor's timeline (each action from the arrival of its input to the posting of its
   output), 1 - busy / (pp * makespan), against the formula (p-1)/(v*m + p-1) that `plan.schedule`
   simulates. On a shared CPU the measured figure also holds the ranks' contention for cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from orangetron import comm
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.model.layers import rope_cos_sin
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.parallel.pipeline import MicroBatch, run_pipeline
from orangetron.spec.layout import Layout
from orangetron.spec.stages import chunk_layers
from orangetron.testing import run_distributed, shutdown_workers

MODEL = ModelConfig(dim=128, n_layers=8, n_heads=4, n_kv_heads=4, vocab_size=256, ffn_dim=256, aux_loss_coef=0.0)
SEQ, ROWS, MICROBATCHES, STEPS = 64, 8, 4, 5
SCHEDULES = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("interleaved", 2)}


def _line(name: str, config: dict, metric: str, value: float, unit: str, baseline: float) -> str:
    ratio = value / baseline if baseline else 0.0
    return json.dumps({"name": name, "config": config, "metric": metric, "value": round(value, 5), "unit": unit,
                       "baseline": round(baseline, 5), "ratio": round(ratio, 3)})


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _barrier() -> None:
    """Every rank starts the step together (a one-element all-reduce, through the ledger like all traffic)."""
    comm.all_reduce(torch.zeros(1), comm.world_group())


# ---- ours --------------------------------------------------------------------------------------------
def ours(schedule: str, v: int) -> dict:
    mesh = init_mesh(Layout(pp=torch.distributed.get_world_size()))
    pc = ParallelConfig(pp_schedule=schedule, microbatches=MICROBATCHES, virtual_stages=v)
    dp = parallelize(Transformer(MODEL, seed=0), mesh, pc)
    times, timeline = [], []
    for step in range(STEPS + 1):
        rows = _batch(step)
        mbs = [MicroBatch(x, y, torch.arange(SEQ), None, 1 / MICROBATCHES, 1 / MICROBATCHES)
               for x, y in zip(rows[:, :-1].chunk(MICROBATCHES), rows[:, 1:].chunk(MICROBATCHES), strict=True)]
        _barrier()
        timeline.clear()
        start = time.perf_counter()
        run_pipeline(dp, mbs, schedule, v, timeline=timeline)
        times.append(time.perf_counter() - start)
        dp.module.zero_grad()
    busy = sum(end - begin for *_, begin, end in timeline)
    return {"time": statistics.median(times[1:]), "busy": busy, "first": min(t[3] for t in timeline),
            "last": max(t[4] for t in timeline)}


# ---- torch.distributed.pipelining ------------------------------------------------------------------
class _TorchStage(nn.Module):
    """Layers of one virtual stage of our reference model (embedding first, norm and head last)."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm, self.output = (model.norm, model.output) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        cos, sin = rope_cos_sin(torch.arange(h.shape[1]), MODEL.head_dim, MODEL.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)) if self.output is not None else h


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def theirs(schedule: str, v: int) -> dict:
    from torch.distributed import pipelining

    p, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = Transformer(MODEL, seed=0)
    ranges = chunk_layers(MODEL.n_layers, p * v)
    stages = [pipelining.PipelineStage(_TorchStage(model, ranges[g], g == 0, g == p * v - 1), g, p * v,
                                       torch.device("cpu")) for g in (c * p + rank for c in range(v))]
    kind = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
            "interleaved": pipelining.ScheduleInterleaved1F1B}[schedule]
    runner = kind(stages if v > 1 else stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss)
    times = []
    for step in range(STEPS + 1):
        rows = _batch(step)
        _barrier()
        start = time.perf_counter()
        if rank == 0:
            runner.step(rows[:, :-1])
        elif rank == p - 1:
            runner.step(target=rows[:, 1:])
        else:
            runner.step()
        times.append(time.perf_counter() - start)
        model.zero_grad()
    return {"time": statistics.median(times[1:])}


def run(name: str) -> tuple[dict, dict | str]:
    schedule, v = SCHEDULES[name]
    mine = ours(schedule, v)
    try:
        other: dict | str = theirs(schedule, v)
    except Exception as err:  # noqa: BLE001 - reported as the reason PyTorch's schedule could not be compared
        other = f"{type(err).__name__}: {err}"
    return mine, other


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for pp in (2, 4):
        for name, (_, v) in SCHEDULES.items():
            results = run_distributed(run, pp, args=(name,))
            config = {"pp": pp, "schedule": name, "virtual_stages": v, "microbatches": MICROBATCHES,
                      "layers": MODEL.n_layers, "dim": MODEL.dim, "seq": SEQ, "rows": ROWS}
            mine = max(r[0]["time"] for r in results)
            other = results[0][1]
            if isinstance(other, dict):
                base = max(r[1]["time"] for r in results)
                print(_line("pipeline_step_time", config, "seconds_per_step_vs_torch_pipelining", mine, "s", base))
            else:
                print(_line("pipeline_step_time", {**config, "torch_pipelining": other}, "seconds_per_step", mine,
                            "s", 0.0))
            makespan = max(r[0]["last"] for r in results) - min(r[0]["first"] for r in results)
            measured = 1 - sum(r[0]["busy"] for r in results) / (pp * makespan)
            formula = (pp - 1) / (v * MICROBATCHES + pp - 1)
            print(_line("pipeline_bubble", config, "measured_bubble_vs_formula", measured, "fraction", formula))
    shutdown_workers()


if __name__ == "__main__":
    main()
