"""The learning-rate schedule a run owns: linear warmup, cosine decay, and how a resumed run keeps it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from orangetron.train.config import TrainConfig, TrainConfigError, _flag


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 0-based `step`: linear warmup to cfg.lr, then cosine decay to cfg.min_lr at the last
    step of cfg.schedule_steps (default cfg.steps); a run extended past that holds its last step's rate."""
    total = cfg.schedule_steps if cfg.schedule_steps is not None else cfg.steps
    step = min(step, total - 1)
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    decay_steps = total - cfg.warmup
    if decay_steps <= 1:
        return cfg.lr
    progress = (step - cfg.warmup) / (decay_steps - 1)  # 0 at the first decay step, 1 at the last
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))



def schedule_of(cfg: TrainConfig) -> dict[str, int | float]:
    """What fixes every step's learning rate: the run's total, the cosine's span, warmup and the two rates."""
    span = cfg.schedule_steps if cfg.schedule_steps is not None else cfg.steps
    return {"steps": cfg.steps, "schedule_steps": span, "warmup": cfg.warmup, "lr": cfg.lr, "min_lr": cfg.min_lr}



def continue_schedule(cfg: TrainConfig, saved: dict[str, Any] | None, path: Path) -> TrainConfig:
    """cfg on the checkpointed run's schedule, so every step's rate is the uninterrupted run's; refuses flags
    that would change it, and a longer run unless cfg.extend (then the old cosine holds its last rate)."""
    if saved is None:  # written before checkpoints kept their schedule: this run's flags define it
        return cfg
    for name in ("warmup", "lr", "min_lr"):
        if getattr(cfg, name) != saved[name]:
            raise TrainConfigError(f"{name}={getattr(cfg, name)!r} ({_flag(name)}): {path} belongs to a run with "
                                   f"{name}={saved[name]!r}; a resumed run keeps its schedule")
    total = int(saved["steps"])
    if cfg.steps < total:
        raise TrainConfigError(f"steps={cfg.steps} (--steps): {path} belongs to a run of {total} steps; give "
                               f"--steps {total}, with --stop-after N to end it early")
    if cfg.steps > total and not cfg.extend:
        raise TrainConfigError(f"steps={cfg.steps} (--steps): {path} belongs to a run of {total} steps; add --extend "
                               "to train past them (the cosine keeps its span, then the rate holds its last value)")
    span = int(saved["schedule_steps"])
    if cfg.schedule_steps is not None and cfg.schedule_steps != span:
        raise TrainConfigError(f"schedule_steps={cfg.schedule_steps} (--schedule-steps): {path} belongs to a run "
                               f"whose schedule spans {span} steps; a resumed run keeps its schedule")
    return dataclasses.replace(cfg, schedule_steps=span)
