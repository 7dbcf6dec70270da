"""A real pipeline step's timeline, in the shape `plan.schedule.simulate` gives: what `schedule --measured`
draws beside the simulated one.

Runs a small dense model on pp local CPU ranks with the executor's `timeline`, one warm-up step and one
recorded step, and returns the recorded step's actions as `Slot`s, time measured from the first action's
start in units of the mean forward of one whole stage (the simulation's unit).
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, ModelSpec, Transformer
from orangetron.parallel import ParallelConfig, parallelize
from orangetron.parallel.config import check_runnable
from orangetron.parallel.pipeline import MicroBatch, run_pipeline
from orangetron.spec.layout import Layout
from orangetron.spec.schedule import Action, Slot
from orangetron.train.launch import launch_local

SEQ, ROWS_PER_MICROBATCH = 64, 2


def _model(pp: int, virtual_stages: int) -> ModelSpec:
    return ModelConfig(dim=64, n_layers=2 * pp * virtual_stages, n_heads=4, n_kv_heads=4, vocab_size=256,
                       ffn_dim=128, aux_loss_coef=0.0)


def _options(schedule: str, microbatches: int, virtual_stages: int) -> ParallelConfig:
    return ParallelConfig(pp_schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages)


def _rank_timeline(pp: int, microbatches: int, schedule: str, virtual_stages: int) -> list[tuple]:
    torch.set_num_threads(1)
    mesh = init_mesh(Layout(pp=pp))
    cfg = _model(pp, virtual_stages)
    model = parallelize(Transformer(cfg, seed=0), mesh, _options(schedule, microbatches, virtual_stages))
    timeline: list[tuple] = []
    for step in range(2):
        rows = torch.randint(0, cfg.vocab_size, (ROWS_PER_MICROBATCH * microbatches, SEQ + 1),
                             generator=torch.Generator().manual_seed(step))
        mbs = [MicroBatch(x, y, torch.arange(SEQ), None, 1 / microbatches, 1 / microbatches)
               for x, y in zip(rows[:, :-1].chunk(microbatches), rows[:, 1:].chunk(microbatches), strict=True)]
        comm.all_reduce(torch.zeros(1), comm.world_group())  # start the recorded step together
        timeline.clear()
        run_pipeline(model, mbs, schedule, virtual_stages, timeline=timeline)
        model.module.zero_grad()
    return timeline


def measured_slots(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> list[Slot]:
    """Every rank's actions of one real step on pp local ranks, as `Slot`s (see the module docstring)."""
    check_runnable(_options(schedule, microbatches, virtual_stages))  # a planner-only schedule: before any rank
    per_rank = launch_local(_rank_timeline, pp, args=(pp, microbatches, schedule, virtual_stages))
    origin = min(t[3] for rank in per_rank for t in rank)
    forwards = [t[4] - t[3] for rank in per_rank for t in rank if t[0] == "F"]
    unit = virtual_stages * sum(forwards) / len(forwards)  # one chunk's forward is 1/v of the stage's
    return sorted((Slot(r, Action(kind, chunk, mb), (start - origin) / unit, (end - origin) / unit)
                   for r, rank in enumerate(per_rank) for kind, chunk, mb, start, end in rank),
                  key=lambda s: (s.start, s.rank))
