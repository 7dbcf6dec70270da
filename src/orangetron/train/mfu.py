"""Model FLOPs utilization of a training step: the planner's FLOP count over a peak, and the step's seconds.

The FLOPs are `plan.timing.model_flops_per_step` for the model this run builds (forward and backward, no
recompute; attention counted as full s x s products, Megatron's and PaLM's convention, each packed document's
own n x n on packed data, `batch_flops`), split evenly over the ranks. On a GPU the peak is its datasheet's,
from the preset (`spec/presets/gpus`) whose name matches `torch.cuda.get_device_name`; a GPU no preset matches
gets no MFU rather than a guess. On a CPU it is what this rank reaches on a large square matmul in the run's
parameter dtype, measured once at start: there is no datasheet number that holds for one thread among many
processes, and a measured peak makes MFU say how far the step is from this process's own best GEMM. Steps are
timed with CUDA events on a GPU (the device's clock, from the step's first kernel to its last), with the host
clock elsewhere.
"""

from __future__ import annotations

import re
import time

import torch

from orangetron.plan.timing import model_flops_per_step
from orangetron.spec.hardware import GPUSpec, gpu_names, load_gpu
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Job
from orangetron.train.config import TrainConfig

# A name part that marks another board of the same chip (other clocks, other peak): a preset matches such a
# device only when its own name has the part.
_VARIANT_PARTS = ("pcie", "nvl", "ti")

_PEAK_SIZE = 256  # large enough to leave the small-matrix overheads behind, small enough to cost milliseconds
_PEAK_REPEATS = 8


def step_flops(cfg: TrainConfig) -> float:
    """Model FLOPs of one optimizer step over the whole batch (every rank together)."""
    job = Job(seq_len=cfg.seq_len, global_batch=cfg.batch_size, param_dtype=cfg.param_dtype)
    return model_flops_per_step(cfg.model_config(), job, cfg.batch_size)


def batch_flops(cfg: TrainConfig, batch: torch.Tensor, model: ModelSpec | None = None) -> float:
    """Model FLOPs of one step over `batch` (every rank together): `step_flops`, except that packed rows ([B,
    S + 1, 2], token and document id pairs) count each document's own attention, which is all the runtime's
    per-document kernels compute (`model/attention.py`), as the planner counts `doc_lengths`. Counting s x s
    there put MFU above what the step ran. `model`: the run's, resolved once by a caller that asks every step
    (`cfg.model_config()` reads a model file anew)."""
    if batch.dim() != 3:
        return step_flops(cfg)
    pieces: list[int] = []
    for ids in batch[:, : cfg.seq_len, 1]:  # the inputs' documents; a row restarts the one it continues
        starts = torch.nonzero(torch.diff(ids, prepend=ids[:1] - 1)).flatten().tolist() + [ids.numel()]
        pieces += [stop - start for start, stop in zip(starts, starts[1:], strict=False)]
    job = Job(seq_len=cfg.seq_len, global_batch=cfg.batch_size, param_dtype=cfg.param_dtype, doc_lengths=tuple(pieces))
    # Uncached: every batch has its own documents, and the cache would keep them all.
    return model_flops_per_step.__wrapped__(model or cfg.model_config(), job, cfg.batch_size)


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


def _squeezed(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def gpu_preset_for(device_name: str) -> GPUSpec | None:
    """The GPU preset `device_name` (as `torch.cuda.get_device_name` gives it) is, or None.

    A preset matches when every part of its name (`a100-80gb`: a100, 80gb) is in the device's name and every
    board variant the device names (PCIe, NVL) is in the preset's; the longest matching preset wins (gb200 over
    b200). "NVIDIA H100 80GB HBM3" is h100; "NVIDIA H100 PCIe" matches none (its peak is not the SXM's).
    """
    device = _squeezed(device_name)
    variants = {part for part in _VARIANT_PARTS if re.search(rf"(?<![a-z]){part}(?![a-z])", device_name.lower())}
    for name in sorted(gpu_names(), key=len, reverse=True):
        parts = name.split("-")
        if all(part in device for part in parts) and variants <= {p for p in parts if p in _VARIANT_PARTS}:
            return load_gpu(name)
    return None


def device_peak_flops(dtype: torch.dtype, device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s for matmuls in `dtype` on `device`, where it comes from). On cuda the matching preset's
    datasheet peak, or (None, why) for a GPU no preset matches; elsewhere `measured_peak_flops`."""
    if device.type != "cuda":
        return measured_peak_flops(dtype, device), "measured matmul"
    name = torch.cuda.get_device_name(device)
    gpu = gpu_preset_for(name)
    if gpu is None:
        return None, (f"GPU {name!r} matches no preset in spec/presets/gpus: no datasheet peak, so no MFU "
                      "(add its preset to report one)")
    return gpu.peak_flops(str(dtype).removeprefix("torch.")), f"datasheet {gpu.name}"


class StepTimer:
    """Seconds from `start()` to `stop()`: between two CUDA events on a GPU, by the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._begin: object = None

    def start(self) -> None:
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._begin = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._begin
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self._begin.elapsed_time(end) / 1000  # milliseconds between the events


def allocator_peak(device: torch.device) -> dict[str, int]:
    """{"allocator_peak": torch.cuda.max_memory_allocated} on cuda, beside the accounted categories; {} elsewhere
    (the CPU allocator keeps no peak)."""
    if device.type != "cuda":
        return {}
    return {"allocator_peak": torch.cuda.max_memory_allocated(device)}
