"""The runtime's objects seen by the cost model, so a test can compare a measured step with its prediction.

The model is the one schema both sides read (`ModelSpec`); the layout is read by attribute (no torch import):
`orangetron.Layout` -> `Degrees`. The runtime's `ParallelConfig` needs no mapping: it is the `Job`'s own options
(spec/options.py).
"""

from __future__ import annotations

from orangetron.plan.memory import stage_memory
from orangetron.plan.traffic import step_records
from orangetron.spec.collectives import CommRecord
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.parallel_config import ParallelConfig, values_of


def degrees_from_layout(layout: object) -> Degrees:
    return Degrees(tp=layout.tp, cp=layout.cp, pp=layout.pp, dp=layout.dp, ep=layout.ep,
                   etp=getattr(layout, "etp", 1))


def predicted_step(
    model: ModelSpec, layout: object, parallel_config: ParallelConfig, seq_len: int, micro_batch: int,
    stage: int = 0, clip_grad: bool = False, doc_lengths: tuple[int, ...] = (), cp_rank: int | None = None,
    doc_batches: tuple = (),
) -> tuple[list[CommRecord], dict[str, int]]:
    """(CommRecords of one step, bytes by memory category) predicted for one rank of pipeline `stage`, every
    micro-batch holding `micro_batch` sequences of `seq_len` (packed documents of `doc_lengths`, or those each
    micro-batch holds, `doc_batches` (`Job`), if given; the rank's cp index `cp_rank` then sets its ring's sizes).

    Gradient buckets are the runtime's (`grad_bucket_numel`): fixed slices of the flat buffer under DDP, equal
    buckets each sharded on its own under ZeRO-1/2 and the distributed optimizer, or one reduction of the
    whole buffer (0). `clip_grad`: the step clips gradients by their global norm (its reductions join the records).
    """
    deg = degrees_from_layout(layout)
    job = Job(**values_of(ParallelConfig, parallel_config), seq_len=seq_len, micro_batch=micro_batch,
              clip_grad=clip_grad, doc_lengths=doc_lengths, doc_batches=doc_batches)
    return step_records(model, deg, job, stage, cp_rank=cp_rank), stage_memory(model, deg, job, stage)
