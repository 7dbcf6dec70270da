"""Training text and its shapes: the embedded stdlib corpus, user files, packing, splits and batches."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

DEFAULT_CORPUS_BYTES = 2_000_000
FILE_SEPARATOR = "\n\n\n"
# Directories of the stdlib that are not "ordinary" library code: third-party packages, the huge
# regression-test suites (mostly repetitive asserts) and IDLE's GUI code.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, root: str | os.PathLike[str] | None = None) -> str:
    """Concatenate the running interpreter's standard-library `.py` files into one string.

    Files are visited in sorted path order (so the corpus is the same run after run), skipping any
    directory named in SKIPPED_DIRS, joined by FILE_SEPARATOR and cut to at most `max_bytes` UTF-8
    bytes. `root` overrides the stdlib directory (for tests). Raises FileNotFoundError if no file is found.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes}: must be positive")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    pieces: list[str] = []
    total = 0
    for path in _stdlib_files(base):
        text = path.read_text(encoding="utf-8", errors="replace") + FILE_SEPARATOR
        pieces.append(text)
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    if not pieces:
        raise FileNotFoundError(f"no standard-library .py files found under {base}")
    corpus = "".join(pieces).encode("utf-8")[:max_bytes]
    # The cut may split a multi-byte character; drop the partial tail rather than emit U+FFFD.
    return corpus.decode("utf-8", errors="ignore")


def _stdlib_files(base: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]  # pruning in place stops the descent
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    # Sorting whole relative paths (not os.walk's order) makes the corpus the same on every filesystem.
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def read_text_files(paths: Sequence[str | os.PathLike[str]]) -> str:
    """Read UTF-8 text files and join them with FILE_SEPARATOR.

    Raises FileNotFoundError naming the first path that is missing or not a file, ValueError naming the
    first file that is not UTF-8 text, and ValueError if `paths` is empty or all files are empty.
    """
    if not paths:
        raise ValueError("no data files given")
    texts = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"data file {str(path)!r} does not exist or is not a file")
        texts.append(_read_utf8(path))
    if not any(texts):
        raise ValueError(f"data files {[str(p) for p in paths]} are all empty")
    return FILE_SEPARATOR.join(texts)


def _read_utf8(path: Path) -> str:
    # Strict: a binary file decoded with replacement would train the model on U+FFFD, silently.
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data file {str(path)!r} is not UTF-8 text (byte {err.start}: "
                         f"{err.object[err.start:err.start + 1]!r})") from None


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


def split_train_eval(tokens: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream [N] into (train, eval), eval being the last int(N * eval_fraction) tokens.

    Holding out the end of the stream (before packing) means no window mixes train and eval text.
    Raises ValueError unless 0 <= eval_fraction < 1.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction}: must be in [0, 1)")
    n_eval = int(tokens.numel() * eval_fraction)
    n_train = tokens.numel() - n_eval
    return tokens[:n_train], tokens[n_train:]


class BatchIterator:
    """Deterministic shuffled batches over samples [n, L].

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
        e = 0
        while True:
            yield from self.epoch(e)
            e += 1


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
