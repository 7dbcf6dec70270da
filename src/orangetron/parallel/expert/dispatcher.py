"""`Dispatcher`: token dispatch to expert-parallel ranks and the combine back, DeepEP's contract.

Experts sit in contiguous blocks: ep rank r owns experts r*E/ep ... (r+1)*E/ep - 1. `dispatch` sends one
row per (token, destination rank) -- a token routed to two experts of one rank travels once -- and returns

    recv_x [R, dim], recv_topk_idx [R, k] (local expert ids, -1 where that slot's expert lives elsewhere),
    recv_topk_weights [R, k] (0 in the -1 slots), tokens_per_expert [E/ep] ((row, local expert) pairs), handle

`combine(expert_out [R, dim], handle)` returns [T, dim]: for each original token the unweighted sum of the
rows sent back for it (the experts apply the weights, as DeepEP's normal mode). Dispatch's backward is a
combine and combine's a dispatch (the collectives' autograd pairs). Each mode is a record in
spec/dispatchers.py whose runtime module has `dispatch(x, topk_idx, topk_weights, group, num_experts, options)`
(this object as `options`) and `combine(expert_out, handle, group)`; the built-in ones:

- "ragged": dropless; row counts are exchanged, then one variable-split all-to-all per tensor.
- "capacity": at most ceil(T * k / E * capacity_factor) assignments per expert from each rank, chosen by
  `drop_policy`, padded to fixed row counts; `handle.dropped` [E] counts what this rank dropped.
- "allgather": gather the ep group's tokens and keep the rows of the local experts; combine reduce-scatters.

`dispatch_compute_combine(x, topk_idx, topk_weights, compute)` runs the three in one call; with
`overlap_chunks` > 1 (ragged only) it pipelines them over token chunks so one chunk's all-to-all runs while
another chunk's experts compute (`overlap.py`). Called as a module with the local experts (and the shared
experts as a callable, run while the combine travels), a `Dispatcher` is the expert-parallel `MoE.dispatcher`
(the seam `orangetron/model/moe.py`'s `LocalDispatcher` fills on one device, same signature).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from orangetron import comm
from orangetron.mesh import MeshGroup, ParallelMesh
from orangetron.parallel.config import DROP_POLICIES, ParallelConfigError
from orangetron.parallel.expert import overlap
from orangetron.parallel.expert.routing import InFlight, sum_rows
from orangetron.spec import rules
from orangetron.spec.parallel_config import check_capacity_factor
from orangetron.spec.variants import DISPATCHERS


class Dispatcher(nn.Module):
    """Dispatch and combine over `mesh["ep"]` (or a `MeshGroup`) for `num_experts` experts."""

    def __init__(self, mesh: ParallelMesh | MeshGroup, num_experts: int, mode: str = "ragged",
                 capacity_factor: float = 1.0, drop_policy: str = "probs", overlap_chunks: int = 1) -> None:
        super().__init__()
        self.group = mesh if isinstance(mesh, MeshGroup) else mesh["ep"]
        record = DISPATCHERS.runtime_record(mode)
        if drop_policy not in DROP_POLICIES:
            raise ParallelConfigError(f"drop_policy={drop_policy!r}: must be one of {', '.join(DROP_POLICIES)}")
        check_capacity_factor(capacity_factor)
        if num_experts < 1 or num_experts % self.group.size:
            raise ParallelConfigError(f"num_experts={num_experts}: must be a positive multiple of ep="
                                      f"{self.group.size} (experts sit in equal blocks per ep rank)")
        if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
            raise ParallelConfigError(f"overlap_chunks={overlap_chunks!r}: must be a positive integer")
        rules.overlap_chunks_need_chunked_dispatcher(overlap_chunks, mode, record.chunked)
        self.runtime = record.load()  # the mode's module: dispatch(x, idx, weights, group, experts, options), combine
        self.num_experts, self.mode, self.overlap_chunks = num_experts, mode, overlap_chunks
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.local_experts = num_experts // self.group.size
        self.first_expert = self.group.rank * self.local_experts

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                experts: nn.Module, shared: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, dim] -> [T, dim]: `dispatch_compute_combine` with the local `experts` (`run_local_experts`),
        plus `shared()` (the shared experts' [T, dim]) computed while the combine travels."""
        return self.dispatch_compute_combine(x, topk_idx, topk_weights, experts, shared=shared)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """x [T, dim], topk_idx [T, k] int64 in [0, E), topk_weights [T, k] -> (recv_x, recv_topk_idx,
        recv_topk_weights, tokens_per_expert, handle); see the module docstring."""
        self._check(x, topk_idx, topk_weights)
        return self.runtime.dispatch(x, topk_idx, topk_weights, self.group, self.num_experts, self)

    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        """expert_out [R, dim] (the received rows' outputs, weighted) -> [T, dim] summed per token."""
        return self.runtime.combine(expert_out, handle, self.group)

    def combine_start(self, expert_out: torch.Tensor, handle) -> InFlight:
        """`combine` that returns at once: `wait()` gives the [T, dim] result. A mode without a `combine_start`
        of its own (a plugin's) combines at once."""
        start = getattr(self.runtime, "combine_start", None)
        if start is None:
            return InFlight(comm.Pending(self.combine(expert_out, handle), None), lambda y: y)
        return start(expert_out, handle, self.group)

    def dispatch_compute_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                                 experts: nn.Module, compute: overlap.ExpertCompute | None = None,
                                 shared: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """`combine(compute(experts, *dispatch(x, ...)[:4]), handle)` (+ `shared()`): x [T, dim] -> [T, dim];
        `compute` defaults to `run_local_experts`. `shared` runs after the combine has started and before it is
        waited for, so the shared experts compute while the routed rows travel home. With `overlap_chunks` > 1
        the tokens go in chunks, each chunk's all-to-all overlapping another chunk's compute (forward and
        backward); `compute` may then use no parameters but those of `experts`, and `shared` runs after."""
        compute = compute or run_local_experts
        if self.overlap_chunks > 1:
            self._check(x, topk_idx, topk_weights)
            y = overlap.overlapped(x, topk_idx, topk_weights, self.group, self.num_experts, self.overlap_chunks,
                                   experts, compute)
            return y if shared is None else y + shared()
        recv_x, recv_idx, recv_w, tokens_per_expert, handle = self.dispatch(x, topk_idx, topk_weights)
        # A mode that read the counts on the host already hands them over, so the experts need not read again.
        counts = getattr(handle, "tokens_per_expert", None)
        counts = tokens_per_expert if counts is None else counts
        in_flight = self.combine_start(compute(experts, recv_x, recv_idx, recv_w, counts), handle)
        extra = None if shared is None else shared()  # while the combine travels
        y = in_flight.wait()
        return y if extra is None else y + extra

    def _check(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape != topk_weights.shape \
                or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"dispatch: need x [T, dim], topk_idx and topk_weights [T, k]; got "
                             f"{tuple(x.shape)}, {tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}")
        if topk_idx.dtype != torch.int64:
            raise ValueError(f"dispatch: topk_idx must be int64, got {topk_idx.dtype}")
        # The ids' range is checked by each mode in its host read of the counts (`routing.read_counts`): a check
        # here would read the device once more per dispatch.


def run_local_experts(experts: nn.Module, recv_x: torch.Tensor, recv_topk_idx: torch.Tensor,
                      recv_topk_weights: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]) -> torch.Tensor:
    """Apply the local `GroupedExperts` to the received rows: each row's weighted outputs of its local
    slots, summed ([R, dim]); rows with no local slot (padding) give zeros. `tokens_per_expert` is read on
    the host once (a list is taken as read already) and serves both the cut and the experts' groups."""
    rows, k = recv_topk_idx.shape
    slots = recv_topk_idx.reshape(-1)
    local = experts.w1.shape[0]
    counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
    # Copies grouped by local expert, row order kept within an expert; -1 slots sort last and are cut off.
    # A copy of the cut: backward keeps `order`, which must not hold the cut-off tail.
    order = torch.argsort(torch.where(slots < 0, local, slots), stable=True)[: sum(counts)].clone()
    row_of_copy = order // k
    out = experts(recv_x[row_of_copy], counts, recv_topk_weights.reshape(-1)[order])
    return sum_rows(out, row_of_copy, rows)  # [R, dim]
