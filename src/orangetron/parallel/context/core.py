"""`ContextParallelAttention`: the attention core a context-parallel model runs in every attention block.

It takes the place of the reference core (`Attention.core_attention`, a `CausalAttention` in
`orangetron/model/layers.py`) with the same signature, so the projections, rotary embedding and tensor
parallelism around it are unchanged: q [B, L, Hq, D], k, v [B, L, Hk, D] of this rank's head-tail shard
-> out [B, L, Hq, D], attending causally over the whole sequence across the cp ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from orangetron.mesh import ParallelMesh
from orangetron.model.documents import Documents
from orangetron.parallel.context.attention import attention


class ContextParallelAttention(nn.Module):
    """Causal attention over the cp ranks of `mesh` in `mode` (`context.attention`, `ulysses_degree` for usp).

    `impl` is the block kernel ("fused" or "reference"), read and set like the reference core's.
    """

    def __init__(self, mesh: ParallelMesh, mode: str, ulysses_degree: int | None = None, impl: str = "fused") -> None:
        super().__init__()
        self.mesh, self.mode, self.ulysses_degree, self.impl = mesh, mode, ulysses_degree, impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """`documents`: those of packed rows over the whole sequence (not this rank's shard)."""
        return attention(q, k, v, self.mesh, mode=self.mode, causal=True, ulysses_degree=self.ulysses_degree,
                         impl=self.impl, documents=documents)
