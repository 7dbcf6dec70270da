"""orangetron: long-context and MoE transformer training with TP, CP, EP, DP and PP, and a planner.

Heavy modules load on first use, so `import orangetron` stays cheap for the planner and the CLI.
"""

from __future__ import annotations

import importlib
from typing import Any

from orangetron.spec.layout import Layout, LayoutError

__version__ = "0.1.0"

_LAZY = {
    "comm": ("orangetron.comm", None),
    "memory": ("orangetron.memory", None),
    "testing": ("orangetron.testing", None),
    "init_mesh": ("orangetron.mesh", "init_mesh"),
    "ParallelMesh": ("orangetron.mesh", "ParallelMesh"),
    "ModelConfig": ("orangetron.model", "ModelConfig"),  # builds a ModelSpec from the runtime's names
    "ModelSpec": ("orangetron.spec.model", "ModelSpec"),  # the one model schema
    "Transformer": ("orangetron.model", "Transformer"),
    "ParallelConfig": ("orangetron.parallel", "ParallelConfig"),
    "DataParallel": ("orangetron.parallel", "DataParallel"),  # the earlier name of ParallelModel
    "ParallelModel": ("orangetron.parallel", "ParallelModel"),
    "parallelize": ("orangetron.parallel", "parallelize"),
}

__all__ = ["Layout", "LayoutError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'orangetron' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value  # bound once, so later lookups skip __getattr__; bounded by _LAZY
    return value
