"""Which rows a rank sends where: one row per (token, destination ep rank), as DeepEP's normal mode.

A token routed to several experts of one rank travels once to that rank; the row carries the token's top-k
expert ids translated to that rank's local ids (-1 for slots whose expert lives elsewhere) and the matching
routing weights (0 in those slots). Rows are grouped by destination rank, in token order within a rank.
"""

from __future__ import annotations

from collections.abc import Callable
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


def slot_ranks(topk_idx: torch.Tensor, local_experts: int, ep: int, routed: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k] int64: the ep rank owning each slot's expert, or `ep` for a slot that does not travel (dropped, as
    `routed` [T, k] bool says, or an id out of range, which `read_counts` reports)."""
    valid = (topk_idx >= 0) & (topk_idx < local_experts * ep)
    if routed is not None:
        valid = valid & routed
    return torch.where(valid, topk_idx // local_experts, ep)


def destinations(dest: torch.Tensor, ep: int) -> torch.Tensor:
    """[T, ep] bool: token t sends a row to rank r, from `slot_ranks`."""
    hit = torch.zeros(dest.shape[0], ep + 1, dtype=torch.bool, device=dest.device)
    return hit.scatter_(1, dest, True)[:, :ep]  # column ep collects the slots that stay


def read_counts(counts: list[torch.Tensor], topk_idx: torch.Tensor | None = None,
                num_experts: int = 0) -> list[list[int]]:
    """The one host read of a dispatch step: each 1-d int64 count tensor as a list, with the check of the expert
    ids `topk_idx` (if given) against [0, num_experts).

    On a GPU reading device values waits for the device, so everything the host needs at one point of a
    dispatch is read here at once. Raises ValueError naming the first expert id out of range.
    """
    extra = [] if topk_idx is None else [((topk_idx < 0) | (topk_idx >= num_experts)).sum().view(1)]
    values = torch.cat([*(c.reshape(-1) for c in counts), *extra]).tolist()
    if extra and values[-1]:
        wrong = topk_idx[(topk_idx < 0) | (topk_idx >= num_experts)][0].item()  # the error path may read again
        raise ValueError(f"dispatch: expert id {wrong} is out of range [0, num_experts={num_experts})")
    found, start = [], 0
    for c in counts:
        found.append(values[start:start + c.numel()])
        start += c.numel()
    return found


def assignments_per_expert(topk_idx: torch.Tensor, num_experts: int,
                           routed: torch.Tensor | None = None) -> torch.Tensor:
    """[num_experts] int64: this rank's (token, expert) assignments per expert, counting only the slots that
    travel (ids in range and, if given, `routed` [T, k] bool), on the device (a scatter, as
    `tokens_per_local_expert`)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    if routed is not None:
        valid = valid & routed
    return tokens_per_local_expert(torch.where(valid, topk_idx, -1), num_experts)


def count_message(rows_out: torch.Tensor, per_expert: torch.Tensor, ep: int) -> torch.Tensor:
    """[ep, 1 + E/ep] int64: for each member, the rows this rank sends it, then this rank's assignments to each
    of its experts (`assignments_per_expert` [E], experts in contiguous blocks per member)."""
    return torch.cat((rows_out.reshape(ep, 1), per_expert.reshape(ep, -1)), dim=1)


def split_received(values: list[int], members: int) -> tuple[list[int], list[int]]:
    """What arrived in a count exchange ([members, 1 + E/ep] as one list, `count_message`'s layout) ->
    (rows from each member, assignments to each local expert summed over the members)."""
    width = len(values) // members
    per_member = [values[j * width:(j + 1) * width] for j in range(members)]
    return [m[0] for m in per_member], [sum(col) for col in zip(*(m[1:] for m in per_member), strict=True)]


def rows_of(topk_idx: torch.Tensor, dest: torch.Tensor, hit: torch.Tensor, local_experts: int,
            send_rows: list[int]) -> Rows:
    """`Rows` from `slot_ranks`, `destinations` and its column sums read on the host, with no further read.

    The (rank, token) pairs of `hit` in rank-major order are the first sum(send_rows) entries of a stable sort
    that puts the hits first: a size the host knows, where `nonzero` would have to ask the device.
    """
    tokens = hit.shape[0]
    misses = (~hit.t().reshape(-1)).to(torch.uint8)  # [ep * T], rank-major
    pair = torch.sort(misses, stable=True).indices[:sum(send_rows)]
    rank, token = pair // tokens, pair % tokens  # by rank, then token
    here = dest[token] == rank[:, None]  # [S, k]
    local_idx = torch.where(here, topk_idx[token] - rank[:, None] * local_experts, -1)
    return Rows(token, rank, local_idx, send_rows)


def route_rows(topk_idx: torch.Tensor, local_experts: int, ep: int, routed: torch.Tensor | None = None) -> Rows:
    """Rows for `topk_idx` [T, k] with experts in contiguous blocks of `local_experts` per rank (one host read).

    `routed` [T, k] bool marks the slots that travel (capacity drops the others); None: all of them.
    """
    dest = slot_ranks(topk_idx, local_experts, ep, routed)
    hit = destinations(dest, ep)
    (send_rows,) = read_counts([hit.sum(0)], topk_idx, local_experts * ep)
    return rows_of(topk_idx, dest, hit, local_experts, send_rows)


def tokens_per_local_expert(recv_topk_idx: torch.Tensor, local_experts: int) -> torch.Tensor:
    """[local_experts] int64: (row, local expert) assignments among the received rows (no host read: a
    scatter into a spare last bin for the -1 slots, where `bincount` would ask the device for its size)."""
    slots = recv_topk_idx.reshape(-1)
    bins = torch.where(slots < 0, local_experts, slots)
    counts = torch.zeros(local_experts + 1, dtype=torch.int64, device=slots.device)
    return counts.scatter_add_(0, bins, torch.ones_like(bins))[:local_experts]


class InFlight:
    """A combine in flight: `wait()` waits for its collective and returns `finish` of what arrived."""

    def __init__(self, started, finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._started, self._finish = started, finish

    def wait(self) -> torch.Tensor:
        return self._finish(self._started.wait())


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
