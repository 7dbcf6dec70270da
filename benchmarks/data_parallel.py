"""Data-parallel step time on 2 local gloo ranks: each ZeRO stage vs PyTorch's DistributedDataParallel.

Same model, batch and AdamW on both sides; the ratio is torch DDP's step time over ours (above 1: ours is
faster). Prints one JSON line per stage, and one for bucketed DDP (all-reduces overlapped with backward)
against DDP reducing once after backward.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from orangetron.layout import Layout
from orangetron.mesh import init_mesh
from orangetron.model import Transformer, model_preset
from orangetron.parallel import DataParallel, ParallelConfig
from orangetron.testing import run_distributed, shutdown_workers

MODEL, BATCH, SEQ, STEPS = "tiny-moe", 4, 128, 8
STAGES = {"ddp": {}, "ddp_buckets": {"grad_bucket_numel": 25_000}, "zero1": {"zero_stage": 1},
          "distributed_optimizer": {"distributed_optimizer": True}, "zero2": {"zero_stage": 2},
          "zero3": {"zero_stage": 3}}


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _median_step_s(model, opt) -> float:
    times = []
    for step in range(STEPS):
        tokens = _tokens(step)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # the first steps allocate optimizer state


def ours(stage: str) -> float:
    mesh = init_mesh(Layout(dp=2))
    dp = DataParallel(Transformer(model_preset(MODEL), seed=0), mesh, ParallelConfig(**STAGES[stage]))
    return _median_step_s(dp, dp.optimizer(lr=1e-3))


def torch_ddp() -> float:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(Transformer(model_preset(MODEL), seed=0))
    return _median_step_s(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, foreach=False))


def _line(stage: str, value: float, baseline: float, against: str) -> str:
    config = {"stage": stage, "model": MODEL, "batch_per_rank": BATCH, "seq_len": SEQ, "ranks": 2,
              "backend": "gloo", "baseline": against}
    return json.dumps({"name": "data_parallel_step", "config": config, "metric": "step_s", "value": round(value, 5),
                       "unit": "s", "baseline": round(baseline, 5), "ratio": round(baseline / value, 3)})


def main() -> None:
    baseline = max(run_distributed(torch_ddp, 2))
    measured = {}
    for stage in STAGES:
        measured[stage] = max(run_distributed(ours, 2, args=(stage,)))
        print(_line(stage, measured[stage], baseline, "torch DistributedDataParallel"), flush=True)
    # Overlapped (buckets all-reduced during backward) vs serial (one all-reduce after backward).
    print(_line("ddp_buckets", measured["ddp_buckets"], measured["ddp"], "ddp, one reduction after backward"))
    shutdown_workers()


if __name__ == "__main__":
    main()
