"""Data-parallel step time on 2 local gloo ranks: each ZeRO stage vs PyTorch's DistributedDataParallel.

Same model, batch and AdamW on both sides; the ratio is torch DDP's step time over ours (above 1: ours is
faster). Prints one JSON line per stage, and one for bucketed DDP (all-reduces overlapped with backward)
against DDP reducing once after backward.

Then ZeRO-2's memory peak with gradient buckets (reduce-scattered during backward, each `.grad` freed once in
its bucket) against ZeRO-2 reducing once after backward, on a 27M-parameter dense model in the same worker
processes: the most heap a step adds to what the rank held before it (glibc's bytes in use, read after every
torch op of the step, so the gradients, wire buffers and activations all count), and the whole heap at that
peak. Ratio: with buckets over without (below 1: smaller).

`--one-rank` prints only one line, in this process: the AdamW step over one flat float32 shard in runs with and
without decay, through torch's fused kernel against the unfused update (torch.optim.AdamW's, used where a
torch lacks the kernel) on the same views; ratio unfused time over fused (above 1: the kernel is faster).
On two loaded CPU cores this says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from orangetron import memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer, model_preset
from orangetron.parallel import DataParallel, ParallelConfig
from orangetron.parallel.data.optim import FlatAdamW
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers

MODEL, BATCH, SEQ, STEPS = "tiny-moe", 4, 128, 8
STAGES = {"ddp": {}, "ddp_buckets": {"grad_bucket_numel": 25_000}, "zero1": {"zero_stage": 1},
          "distributed_optimizer": {"distributed_optimizer": True}, "zero2": {"zero_stage": 2},
          "zero2_buckets": {"zero_stage": 2, "grad_bucket_numel": 25_000}, "zero3": {"zero_stage": 3}}


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


# ---- ZeRO-2's peak with and without gradient buckets ---------------------------------------------------
PEAK_CFG = ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=256, ffn_dim=1536)
PEAK_BATCH, PEAK_SEQ, PEAK_BUCKET = 1, 64, 1_000_000


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def _heap_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd  # allocated chunks plus mmapped blocks (every large tensor)


class _HeapPeak(TorchDispatchMode):
    """The largest heap in use seen after any torch op run inside (autograd's backward ops included)."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = _heap_in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _heap_in_use())
        return out


def zero2_peaks() -> dict[str, tuple[int, int, int, dict]]:
    """Of the third step, per variant: the heap's growth over the step's start at its peak during forward,
    backward and the gradient reduction, and during the whole step; the heap at the step's peak; the memory
    categories."""
    torch.set_num_threads(1)
    mesh = init_mesh(Layout(dp=2))
    out = {}
    for variant, bucket in (("after_backward", 0), ("buckets", PEAK_BUCKET)):
        dp = DataParallel(Transformer(PEAK_CFG, seed=0), mesh, ParallelConfig(zero_stage=2, grad_bucket_numel=bucket))
        opt = dp.optimizer(lr=1e-4)
        for step in range(3):  # the first step allocates AdamW's moments
            tokens = torch.randint(0, 256, (PEAK_BATCH, PEAK_SEQ + 1), generator=torch.Generator().manual_seed(step))
            start = _heap_in_use()
            with _HeapPeak() as backward:  # forward, backward and the gradient reduction
                loss = dp.module.loss_from_logits(dp(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                dp.reduce_gradients()
                del loss
            with _HeapPeak() as update:  # clipping and AdamW
                opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
        step = max(backward.peak, update.peak)
        out[variant] = (backward.peak - start, step - start, step, memory.model_state_bytes(dp, opt))
        del dp, opt
    return out


def _peak_line(metric: str, value: int, baseline: int, categories: dict) -> str:
    config = {"stage": "zero2", "model": "dense dim 512, 8 layers", "params": Transformer(PEAK_CFG).num_parameters(),
              "batch_per_rank": PEAK_BATCH, "seq_len": PEAK_SEQ, "ranks": 2, "backend": "gloo",
              "grad_bucket_numel": PEAK_BUCKET, "categories_with_buckets": categories,
              "baseline": "zero2, one reduce-scatter after backward"}
    return json.dumps({"name": "zero2_bucket_peak", "config": config, "metric": metric, "value": value, "unit": "B",
                       "baseline": baseline, "ratio": round(value / baseline, 3)})


# ---- one rank: torch's fused AdamW kernel against the unfused update -----------------------------------
ADAMW_NUMEL, ADAMW_RUN, ADAMW_STEPS = 4_000_000, 50_000, 20  # runs of 50k elements, decaying every other one


def adamw_step_s(fused: bool) -> float:
    """Median seconds of one FlatAdamW step on a float32 shard of ADAMW_NUMEL elements."""
    g = torch.Generator().manual_seed(0)
    flat, grad = torch.randn(ADAMW_NUMEL, generator=g), torch.randn(ADAMW_NUMEL, generator=g)
    mask = (torch.arange(ADAMW_NUMEL) // ADAMW_RUN) % 2 == 0
    opt = FlatAdamW(flat, lr=1e-3, weight_decay=0.1, decay_mask=mask)
    times = []
    with mock.patch.object(torch, "_fused_adamw_", torch._fused_adamw_ if fused else None):
        for _ in range(ADAMW_STEPS):
            times.append(_timed_s(lambda: opt.step(grad)))
    return statistics.median(times[2:])


def _timed_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def adamw_line() -> str:
    fused, unfused = adamw_step_s(True), adamw_step_s(False)
    config = {"numel": ADAMW_NUMEL, "run": ADAMW_RUN, "dtype": "float32", "ranks": 1,
              "threads": torch.get_num_threads(), "baseline": "unfused update on the same views"}
    return json.dumps({"name": "flat_adamw_step", "config": config, "metric": "step_s", "value": round(fused, 5),
                       "unit": "s", "baseline": round(unfused, 5), "ratio": round(unfused / fused, 3)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one-rank", action="store_true", help="only the fused-AdamW line, in this process")
    if parser.parse_args().one_rank:
        print(adamw_line())
        return
    print(adamw_line(), flush=True)
    baseline = max(run_distributed(torch_ddp, 2))
    measured = {}
    for stage in STAGES:
        measured[stage] = max(run_distributed(ours, 2, args=(stage,)))
        print(_line(stage, measured[stage], baseline, "torch DistributedDataParallel"), flush=True)
    # Overlapped (buckets all-reduced during backward) vs serial (one all-reduce after backward).
    print(_line("ddp_buckets", measured["ddp_buckets"], measured["ddp"], "ddp, one reduction after backward"))
    print(_line("zero2_buckets", measured["zero2_buckets"], measured["zero2"], "zero2, one reduction after backward"))
    shutdown_workers()
    peaks = max(run_distributed(zero2_peaks, 2), key=lambda r: r["buckets"][1])
    with_buckets, without = peaks["buckets"], peaks["after_backward"]
    for i, metric in enumerate(("backward_peak_growth_bytes", "step_peak_growth_bytes", "step_peak_heap_bytes")):
        print(_peak_line(metric, with_buckets[i], without[i], with_buckets[3]), flush=True)
    shutdown_workers()


if __name__ == "__main__":
    main()
