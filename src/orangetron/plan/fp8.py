"""FP8 training's extra memory: FP8 linear layers under Transformer Engine's delayed per-tensor scaling or
DeepSeek-V3's blockwise scaling.

Compute under FP8 (`Job.fp8`) is priced in `timing`/`compute`: linear-layer GEMMs at the GPU's FP8 peak with
1-byte operands and 16-bit outputs (blockwise scaling at the GPU's `fp8_blockwise_gemm_efficiency`), a cast (and
transpose, for wgrad) of every GEMM input as memory-bound work; the output head, attention, norms and the
optimizer stay in 16/32-bit (Megatron's output layer is not a Transformer Engine module; DeepSeek-V3 keeps its
head in BF16, arXiv:2412.19437 section 3.3.1). Memory adds, per GPU:
- an FP8 copy of every linear weight but the head's, and its transpose (2 bytes per linear parameter), cached
  across the micro-batches of a step, while the 16-bit weights and fp32 master copies stay as they are (Hopper's
  FP8 tensor-core GEMMs read both operands K-major, so dgrad needs the transposed copy under either recipe);
- the scale tensors. `delayed` (`Job.fp8_recipe`, Transformer Engine's default): per GEMM operand one fp32
  scale, one scale inverse and an amax history of `AMAX_HISTORY` fp32 values (three operands per GEMM, four
  linear layers per dense layer). `current` (Transformer Engine's Float8CurrentScaling): per operand a scale, a
  scale inverse and the one amax it takes from the tensor before each cast, no history. `blockwise`
  (DeepSeek-V3, arXiv:2412.19437 section 3.3.2): one fp32 scale per 128 x 128 block of each weight copy,
  computed online, so no history (exact when weight dimensions are multiples of 128, as in every shipped
  preset).
Saved activations: every linear layer keeps the FP8 cast of its input (1 byte per element) instead of the
16-bit tensor, as Transformer Engine does, plus under `blockwise` one fp32 scale per 1 x 128 tile
(`activations.py`); the gradients, reductions and optimizer are unchanged.
"""

from __future__ import annotations

from orangetron.plan.params import head_weights, stage_params
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.stages import stage_layers

AMAX_HISTORY = 1024  # Transformer Engine's default amax_history_len
GEMMS_PER_LAYER = 4  # QKV, output projection, up (gate+up), down
WEIGHT_BLOCK = 128 * 128  # elements per fp32 scale of a blockwise-scaled weight
ACTIVATION_TILE = 128  # elements per fp32 scale of a blockwise-scaled activation (1 x 128 tiles)


def fp8_memory_bytes(model: ModelSpec, deg: Degrees, job: Job, stage: int = 0) -> int:
    """Bytes FP8 training adds on one GPU of `stage`: FP8 weight copies and transposes, scale tensors."""
    if not job.fp8:
        return 0
    params = stage_params(model, deg, stage, job.virtual_stages, job.pipeline_layout).total
    if stage == 0 and not model.patch_size:
        params -= model.vocab_size * model.hidden_size // deg.tp  # the embedding is a lookup, not a GEMM
    if stage == deg.pp - 1:
        params -= head_weights(model, deg.tp, deg.pp)  # the output head stays 16-bit (see `timing`)
    params = max(0, params)
    if job.fp8_recipe == "blockwise":
        return 2 * params + 2 * 4 * -(-params // WEIGHT_BLOCK)  # both copies, one fp32 scale per block
    layers = len(stage_layers(model.num_layers, deg.pp, job.virtual_stages, stage, job.pipeline_layout))
    per_operand = 2 + (1 if job.fp8_recipe == "current" else AMAX_HISTORY)
    scales = layers * GEMMS_PER_LAYER * 3 * per_operand * 4
    return 2 * params + scales
