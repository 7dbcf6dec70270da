"""All-gather dispatch: every rank gathers all tokens of the ep group and keeps the rows its experts serve;
combine scatters the expert outputs into the gathered layout and reduce-scatters them home.

Token counts are gathered first (one int64 per rank), and every rank's tokens are padded to the largest
count, so ranks with different token counts (or none) take part safely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.expert.routing import sum_rows, tokens_per_local_expert


@dataclass(frozen=True)
class AllGatherHandle:
    keep: torch.Tensor  # [R] rows of the gathered [ep * T_max] layout that this rank's experts serve
    padded_tokens: int  # T_max
    num_tokens: int


def _pad(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    return torch.cat((t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)))


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
             num_experts: int, options: object = None):
    """Gather the group's tokens and keep the rows of this rank's experts; `options` unused."""
    tokens = x.shape[0]
    local = num_experts // group.size
    counts = comm.all_gather(comm.host_tensor([tokens], torch.int64), group)  # [ep]
    t_max = int(counts.max())
    gathered_x = comm.all_gather(_pad(x, t_max, 0), group)  # [ep * T_max, dim]
    gathered_idx = comm.all_gather(_pad(topk_idx, t_max, -1), group)  # [ep * T_max, k]; -1: padding
    gathered_w = comm.all_gather(_pad(topk_weights, t_max, 0), group)
    here = (gathered_idx >= 0) & (gathered_idx // local == group.rank)
    local_idx = torch.where(here, gathered_idx - group.rank * local, -1)
    keep = here.any(1).nonzero().squeeze(1)  # [R]
    recv_w = torch.where(here, gathered_w, torch.zeros_like(gathered_w))[keep]
    recv_idx = local_idx[keep]
    handle = AllGatherHandle(keep, t_max, tokens)
    return gathered_x[keep], recv_idx, recv_w, tokens_per_local_expert(recv_idx, local), handle


def combine(expert_out: torch.Tensor, handle: AllGatherHandle, group: MeshGroup) -> torch.Tensor:
    """Place each kept row's output in the gathered layout and reduce-scatter: [R, dim] -> [T, dim]."""
    full = sum_rows(expert_out, handle.keep, group.size * handle.padded_tokens)  # [ep * T_max, dim]
    return comm.reduce_scatter(full, group)[:handle.num_tokens]
