"""The single-device reference model; parallelism is applied from outside (`orangetron.parallel`).

The model is described by the one schema, `ModelSpec` (spec/model.py); `ModelConfig` builds one from the
runtime's argument names. Those and the presets need no torch; the layers load on first use, so the CLI and
the planner can read presets without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import MODEL_PRESETS as MODEL_PRESETS
from .config import ConfigError as ConfigError
from .config import ModelConfig as ModelConfig
from .config import ModelSpec as ModelSpec
from .config import check_runnable as check_runnable
from .config import model_from_record as model_from_record
from .config import model_preset as model_preset

_LAZY = {
    "attention_kernel": ".attention",
    "Attention": ".layers", "CausalAttention": ".layers", "RMSNorm": ".layers", "SwiGLU": ".layers",
    "apply_rope": ".layers", "rope_cos_sin": ".layers", "rope_inv_freq": ".layers",
    "rope_tables": ".layers",
    "GroupedExperts": ".moe", "LocalDispatcher": ".moe", "MoE": ".moe", "Router": ".moe", "RouterLosses": ".moe",
    "load_balancing_loss": ".moe",
    "TokenIO": ".token_io",
    "Transformer": ".transformer", "TransformerBlock": ".transformer", "init_parameter": ".transformer",
}

__all__ = ["MODEL_PRESETS", "ConfigError", "ModelConfig", "ModelSpec", "check_runnable", "model_from_record",
           "model_preset", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # bound once, so later lookups skip __getattr__; bounded by _LAZY
    return value
