"""`attention`: one entry for every context-parallel attention mode, each in its own module.

Every mode takes this rank's head-tail shard (`context.shard`) of q [B, L, Hq, D] and k, v
[B, L, Hk, D] and returns this rank's output [B, L, Hq, D], forward and backward:

| mode | what travels over cp | module |
|---|---|---|
| ring | K,V blocks around the ring, overlapped with the block at hand; dK,dV home behind them | `ring` |
| allgather | K,V gathered once (again in backward); dK,dV reduce-scattered | `allgather` |
| ulysses | Q, K+V and the output by all-to-all between sequence and head shards | `ulysses` |
| rsa | K then V around the ring, [L, S] probabilities kept (ColossalAI) | `rsa` |
| usp | Ulysses over `ulysses_degree` consecutive ranks, ring over the rest | `usp` |
"""

from __future__ import annotations

import torch

from orangetron.mesh import ParallelMesh
from orangetron.parallel.context import allgather, ring, rsa, ulysses, usp

MODES = {"ring": ring, "allgather": allgather, "ulysses": ulysses, "rsa": rsa, "usp": usp}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: ParallelMesh, mode: str = "ring",
              causal: bool = True, scale: float | None = None, ulysses_degree: int | None = None) -> torch.Tensor:
    """Attention of this cp rank's head-tail shard over the whole sequence -> [B, L, Hq, D].

    `causal` masks by global position (the head-tail layout is known from the mesh). `scale` defaults to
    head_dim ** -0.5. `ulysses_degree` (mode "usp" only; it must divide cp) is the all-to-all factor. A cp
    group of one rank attends locally with the fused kernel.
    """
    if mode not in MODES:
        raise ValueError(f"cp_mode={mode!r}: must be one of {', '.join(MODES)}")
    group = mesh["cp"]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if group.size == 1:
        from orangetron.model.attention import attention_kernel

        return attention_kernel(q, k, v, causal=causal, scale=scale)[0]
    if mode == "usp":
        group = mesh.split_cp(ulysses_degree or 1)
    elif ulysses_degree not in (None, 1):
        raise ValueError(f"ulysses_degree={ulysses_degree}: only cp_mode 'usp' takes it, not {mode!r}")
    out = MODES[mode].attention(q, k, v, group, causal, scale)
    return out[0] if isinstance(out, tuple) else out
