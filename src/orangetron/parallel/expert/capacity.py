"""Capacity dispatch: each expert takes at most `capacity` of this rank's assignments, the rest are dropped,
and every destination's rows are padded to the most it can receive, so the row counts are fixed.

capacity = ceil(T * top_k / num_experts * capacity_factor) for the T tokens of this rank (Switch, GShard).
The drop policy orders each expert's assignments: "probs" keeps the highest routing weights, "position" the
earliest tokens; ties keep token order. A rank sends min(local_experts * capacity, T) rows to every rank (padding
rows carry zeros, expert ids -1 and weight 0); the counts are still exchanged first, so ranks with
different token counts (or none) stay safe.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from orangetron.mesh import MeshGroup
from orangetron.parallel.expert import ragged
from orangetron.parallel.expert.ragged import RaggedHandle, send
from orangetron.parallel.expert.routing import Rows, route_rows


class CapacityOptions(Protocol):
    """What capacity dispatch reads from its dispatcher (`parallel.expert.Dispatcher` has both)."""

    capacity_factor: float
    drop_policy: str


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert on one rank: ceil(tokens * top_k / experts * capacity_factor)."""
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def kept_slots(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, slots: int,
               policy: str) -> torch.Tensor:
    """[T, k] bool: the assignments each expert keeps, at most `slots` per expert, chosen by `policy`."""
    flat_e = topk_idx.reshape(-1)
    if policy == "probs":
        order = torch.argsort(-topk_weights.detach().reshape(-1), stable=True)  # ties: token order
    else:
        order = torch.arange(flat_e.numel(), device=flat_e.device)
    order = order[torch.argsort(flat_e[order], stable=True)]  # grouped by expert, preference kept within
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
    keep = torch.zeros_like(flat_e, dtype=torch.bool)
    keep[order] = rank_in_expert < slots
    return keep.view_as(topk_idx)


def _padded(rows: Rows, per_rank: int, ep: int, num_tokens: int) -> Rows:
    """Rows laid out in blocks of `per_rank` per destination; empty slots carry token `num_tokens`."""
    starts = torch.tensor([0, *rows.send_rows], device=rows.token.device).cumsum(0)[:-1]
    position = rows.rank * per_rank + torch.arange(rows.token.numel(), device=rows.token.device) - starts[rows.rank]
    token = torch.full((ep * per_rank,), num_tokens, dtype=torch.int64, device=rows.token.device)
    token[position] = rows.token
    local_idx = torch.full((ep * per_rank, rows.local_idx.shape[1]), -1, dtype=torch.int64,
                           device=rows.token.device)
    local_idx[position] = rows.local_idx
    rank = torch.arange(ep, device=rows.token.device).repeat_interleave(per_rank)
    return Rows(token, rank, local_idx, [per_rank] * ep)


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
             num_experts: int, options: CapacityOptions):
    """Ragged dispatch of at most `options.capacity_factor` x the fair share per expert, the rest dropped by
    `options.drop_policy`, every destination padded to the same row count."""
    tokens, top_k = topk_idx.shape
    local = num_experts // group.size
    slots = capacity(tokens, top_k, num_experts, options.capacity_factor)
    keep = kept_slots(topk_idx, topk_weights, num_experts, slots, options.drop_policy)
    # No destination can receive more rows than there are tokens (one row per token and rank).
    per_rank = min(local * slots, tokens)
    rows = _padded(route_rows(topk_idx, local, group.size, routed=keep), per_rank, group.size, tokens)
    # A spare zero token (and zero weights) feeds the padding rows.
    x_pad = torch.cat((x, x.new_zeros(1, x.shape[-1])))
    w_pad = torch.cat((topk_weights, topk_weights.new_zeros(1, top_k)))
    recv_x, recv_idx, recv_w, tokens_per_expert, recv_rows = send(x_pad, w_pad, rows, group, local)
    dropped = torch.bincount(topk_idx[~keep], minlength=num_experts)
    handle = RaggedHandle(rows.token, rows.send_rows, recv_rows, tokens, dropped)
    return recv_x, recv_idx, recv_w, tokens_per_expert, handle


combine = ragged.combine  # the padded rows travel back like any other
