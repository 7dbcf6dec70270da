"""Training: byte tokenizer, embedded corpus and packing, the trainer loop and the `train` command."""

from __future__ import annotations

from typing import Any

from orangetron.train.data import (
    BatchIterator,
    pack_sequences,
    pad_to_multiple,
    read_text_files,
    split_train_eval,
    stdlib_corpus,
)
from orangetron.train.tokenizer import ByteTokenizer

__all__ = [
    "BatchIterator",
    "ByteTokenizer",
    "TrainConfig",
    "TrainConfigError",
    "pack_sequences",
    "pad_to_multiple",
    "read_text_files",
    "split_train_eval",
    "stdlib_corpus",
    "train",
]

_TRAINER_NAMES = ("TrainConfig", "TrainConfigError", "train")


def __getattr__(name: str) -> Any:
    # Loaded on first use: the trainer imports model, comm and (later) parallel, while those may want
    # the light data helpers here (pad_to_multiple); an eager import would make that a cycle.
    if name in _TRAINER_NAMES:
        from orangetron.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
