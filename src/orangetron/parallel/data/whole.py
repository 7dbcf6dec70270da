"""Whole tensors by parameter name, gathered on every rank: the same on any layout, so a run can compare
gradients with one device (`orangetron verify`) or resume on another layout.

A part's flat buffer is gathered over its shard group when sharded, each local tensor over tp (its
`Placement`) and, for the routed experts, over ep (the ep blocks in rank order); under pipeline parallelism
every stage's tensors are exchanged, so the result names the whole model on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from orangetron import comm
from orangetron.parallel.data.buffers import DataParallelBuffers
from orangetron.parallel.data.flat import FlatPart
from orangetron.parallel.data.sharded_adamw import ShardedAdamW
from orangetron.parallel.tensor import gather_tensor


def full_grads(buffers: DataParallelBuffers) -> dict[str, torch.Tensor]:
    """Whole averaged gradients by parameter name, on every rank (after the gradients were reduced)."""
    return _by_name(buffers, [part.owned_grads() for part in buffers.parts])


def full_state(buffers: DataParallelBuffers, optimizer: ShardedAdamW) -> dict[str, Any]:
    """Whole (unsharded) main parameters and AdamW moments by parameter name, on every rank, with AdamW's step
    count and the module's buffers (the routers' balancing biases)."""
    return {
        "params": _by_name(buffers, [part.main_params for part in buffers.parts]),
        "exp_avg": _by_name(buffers, [a.exp_avg for a in optimizer.adamws]),
        "exp_avg_sq": _by_name(buffers, [a.exp_avg_sq for a in optimizer.adamws]),
        "optimizer_steps": optimizer.steps,
        "buffers": _module_buffers(buffers),
    }


def _whole(buffers: DataParallelBuffers, part: FlatPart, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Whole tensors by parameter name from a part's full flat buffer (gathered over tp and ep)."""
    out = {}
    for name, local in part.locals_by_name(flat).items():
        if buffers.tp is not None:
            local = gather_tensor(local, buffers.placements[name], buffers.tp)
        if buffers.is_expert(name):
            local = comm.all_gather(local.contiguous(), buffers.ep, dim=0)  # the ep blocks, in rank order
        out[name] = local
    return out


def _by_name(buffers: DataParallelBuffers, owned: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for part, tensor in zip(buffers.parts, owned, strict=True):
        out |= _whole(buffers, part, part.gather_owned(tensor))
    return _every_stage(buffers, out)


def _module_buffers(buffers: DataParallelBuffers) -> dict[str, torch.Tensor]:
    # Buffers (the routers' balancing biases) are whole and the same on every rank of a stage.
    out = {name: b.detach().clone() for name, b in buffers.module.named_buffers()}
    return _every_stage(buffers, out)


def _every_stage(buffers: DataParallelBuffers, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if buffers.pp is None:
        return mine
    out: dict[str, torch.Tensor] = {}
    for stage in comm.all_gather_objects(mine, buffers.pp):
        for name, t in stage.items():
            out.setdefault(name, t)  # a tied embedding: the first stage's, which a checkpoint keeps
    return out
