"""Dropless dispatch: the row counts first, then one variable-split all-to-all per tensor (x, ids, weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.expert.routing import Rows, route_rows, sum_rows, tokens_per_local_expert


@dataclass(frozen=True)
class RaggedHandle:
    """What combine needs from dispatch: where each sent row came from and the split sizes."""

    token: torch.Tensor  # [S] the token each sent row carries (T = padding row, for capacity)
    send_rows: list[int]
    recv_rows: list[int]
    num_tokens: int
    dropped: torch.Tensor | None = None  # capacity: [E] assignments dropped per expert on this rank


def exchange_counts(send_rows: list[int], group: MeshGroup) -> list[int]:
    """Rows each member sends to this rank (one int64 per peer, one all-to-all)."""
    counts = comm.host_tensor(send_rows, torch.int64).view(-1, 1)  # [ep, 1]
    ones = [1] * group.size
    return comm.all_to_all(counts, group, ones, ones).view(-1).tolist()


def send(x: torch.Tensor, topk_weights: torch.Tensor, rows: Rows, group: MeshGroup, local_experts: int):
    """All-to-all the rows; returns (recv_x, recv_topk_idx, recv_topk_weights, tokens_per_expert, recv_rows)."""
    recv_rows = exchange_counts(rows.send_rows, group)
    recv_x = comm.all_to_all(x[rows.token], group, rows.send_rows, recv_rows)  # [R, dim]
    recv_idx = comm.all_to_all(rows.local_idx, group, rows.send_rows, recv_rows)  # [R, k]
    recv_w = comm.all_to_all(rows.weights(topk_weights), group, rows.send_rows, recv_rows)  # [R, k]
    return recv_x, recv_idx, recv_w, tokens_per_local_expert(recv_idx, local_experts), recv_rows


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
             num_experts: int, options: object = None):
    """Dropless dispatch: one row per (token, destination rank); `options` unused."""
    local = num_experts // group.size
    rows = route_rows(topk_idx, local, group.size)
    recv_x, recv_idx, recv_w, tokens_per_expert, recv_rows = send(x, topk_weights, rows, group, local)
    return recv_x, recv_idx, recv_w, tokens_per_expert, RaggedHandle(rows.token, rows.send_rows, recv_rows,
                                                                       x.shape[0])


def combine(expert_out: torch.Tensor, handle: RaggedHandle, group: MeshGroup) -> torch.Tensor:
    """Return every row to its sender and sum each token's rows: [R, dim] -> [T, dim]."""
    back = comm.all_to_all(expert_out, group, handle.recv_rows, handle.send_rows)  # [S, dim]
    # One spare row collects padding rows (capacity), which carry no token.
    return sum_rows(back, handle.token, handle.num_tokens + 1)[:handle.num_tokens]
