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
from orangetron.parallel.expert.routing import InFlight, read_counts, sum_rows, tokens_per_local_expert


@dataclass(frozen=True)
class AllGatherHandle:
    keep: torch.Tensor  # [R] rows of the gathered [ep * T_max] layout that this rank's experts serve
    padded_tokens: int  # T_max
    num_tokens: int
    tokens_per_expert: list[int] | None = None  # read on the host with R, for the experts' groups


def _pad(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    return torch.cat((t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)))


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
             num_experts: int, options: object = None):
    """Gather the group's tokens and keep the rows of this rank's experts; `options` unused."""
    tokens = x.shape[0]
    local = num_experts // group.size
    # The counts travel on the device, as the rows do, and are read once with the ids' check.
    counts = comm.all_gather(torch.full((1,), tokens, dtype=torch.int64, device=x.device), group)  # [ep]
    t_max = max(read_counts([counts], topk_idx, num_experts)[0])  # host read 1 of 2
    gathered_x = comm.all_gather(_pad(x, t_max, 0), group)  # [ep * T_max, dim]
    gathered_idx = comm.all_gather(_pad(topk_idx, t_max, -1), group)  # [ep * T_max, k]; -1: padding
    gathered_w = comm.all_gather(_pad(topk_weights, t_max, 0), group)
    here = (gathered_idx >= 0) & (gathered_idx // local == group.rank)
    local_idx = torch.where(here, gathered_idx - group.rank * local, -1)
    served = here.any(1)  # [ep * T_max]
    tokens_per_expert = tokens_per_local_expert(local_idx, local)  # rows served by none add nothing
    (kept,), counts = read_counts([served.sum().view(1), tokens_per_expert])  # host read 2 of 2
    # [R] served rows in order; a copy of the cut, as backward keeps `keep` and must not hold the tail
    keep = torch.sort((~served).to(torch.uint8), stable=True).indices[:kept].clone()
    recv_w = torch.where(here, gathered_w, torch.zeros_like(gathered_w))[keep]
    handle = AllGatherHandle(keep, t_max, tokens, counts)
    return gathered_x[keep], local_idx[keep], recv_w, tokens_per_expert, handle


def combine(expert_out: torch.Tensor, handle: AllGatherHandle, group: MeshGroup) -> torch.Tensor:
    """Place each kept row's output in the gathered layout and reduce-scatter: [R, dim] -> [T, dim]."""
    return combine_start(expert_out, handle, group).wait()


def combine_start(expert_out: torch.Tensor, handle: AllGatherHandle, group: MeshGroup) -> InFlight:
    """`combine` that returns at once: its `wait()` gives the [T, dim] result (compute may run until then)."""
    full = sum_rows(expert_out, handle.keep, group.size * handle.padded_tokens)  # [ep * T_max, dim]
    return InFlight(comm.reduce_scatter_async(full, group), lambda mine: mine[:handle.num_tokens])
