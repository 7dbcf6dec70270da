"""Byte-level tokenizer: one token per UTF-8 byte, so any text round-trips and vocab is fixed at 256.

`Tokenizer` is what the rest of the code asks of a tokenizer, and `TOKENIZERS` names the ones there are, so a
run can record which it used and `orangetron sample` can pick it by that name (the byte tokenizer, the only
one yet, is the default for runs that record none).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Tokenizer(Protocol):
    """Text <-> token ids in [0, vocab_size)."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Maps text to UTF-8 byte values (0..255) and back.

    No special tokens: the models' vocab_size of 256 covers every id this tokenizer emits.
    """

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of `text` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Return the UTF-8 bytes of `text` as an int64 tensor of shape [len(bytes)]."""
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.long)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Inverse of encode; byte sequences that are not valid UTF-8 decode to U+FFFD.

        Raises ValueError for ids outside [0, 256).
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        try:
            raw = bytes(ids)
        except ValueError as err:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}): {err}") from None
        return raw.decode("utf-8", errors="replace")


TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer}


def tokenizer_named(name: str) -> Tokenizer:
    """A new tokenizer of the kind `name` names in `TOKENIZERS`; ValueError listing the known names otherwise."""
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer={name!r}: unknown; known: {', '.join(sorted(TOKENIZERS))}")
    return TOKENIZERS[name]()
