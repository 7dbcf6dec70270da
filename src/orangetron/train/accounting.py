"""What the planner predicts for one rank beside what the rank measured: memory by category and the bytes
one training step sends, by "op/mesh_dim".

The prediction is `plan.bridge.predicted_step` for this rank's pipeline stage, on the sequence length the
rank really runs (padded to the context-parallel shard multiple) and its share of each micro-batch, with
the global gradient norm's reductions (computed every step: reported, clipped by, checked for divergence).
The planner's fixed overhead term (CUDA context, allocator slack) has no measured counterpart and is left
out. MoE dispatch sizes and activations follow the routing, which the planner takes as balanced, so a MoE
layout's ep rows differ by what the routing did. A packed run's rows keep RoPE tables of their own, which the
prediction counts; its ring's transfers follow each batch's documents, and are predicted for one document per
sequence: the most a rank receives when the rows of a micro-batch share their boundaries (rows with different
ones shard at the union of their starts, and a rank may then receive more).
"""

from __future__ import annotations

from typing import Any

from orangetron.spec.sharding import cp_padded_len
from orangetron.train.config import TrainConfig

# measured name -> predicted name, in the order the table shows them
MEMORY_CATEGORIES = {"params": "params", "grads": "grads", "main_params": "main_params", "optimizer": "optimizer",
                     "activations_peak": "activations", "gathered_params": "gathered_params",
                     "grad_buckets": "grad_buckets", "param_grads": "param_grads"}


def predicted_for_rank(cfg: TrainConfig, stage: int, cp_rank: int = 0) -> dict[str, Any]:
    """{"memory": bytes by measured category name, "comm_per_step": bytes sent by "op/dim"} for a rank of
    pipeline `stage` and context-parallel index `cp_rank`."""
    from orangetron.comm import bytes_by_key
    from orangetron.plan.bridge import predicted_step

    seq_len = cp_padded_len(cfg.seq_len, cfg.cp, cfg.tp, cfg.sequence_parallel)
    documents = (seq_len,) if cfg.pack_documents else ()  # one document per sequence (module docstring)
    records, memory = predicted_step(cfg.model_config(), cfg.layout, cfg.parallel_config(), seq_len=seq_len,
                                     micro_batch=cfg.batch_size // (cfg.dp * cfg.microbatches), stage=stage,
                                     clip_grad=True,  # the global norm is computed every step, clipping or not
                                     doc_lengths=documents, cp_rank=cp_rank)
    return {"memory": {name: memory[planned] for name, planned in MEMORY_CATEGORIES.items()},
            "comm_per_step": dict(sorted(bytes_by_key(records).items()))}


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
