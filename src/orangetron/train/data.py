"""Training data's shapes: packing, splits, batches and padding (the text itself comes from `corpus`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from orangetron.model.documents import Documents
from orangetron.train.corpus import (  # noqa: F401 (re-exported: the data API in one place)
    DEFAULT_CORPUS_BYTES,
    FILE_SEPARATOR,
    read_text_documents,
    read_text_files,
    stdlib_corpus,
    stdlib_documents,
)


def pack_sequences(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream [N] into windows [n, seq_len + 1] for next-token prediction.

    Window i is tokens[i*seq_len : (i+1)*seq_len + 1]: inputs `w[:, :-1]` tile the stream without
    overlap and labels `w[:, 1:]` are the inputs shifted by one, so each token after the first is
    a label exactly once. n = (N - 1) // seq_len; the tail that does not fill a window is dropped.
    Raises ValueError if seq_len < 1 or the stream is shorter than one window.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be at least 1")
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"seq_len={seq_len}: needs at least {seq_len + 1} tokens, got {tokens.numel()}")
    return tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()  # [n, seq_len+1]


def pack_documents(tokens: torch.Tensor, document_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`pack_sequences` for packed documents: windows [n, seq_len + 1, 2] of (token, document id) pairs, cut
    from the stream tokens [N] and its document id per token [N] alike. Every tensor of samples is indexed,
    split and shuffled along its first dimension, so packed samples travel wherever plain ones do."""
    if tokens.shape != document_ids.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and document ids {tuple(document_ids.shape)} differ in shape")
    return torch.stack((pack_sequences(tokens, seq_len), pack_sequences(document_ids, seq_len)), dim=-1)


def document_ids(lengths: list[int]) -> torch.Tensor:
    """The document id of every token [sum(lengths)]: 0 for the first lengths[0] tokens, then 1, ..."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))


def packed_inputs(samples: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor,
                                                                            Documents | None]:
    """(inputs [B, S], labels [B, S], documents) of samples: [B, S + 1] tokens (documents None) or packed
    [B, S + 1, 2] (token, document id) pairs. A label from another document than its input's, the one after a
    document's last token, is `ignore_index`: no loss spans two documents."""
    if samples.dim() == 2:
        return samples[:, :-1], samples[:, 1:], None
    tokens, ids = samples[..., 0], samples[..., 1]  # [B, S + 1] each
    labels = tokens[:, 1:].masked_fill(ids[:, 1:] != ids[:, :-1], ignore_index)
    return tokens[:, :-1], labels, Documents.from_ids(ids[:, :-1])


def label_count(samples: torch.Tensor) -> int:
    """The labels of samples [B, S + 1] (or packed, [B, S + 1, 2]) that count in the loss: all B * S of plain
    samples, and of packed ones those whose input lies in the same document (`packed_inputs`)."""
    if samples.dim() == 2:
        return samples.shape[0] * (samples.shape[1] - 1)
    ids = samples[..., 1]
    return int((ids[:, 1:] == ids[:, :-1]).sum())


def split_train_eval(tokens: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream [N] (or a packed one, [N, 2]) into (train, eval), eval being the last
    int(N * eval_fraction) tokens.

    Holding out the end of the stream (before packing) means no window mixes train and eval text.
    Raises ValueError unless 0 <= eval_fraction < 1.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction}: must be in [0, 1)")
    n_eval = int(tokens.shape[0] * eval_fraction)
    n_train = tokens.shape[0] - n_eval
    return tokens[:n_train], tokens[n_train:]


class BatchIterator:
    """Deterministic shuffled batches over samples [n, L] (a tensor, or windows read on demand such as a prepared
    dataset's `datasets.TokenWindows`).

    Epoch e visits every sample exactly once in an order drawn from a torch.Generator seeded by
    (seed, e), so the same seed gives the same batches on any machine and an epoch can be replayed
    on its own. With drop_last the final short batch of each epoch is skipped.
    Iterating the object yields batches forever, epoch after epoch.
    """

    def __init__(self, samples: torch.Tensor, batch_size: int, seed: int = 0, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be at least 1")
        if samples.shape[0] < 1 or (drop_last and samples.shape[0] < batch_size):
            raise ValueError(f"batch_size={batch_size}: only {samples.shape[0]} samples available")
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Batches per epoch."""
        n = self.samples.shape[0]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of sample indices used in `epoch`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.samples.shape[0], generator=gen)

    def epoch(self, epoch: int) -> Iterator[torch.Tensor]:
        """Yield the batches [batch_size, L] of one epoch (the last may be short unless drop_last)."""
        perm = self.order(epoch)
        for b in range(len(self)):
            yield self.samples[perm[b * self.batch_size : (b + 1) * self.batch_size]]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.from_sample(0)

    def from_sample(self, cursor: int) -> Iterator[torch.Tensor]:
        """The batches after the first `cursor` samples of the stream (a global sample cursor: what a checkpoint
        records), epoch after epoch, computed from the cursor without drawing the batches before it.
        ValueError unless the cursor falls on a batch boundary."""
        per_epoch = len(self) * self.batch_size if self.drop_last else self.samples.shape[0]
        epoch, within = divmod(cursor, per_epoch)
        if cursor < 0 or within % self.batch_size:
            raise ValueError(f"sample cursor {cursor}: not at the start of a batch of {self.batch_size}")
        first = within // self.batch_size
        while True:
            perm = self.order(epoch)
            for b in range(first, len(self)):
                yield self.samples[perm[b * self.batch_size : (b + 1) * self.batch_size]]
            epoch, first = epoch + 1, 0


def pad_to_multiple(
    inputs: torch.Tensor, labels: torch.Tensor, multiple: int, ignore_index: int = -100, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad inputs and labels [B, S] along the sequence so S divides by `multiple`.

    Padded inputs are `pad_id`, padded labels `ignore_index`. Under causal attention no real token
    attends to a later (padded) one, and ignored labels add nothing to the loss, so padding leaves
    the loss and gradients unchanged (context parallelism needs S % (2*cp) == 0).
    """
    if multiple < 1:
        raise ValueError(f"multiple={multiple}: must be at least 1")
    if inputs.shape != labels.shape:
        raise ValueError(f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} differ in shape")
    extra = -inputs.shape[1] % multiple
    if extra == 0:
        return inputs, labels
    pad = (0, extra)
    return (
        torch.nn.functional.pad(inputs, pad, value=pad_id),
        torch.nn.functional.pad(labels, pad, value=ignore_index),
    )
