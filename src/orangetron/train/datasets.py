"""Prepared datasets: a folder of token ids that `orangetron prepare-data` wrote and `train --data DIR` reads.

The folder holds
- `tokens.bin`: every document's token ids, one after another, little-endian uint16 (vocabularies up to
  65,536 ids) or uint32, each document followed by the tokenizer's EOS (the byte tokenizer, which has none,
  puts "\\n\\n\\n" between documents, as text files are joined);
- `documents.npy`: int64 offsets into tokens.bin, one per document and a last one at the end;
- `dataset.json`: the format, dtype, counts, the tokenizer (its name or path, and the SHA-256 of its files),
  its vocabulary size, EOS id, the sources (path, size, SHA-256), and the SHA-256 of the two files above.

`train` reads tokens.bin through a memory map (`numpy.memmap`), a batch's windows at a time, never whole; a
run records the dataset by the SHA-256 of dataset.json, which vouches for the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orangetron.spec.digest import file_sha256

if TYPE_CHECKING:  # both load on first use: `train --help` reads this module's names without them
    import numpy as np
    import torch

DATASET_FILE = "dataset.json"
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.npy"
FORMAT = "orangetron-tokens"
VERSION = 1


def is_prepared_dataset(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / DATASET_FILE).is_file()


def read_meta(path: str | Path) -> dict[str, Any]:
    """dataset.json of the prepared dataset at `path`; ValueError naming what is wrong."""
    file = Path(path) / DATASET_FILE
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not a prepared dataset's record ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{file}: not a {FORMAT} dataset of version {VERSION}")
    return meta


def meta_sha256(path: str | Path) -> str:
    return file_sha256(Path(path) / DATASET_FILE)


@dataclass
class PreparedDataset:
    """A prepared dataset opened for reading: its record and its tokens, memory-mapped."""

    path: Path
    meta: dict[str, Any]
    tokens: np.memmap  # [N], uint16 or uint32

    @staticmethod
    def open(path: str | Path) -> PreparedDataset:
        import numpy as np

        path = Path(path)
        meta = read_meta(path)
        file = path / TOKENS_FILE
        expected = meta["tokens"] * np.dtype(meta["dtype"]).itemsize
        if not file.is_file() or file.stat().st_size != expected:
            raise ValueError(f"{file}: missing or not {expected:,} bytes long, as {DATASET_FILE} says")
        tokens = np.memmap(file, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r", shape=(meta["tokens"],))
        return PreparedDataset(path, meta, tokens)

    def __len__(self) -> int:
        return int(self.meta["tokens"])

    def windows(self, start: int, stop: int, seq_len: int, *, documents: bool = False) -> TokenWindows:
        """The windows of tokens[start:stop]; with `documents`, packed: each token with its document's index."""
        return TokenWindows(self.tokens, start, stop, seq_len, self.document_offsets() if documents else None)

    def document_lengths(self, stop: int) -> np.ndarray:
        """Tokens of each document in tokens[:stop] (of the one `stop` cuts, those before it), as windows pack
        them: every document ends with its separator."""
        import numpy as np

        lengths = np.diff(np.minimum(self.document_offsets(), stop))
        return lengths[lengths > 0]

    def document_offsets(self) -> np.ndarray:
        """documents.npy: each document's first token, and the token count last (int64 [documents + 1])."""
        import numpy as np

        file = self.path / DOCUMENTS_FILE
        offsets = np.load(file) if file.is_file() else None
        if offsets is None or offsets.shape != (self.meta["documents"] + 1,) or offsets[-1] != len(self):
            raise ValueError(f"{file}: missing or not the {self.meta['documents'] + 1} offsets {DATASET_FILE} says")
        return offsets


class TokenWindows:
    """The windows [seq_len + 1] of tokens[start:stop] with stride seq_len (as `data.pack_sequences` cuts a
    stream), read from the memory map when indexed: `windows[idx]` (an int64 tensor of window numbers, a slice
    or an int) -> int64 [len(idx), seq_len + 1]. `shape` is that of the whole stack, as for a tensor. Given the
    document `offsets`, windows are packed (`data.pack_documents`): [len(idx), seq_len + 1, 2], each token
    beside the index of its document."""

    def __init__(self, tokens: np.ndarray, start: int, stop: int, seq_len: int,
                 offsets: np.ndarray | None = None) -> None:
        self.tokens, self.start, self.seq_len, self.offsets = tokens, start, seq_len, offsets
        self.count = max(stop - start - 1, 0) // seq_len

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.count, self.seq_len + 1) + (() if self.offsets is None else (2,))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: torch.Tensor | slice | int) -> torch.Tensor:
        import numpy as np
        import torch

        if isinstance(index, slice):
            index = torch.arange(self.count)[index]
        rows = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.count):
            raise IndexError(f"window index out of range [0, {self.count})")
        out = np.empty((rows.numel(), self.seq_len + 1), dtype=np.int64)
        for i, w in enumerate(rows.tolist()):
            at = self.start + w * self.seq_len
            out[i] = self.tokens[at:at + self.seq_len + 1]
        stacked = torch.from_numpy(out)
        if self.offsets is not None:
            at = self.start + rows.unsqueeze(1) * self.seq_len + torch.arange(self.seq_len + 1)  # [n, seq_len + 1]
            ids = torch.searchsorted(torch.from_numpy(self.offsets), at, right=True) - 1
            stacked = torch.stack((stacked, ids), dim=-1)
        return stacked[0] if isinstance(index, int) else stacked
