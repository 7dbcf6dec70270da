"""A run's checkpoints: every rank writing its own shards, and resuming from the latest on any layout.

What a run's checkpoint holds: the whole-tensor pieces of the main parameters and both AdamW moments (by
parameter name, under `params/`, `exp_avg/`, `exp_avg_sq/`), the router biases (`buffers/`), each rank's
torch RNG state (`rng/rankNNNNN`), and as JSON the step, AdamW's step count, the data position (batches
consumed, and the global sample cursor the data continues from), the loss history (the global-batch mean per
step), the model config, the schedule, the layout it was written on, the tokenizer (a name of
`train/tokenizer.py`'s TOKENIZERS or a tokenizer's path, and for a path the hash of its ids and its files' texts
as the run read them when it started: `kept_tokenizer`) and, for a run started from a Hugging Face folder,
that folder's record and config (`model_source`). The model is recorded by
the schema's field names (`dataclasses.asdict` of its `ModelSpec`); a checkpoint written before the one
schema recorded the runtime's argument names, and resumes all the same
(`orangetron.model.config.model_from_record`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.model.config import model_from_record
from orangetron.spec.model import ModelSpec
from orangetron.train.checkpoint import (
    CheckpointError,
    earlier_checkpoint,
    latest_checkpoint,
    load_into,
    open_checkpoint,
    save_checkpoint,
)
from orangetron.train.config import TrainConfig, TrainConfigError
from orangetron.train.run_folder import DIRECTIVES, model_source
from orangetron.train.runlog import Resumed
from orangetron.train.schedule import continue_schedule, schedule_of

if TYPE_CHECKING:
    from orangetron.train.trainer import RunSetup


def _checkpoint_folder(cfg: TrainConfig) -> Path:
    return Path(cfg.out) / "checkpoints"


def _rng_name(rank: int) -> str:
    return f"rank{rank:05d}"


def _tensors(setup: RunSetup, writing: bool = False) -> dict[str, Any]:
    """This rank's pieces of the run's tensors (views of its buffers), nested as the checkpoint names them;
    `writing`: without the copies a checkpoint keeps once (a tied embedding's on the last stage)."""
    state = setup.model.sharded_state(setup.optimizer, writing=writing)
    return {**state, "rng": {_rng_name(setup.rank): torch.get_rng_state()}}


def save(cfg: TrainConfig, setup: RunSetup, step: int, losses: list[float]) -> Path | None:
    """Checkpoint the run after `step`; every rank writes its own shards. The checkpoint's folder on rank 0."""
    with comm.unmeasured():  # checkpoint traffic is not training traffic
        return _write_checkpoint(cfg, setup, step, losses)


def _write_checkpoint(cfg: TrainConfig, setup: RunSetup, step: int, losses: list[float]) -> Path | None:
    plain = {"step": step, "losses": list(losses), "model": dataclasses.asdict(cfg.model_config()),
             "schedule": schedule_of(cfg), "optimizer_steps": setup.optimizer.steps,
             "data": {"batches": step, "samples": step * cfg.batch_size}, "layout": cfg.layout.degrees(),
             "tokenizer": cfg.tokenizer or "byte", **setup.tokenizer,  # losses: the global batch's, on every rank
             # What the run is, beside config.toml: a resume checks it where the record is gone or was edited.
             "options": {k: v for k, v in cfg.options().items() if k not in DIRECTIVES}}
    if cfg.hf_model is not None:  # export --hf writes the model back in its source's config and dtype
        plain["model_source"] = model_source(cfg)
    tensors = _tensors(setup, writing=True)
    path = save_checkpoint(_checkpoint_folder(cfg), step, {**tensors, **plain}, comm.world_group())
    return path if setup.rank == 0 else None


def resume(cfg: TrainConfig, setup: RunSetup) -> tuple[TrainConfig, Resumed]:
    """The run's config with the checkpoint's schedule, and where it stands; loads this rank's share of the
    state (from a checkpoint written on any layout) into setup."""
    with comm.unmeasured():
        return _resume(cfg, setup, comm.world_group())


def check_same_model(record: dict[str, Any], model: ModelSpec, path: Path) -> None:
    """Refuse to resume a checkpoint whose recorded model differs from `model` in a field of its shape (the
    `name` is a label: a preset and the same model built by hand resume each other)."""
    stored, built = dataclasses.asdict(model_from_record(record)), dataclasses.asdict(model)
    for name, value in stored.items():
        if name != "name" and built[name] != value:
            raise TrainConfigError(f"resume=True (--resume): {path} holds a model with {name}={value!r}, "
                                   f"this run builds {name}={built[name]!r}")


def check_steps_left(cfg: TrainConfig, path: Path, step: int) -> None:
    """Refuse a resume from `path`, at `step`, that has no step left to take before --steps or --stop-after."""
    if step >= cfg.steps:
        # Led by --resume, not by steps (a command line would add "(--steps)"): a resume takes the run's steps
        # from its record when none are given.
        raise TrainConfigError(f"resume=True (--resume): {path} is already at step {step} of steps={cfg.steps}; "
                               "to train further, raise --steps (with --extend past the run's own steps)")
    if cfg.stop_after and cfg.stop_after <= step:
        raise TrainConfigError(f"stop_after={cfg.stop_after} (--stop-after): {path} is already at step {step}")


def _resume(cfg: TrainConfig, setup: RunSetup, world: MeshGroup) -> tuple[TrainConfig, Resumed]:
    path = latest_checkpoint(_checkpoint_folder(cfg))
    if path is None:
        raise TrainConfigError(f"resume=True (--resume): no checkpoint under {_checkpoint_folder(cfg)}")
    try:
        checkpoint = open_checkpoint(path, world)  # every file checked against the manifest first
    except CheckpointError as err:
        earlier = earlier_checkpoint(path)
        if earlier is None:
            raise
        raise CheckpointError(f"{err}; to resume from the checkpoint before it, {earlier.name}, move {path.name} out "
                              f"of {path.parent}") from None
    state = checkpoint.plain
    check_same_model(state["model"], cfg.model_config(), path)
    step = int(state["step"])
    check_steps_left(cfg, path, step)
    if state["data"]["batches"] != step:  # the loop replays one batch per step to find its place
        raise TrainConfigError(f"resume=True (--resume): {path} consumed {state['data']['batches']} batches "
                               f"in {step} steps; this trainer takes one per step")
    cfg = continue_schedule(cfg, state.get("schedule"), path)
    tensors = _tensors(setup)
    # A rank's RNG state continues only where the same rank exists with the same role: the same layout.
    same_layout = state["layout"] == cfg.layout.degrees()
    if not same_layout:
        del tensors["rng"]
    load_into(checkpoint, tensors, world)
    setup.model.state_loaded(setup.optimizer, int(state["optimizer_steps"]))
    if same_layout:
        torch.set_rng_state(tensors["rng"][_rng_name(setup.rank)])
    samples = int(state["data"].get("samples", step * cfg.batch_size))  # the global sample cursor
    return cfg, Resumed(step, [float(x) for x in state["losses"]], path, samples)
