"""The single-device reference model; parallelism is applied from outside (`orangetron.parallel`)."""

from .attention import attention_kernel
from .config import MODEL_PRESETS, ConfigError, ModelConfig, model_preset
from .layers import Attention, RMSNorm, SwiGLU, apply_rope, rope_cos_sin
from .moe import GroupedExperts, MoE, Router, load_balancing_loss
from .transformer import Transformer, TransformerBlock, init_parameter

__all__ = [
    "MODEL_PRESETS",
    "Attention",
    "ConfigError",
    "GroupedExperts",
    "MoE",
    "ModelConfig",
    "RMSNorm",
    "Router",
    "SwiGLU",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "attention_kernel",
    "init_parameter",
    "load_balancing_loss",
    "model_preset",
    "rope_cos_sin",
]
