"""Where a rank's pieces of every whole tensor lie: the layout-independent view that checkpoints save and load.

A parameter's whole tensor (its shape in the one-device model) is split three ways before a rank holds any
of it: tensor parallelism keeps a slice along one dimension (`Placement`), expert parallelism a block of
experts along dimension 0, and the data-parallel flat buffer (`FlatPart`) a contiguous range of the
flattened local tensor, which under ZeRO may start and end in the middle of a row. A flat range of an
N-d tensor is a union of at most 2N - 1 boxes, each contiguous in memory (`flat_range_boxes`): for a
matrix, the tail of a first row, whole rows, the head of a last row.

`Shards` names those boxes in the coordinates of the whole tensor (offsets and sizes) together with the
rank's memory for each (a view into its own buffers: main parameters, AdamW moments). Nothing is copied,
so writing a checkpoint reads a rank's own shard and nothing else, and loading one writes straight into
the buffers. Replicas (DDP's full buffers, tp ranks sharing a replicated weight or key/value head) name
identical boxes; the checkpoint writer keeps one copy of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from orangetron.parallel.data.buffers import TIED
from orangetron.parallel.data.flat import FlatPart

if TYPE_CHECKING:
    from orangetron.parallel.data import DataParallelBuffers, ShardedAdamW


@dataclass(frozen=True)
class Piece:
    """One box of a whole tensor: `data` (a view of the rank's memory, shape `sizes`) at `offsets`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor


@dataclass(frozen=True)
class Shards:
    """The pieces of a whole tensor of `shape` that this rank holds (possibly none)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @staticmethod
    def whole(tensor: torch.Tensor) -> Shards:
        """A tensor every rank holds whole (`tensor` itself is the one piece)."""
        shape = tuple(tensor.shape)
        return Shards(shape, tensor.dtype, (Piece((0,) * len(shape), shape, tensor),))


Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, first flat element


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes `(offsets, sizes, flat_start)` whose union is elements `[start, stop)` of a row-major tensor.

    Each box is contiguous in the flattened tensor and starts at element `flat_start`; boxes come in order.
    At most 2 * len(shape) - 1 of them. A 0-d tensor is one box of no dimensions.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner  # the rows (along dim 0) the range touches
    if start % inner == 0 and stop % inner == 0 or inner == 1:
        return [((first,) + (0,) * (len(shape) - 1), (last - first + 1,) + tuple(shape[1:]), start)]
    if first == last:  # inside one row: a range of the sub-tensor
        return [((first,) + offsets, (1,) + sizes, first * inner + at)
                for offsets, sizes, at in flat_range_boxes(shape[1:], start - first * inner, stop - first * inner)]
    head_end = (first + 1) * inner if start % inner else start
    tail_start = last * inner if stop % inner else stop
    return (flat_range_boxes(shape, start, head_end) + flat_range_boxes(shape, head_end, tail_start)
            + flat_range_boxes(shape, tail_start, stop))


def _owned_ranges(part: FlatPart) -> dict[str, list[tuple[int, int, int, int]]]:
    """For each parameter of `part` that this rank owns some of, one entry per segment it owns a range of:
    (first element, end element, segment index, position of the first in that segment's slice). ZeRO-3's
    units hold whole parameters; equal gradient buckets may cut a parameter into several."""
    r = part.group.rank if part.shards > 1 else 0
    out: dict[str, list[tuple[int, int, int, int]]] = {}
    for name, p in part.named:
        at, end = part.offsets[name], part.offsets[name] + p.numel()
        for k, seg in enumerate(part.segments):
            owned_start = seg.start + r * seg.shard_numel
            lo, hi = max(at, owned_start), min(end, owned_start + seg.shard_numel)
            if lo < hi:
                out.setdefault(name, []).append((lo - at, hi - at, k, lo - owned_start))
    return out


def _segment_slice(part: FlatPart, owned: torch.Tensor, k: int) -> torch.Tensor:
    """Segment k's slice of a shard-layout buffer, 1-D: a row of the [buckets, slice] view when bucketed."""
    if part.bucketed:
        return owned[k]
    seg = part.segments[k]
    return owned[seg.shard_start:seg.shard_start + seg.shard_numel]


def _global_offset(buffers: DataParallelBuffers, name: str,
                   local_shape: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Where this rank's local tensor of `name` starts in the whole tensor, and the whole tensor's shape."""
    offset, shape = [0] * len(local_shape), list(local_shape)
    if buffers.tp is not None:
        placement = buffers.placements[name]
        if placement.dim is not None:
            offset[placement.dim] = placement.slice_index(buffers.tp.rank) * local_shape[placement.dim]
            shape[placement.dim] = local_shape[placement.dim] * placement.slices(buffers.tp.size)
    if buffers.is_expert(name):  # the ep ranks hold consecutive blocks of experts
        offset[0] += buffers.ep.rank * local_shape[0]
        shape[0] *= buffers.ep.size
    return offset, shape


def part_shards(buffers: DataParallelBuffers, part: FlatPart, owned: torch.Tensor) -> dict[str, Shards]:
    """The whole tensors by parameter name whose pieces `owned` (a shard-layout buffer of `part`: main params
    or an AdamW moment) holds; every parameter of the part is named, with no pieces where none is owned."""
    ranges = _owned_ranges(part)
    out = {}
    for name, p in part.named:
        local_shape = tuple(p.shape)
        offset, shape = _global_offset(buffers, name, local_shape)
        pieces = []
        for lo, hi, k, at in ranges.get(name, []):
            row = _segment_slice(part, owned, k)
            for box_offsets, sizes, flat_start in flat_range_boxes(local_shape, lo, hi):
                begin = at + flat_start - lo
                view = row[begin:begin + math.prod(sizes)].view(sizes)
                pieces.append(Piece(tuple(o + g for o, g in zip(box_offsets, offset, strict=True)), sizes, view))
        out[name] = Shards(tuple(shape), owned.dtype, tuple(pieces))
    return out


def sharded_state(buffers: DataParallelBuffers, optimizer: ShardedAdamW,
                  writing: bool = False) -> dict[str, dict[str, Shards]]:
    """This rank's pieces of the main parameters, both AdamW moments and the buffers, by parameter name.

    Views, not copies: saving reads them, loading writes into them (follow a load with the model's
    `state_loaded`). A pipeline stage names only its own layers; the stages together name the whole model.
    `writing`: a tied embedding's last-stage copy names no pieces. Its flat layout is not the first stage's,
    so its boxes would overlap the first stage's without matching them, which a checkpoint refuses; loading
    fills both copies.
    """
    state: dict[str, dict[str, Shards]] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for part, adamw in zip(buffers.parts, optimizer.adamws, strict=True):
        state["params"] |= part_shards(buffers, part, part.main_params)
        state["exp_avg"] |= part_shards(buffers, part, adamw.exp_avg)
        state["exp_avg_sq"] |= part_shards(buffers, part, adamw.exp_avg_sq)
    if writing and buffers.tied_copy:
        for kind in state.values():
            kind[TIED] = Shards(kind[TIED].shape, kind[TIED].dtype, ())
    # Buffers (the routers' balancing biases) are whole and the same on every rank of a stage.
    state["buffers"] = {name: Shards.whole(b) for name, b in buffers.module.named_buffers()}
    return state
