"""Sharding of the sequence over the cp ranks: head-tail for one sequence, balanced for packed documents.

Causal attention gives late tokens more work than early ones, so the sequence is cut into 2*cp equal chunks
and cp rank r keeps chunks r and 2*cp-1-r: one from the cheap head and one from the expensive tail, the
same work on every rank. RoPE then needs each token's global position, not its local index.

Packed documents break that balance (a query sees only its own document), so a packed batch is cut the same
way within every document instead (`calls.document_runs`, at `Documents.cuts`): each rank holds an equal
share of every document's visible pairs. Every function here takes those `cuts` (None: head-tail).
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import ParallelMesh
from orangetron.parallel.context import calls
from orangetron.spec import rules
from orangetron.spec.layout import Layout, LayoutError
from orangetron.spec.sharding import sequence_multiple


def _chunk_len(seq_len: int, cp: int) -> int:
    rules.cp_splits_sequence(cp, seq_len)
    return seq_len // (2 * cp)


def head_tail_indices(seq_len: int, cp: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions, in local order, of the tokens cp rank `cp_rank` keeps: chunk r, then 2*cp-1-r; on
    `device`."""
    if not 0 <= cp_rank < cp:
        raise LayoutError(f"cp_rank={cp_rank}: must lie in [0, cp={cp})")
    if cp == 1:
        return torch.arange(seq_len, device=device)  # nothing to balance: any length, natural order
    chunk = _chunk_len(seq_len, cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def shard_indices(seq_len: int, cp: int, cp_rank: int, cuts: tuple[int, ...] | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions, in local order, of the tokens cp rank `cp_rank` keeps (`calls.shard_runs`)."""
    runs = calls.shard_runs(seq_len, cp, cp_rank, cuts)
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in runs])


def position_ids(seq_len: int, mesh: ParallelMesh) -> torch.Tensor:
    """Global positions of this rank's tokens ([seq_len / cp], int64, on the mesh's device), for RoPE."""
    cp = mesh["cp"]
    return head_tail_indices(seq_len, cp.size, cp.rank, mesh.device())


def shard(x: torch.Tensor, mesh: ParallelMesh, seq_dim: int = 1, cuts: tuple[int, ...] | None = None) -> torch.Tensor:
    """This rank's share of the full sequence `x` (the same on every cp rank) along `seq_dim`: head-tail, or
    balanced over packed documents cut at `cuts` (`Documents.cuts`)."""
    cp = mesh["cp"]
    if cp.size == 1:
        return x
    index = shard_indices(x.shape[seq_dim], cp.size, cp.rank, cuts, x.device)
    return x.index_select(seq_dim, index)


def unshard(x_local: torch.Tensor, mesh: ParallelMesh, seq_dim: int = 1,
            cuts: tuple[int, ...] | None = None) -> torch.Tensor:
    """The full sequence from every cp rank's share (`shard`'s, of the same `cuts`), in natural order (an
    all-gather over cp).

    Backward returns to each rank the sum of every rank's gradient for its tokens (the all-gather's
    reduce-scatter), which is right when each rank's copy feeds a different part of the loss.
    """
    cp = mesh["cp"]
    if cp.size == 1:
        return x_local
    gathered = comm.all_gather(x_local, cp, dim=seq_dim)  # rank order: (head_0, tail_0, head_1, tail_1, ...)
    seq_len = gathered.shape[seq_dim]
    local_order = torch.cat([shard_indices(seq_len, cp.size, r, cuts, gathered.device) for r in range(cp.size)])
    natural = torch.empty_like(local_order)
    natural[local_order] = torch.arange(seq_len, device=gathered.device)  # where each position sits in gathered
    return gathered.index_select(seq_dim, natural)


def shard_multiple(layout: Layout, sequence_parallel: bool = False) -> int:
    """The multiple a sequence must be for `layout` (`spec.sharding.sequence_multiple`)."""
    return sequence_multiple(layout.cp, layout.tp, sequence_parallel)


def pad_sequence(inputs: torch.Tensor, labels: torch.Tensor, multiple: int,
                 ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs, labels [B, S] padded at the end to a multiple of `multiple` (token 0, label ignored).

    Padding comes last, so under causal attention no real token sees it, and its ignored labels keep it
    out of the loss (and out of the MoE balancing loss, which reads the labels' mask).
    """
    extra = -inputs.shape[1] % multiple
    if extra == 0:
        return inputs, labels
    return (torch.nn.functional.pad(inputs, (0, extra), value=0),
            torch.nn.functional.pad(labels, (0, extra), value=ignore_index))
