"""Model FLOPs utilization of a training step: the planner's FLOP count over a measured matmul peak.

The FLOPs are `plan.timing.model_flops_per_step` for the model this run builds (forward and backward, no
recompute; attention counted as full s x s products, Megatron's and PaLM's convention), split evenly over the
ranks. The peak is what this rank reaches on a large square matmul in the run's parameter dtype, measured once
at start: on a CPU there is no datasheet number that holds for one thread among many processes, and a measured
peak makes MFU say how far the step is from this process's own best GEMM.
"""

from __future__ import annotations

import time

import torch

from orangetron.plan.timing import model_flops_per_step
from orangetron.spec.options import Job
from orangetron.train.config import TrainConfig

_PEAK_SIZE = 256  # large enough to leave the small-matrix overheads behind, small enough to cost milliseconds
_PEAK_REPEATS = 8


def step_flops(cfg: TrainConfig) -> float:
    """Model FLOPs of one optimizer step over the whole batch (every rank together)."""
    job = Job(seq_len=cfg.seq_len, global_batch=cfg.batch_size, param_dtype=cfg.param_dtype)
    return model_flops_per_step(cfg.model_config(), job, cfg.batch_size)


def measured_peak_flops(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """FLOP/s of the fastest of a few [n, n] @ [n, n] matmuls in `dtype` on `device` (after one warm-up)."""
    a = torch.randn(_PEAK_SIZE, _PEAK_SIZE, device=device).to(dtype)
    b = torch.randn(_PEAK_SIZE, _PEAK_SIZE, device=device).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(_PEAK_REPEATS):
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        start = time.perf_counter()
        torch.mm(a, b)
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * _PEAK_SIZE**3 / max(best, 1e-9)
