"""Which rows a rank sends where: one row per (token, destination ep rank), as DeepEP's normal mode.

A token routed to several experts of one rank travels once to that rank; the row carries the token's top-k
expert ids translated to that rank's local ids (-1 for slots whose expert lives elsewhere) and the matching
routing weights (0 in those slots). Rows are grouped by destination rank, in token order within a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """The send side of a dispatch: row i carries token `token[i]` to rank `rank[i]`."""

    token: torch.Tensor  # [S] int64
    rank: torch.Tensor  # [S] int64
    local_idx: torch.Tensor  # [S, k] int64: local expert id on `rank`, -1 elsewhere
    send_rows: list[int]  # rows per destination rank

    def weights(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """[S, k] routing weights of each row's local slots, 0 in the others (autograd flows to topk_weights)."""
        picked = topk_weights[self.token]
        return torch.where(self.local_idx >= 0, picked, torch.zeros_like(picked))


def route_rows(topk_idx: torch.Tensor, local_experts: int, ep: int, routed: torch.Tensor | None = None) -> Rows:
    """Rows for `topk_idx` [T, k] with experts in contiguous blocks of `local_experts` per rank.

    `routed` [T, k] bool marks the slots that travel (capacity drops the others); None: all of them.
    """
    tokens = topk_idx.shape[0]
    dest = topk_idx // local_experts  # [T, k] owning rank of each slot
    if routed is not None:
        dest = torch.where(routed, dest, ep)  # column ep collects the dropped slots, then is cut off
    hit = torch.zeros(tokens, ep + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, dest, True)
    hit = hit[:, :ep]  # [T, ep]: token t sends a row to rank r
    rank, token = (t.clone() for t in hit.t().nonzero(as_tuple=True))  # by rank, then token; own storages, as
    # backward keeps `token` (nonzero's views would keep both columns)
    here = dest[token] == rank[:, None]  # [S, k]
    local_idx = torch.where(here, topk_idx[token] - rank[:, None] * local_experts, -1)
    return Rows(token, rank, local_idx, hit.sum(0).tolist())


def tokens_per_local_expert(recv_topk_idx: torch.Tensor, local_experts: int) -> torch.Tensor:
    """[local_experts] int64: (row, local expert) assignments among the received rows."""
    slots = recv_topk_idx.reshape(-1)
    return torch.bincount(slots[slots >= 0], minlength=local_experts)


class SumRows(torch.autograd.Function):
    """`rows` [R, dim] summed into [size, dim] by `index` [R] forward; each row's gradient gathered backward.

    Saves only the index (`index_add` would keep the rows too).
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return rows.new_zeros(size, rows.shape[-1]).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad[index], None, None


def sum_rows(rows: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """[size, dim]: row i of the result is the sum of the `rows` whose `index` is i."""
    return SumRows.apply(rows, index, size)
