"""The runtime's objects seen by the cost model, so a test can compare a measured step with its prediction.

The model is the one schema both sides read (`ModelSpec`); the rest is read by attribute (no torch import):
`orangetron.Layout` -> `Degrees`, `orangetron.ParallelConfig` -> `Job`.
"""

from __future__ import annotations

from dataclasses import replace

from orangetron.plan.memory import stage_memory
from orangetron.plan.traffic import step_records
from orangetron.spec.collectives import CommRecord
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job


def degrees_from_layout(layout: object) -> Degrees:
    return Degrees(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp, ep=layout.ep,
                   etp=getattr(layout, "etp", 1))


def job_from_parallel_config(pc: object, seq_len: int, micro_batch: int) -> Job:
    """A `Job` with the runtime's options; every micro-batch has `micro_batch` sequences of `seq_len`.

    Gradient buckets are the runtime's (`grad_bucket_numel`): fixed slices of the flat buffer under DDP, equal
    buckets each sharded on its own under ZeRO-1/2 and the distributed optimizer, or one reduction of the
    whole buffer (0).
    """
    return Job(seq_len=seq_len, micro_batch=micro_batch, num_microbatches=pc.microbatches,
               sequence_parallel=pc.sequence_parallel, cp_mode=pc.cp_mode, ulysses_degree=pc.ulysses_degree,
               dispatcher=pc.dispatcher, capacity_factor=pc.capacity_factor,
               ep_overlap_chunks=pc.ep_overlap_chunks, zero_stage=pc.zero_stage,
               distributed_optimizer=pc.distributed_optimizer, zero3_prefetch=pc.zero3_prefetch,
               zero3_keep_params=pc.zero3_keep_params,
               zero3_reduce_every_microbatch=pc.zero3_reduce_every_microbatch, param_dtype=pc.param_dtype,
               reduce_dtype=pc.reduce_dtype or "", bucket_numel=pc.grad_bucket_numel, pp_schedule=pc.pp_schedule,
               virtual_stages=pc.virtual_stages, recompute=pc.recompute)


def predicted_step(
    model: ModelSpec, layout: object, parallel_config: object, seq_len: int, micro_batch: int, stage: int = 0,
    clip_grad: bool = False,
) -> tuple[list[CommRecord], dict[str, int]]:
    """(CommRecords of one step, bytes by memory category) predicted for one rank of pipeline `stage`.

    `clip_grad`: the step clips gradients by their global norm (its reductions join the records).
    """
    deg = degrees_from_layout(layout)
    job = replace(job_from_parallel_config(parallel_config, seq_len, micro_batch), clip_grad=clip_grad)
    return step_records(model, deg, job, stage), stage_memory(model, deg, job, stage)
