"""`attention`: one entry for every context-parallel attention mode; each mode is a record of its own.

Every mode takes this rank's shard (`context.shard`: head-tail, or balanced over packed documents) of q [B, L,
Hq, D] and k, v [B, L, Hk, D] and returns this rank's output [B, L, Hq, D], forward and backward. The modes,
their traffic and their costs are records in spec/context_modes.py (`CONTEXT_MODES`); each names its runtime
module here, which has `attention(q, k, v, group, causal, scale, impl)` and, when it talks over other groups
than `mesh["cp"]`, `cp_group(mesh, ulysses_degree)`:

| mode | what travels over cp | module |
|---|---|---|
| ring | K,V blocks around the ring, overlapped with the block at hand; dK,dV home behind them | `ring` |
| allgather | K,V gathered once (again in backward); dK,dV reduce-scattered | `allgather` |
| ulysses | Q, K+V and the output by all-to-all between sequence and head shards | `ulysses` |
| rsa | K then V around the ring, [L, S] probabilities kept (ColossalAI) | `rsa` |
| usp | Ulysses over `ulysses_degree` consecutive ranks, ring over the rest | `usp` |

`impl` picks the block kernel: "fused" (the fused kernel seam of `orangetron/model/attention.py`, fed only
calls whose mask it can express; `blocks.attend`) or "reference" (plain matmuls masked by position).
"""

from __future__ import annotations

import torch

from orangetron.mesh import ParallelMesh
from orangetron.model.documents import Documents
from orangetron.spec import rules
from orangetron.spec.variants import CONTEXT_MODES


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: ParallelMesh, mode: str = "ring",
              causal: bool = True, scale: float | None = None, ulysses_degree: int | None = None,
              impl: str = "fused", documents: Documents | None = None) -> torch.Tensor:
    """Attention of this cp rank's shard over the whole sequence -> [B, L, Hq, D].

    `causal` masks by global position (the shards are known from the mesh, and from `documents`' cuts). `scale`
    defaults to head_dim ** -0.5. `ulysses_degree` (mode "usp" only; it must divide cp) is the all-to-all factor. A
    cp group of one rank attends locally with the kernel `impl` ("fused" or "reference", as `attention_kernel`).
    `documents` (packed rows; causal only): the documents of the whole (unsharded) sequence [B, S]; a query then
    sees only the earlier keys of its own document.
    """
    if documents is not None and not causal:
        raise ValueError("packed documents need causal attention")
    record = CONTEXT_MODES.runtime_record(mode)
    rules.ulysses_degree_only_for_its_modes(ulysses_degree or 1, mode, record.takes_ulysses_degree)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if mesh["cp"].size == 1:
        from orangetron.model.attention import attention_kernel, document_attention

        if documents is not None:
            return document_attention(q, k, v, documents, scale=scale, impl=impl)[0]
        return attention_kernel(q, k, v, causal=causal, scale=scale, impl=impl)[0]
    runtime = record.load()
    group = runtime.cp_group(mesh, ulysses_degree or 1) if hasattr(runtime, "cp_group") else mesh["cp"]
    # Unpacked rows call a mode as (q, k, v, group, causal, scale, impl) alone, which every mode takes.
    extra = {} if documents is None else {"documents": documents}
    out = runtime.attention(q, k, v, group, causal, scale, impl, **extra)
    return out[0] if isinstance(out, tuple) else out
