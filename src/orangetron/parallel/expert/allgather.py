"""All-gather dispatch: every rank gathers all tokens of the ep group and keeps the rows its experts serve;
combine scatters the expert outputs into the gathered layout and reduce-scatters them home.

Counts are gathered first (1 + ep + E int64 per rank: its tokens, the rows it has for each rank's experts and
its assignments per expert), and read on the host once: every rank's tokens are padded to the largest count,
so ranks with different token counts (or none) take part safely, and the rows this rank's experts serve and
their group sizes are known before the tokens arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.expert.routing import (
    InFlight,
    assignments_per_expert,
    destinations,
    read_counts,
    slot_ranks,
    sum_rows,
    tokens_per_local_expert,
)


@dataclass(frozen=True)
class AllGatherHandle:
    keep: torch.Tensor  # [R] rows of the gathered [ep * T_max] layout that this rank's experts serve
    padded_tokens: int  # T_max
    num_tokens: int
    tokens_per_expert: list[int] | None = None  # read on the host with R, for the experts' groups


def _count_row(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, ep: int) -> torch.Tensor:
    """[1 + ep + E] int64 on the device: this rank's tokens, its rows for each rank (tokens with a slot there) and
    its assignments per expert."""
    tokens = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
    rows = destinations(slot_ranks(topk_idx, num_experts // ep, ep), ep).sum(0)  # [ep]
    return torch.cat((tokens, rows, assignments_per_expert(topk_idx, num_experts)))


def _served(counts: list[int], rank: int, ep: int, local: int) -> tuple[int, int, list[int]]:
    """From the gathered count rows (one list): (T_max, rows this rank serves, its experts' group sizes)."""
    width = 1 + ep + ep * local
    per_rank = [counts[j * width:(j + 1) * width] for j in range(ep)]
    first = 1 + ep + rank * local
    per_expert = [sum(row[first + e] for row in per_rank) for e in range(local)]
    return max(row[0] for row in per_rank), sum(row[1 + rank] for row in per_rank), per_expert


def _pad(t: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    return torch.cat((t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)))


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
             num_experts: int, options: object = None):
    """Gather the group's tokens and keep the rows of this rank's experts; `options` unused."""
    tokens = x.shape[0]
    local = num_experts // group.size
    # The counts travel on the device, as the rows do, and are read once with the ids' check: the one host read.
    counts = comm.all_gather(_count_row(x, topk_idx, num_experts, group.size), group)  # [ep * (1 + ep + E)]
    t_max, kept, per_expert = _served(read_counts([counts], topk_idx, num_experts)[0], group.rank, group.size,
                                      local)
    gathered_x = comm.all_gather(_pad(x, t_max, 0), group)  # [ep * T_max, dim]
    gathered_idx = comm.all_gather(_pad(topk_idx, t_max, -1), group)  # [ep * T_max, k]; -1: padding
    gathered_w = comm.all_gather(_pad(topk_weights, t_max, 0), group)
    here = (gathered_idx >= 0) & (gathered_idx // local == group.rank)
    local_idx = torch.where(here, gathered_idx - group.rank * local, -1)
    served = here.any(1)  # [ep * T_max]
    tokens_per_expert = tokens_per_local_expert(local_idx, local)  # rows served by none add nothing
    # [R] served rows in order; a copy of the cut, as backward keeps `keep` and must not hold the tail
    keep = torch.sort((~served).to(torch.uint8), stable=True).indices[:kept].clone()
    recv_w = torch.where(here, gathered_w, torch.zeros_like(gathered_w))[keep]
    handle = AllGatherHandle(keep, t_max, tokens, per_expert)
    return gathered_x[keep], local_idx[keep], recv_w, tokens_per_expert, handle


def combine(expert_out: torch.Tensor, handle: AllGatherHandle, group: MeshGroup) -> torch.Tensor:
    """Place each kept row's output in the gathered layout and reduce-scatter: [R, dim] -> [T, dim]."""
    return combine_start(expert_out, handle, group).wait()


def combine_start(expert_out: torch.Tensor, handle: AllGatherHandle, group: MeshGroup) -> InFlight:
    """`combine` that returns at once: its `wait()` gives the [T, dim] result (compute may run until then)."""
    full = sum_rows(expert_out, handle.keep, group.size * handle.padded_tokens)  # [ep * T_max, dim]
    return InFlight(comm.reduce_scatter_async(full, group), lambda mine: mine[:handle.num_tokens])
