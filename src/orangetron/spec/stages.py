"""Which layers each pipeline stage (and each virtual chunk) holds.

A layout is the number of decoder layers of each virtual stage (chunk g on rank g % pp), as Megatron's
`--pipeline-model-parallel-layout` lists them; empty: Megatron's even split. Every function here takes it last.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from orangetron.spec.model import ModelSpec


def chunk_layers(num_layers: int, chunks: int, layout: tuple[int, ...] = ()) -> list[range]:
    """Contiguous layer ranges of `chunks` model chunks: `layout`'s sizes, or evenly with the first
    `num_layers % chunks` one layer longer."""
    base, extra = divmod(num_layers, chunks)
    sizes = layout or tuple(base + (1 if i < extra else 0) for i in range(chunks))
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


@lru_cache(maxsize=8192)
def stage_layers(num_layers: int, pp: int, virtual_stages: int, stage: int,
                 layout: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Layer indices on pipeline `stage`: chunks stage, stage+pp, ... (Megatron's interleaved assignment)."""
    chunks = chunk_layers(num_layers, pp * virtual_stages, layout)
    return tuple(i for v in range(virtual_stages) for i in chunks[stage + v * pp])


@lru_cache(maxsize=8192)
def stage_layer_counts(model: ModelSpec, pp: int, virtual_stages: int, stage: int,
                       layout: tuple[int, ...] = ()) -> tuple[int, int]:
    """(layers, of which MoE) on pipeline `stage`: every layer of a kind costs the same, so costs need only these."""
    layers = stage_layers(model.num_layers, pp, virtual_stages, stage, layout)
    return len(layers), sum(model.is_moe_layer(i) for i in layers)


@lru_cache(maxsize=8192)
def distinct_stages(model: ModelSpec, pp: int, virtual_stages: int, layout: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The first stage of each kind: the dense-or-MoE sequence of each of its chunks, and whether it is the
    first or the last stage. Stages of a kind take the same time per micro-batch and hold the same states,
    and the earliest holds the most micro-batches in flight, so these bound every stage's time and memory (a
    middle stage may be the slowest or the fullest: MoE layers after dense ones, a last stage with a layer
    fewer; where in a chunk its MoE layers sit decides what full recompute and an interleaved schedule hold).
    """
    chunks = chunk_layers(model.num_layers, pp * virtual_stages, layout)
    kinds: dict[tuple, int] = {}
    for stage in range(pp):
        moe = tuple(tuple(model.is_moe_layer(i) for i in chunks[stage + v * pp]) for v in range(virtual_stages))
        kinds.setdefault((moe, stage == 0, stage == pp - 1), stage)
    return tuple(kinds.values())


def longest_chunk(num_layers: int, pp: int, virtual_stages: int, layout: tuple[int, ...] = ()) -> int:
    """Layers of the largest pipeline chunk (`chunk_layers` gives the first ones the extra layers)."""
    return max(layout) if layout else -(-num_layers // (pp * virtual_stages))


@lru_cache(maxsize=8192)
def replayed_layers(num_layers: int, pp: int, virtual_stages: int, stage: int, per_chunk: int,
                    layout: tuple[int, ...] = ()) -> frozenset[int]:
    """Layers of `stage` that replay their forward when full recompute covers the first `per_chunk` layers of
    each of its chunks (0: all of them)."""
    chunks = chunk_layers(num_layers, pp * virtual_stages, layout)
    mine = (chunks[stage + v * pp] for v in range(virtual_stages))
    return frozenset(i for chunk in mine for i in (chunk if not per_chunk else chunk[:per_chunk]))


def replay_split(num_layers: int, pp: int, virtual_stages: int, stage: int, per_chunk: int,
                 layers: Sequence[int], layout: tuple[int, ...] = ()) -> tuple[tuple[bool, tuple[int, ...]], ...]:
    """`layers` of `stage` as (replayed or not, those layers), the replayed ones first, each group where present."""
    replayed = replayed_layers(num_layers, pp, virtual_stages, stage, per_chunk, layout)
    groups = ((flag, tuple(i for i in layers if (i in replayed) == flag)) for flag in (True, False))
    return tuple((flag, mine) for flag, mine in groups if mine)
