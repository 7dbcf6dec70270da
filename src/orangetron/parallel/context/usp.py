"""Unified sequence parallelism (USP): Ulysses over `ulysses_degree` ranks times ring over the rest.

The cp group is split into ring x Ulysses, Ulysses fastest, so consecutive cp ranks (one node's fast
links) exchange heads by all-to-all, and the Ulysses groups pass K,V around a ring between them. After the
all-to-all each rank holds its Ulysses group's tokens for its share of the heads; the ring then runs over
those gathered blocks with masks by global position: a member's tokens are not in increasing order, and
`blocks.attend` reorders each block before cutting it into kernel calls. Any factorization of cp works,
including the two ends (ulysses_degree 1: a ring; cp: Ulysses).
"""

from __future__ import annotations

import torch

from orangetron.mesh import MeshGroup, ParallelMesh
from orangetron.model.autograd import expand_kv
from orangetron.model.documents import Documents
from orangetron.parallel.context import ring
from orangetron.parallel.context.blocks import pack
from orangetron.parallel.context.calls import cuts_of
from orangetron.parallel.context.ulysses import to_heads, to_sequence
from orangetron.spec import rules


def cp_group(mesh: ParallelMesh, ulysses_degree: int) -> tuple[MeshGroup, MeshGroup]:
    """(ring group, Ulysses group): the cp group split as `mesh.split_cp` builds it."""
    return mesh.split_cp(ulysses_degree)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: tuple[MeshGroup, MeshGroup],
              causal: bool, scale: float, impl: str = "fused", documents: Documents | None = None) -> torch.Tensor:
    """USP attention of this rank's shard over (ring group, Ulysses group) -> [B, L, Hq, D].

    `impl` is the block kernel and `documents` those of packed rows (`blocks.attend`)."""
    ring_group, ulysses_group = groups
    u, cp = ulysses_group.size, ring_group.size * ulysses_group.size
    rules.heads_split_by_all_to_all(u, q.shape[2], k.shape[2], "ulysses_degree")
    kv = pack(k, v)
    if kv.shape[2] < u:
        kv = expand_kv(kv, u)  # one kv head per Ulysses rank
    q_h, kv_h = to_heads(q, ulysses_group), to_heads(kv, ulysses_group)  # [B, u*L, Hq/u, D], [B, u*L, ., 2D]
    k_h, v_h = kv_h.split(k.shape[-1], dim=-1)
    layout = ("usp", q.shape[1] * cp, cp, u, cuts_of(documents))
    out, _ = ring.attention(q_h, k_h, v_h, ring_group, causal, scale, impl, layout=layout, documents=documents)
    return to_sequence(out, ulysses_group)
