"""Overlapped ragged dispatch: the tokens in chunks, one chunk's all-to-all in flight while another's experts
compute (DeepEP's communication behind compute, without its kernels).

The T tokens split into `chunks` contiguous ranges (sizes differ by at most one; a range may be empty). The
row counts of every chunk travel first in one all-to-all ([ep, chunks] int64), so no later exchange has to
wait for a size. Then, on every rank in the same order:

    start dispatch 0
    for c: start dispatch c+1 | wait dispatch c | experts on chunk c | start combine c
    wait every combine, sum each token's rows

so chunk c+1's rows travel while chunk c's experts compute, and chunk c's outputs travel back while chunk c+1
computes. Each chunk sends exactly the rows the serial dispatch would send for its tokens (one per token and
destination rank), so the bytes per layer equal the serial path's; only the count exchange grows, by
`chunks` int64 per peer. Backward is exact and blocking: each received tensor's gradient goes home by the
reverse all-to-all when autograd reaches it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.expert.routing import Rows, route_rows, tokens_per_local_expert
from orangetron.plan.traffic import token_chunks

# (recv_x [R, dim], recv_topk_idx [R, k], recv_topk_weights [R, k], tokens_per_expert [E/ep]) -> [R, dim]
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """`chunks` contiguous [start, end) token ranges, sized as the planner's `token_chunks`."""
    ends = [0]
    for n in token_chunks(tokens, chunks):
        ends.append(ends[-1] + n)
    return list(zip(ends[:-1], ends[1:], strict=True))


def exchange_chunk_counts(send_rows: list[list[int]], group: MeshGroup) -> list[list[int]]:
    """send_rows[c][j]: rows chunk c sends to member j -> recv_rows[c][j]: rows chunk c receives from j."""
    counts = torch.tensor(send_rows, dtype=torch.int64).t().contiguous()  # [ep, chunks]
    ones = [1] * group.size
    return comm.all_to_all(counts, group, ones, ones).t().tolist()


def _start_dispatch(x: torch.Tensor, topk_weights: torch.Tensor, rows: Rows, recv_rows: list[int],
                    group: MeshGroup) -> list[comm.PendingAllToAll]:
    return [comm.all_to_all_start(t, group, rows.send_rows, recv_rows)
            for t in (x[rows.token], rows.local_idx, rows.weights(topk_weights))]


def overlapped(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: MeshGroup,
               num_experts: int, chunks: int, compute: ExpertCompute) -> torch.Tensor:
    """Ragged dispatch, `compute`, combine, pipelined over `chunks` token chunks: x [T, dim] -> y [T, dim],
    equal to the serial path's result (per token, the sum of its rows' expert outputs)."""
    local = num_experts // group.size
    bounds = chunk_bounds(x.shape[0], chunks)
    rows = [route_rows(topk_idx[a:b], local, group.size) for a, b in bounds]
    recv_rows = exchange_chunk_counts([r.send_rows for r in rows], group)

    def start(c: int) -> list[comm.PendingAllToAll]:
        a, b = bounds[c]
        return _start_dispatch(x[a:b], topk_weights[a:b], rows[c], recv_rows[c], group)

    dispatches, combines = [start(0)], []
    for c in range(chunks):
        if c + 1 < chunks:
            dispatches.append(start(c + 1))  # in flight while chunk c computes
        recv_x, recv_idx, recv_w = (p.wait() for p in dispatches[c])
        out = compute(recv_x, recv_idx, recv_w, tokens_per_local_expert(recv_idx, local))  # [R_c, dim]
        combines.append(comm.all_to_all_start(out, group, recv_rows[c], rows[c].send_rows))
    y = [_sum_rows(p.wait(), r.token, b - a) for p, r, (a, b) in zip(combines, rows, bounds, strict=True)]
    return torch.cat(y)


def _sum_rows(back: torch.Tensor, token: torch.Tensor, tokens: int) -> torch.Tensor:
    return back.new_zeros(tokens, back.shape[-1]).index_add(0, token, back)  # [tokens, dim]
