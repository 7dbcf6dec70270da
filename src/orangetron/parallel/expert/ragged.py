"""Dropless dispatch: the counts first (rows, and assignments per expert), then one variable-split all-to-all per
tensor (x, ids, weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.expert.routing import (
    InFlight,
    Rows,
    assignments_per_expert,
    count_message,
    destinations,
    read_counts,
    rows_of,
    slot_ranks,
    split_received,
    sum_rows,
)


@dataclass(frozen=True)
class RaggedHandle:
    """What combine needs from dispatch: where each sent row came from and the split sizes."""

    token: torch.Tensor  # [S] the token each sent row carries (T = padding row, for capacity)
    send_rows: list[int]
    recv_rows: list[int]
    num_tokens: int
    dropped: torch.Tensor | None = None  # capacity: [E] assignments dropped per expert on this rank
    tokens_per_expert: list[int] | None = None  # read on the host with the row counts, for the experts' groups


def swap_counts(message: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """The count exchange: `message` [ep, m] int64 (row j for member j, `routing.count_message`) -> [ep, m], row
    j what member j sent this rank, on the device (no host read)."""
    ones = [1] * group.size
    return comm.all_to_all(message, group, ones, ones)


def send(x: torch.Tensor, topk_weights: torch.Tensor, rows: Rows, group: MeshGroup, recv_rows: list[int]):
    """All-to-all the rows; returns (recv_x, recv_topk_idx, recv_topk_weights)."""
    recv_x = comm.all_to_all(x[rows.token], group, rows.send_rows, recv_rows)  # [R, dim]
    recv_idx = comm.all_to_all(rows.local_idx, group, rows.send_rows, recv_rows)  # [R, k]
    recv_w = comm.all_to_all(rows.weights(topk_weights), group, rows.send_rows, recv_rows)  # [R, k]
    return recv_x, recv_idx, recv_w


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
             num_experts: int, options: object = None):
    """Dropless dispatch: one row per (token, destination rank); `options` unused. One host read, after the
    count exchange: the row counts of both directions, the received assignments per local expert (the
    experts' group sizes) and the ids' check."""
    local = num_experts // group.size
    dest = slot_ranks(topk_idx, local, group.size)
    hit = destinations(dest, group.size)
    send_counts = hit.sum(0)  # [ep]
    received = swap_counts(count_message(send_counts, assignments_per_expert(topk_idx, num_experts), group.size),
                           group)  # [ep, 1 + local]
    send_rows, arrived = read_counts([send_counts, received], topk_idx, num_experts)
    recv_rows, per_expert = split_received(arrived, group.size)
    rows = rows_of(topk_idx, dest, hit, local, send_rows)
    recv_x, recv_idx, recv_w = send(x, topk_weights, rows, group, recv_rows)
    handle = RaggedHandle(rows.token, rows.send_rows, recv_rows, x.shape[0], tokens_per_expert=per_expert)
    return recv_x, recv_idx, recv_w, received[:, 1:].sum(0), handle


def combine(expert_out: torch.Tensor, handle: RaggedHandle, group: MeshGroup) -> torch.Tensor:
    """Return every row to its sender and sum each token's rows: [R, dim] -> [T, dim]."""
    return combine_start(expert_out, handle, group).wait()


def combine_start(expert_out: torch.Tensor, handle: RaggedHandle, group: MeshGroup) -> InFlight:
    """`combine` that returns at once: its `wait()` gives the [T, dim] result (compute may run until then)."""
    back = comm.all_to_all_async(expert_out, group, handle.recv_rows, handle.send_rows)  # [S, dim] on its way
    # One spare row collects padding rows (capacity), which carry no token.
    return InFlight(back, lambda rows: sum_rows(rows, handle.token, handle.num_tokens + 1)[:handle.num_tokens])
