"""A run's checkpoints: writing one (every rank takes part) and resuming from the latest."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from orangetron import comm
from orangetron.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from orangetron.train.config import TrainConfig, TrainConfigError
from orangetron.train.runlog import Resumed
from orangetron.train.schedule import continue_schedule, schedule_of

if TYPE_CHECKING:
    from orangetron.train.trainer import RunSetup


def _checkpoint_folder(cfg: TrainConfig) -> Path:
    return Path(cfg.out) / "checkpoints"


def save(cfg: TrainConfig, setup: RunSetup, step: int, losses: list[float]) -> Path | None:
    """Checkpoint the run after `step`; every rank takes part. The checkpoint's folder on rank 0, else None."""
    with comm.unmeasured():  # checkpoint traffic is not training traffic
        return _write_checkpoint(cfg, setup, step, losses)


def _write_checkpoint(cfg: TrainConfig, setup: RunSetup, step: int, losses: list[float]) -> Path | None:
    state = setup.dp.full_state(setup.optimizer)  # every rank takes part: it gathers the shards
    if setup.rank == 0:  # the losses are the global batch's, the same on every rank
        model = dataclasses.asdict(cfg.model_config())
        return save_checkpoint(_checkpoint_folder(cfg), step, {**state, "step": step, "losses": list(losses),
                                                               "model": model, "schedule": schedule_of(cfg)})
    return None



def resume(cfg: TrainConfig, setup: RunSetup) -> tuple[TrainConfig, Resumed]:
    """The run's config with the checkpoint's schedule, and where it stands; loads the state into setup."""
    path = latest_checkpoint(_checkpoint_folder(cfg))
    if path is None:
        raise TrainConfigError(f"resume=True (--resume): no checkpoint under {_checkpoint_folder(cfg)}")
    state = load_checkpoint(path)
    model = dataclasses.asdict(cfg.model_config())
    for name, value in state["model"].items():
        if model.get(name) != value:
            raise TrainConfigError(f"resume=True (--resume): {path} holds a model with {name}={value!r}, "
                                   f"this run builds {name}={model.get(name)!r}")
    step = int(state["step"])
    if step >= cfg.steps:
        raise TrainConfigError(f"steps={cfg.steps} (--steps): {path} is already at step {step}; "
                               "raise --steps and add --extend to train further")
    if cfg.stop_after and cfg.stop_after <= step:
        raise TrainConfigError(f"stop_after={cfg.stop_after} (--stop-after): {path} is already at step {step}")
    cfg = continue_schedule(cfg, state.get("schedule"), path)
    setup.dp.load_full_state(state, setup.optimizer)
    return cfg, Resumed(step, [float(x) for x in state["losses"]], path)
