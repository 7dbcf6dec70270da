"""Stage partitioning: which parts of the reference model one pipeline rank keeps, and how one chunk runs.

With pp ranks and v virtual stages the layers form pp * v contiguous chunks, split as the planner splits
them (`plan.stages.chunk_layers`); rank r runs chunks r, r + pp, ... (virtual stage g = chunk * pp + r).
The embedding lives on virtual stage 0, the final norm, output projection and loss on the last one. A
tied model's last stage keeps the embedding too, for its head: the two copies start equal and receive the
same summed gradient each step (`DataParallelBuffers.sum_partials`), up to the rounding of each stage's own
data-parallel reduction (docs/pipeline_parallel.md).
Parameters keep their reference names (`layers.5.attention.wq.weight`), so checkpoints and whole
gradients are the same on every layout. The parts a rank does not run are emptied with `replace_module`
(`orangetron/parallel/replace.py`), like every other change a dimension makes to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from orangetron.model.documents import Documents
from orangetron.model.layers import rope_tables
from orangetron.model.moe import MoE
from orangetron.parallel.config import ParallelConfig, ParallelConfigError
from orangetron.parallel.replace import replace_module
from orangetron.spec.layout import LayoutError
from orangetron.spec.model import ModelSpec
from orangetron.spec.stages import chunk_layers


@dataclass(frozen=True)
class Chunk:
    """One model chunk of a pipeline rank: virtual stage `stage`, its layer indices, first or last."""

    stage: int
    index: int  # which of the rank's chunks (0 .. v-1): the schedule's `Action.chunk`
    layers: tuple[int, ...]
    first: bool
    last: bool


def check_pipeline(cfg: ModelSpec, pp: int, config: ParallelConfig) -> None:
    """Refuse pipeline settings the runtime cannot run (LayoutError / ParallelConfigError)."""
    if pp == 1:
        return
    chunks = pp * config.virtual_stages
    if cfg.num_layers < chunks:
        raise LayoutError(f"pp={pp}: num_layers={cfg.num_layers} < pp*virtual_stages={chunks}; every chunk needs a "
                          "layer")
    if config.zero_stage == 3 and config.virtual_stages > 1:
        raise ParallelConfigError(f"zero_stage=3 with pp={pp} and virtual_stages={config.virtual_stages}: ZeRO-3 "
                                  "is pipelined with one model chunk per rank only; use virtual_stages 1")


def split_stages(model: nn.Module, pp: int, pp_rank: int, virtual_stages: int) -> list[Chunk]:
    """Drop from `model` (in place) every part that pipeline rank `pp_rank` does not run; return its chunks.

    `model.layers` becomes an `nn.ModuleDict` keyed by the global layer index.
    """
    ranges = chunk_layers(len(model.layers), pp * virtual_stages)
    chunks = []
    for c in range(virtual_stages):
        g = c * pp + pp_rank
        chunks.append(Chunk(g, c, tuple(ranges[g]), g == 0, g == pp * virtual_stages - 1))
    kept = [i for chunk in chunks for i in chunk.layers]
    replace_module(model, "layers", nn.ModuleDict({str(i): model.layers[i] for i in kept}))
    # A tied head reads the embedding's matrix: the last stage keeps its own copy (`tied_copy`).
    keeps_embedding = chunks[0].first or (chunks[-1].last and model.cfg.tied_embeddings)
    dropped = ([] if keeps_embedding else ["tok_embeddings"]) + ([] if chunks[-1].last else ["norm", "output"])
    for name in dropped:
        replace_module(model, name, None)
    return chunks


def hidden_shape(model: nn.Module, tokens: torch.Tensor) -> tuple[int, int, int]:
    """The activation passed between stages for tokens [B, S]: [B, S/tp, dim] under SP, else [B, S, dim]."""
    b, s = tokens.shape
    return b, model.io.hidden_len(s), model.cfg.hidden_size


def chunk_forward(model: nn.Module, chunk: Chunk, x: torch.Tensor, positions: torch.Tensor,
                  token_mask: torch.Tensor | None,
                  documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `chunk` on x (tokens [B, S] on the first chunk, else the previous chunk's activation).

    `positions`: the global positions of the micro-batch's tokens ([S] or [B, S]; packed rows: within their
    `documents`, which every block attends within). Returns (the activation
    for the next chunk, or logits on the last; the chunk's load-balancing loss, or None without MoE).
    """
    h = model.embed(x) if chunk.first else x
    cos, sin = rope_tables(positions, model.cfg, h.dtype)
    mask = model.routing_mask(token_mask)
    aux = None
    for i in chunk.layers:
        layer = model.layers[str(i)]
        h = layer(h, cos, sin, mask, documents)
        ff = layer.feed_forward
        if isinstance(ff, MoE) and ff.last_aux_loss is not None:  # read now: the next forward overwrites it
            aux = ff.last_aux_loss if aux is None else aux + ff.last_aux_loss
    return (model.head(h) if chunk.last else h), aux
