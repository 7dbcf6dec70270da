"""Hugging Face models in and out: `config(path)` (a folder's config.json as the one model schema),
`load(path, dtype=...)` (the reference `Transformer` holding its weights), `save(model, folder)` (a folder
`transformers.AutoModelForCausalLM` loads). The trainer imports on any layout with `read_into`, each rank
reading only its own boxes. `config` needs no torch; the rest loads on first use. docs/models.md lists the
families and what is refused.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from orangetron.spec.hf_config import HFConfigError, read_config, spec_from_hf
from orangetron.spec.model import ModelSpec

__all__ = ["HFConfigError", "config", "describe_folder", "load", "read_into", "save"]

_LAZY = {"load": ".io", "save": ".io", "read_into": ".io", "describe_folder": ".folder"}


def config(path: str | Path) -> ModelSpec:
    """The `ModelSpec` of the Hugging Face folder (or config.json) `path`, named after the folder;
    `HFConfigError` names the first key orangetron cannot honour."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    return spec_from_hf(read_config(path), folder.resolve().name)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)  # the module caches itself
