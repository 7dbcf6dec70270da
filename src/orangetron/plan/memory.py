"""Per-GPU memory by category: params, grads, main_params, optimizer (DESIGN section 5) and activations
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198,
generalized to GQA, SwiGLU, MoE, CP and flash attention).

Every function is pure; bytes are integers so the runtime's ledger can be compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from orangetron.plan.activations import stage_activation_bytes
from orangetron.plan.config import DTYPE_BYTES, Degrees, Job
from orangetron.plan.models import ModelSpec
from orangetron.plan.sharding import padded_numel, shard_numel
from orangetron.plan.stages import stage_layers

CATEGORIES = ("params", "grads", "main_params", "optimizer", "activations")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- model states ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU of a stage holds: `dense` replicated over dp x cp, `expert` over edp."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_params(model: ModelSpec, deg: Degrees, stage: int, virtual_stages: int = 1) -> StageParams:
    """Parameter counts on one GPU of pipeline `stage` (TP shards projections, MLPs and the vocabulary)."""
    return _stage_params(model, deg.tp, deg.pp, deg.ep, deg.etp, stage, virtual_stages)


@lru_cache(maxsize=8192)
def _stage_params(model: ModelSpec, t: int, pp: int, ep: int, etp: int, stage: int,
                  virtual_stages: int) -> StageParams:
    dense = expert = 0
    norms = model.norm_params()
    kv_whole, kv_local = _kv_weights(model, t)
    for i in stage_layers(model.num_layers, pp, virtual_stages, stage):
        # Norm weights and the router are replicated across tp; everything else is split, except kv heads
        # fewer than tp, of which each rank keeps one.
        replicated = norms + (model.num_experts * model.hidden_size if model.is_moe_layer(i) else 0)
        split = model.dense_params_of_layer(i) - replicated - kv_whole
        dense += replicated + _ceil_div(split, t) + kv_local
        if model.is_moe_layer(i):
            expert += _ceil_div(model.expert_params_per_layer(), ep * etp)
    if stage == 0:
        dense += _ceil_div(model.vocab_size * model.hidden_size, t) if not model.patch_size else 0
        dense += model.embedding_params() - (0 if model.patch_size else model.vocab_size * model.hidden_size)
    if stage == pp - 1:
        final_norm = model.hidden_size * (2 if model.bias else 1)
        head = model.output_params() - final_norm
        # A tied head on a separate last stage keeps its own copy of the embedding (as Megatron does).
        if model.tied_embeddings and pp > 1 and not model.patch_size:
            head = model.vocab_size * model.hidden_size
        dense += final_norm + _ceil_div(head, t)
    return StageParams(dense, expert)


def _kv_weights(model: ModelSpec, t: int) -> tuple[int, int]:
    """(whole, per-rank) K and V projection elements of a layer when its kv heads are fewer than tp and so
    replicated, one per rank; (0, 0) when they split evenly like the other heads."""
    if model.kv_lora_rank or model.kv_heads >= t:
        return 0, 0
    per_head = 2 * model.qk_head_dim * (model.hidden_size + (1 if model.bias else 0))
    return model.kv_heads * per_head, per_head


def shard_groups(params: StageParams, deg: Degrees) -> list[tuple[str, int, int]]:
    """(mesh dim, ranks, elements) of each flat data-parallel buffer. With ep = 1 the experts are ordinary
    replicated parameters and share the dense buffer over dp x cp, as in the runtime."""
    if deg.ep == 1:
        return [("dp_cp", deg.dp_cp, params.total)]
    return [("dp_cp", deg.dp_cp, params.dense), ("edp", deg.edp, params.expert)]


def model_state_bytes(params: StageParams, deg: Degrees, job: Job) -> dict[str, int]:
    """params / grads / main_params / optimizer bytes per GPU, exactly DESIGN section 5's table.

    Dense parameters shard over d = dp x cp, expert parameters over edp. ZeRO-1 and the distributed
    optimizer shard optimizer state and fp32 main params; ZeRO-2 also the gradients; ZeRO-3 also the params.
    A sharded flat buffer is padded to a multiple of its shard count (`plan.sharding`, shared with the runtime).
    """
    sharding = job.zero_stage >= 1 or job.distributed_optimizer
    full = shard = 0
    for _, ranks, numel in shard_groups(params, deg):
        n = ranks if sharding else 1
        full += padded_numel(numel, n)
        shard += shard_numel(numel, n)
    p_bytes = job.param_bytes
    main_bytes = 4 if job.mixed_precision else p_bytes  # fp32 main params and grads under mixed precision
    g_bytes = DTYPE_BYTES[job.grad_dtype] if job.mixed_precision else p_bytes
    return {
        "params": p_bytes * (shard if job.zero_stage == 3 else full),
        "grads": g_bytes * (shard if job.zero_stage >= 2 else full),
        "main_params": main_bytes * shard if job.mixed_precision else 0,
        "optimizer": 2 * main_bytes * shard,  # Adam's two moments, in the main-param dtype
    }


def stage_memory(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> dict[str, int]:
    """Bytes by category (and `total`) on one GPU of pipeline `stage`."""
    out = model_state_bytes(stage_params(model, deg, stage, job.virtual_stages), deg, job)
    out["activations"] = stage_activation_bytes(model, deg, job, stage)
    out["buffers"] = zero3_gather_bytes(model, deg, job)
    out["total"] = sum(out[c] for c in CATEGORIES) + out["buffers"]
    return out


def zero3_gather_bytes(model: ModelSpec, deg: Degrees, job: Job) -> int:
    """ZeRO-3's transient full parameters: the layer in use and the one being prefetched."""
    if job.zero_stage != 3:
        return 0
    biggest = max(model.dense_params_of_layer(i) // deg.tp
                  + (model.expert_params_per_layer() // (deg.ep * deg.etp) if model.is_moe_layer(i) else 0)
                  for i in range(min(model.num_layers, model.first_dense_layers + 2)))
    return 2 * biggest * job.param_bytes


def memory_per_gpu(model: ModelSpec, deg: Degrees, job: Job) -> dict[str, int]:
    """The busiest GPU's bytes by category: the stage with the largest total (first and last are checked,
    plus the middle one, which bound every other stage)."""
    stages = sorted({0, deg.pp // 2, deg.pp - 1})
    return max((stage_memory(model, deg, job, s) for s in stages), key=lambda r: r["total"])
