"""DeepSpeed-Ulysses: all-to-all from sequence shards to head shards, whole-sequence attention, and back.

Q, K+V and the output each cross one all-to-all per direction ([B, S/P, H, D] <-> [B, S, H/P, D]), so the
bytes per rank stay constant as the sequence and P grow together. Query heads must divide by P; kv heads
either divide by P or divide P (then each rank gets the one kv head its query heads use, sent once to
each rank that needs it). The whole sequence arrives in rank order; `blocks.attend` puts it in order of
position, so causal attention is one causal kernel call.
"""

from __future__ import annotations

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.model.autograd import expand_kv
from orangetron.model.documents import Documents
from orangetron.parallel.context.blocks import PositionalAttention, pack
from orangetron.parallel.context.calls import cuts_of
from orangetron.spec import rules


def to_heads(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """[B, L, H, D] sequence shard -> [B, n*L, H/n, D] head shard (sequence in rank order); all-to-all."""
    b, length, h, d = x.shape
    n = group.size
    send = x.view(b, length, n, h // n, d).permute(2, 0, 1, 3, 4).reshape(n, -1)  # row j goes to rank j
    got = comm.all_to_all(send, group, [1] * n, [1] * n)
    return got.view(n, b, length, h // n, d).permute(1, 0, 2, 3, 4).reshape(b, n * length, h // n, d)


def to_sequence(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """Inverse of `to_heads`: [B, n*L, H/n, D] -> [B, L, H, D]; all-to-all."""
    b, seq, hh, d = x.shape
    n = group.size
    send = x.view(b, n, seq // n, hh, d).permute(1, 0, 2, 3, 4).reshape(n, -1)
    got = comm.all_to_all(send, group, [1] * n, [1] * n)
    return got.view(n, b, seq // n, hh, d).permute(1, 2, 0, 3, 4).reshape(b, seq // n, n * hh, d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: MeshGroup, causal: bool,
              scale: float, impl: str = "fused", documents: Documents | None = None) -> torch.Tensor:
    """Ulysses attention of this rank's shard -> out [B, L, Hq, D]; `impl` and `documents` as
    `blocks.attend`'s."""
    n = group.size
    rules.heads_split_by_all_to_all(n, q.shape[2], k.shape[2])
    kv = pack(k, v)
    if kv.shape[2] < n:
        kv = expand_kv(kv, n)  # one kv head per destination rank
    q_h, kv_h = to_heads(q, group), to_heads(kv, group)  # [B, S, Hq/n, D], [B, S, max(Hk/n, 1), 2D]
    k_h, v_h = kv_h.split(k.shape[-1], dim=-1)
    spec = (q_h.shape[1], n, None, cuts_of(documents))  # every rank's tokens, in rank order
    out = PositionalAttention.apply(q_h, k_h, v_h, spec, spec, causal, scale, impl, documents)
    return to_sequence(out, group)
