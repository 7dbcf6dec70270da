"""Dropless dispatch: the row counts first, then one variable-split all-to-all per tensor (x, ids, weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.expert.routing import (
    InFlight,
    Rows,
    destinations,
    read_counts,
    rows_of,
    slot_ranks,
    sum_rows,
    tokens_per_local_expert,
)


@dataclass(frozen=True)
class RaggedHandle:
    """What combine needs from dispatch: where each sent row came from and the split sizes."""

    token: torch.Tensor  # [S] the token each sent row carries (T = padding row, for capacity)
    send_rows: list[int]
    recv_rows: list[int]
    num_tokens: int
    dropped: torch.Tensor | None = None  # capacity: [E] assignments dropped per expert on this rank


def swap_counts(send_counts: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """[ep] int64 rows each member sends to this rank, from `send_counts` [ep] on the device (no host read)."""
    ones = [1] * group.size
    return comm.all_to_all(send_counts.reshape(-1, 1), group, ones, ones).view(-1)


def send(x: torch.Tensor, topk_weights: torch.Tensor, rows: Rows, group: MeshGroup, local_experts: int,
         recv_rows: list[int]):
    """All-to-all the rows; returns (recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert)."""
    recv_x = comm.all_to_all(x[rows.token], group, rows.send_rows, recv_rows)  # [R, dim]
    recv_idx = comm.all_to_all(rows.local_idx, group, rows.send_rows, recv_rows)  # [R, k]
    recv_w = comm.all_to_all(rows.weights(topk_weights), group, rows.send_rows, recv_rows)  # [R, k]
    return recv_x, recv_idx, recv_w, tokens_per_local_expert(recv_idx, local_experts)


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
             num_experts: int, options: object = None):
    """Dropless dispatch: one row per (token, destination rank); `options` unused. One host read: the row
    counts of both directions (and the ids' check), after the count exchange."""
    local = num_experts // group.size
    dest = slot_ranks(topk_idx, local, group.size)
    hit = destinations(dest, group.size)
    send_counts = hit.sum(0)  # [ep]
    send_rows, recv_rows = read_counts([send_counts, swap_counts(send_counts, group)], topk_idx, num_experts)
    rows = rows_of(topk_idx, dest, hit, local, send_rows)
    recv_x, recv_idx, recv_w, tokens_per_expert = send(x, topk_weights, rows, group, local, recv_rows)
    return recv_x, recv_idx, recv_w, tokens_per_expert, RaggedHandle(rows.token, rows.send_rows, recv_rows,
                                                                       x.shape[0])


def combine(expert_out: torch.Tensor, handle: RaggedHandle, group: MeshGroup) -> torch.Tensor:
    """Return every row to its sender and sum each token's rows: [R, dim] -> [T, dim]."""
    return combine_start(expert_out, handle, group).wait()


def combine_start(expert_out: torch.Tensor, handle: RaggedHandle, group: MeshGroup) -> InFlight:
    """`combine` that returns at once: its `wait()` gives the [T, dim] result (compute may run until then)."""
    back = comm.all_to_all_async(expert_out, group, handle.recv_rows, handle.send_rows)  # [S, dim] on its way
    # One spare row collects padding rows (capacity), which carry no token.
    return InFlight(back, lambda rows: sum_rows(rows, handle.token, handle.num_tokens + 1)[:handle.num_tokens])
