"""What the planner predicts for one rank beside what the rank measured: memory by category and the bytes
one training step sends, by "op/mesh_dim".

The prediction is `plan.bridge.predicted_step` for this rank's pipeline stage, on the sequence length the
rank really runs (padded to the context-parallel shard multiple) and its share of each micro-batch, with
the global gradient norm's reductions (computed every step: reported, clipped by, checked for divergence).
The planner's fixed overhead term (CUDA context, allocator slack) has no measured counterpart and is left
out. MoE dispatch sizes and activations follow the routing, which the planner takes as balanced, so a MoE
layout's ep rows differ by what the routing did. A packed run's rows keep RoPE tables of their own, which the
prediction counts; its ring's transfers follow each micro-batch's documents (the rows are sharded at every row's
document starts), and are predicted from the documents of the step measured, the run's last.
"""

from __future__ import annotations

from typing import Any

import torch

from orangetron.spec.sharding import cp_padded_len
from orangetron.train.config import TrainConfig
from orangetron.train.data import packed_inputs
from orangetron.train.step import padded_documents

# measured name -> predicted name, in the order the table shows them
MEMORY_CATEGORIES = {"params": "params", "grads": "grads", "main_params": "main_params", "optimizer": "optimizer",
                     "activations_peak": "activations", "gathered_params": "gathered_params",
                     "grad_buckets": "grad_buckets", "param_grads": "param_grads"}


def predicted_for_rank(cfg: TrainConfig, stage: int, cp_rank: int = 0,
                       step_rows: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """{"memory": bytes by measured category name, "comm_per_step": bytes sent by "op/dim"} for a rank of
    pipeline `stage` and context-parallel index `cp_rank`; a packed run's from the documents of the step
    measured, the rank's rows of each of its micro-batches (`step_rows`; None, as for a run that trained no
    step: one document per sequence)."""
    from orangetron.comm import bytes_by_key
    from orangetron.plan.bridge import predicted_step

    seq_len = cp_padded_len(cfg.seq_len, cfg.cp, cfg.tp, cfg.sequence_parallel)
    batches = tuple(step_documents(rows, seq_len) for rows in step_rows) if cfg.pack_documents and step_rows else ()
    documents = (seq_len,) if cfg.pack_documents and not batches else ()  # no step: one document per sequence
    records, memory = predicted_step(cfg.model_config(), cfg.layout, cfg.parallel_config(), seq_len=seq_len,
                                     micro_batch=cfg.batch_size // (cfg.dp * cfg.microbatches), stage=stage,
                                     clip_grad=True,  # the global norm is computed every step, clipping or not
                                     doc_lengths=documents, cp_rank=cp_rank, doc_batches=batches)
    return {"memory": {name: memory[planned] for name, planned in MEMORY_CATEGORIES.items()},
            "comm_per_step": dict(sorted(bytes_by_key(records).items()))}


def step_documents(rows: torch.Tensor, seq_len: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per row of packed samples [b, S + 1, 2], the [start, stop) of each document of the sequence the model
    runs, padded at its end to `seq_len` as the trainer pads it (`train/step.py`)."""
    documents = padded_documents(packed_inputs(rows)[2], seq_len)
    return tuple(tuple(spans) for spans in documents.spans)


def side_by_side(predicted: dict[str, Any], memory: dict[str, int], comm_per_step: dict[str, int],
                 ) -> list[tuple[str, int | None, int | None]]:
    """(row, predicted, measured) for every memory category and every "op/dim" either side has."""
    rows = [(f"memory {name}", predicted["memory"].get(name), memory.get(name)) for name in MEMORY_CATEGORIES]
    keys = sorted(set(predicted["comm_per_step"]) | set(comm_per_step))
    rows += [(f"sent {key}", predicted["comm_per_step"].get(key, 0), comm_per_step.get(key, 0)) for key in keys]
    return rows


def format_table(rows: list[tuple[str, int | None, int | None]]) -> str:
    """The rows as a text table, bytes with thousands separators, and the difference where they differ."""
    lines = [f"{'rank 0, per training step':<34} {'predicted':>14} {'measured':>14}"]
    for name, want, got in rows:
        gap = "" if want == got or None in (want, got) else f"   ({got - want:+,})"
        lines.append(f"{name:<34} {_text(want):>14} {_text(got):>14}{gap}")
    return "\n".join(lines)


def _text(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
