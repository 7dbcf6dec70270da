"""The built-in pipeline schedules, each one record: its action lists, its rules and what a stage holds.

In flight, in units of a stage's layers (the activations a stage keeps at its peak): 1F1B's stage s holds
pp - s micro-batches (stage 0 holds pp); GPipe holds all m; interleaved with v chunks holds v*pp + pp - 1 - 2s
chunk-micro-batches of 1/v of its layers (Korthikanti et al. 2022, 1 + (p-1)/(p*v)); zb-h1 holds pp on every
stage, counting a micro-batch whose W waits as whole (an upper bound; the planner prices the W's state apart).
Held outputs: micro-batches whose last-stage output and loss wait for their backward.
"""

from __future__ import annotations

from orangetron.spec import rules
from orangetron.spec.schedule import gpipe, interleaved, one_forward_one_backward, zero_bubble_h1
from orangetron.spec.variants import SCHEDULES, Schedule

# Every runtime schedule runs on the one executor that plays action lists (parallel/pipeline/executor.py).
EXECUTOR = "orangetron.parallel.pipeline.executor:run_pipeline"


def _interleaved_in_flight(pp: int, v: int, m: int, stage: int) -> float:
    return min(v * pp + pp - 1 - 2 * stage, m * v) / v if v > 1 else float(min(pp - stage, m))


SCHEDULES.register(Schedule(
    name="gpipe", summary="every forward, then every backward", runtime=EXECUTOR, actions=gpipe,
    in_flight=lambda pp, v, m, stage: float(m), held_outputs=lambda pp, m: m))
SCHEDULES.register(Schedule(
    name="1f1b", summary="one forward, one backward after a warmup of pp - rank - 1 forwards", runtime=EXECUTOR,
    actions=one_forward_one_backward, in_flight=lambda pp, v, m, stage: float(min(pp - stage, m)),
    held_outputs=lambda pp, m: 1))
SCHEDULES.register(Schedule(
    name="interleaved", summary="1F1B over --virtual-stages model chunks per rank (Megatron)", runtime=EXECUTOR,
    actions=interleaved, chunks=True, check=rules.microbatches_multiple_of_pp, in_flight=_interleaved_in_flight,
    held_outputs=lambda pp, m: 1))
SCHEDULES.register(Schedule(
    name="zb-h1", summary="planner only: zero bubble, each weight gradient deferred to fill the drain (Qi et al.)",
    actions=zero_bubble_h1, split_backward=True, check=rules.microbatches_at_least_pp,
    in_flight=lambda pp, v, m, stage: float(min(pp, m)), held_outputs=lambda pp, m: min(pp, m)))
