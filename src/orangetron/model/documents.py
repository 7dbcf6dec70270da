"""Packed documents: the boundaries of the documents a batch row holds, given as data beside the tokens.

A packed row attends block-diagonally and causally (a token sees the earlier tokens of its own document only),
its rotary positions restart at 0 in each document, and the label after a document's last token is ignored
(`orangetron/train/data.py`, `packed_inputs`). The mask comes from the document ids, never from positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Spans = tuple[tuple[int, int], ...]  # [start, stop) of each document of a row, in order


class DocumentIdsError(ValueError):
    """Document ids that do not describe contiguous documents."""


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a packed batch: `ids` [B, S] int64 (equal ids: one document) and `spans`, per row the
    [start, stop) of each document. Build it with `Documents.from_ids`, once per batch: the spans are read to
    the host there, and every attention layer reuses them."""

    ids: torch.Tensor | None  # None once only the spans are kept (`spans_only`)
    spans: tuple[Spans, ...]
    # What every attention layer of the batch would work out alike from the spans (a ring's route), once.
    _memo: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def from_ids(ids: torch.Tensor) -> Documents:
        """Documents of ids [B, S] (or [S], one row); DocumentIdsError unless each id is one contiguous run of
        its row (a document split in two would need a mask the per-document kernel calls cannot give)."""
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype.is_floating_point:
            raise DocumentIdsError(f"document ids must be integers [B, S] with S >= 1; got {ids.dtype} "
                                   f"{tuple(ids.shape)}")
        return Documents(ids, tuple(_row_spans(row) for row in ids.tolist()))

    @property
    def seq_len(self) -> int:
        return self.spans[0][-1][1]

    def memo(self, key: tuple, build: Callable[[], Any]) -> Any:
        """build(), made once per `key` for these documents (every layer of a batch shares them)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def spans_only(self) -> Documents:
        """These documents without the ids tensor: what a fused backward keeps on its autograd context (it reads
        the spans alone), so that no tensor escapes the activation meter (`orangetron/memory.py`)."""
        return Documents(None, self.spans)

    def kept_for(self, impl: str) -> Documents:
        """What an attention backward of kernel `impl` keeps: the matmul path ("reference") masks by the ids."""
        return self if impl == "reference" else self.spans_only()

    @property
    def cuts(self) -> tuple[int, ...]:
        """The increasing global positions where a document of some row begins (0 first): the balanced cp
        sharding cuts the sequence there (`orangetron/parallel/context/calls.py`, `document_runs`)."""
        return tuple(sorted({start for spans in self.spans for start, _ in spans}))

    def positions(self) -> torch.Tensor:
        """Rotary positions [B, S]: each token's offset from the start of its document."""
        starts = torch.zeros_like(self.ids)
        for r, spans in enumerate(self.spans):
            for start, stop in spans:
                starts[r, start:stop] = start
        return torch.arange(self.seq_len, device=self.ids.device) - starts

    def row_groups(self) -> list[tuple[list[int], Spans]]:
        """Rows sharing the same spans, as (row indices in order, their spans), in order of first row."""
        groups: dict[Spans, list[int]] = {}
        for r, spans in enumerate(self.spans):
            groups.setdefault(spans, []).append(r)
        return [(rows, spans) for spans, rows in groups.items()]


def _row_spans(row: list[int]) -> Spans:
    spans, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[i - 1]:
            spans.append((start, i))
            start = i
    seen = [row[a] for a, _ in spans]
    if len(set(seen)) != len(seen):
        raise DocumentIdsError(f"document ids {seen} in row order: a document is split into more than one run")
    return tuple(spans)
