"""Capacity dispatch: each expert takes at most `capacity` of this rank's assignments, the rest are dropped,
and every destination's rows are padded to the most it can receive, so the row counts are fixed.

capacity = ceil(T * top_k / num_experts * capacity_factor) for the T tokens of this rank (Switch, GShard).
The drop policy orders each expert's assignments: "probs" keeps the highest routing weights, "position" the
earliest tokens; ties keep token order. A rank sends min(local_experts * capacity, T) rows to every rank (padding
rows carry zeros, expert ids -1 and weight 0); the counts are still exchanged first, so ranks with
different token counts (or none) stay safe.
"""

from __future__ import annotations

from typing import Protocol

import torch

from orangetron.mesh import MeshGroup
from orangetron.parallel.expert import ragged
from orangetron.parallel.expert.ragged import RaggedHandle, send, swap_counts
from orangetron.parallel.expert.routing import (
    Rows,
    assignments_per_expert,
    count_message,
    destinations,
    read_counts,
    rows_of,
    slot_ranks,
    split_received,
    tokens_per_local_expert,
)
from orangetron.spec.dispatchers import slots_per_expert


class CapacityOptions(Protocol):
    """What capacity dispatch reads from its dispatcher (`parallel.expert.Dispatcher` has both)."""

    capacity_factor: float
    drop_policy: str


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert on one rank (`spec.dispatchers.slots_per_expert`: ceil(tokens * top_k / experts *
    capacity_factor), and no more than the tokens)."""
    return slots_per_expert(num_tokens, top_k, num_experts, capacity_factor)


def kept_slots(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, slots: int,
               policy: str) -> torch.Tensor:
    """[T, k] bool: the assignments each expert keeps, at most `slots` per expert, chosen by `policy`."""
    flat_e = topk_idx.reshape(-1)
    if policy == "probs":
        order = torch.argsort(-topk_weights.detach().reshape(-1), stable=True)  # ties: token order
    else:
        order = torch.arange(flat_e.numel(), device=flat_e.device)
    order = order[torch.argsort(flat_e[order], stable=True)]  # grouped by expert, preference kept within
    grouped = flat_e[order]
    # Where each expert's group starts, found by search rather than by counts whose size the host would read.
    rank_in_expert = torch.arange(order.numel(), device=order.device) - torch.searchsorted(grouped, grouped)
    keep = torch.zeros_like(flat_e, dtype=torch.bool)
    keep[order] = rank_in_expert < slots
    return keep.view_as(topk_idx)


def _padded(rows: Rows, per_rank: int, ep: int, num_tokens: int) -> Rows:
    """Rows laid out in blocks of `per_rank` per destination; empty slots carry token `num_tokens`."""
    # Rows come grouped by rank: a row's place in its rank's block is its distance from the block's first row.
    first = torch.searchsorted(rows.rank, rows.rank)
    position = rows.rank * per_rank + torch.arange(rows.token.numel(), device=rows.token.device) - first
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
    dest = slot_ranks(topk_idx, local, group.size, routed=keep)
    hit = destinations(dest, group.size)
    padded_rows = torch.full((group.size,), per_rank, dtype=torch.int64, device=topk_idx.device)
    message = count_message(padded_rows, assignments_per_expert(topk_idx, num_experts, routed=keep), group.size)
    received = swap_counts(message, group)  # [ep, 1 + local]: padded rows, kept assignments per local expert
    # The one host read: the rows before padding (to lay them out), the padded rows each member sends here and
    # the kept assignments each local expert receives.
    send_rows, arrived = read_counts([hit.sum(0), received], topk_idx, num_experts)
    recv_rows, per_expert = split_received(arrived, group.size)
    rows = _padded(rows_of(topk_idx, dest, hit, local, send_rows), per_rank, group.size, tokens)
    # A spare zero token (and zero weights) feeds the padding rows.
    x_pad = torch.cat((x, x.new_zeros(1, x.shape[-1])))
    w_pad = torch.cat((topk_weights, topk_weights.new_zeros(1, top_k)))
    recv_x, recv_idx, recv_w = send(x_pad, w_pad, rows, group, recv_rows)
    dropped = tokens_per_local_expert(torch.where(keep, -1, topk_idx), num_experts)  # [E]
    handle = RaggedHandle(rows.token, rows.send_rows, recv_rows, tokens, dropped, per_expert)
    return recv_x, recv_idx, recv_w, received[:, 1:].sum(0), handle


combine, combine_start = ragged.combine, ragged.combine_start  # the padded rows travel back like any other
