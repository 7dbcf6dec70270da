"""ZeRO-3 by unit against PyTorch's FSDP2 (`fully_shard` per block), same model, ranks and machine.

Two ranks on gloo, a dense model of about 27M parameters in float32, AdamW. For each: the median step time
(forward, backward, optimizer) and the growth of the process's peak resident memory over what it held
before building the model (fresh processes for each, so one peak cannot hide the other). Ratios are ours
over FSDP2's (below 1: ours faster or smaller). Our own gathered-parameter peak (a memory category of the
runtime) is printed beside the whole model's bytes.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from orangetron import memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers

CFG = ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=256, ffn_dim=1536)
BATCH, SEQ, STEPS = 2, 128, 6


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _steps(model, opt, loss_of) -> float:
    times = []
    for step in range(STEPS):
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        start = time.perf_counter()
        loss_of(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def ours() -> tuple[float, int, int]:
    before = _rss_bytes()
    dp = parallelize(Transformer(CFG, seed=0), init_mesh(Layout(dp=2)), ParallelConfig(zero_stage=3))
    opt = dp.optimizer(lr=1e-4)

    def loss_of(model, tokens):
        return model.module.loss_from_logits(model(tokens[:, :-1]), tokens[:, 1:])

    seconds = _steps(dp, opt, loss_of)
    gathered = memory.model_state_bytes(dp, opt).get("gathered_params", 0)
    return seconds, _peak_rss_bytes() - before, gathered


def fsdp2() -> tuple[float, int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    before = _rss_bytes()
    model = Transformer(CFG, seed=0)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def loss_of(m, tokens):
        return F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    return _steps(model, opt, loss_of), _peak_rss_bytes() - before, 0


def _line(metric: str, value: float, unit: str, baseline: float) -> str:
    config = {"model": "dense dim 512, 8 layers", "params": Transformer(CFG).num_parameters(), "ranks": 2,
              "backend": "gloo", "batch_per_rank": BATCH, "seq_len": SEQ, "baseline": "torch fully_shard per block"}
    return json.dumps({"name": "zero3_vs_fsdp2", "config": config, "metric": metric, "value": round(value, 5),
                       "unit": unit, "baseline": round(baseline, 5), "ratio": round(value / baseline, 3)})


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    shutdown_workers()
    theirs = max(run_distributed(fsdp2, 2))
    shutdown_workers()  # fresh processes: the peak resident memory starts over
    mine = max(run_distributed(ours, 2))
    shutdown_workers()
    print(_line("step_s", mine[0], "s", theirs[0]), flush=True)
    print(_line("peak_rss_growth_bytes", mine[1], "B", theirs[1]), flush=True)
    whole = Transformer(CFG).num_parameters() * 4
    print(_line("gathered_params_peak_bytes", mine[2], "B", whole), flush=True)  # against the whole model


if __name__ == "__main__":
    main()
