"""Host pacing of a MoE layer: the CPU issues every kernel, and a layer cannot run faster than its host issues it.

Eager training issues one operation at a time from the CPU: the Python call, the autograd record, the ATen
dispatch, the backend's setup and the driver's launch each take microseconds (the driver's launch alone a few),
whatever the kernel then does. A dense layer of the sizes the planner prices keeps the GPU busy for far longer
than its few dozen operations take to issue, so the host runs ahead and its time is hidden. A MoE layer issues
more, and more of them small: Transformer Engine's grouped linear layer (Megatron-Core's `TEGroupedMLP`) calls one
GEMM per local expert, forward, dgrad and wgrad, with an FP8 cast per expert input under FP8; and the dropless
dispatcher reads every expert's token count on the host before it can size the all-to-all (Megatron-Core's
`MoEAlltoAllTokenDispatcher.preprocess`, its "before_ep_alltoall" synchronization), which empties the GPU's
queue once per layer: the host's lead is gone, so the layer's forward runs at the slower of its GPU time and
the time its host takes to issue it. The backward, with no such read, is paced the same way on balance: a run
of alike layers takes the longer of the two sums.

Counted per MoE layer and micro-batch on one GPU (`layer_ops`), forward: `FORWARD_OPS`, the operations that do
not repeat per expert (and a norm over the query and the key heads where the model has QK-norm), as
Megatron-Core issues them with Transformer Engine, the all-to-all dispatcher and the
unfused permutation (`moe_utils.permute` / `unpermute`); plus, per local expert, `EXPERT_GEMMS` GEMMs (up and
down projection) and an FP8 cast of each GEMM input (`CAST_OPS` operations, by recipe). Backward:
`BACKWARD_OPS_RATIO` times the forward's shared operations (an autograd node launches about one kernel per input
gradient), and per local expert a dgrad and a wgrad per projection, plus an FP8 cast of each output gradient.
Full recompute issues the forward again during backward, a replayed module its own operations (`REPLAY_OPS`).
`ep_overlap_chunks` runs each chunk's experts as their own GEMMs, so the per-expert operations repeat per chunk.
"""

from __future__ import annotations

from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job

# A MoE layer's forward operations that do not repeat per local expert, by part.
FORWARD_OPS = {
    "attention block": 7,  # input norm, QKV GEMM, RoPE on q and on k, attention, output GEMM, residual
    "router": 10,  # norm, GEMM, score function, top-k, routing map; the balancing loss's 5 reductions and products
    "dispatch": 12,  # counts, their all-gather, 3 splits, host copy, permutation (3), 2 all-to-alls, expert sort
    "experts' activation and weighting": 2,
    "combine": 5,  # unsort, all-to-all, unpermutation (zeros, scatter-add), residual
}
LAYER_FORWARD_OPS = sum(FORWARD_OPS.values())
QK_NORM_OPS = 2  # a norm over each query head and each key head (Qwen3), before RoPE
BACKWARD_OPS_RATIO = 2  # backward operations per forward one (an autograd node: one kernel per input gradient)
EXPERT_GEMMS = 2  # up (gate and up fused) and down projection per expert
# Operations a MoE layer's backward issues again per replayed module (`Job.recompute_modules`): the pre-MLP norm
# (and MLA's input norm, in `replayed_ops`); MLA's two up-projection GEMMs with the latent norms fused into them
# (a norm kernel each), RoPE on q and on k and their two concatenations; the experts' activation over the grouped
# rows; a dense MLP replays in dense layers only, which nothing paces
REPLAY_OPS = {"layernorm": 1, "mla_up_proj": 8, "mlp": 0, "moe_act": 1}
# Operations one FP8 cast issues, by recipe (`Job.fp8_recipe`): a fused cast (delayed scaling takes the amax its
# cast kernel records for the next step; a blockwise cast computes each tile's scale in the kernel); current
# scaling computes the tensor's amax, then its scale, then casts (Transformer Engine's
# Float8CurrentScalingQuantizer: nvte_compute_amax, nvte_compute_scale_from_amax, nvte_quantize)
CAST_OPS = {"delayed": 1, "current": 3, "blockwise": 1}


def layer_ops(model: ModelSpec, deg: Degrees, job: Job) -> tuple[int, int]:
    """(forward, backward) host-issued operations of one MoE layer for one micro-batch on one GPU, recompute
    excluded."""
    experts = max(1, model.num_experts // deg.ep) * job.ep_overlap_chunks
    cast = CAST_OPS[job.fp8_recipe] if job.fp8 else 0  # per GEMM input (forward) and output gradient (backward)
    shared = LAYER_FORWARD_OPS + (QK_NORM_OPS if model.qk_norm else 0)
    forward = shared + experts * EXPERT_GEMMS * (1 + cast)
    backward = BACKWARD_OPS_RATIO * shared + experts * EXPERT_GEMMS * (2 + cast)
    return forward, backward


def paced_seconds(gpu_forward: float, gpu_backward: float, model: ModelSpec, deg: Degrees, job: Job,
                  op_s: float) -> float:
    """Seconds of one MoE layer's forward and backward (recompute included) when its host issues each operation
    in `op_s`: each pass takes the longer of its GPU time and its host time. `gpu_backward` includes the
    replayed forward under full recompute."""
    forward, backward = layer_ops(model, deg, job)
    if job.recompute == "full":
        backward += forward
    backward += replayed_ops(model, job)
    return max(gpu_forward, forward * op_s) + max(gpu_backward, backward * op_s)


def replayed_ops(model: ModelSpec, job: Job) -> int:
    """Operations one MoE layer's backward issues again for its replayed modules."""
    mla_norm = "layernorm" in job.recompute_modules and model.kv_lora_rank > 0
    return sum(REPLAY_OPS[name] for name in job.recompute_modules) + mla_norm
