"""Refuse a run whose model cannot fit in this machine's memory, before any rank allocates a byte.

Each rank first builds the whole reference model, then keeps its share (`parallelize`); its peak is about
that whole copy plus what the planner predicts the rank holds during a step (`plan.bridge.predicted_step`:
model state, activations, transient buffers), on its worst pipeline stage. The local ranks of this machine
share its memory. The figure is an estimate, so only a run that needs more than the memory the kernel
reports as available is refused; a run that fits by the estimate may still run short.
"""

from __future__ import annotations

import os
from pathlib import Path

from orangetron.train.config import TrainConfig, TrainConfigError

_BYTES = {"float32": 4, "float64": 8, "bfloat16": 4}  # the reference copy: bf16 runs build it in float32


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where the kernel does not report it."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def rank_peak_bytes(cfg: TrainConfig) -> int:
    """Estimated peak bytes of one rank of `cfg`: the whole reference model plus its worst stage's step."""
    from orangetron.plan.bridge import predicted_step

    model = cfg.model_config()
    micro_batch = cfg.batch_size // (cfg.dp * cfg.microbatches)
    step = max(predicted_step(model, cfg.layout, cfg.parallel_config(), seq_len=cfg.seq_len,
                              micro_batch=micro_batch, stage=stage)[1]["total"] for stage in range(cfg.pp))
    return model.total_params() * _BYTES[cfg.param_dtype] + step


def check_fits(cfg: TrainConfig, available: int | None = None) -> None:
    """TrainConfigError naming the model when this machine's local ranks would need more than `available`
    bytes (default: what the kernel reports); nothing is checked where no figure is known."""
    available = available_bytes() if available is None else available
    if available is None:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.layout.world_size))  # torchrun: this node's processes
    per_rank = rank_peak_bytes(cfg)
    if per_rank * local > available:
        raise TrainConfigError(
            f"model={cfg.model_config().name!r} (--model): needs about {per_rank * local / 2**30:,.1f} GiB "
            f"({per_rank / 2**30:,.2f} GiB on each of {local} local rank(s), estimated), more than the "
            f"{available / 2**30:,.1f} GiB this machine has available; choose a smaller model, --seq-len or "
            "--batch-size, or spread it over more ranks")
