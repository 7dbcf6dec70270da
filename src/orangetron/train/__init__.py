"""Training: byte tokenizer, embedded corpus and packing, the trainer loop and the `train` command.

Names load on first use: `orangetron --help` builds the train flags from `train.config` without importing
torch, and the trainer imports model, comm and parallel, which may want the light helpers here.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "BatchIterator": "data", "pack_sequences": "data", "pad_to_multiple": "data", "split_train_eval": "data",
    "read_text_files": "corpus", "stdlib_corpus": "corpus",
    "ByteTokenizer": "tokenizer",
    "TrainConfig": "config", "TrainConfigError": "config",
    "train": "trainer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
