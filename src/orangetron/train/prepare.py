"""`orangetron prepare-data` and `orangetron tokenizer train` / `export`: a corpus tokenized once into a prepared
dataset (`train/datasets.py`), a byte-level BPE tokenizer trained offline, and the tokenizer a run's checkpoint
keeps written back out as files.

Inputs are documents: a text file is one document; a JSONL file (`.jsonl`, `.json`, `.ndjson`, in any case) is
one document per line, its `"text"` field. `prepare-data` writes each document's ids followed by the tokenizer's
EOS (the byte tokenizer has none and puts "\\n\\n\\n" between documents, as text files are joined) into
tokens.bin, streaming, with a progress bar on standard error by bytes read. torch is imported only when a command
runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from orangetron.cli.wording import BYTE_UNITS, counted, unit_for
from orangetron.spec.digest import file_record, file_sha256
from orangetron.train.corpus import FILE_SEPARATOR, file_documents
from orangetron.train.datasets import DATASET_FILE, DOCUMENTS_FILE, FORMAT, TOKENS_FILE, VERSION
from orangetron.train.outputs import check_claim, check_writable, claim_output, free_suffix, move_aside

BATCH_DOCUMENTS = 256  # documents tokenized together (the tokenizers library spreads a batch over threads)
SPECIAL_TOKENS = ("<|endoftext|>",)  # `tokenizer train`'s only special token: EOS (and BOS) of its documents


def add_data_commands(sub: Any) -> None:
    """Register `prepare-data` and `tokenizer` on an argparse subparsers object."""
    p = sub.add_parser(
        "prepare-data", help="tokenize a corpus into a memory-mapped dataset folder for train --data DIR",
        description="Tokenize text files (one document each) and JSONL files (one document per line, its \"text\" "
        "field) into DIR: tokens.bin (uint16 or uint32 ids, EOS after each document), documents.npy (document "
        "offsets) and dataset.json. `orangetron train --data DIR` reads it through a memory map.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="text or JSONL files")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the dataset folder to write (new or empty)")
    p.add_argument("--tokenizer", default="byte", metavar="T",
                   help="byte, or a tokenizer folder or tokenizer.json (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true",
                   help="an -o that exists moves aside to DIR.previous-N (never deleted) once the new dataset is "
                   "written, instead of refusing")
    p.add_argument("--json", action="store_true", help="print dataset.json's summary as one JSON object")
    p.set_defaults(run=_run_prepare)
    t = sub.add_parser("tokenizer", help="tokenizer tools: `tokenizer train`, `tokenizer export`",
                       description="Tokenizer tools. `orangetron tokenizer train FILES -o DIR --vocab N` trains a "
                       "byte-level BPE tokenizer offline; `orangetron tokenizer export RUN_DIR -o DIR` writes the "
                       "tokenizer a run's checkpoint keeps.")
    tsub = t.add_subparsers(dest="tokenizer_command", required=True, metavar="COMMAND")
    tr = tsub.add_parser("train", help="train a byte-level BPE tokenizer on text or JSONL files",
                         description="Train a byte-level BPE tokenizer (Hugging Face tokenizers) on the documents of "
                         "FILES and write DIR/tokenizer.json and tokenizer_config.json, which --tokenizer DIR and "
                         "transformers.AutoTokenizer read. Its one special token, <|endoftext|>, is EOS and BOS; "
                         "encoding adds neither.")
    tr.add_argument("files", nargs="+", metavar="FILE", help="text or JSONL files")
    tr.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write")
    tr.add_argument("--vocab", type=int, required=True, metavar="N",
                    help=f"vocabulary size, at least 256 + {len(SPECIAL_TOKENS)} (the bytes and the special token)")
    tr.add_argument("--overwrite", action="store_true",
                    help="a tokenizer already in DIR moves aside (tokenizer.json.previous-N, ...) instead of refusing")
    tr.add_argument("--json", action="store_true", help="print one JSON object: output, vocab_size")
    tr.set_defaults(run=_run_tokenizer_train)
    te = tsub.add_parser("export", help="write the tokenizer files a run's latest checkpoint keeps",
                         description="Write the tokenizer files (tokenizer.json, and tokenizer_config.json and "
                         "special_tokens_map.json where the run had them) that RUN_DIR's latest checkpoint keeps, "
                         "as the run read them when it started, into DIR: a copy a resume takes with --tokenizer "
                         "DIR once the recorded tokenizer is gone or rewritten.")
    te.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its latest checkpoint) or a checkpoint folder")
    te.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write")
    te.add_argument("--overwrite", action="store_true",
                    help="tokenizer files already in DIR move aside (NAME.previous-N) instead of refusing")
    te.add_argument("--json", action="store_true", help="print one JSON object: checkpoint, output, files")
    te.set_defaults(run=_run_tokenizer_export)


# ---- documents --------------------------------------------------------------------------------------------

def _source_file(name: str) -> Path:
    """`name` as a path, when it is a file: a folder or nothing there is refused, naming it."""
    path = Path(name)
    if path.is_dir():
        raise ValueError(f"{name}: a folder; give its files ({name}/*.txt, say)")
    if not path.is_file():
        raise FileNotFoundError(f"{name}: no such file")
    return path


def documents(files: list[str]) -> Iterator[tuple[str, int]]:
    """(text, bytes of input it took) for every document of `files` in order (`corpus.file_documents`: as
    `train --data` reads them); ValueError naming a bad file or line."""
    for name in files:
        yield from file_documents(_source_file(name))


class ByteProgress:
    """`prepare-data`'s bar: bytes read of the total, redrawn in place on a terminal, else a line per 10%."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.next_tenth, self.started = 1, time.perf_counter()
        self.unit = unit_for(max(total, 1), BYTE_UNITS)  # the input's size picks it: a small file is not "0.0 MiB"

    def advance(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0  # an empty file is read at once
        seconds = time.perf_counter() - self.started
        unit, size = self.unit
        text = (f"[{'#' * int(24 * fraction):-<24}] {100 * fraction:5.1f}% {self.done / size:,.1f} {unit}, "
                f"{tokens:,} tokens, {self.done / size / max(seconds, 1e-9):,.1f} {unit}/s")
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
        elif fraction * 10 >= self.next_tenth:
            self.stream.write(text + "\n")
            while self.next_tenth <= fraction * 10:
                self.next_tenth += 1
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


# ---- prepare-data -----------------------------------------------------------------------------------------

def prepare_data(files: list[str], output: str | Path, tokenizer: str = "byte", progress: bool = True,
                 stream: TextIO | None = None, overwrite: bool = False, moved: list[Path] | None = None
                 ) -> dict[str, Any]:
    """Tokenize the documents of `files` into the dataset folder `output` (new, or empty; with `overwrite` what
    is there moves aside to `output.previous-N`, whose path `moved` gets); returns dataset.json.

    Written in a staging folder beside `output` and renamed into place, so a failed run leaves nothing half
    written and moves nothing aside. The tokenizer must have an EOS (the byte tokenizer separates documents by
    "\\n\\n\\n")."""
    import numpy as np

    from orangetron.train.tokenizer import TOKENIZERS, tokenizer_named

    output = Path(output)
    inputs = [("a file it tokenizes", file) for file in files]
    inputs += [("its tokenizer", None if tokenizer in TOKENIZERS else tokenizer)]
    check_claim(output, "-o", overwrite, inputs)  # before the work; claimed after it
    name = tokenizer if tokenizer in TOKENIZERS else str(Path(tokenizer).resolve())
    tok = tokenizer_named(name)
    separator = tok.encode(FILE_SEPARATOR) if tok.eos_id is None and name == "byte" else None
    if tok.eos_id is None and separator is None:
        raise ValueError(f"--tokenizer {tokenizer}: has no eos_token (tokenizer_config.json); prepare-data puts EOS "
                         "between documents")
    end = separator if separator is not None else [tok.eos_id]
    dtype = np.dtype("<u2") if tok.vocab_size <= 2**16 else np.dtype("<u4")
    sources = [file_record(_source_file(f)) for f in files]
    staging = output.with_name(f".{output.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        offsets, empty = _write_tokens(files, tok, end, dtype, staging / TOKENS_FILE,
                                       ByteProgress(sum(s["bytes"] for s in sources), progress, stream))
        if len(offsets) == 1:
            raise ValueError(f"{' '.join(files)}: no text to tokenize (every document is empty)")
        np.save(staging / DOCUMENTS_FILE, np.asarray(offsets, dtype=np.int64))
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "tokens": offsets[-1],
                "documents": len(offsets) - 1, "tokenizer": name, "tokenizer_ids_sha256": _tokenizer_hash(tok),
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                "separator": separator, "empty_documents_skipped": empty, "sources": sources,
                "sha256": {n: file_sha256(staging / n) for n in (TOKENS_FILE, DOCUMENTS_FILE)}}
        (staging / DATASET_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        aside = claim_output(output, "-o", overwrite, inputs)
        if aside is not None and moved is not None:
            moved.append(aside)
        if output.exists():
            output.rmdir()  # empty, as claim_output found it
        os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return meta


def _write_tokens(files: list[str], tok: Any, end: list[int], dtype: Any, path: Path,
                  bar: ByteProgress) -> tuple[list[int], int]:
    """Stream every document's ids and `end` into `path`; the documents' start offsets and the total, and how
    many empty documents were left out (an empty file or `{"text": ""}` would be a document of EOS alone)."""
    import numpy as np

    offsets, total, empty = [0], 0, 0
    with open(path, "wb") as out:
        batch: list[tuple[str, int]] = []
        for document in (*documents(files), None):
            if document is not None and not document[0]:
                empty += 1
                bar.advance(document[1], total)
            elif document is not None:
                batch.append(document)
            if batch and (document is None or len(batch) == BATCH_DOCUMENTS):
                for ids, (_, nbytes) in zip(tok.encode_batch([text for text, _ in batch]), batch, strict=True):
                    np.asarray(ids + end, dtype=dtype).tofile(out)
                    total += len(ids) + len(end)
                    offsets.append(total)
                    bar.advance(nbytes, total)
                batch = []
    bar.advance(bar.total - bar.done, total)  # the bytes no document took (blank lines) are read too
    bar.close()
    return offsets, empty




def _tokenizer_hash(tok: Any) -> str | None:
    return tok.ids_sha256() if hasattr(tok, "ids_sha256") else None


def _run_prepare(args: argparse.Namespace) -> int:
    moved: list[Path] = []
    meta = prepare_data(args.files, args.output, args.tokenizer, progress=not args.quiet, overwrite=args.overwrite,
                        moved=moved)
    if moved:
        print(f"orangetron prepare-data: moved the former {args.output} to {moved[0]}", file=sys.stderr)
    skipped = meta["empty_documents_skipped"]
    left_out = f" ({counted(skipped, 'empty one')} left out)" if skipped else ""
    print(f"orangetron prepare-data: wrote {args.output}: {counted(meta['documents'], 'document')}{left_out}, "
          f"{counted(meta['tokens'], 'token')} ({meta['dtype']}); train with --data {args.output}", file=sys.stderr)
    if args.json:
        keys = ("documents", "empty_documents_skipped", "tokens", "dtype", "tokenizer", "vocab_size")
        print(json.dumps({k: meta[k] for k in keys}
                         | {"output": str(args.output)}))
    return 0


# ---- tokenizer train --------------------------------------------------------------------------------------

def train_tokenizer(files: list[str], output: str | Path, vocab: int, overwrite: bool = False,
                    moved: list[Path] | None = None) -> Path:
    """Train a byte-level BPE on the documents of `files`; write tokenizer.json and tokenizer_config.json into
    `output` (`_free_tokenizer_files`). `moved`, when given, gets where `overwrite` moved the former files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    smallest = 256 + len(SPECIAL_TOKENS)
    if vocab < smallest:
        raise ValueError(f"--vocab {vocab}: a byte-level BPE needs at least {smallest} ids (every byte and "
                         f"{', '.join(SPECIAL_TOKENS)})")
    written = _free_tokenizer_files(Path(output), overwrite)  # refused before training, not after
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    read = [0]  # characters of text seen

    def texts() -> Iterator[str]:
        for text, _ in documents(files):
            read[0] += len(text.strip())
            yield text

    tok.train_from_iterator(texts(), trainer=trainer)
    if not read[0]:  # it wrote a tokenizer of the bytes alone, as if trained
        raise ValueError(f"{', '.join(files)}: no text to train on")
    output = Path(output)
    _move_former(written, overwrite, moved)
    output.mkdir(parents=True, exist_ok=True)
    tok.save(str(output / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
              "eos_token": SPECIAL_TOKENS[0], "unk_token": None, "model_max_length": 1_000_000_000}
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return output


def _free_tokenizer_files(output: Path, overwrite: bool,
                          names: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")) -> list[Path]:
    """The files `names` a tokenizer command writes into `output`. A folder may hold a model beside them (a
    tokenizer paired with it), but a tokenizer already there is refused, or with `overwrite` moved aside when
    the new one is written."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"-o {str(output)!r}: is a file; give a folder")
    check_writable(output, "-o", inside=True)
    written = [output / name for name in names]
    present = [path.name for path in written if path.exists()]
    if present and not overwrite:
        raise ValueError(f"-o {str(output)!r}: holds {' and '.join(present)} already; choose another folder, or "
                         "add --overwrite to move them aside to NAME.previous-N")
    return written


def _move_former(written: list[Path], overwrite: bool, moved: list[Path] | None) -> None:
    """With `overwrite`, move the files of `written` that exist aside, all to one `.previous-N` so that the files
    that moved stay together; `moved`, when given, gets their new names."""
    present = [path for path in written if overwrite and os.path.lexists(path)]
    suffix = free_suffix(present)
    for path in present:
        aside = move_aside(path, suffix)
        if moved is not None:
            moved.append(aside)


def _run_tokenizer_train(args: argparse.Namespace) -> int:
    from orangetron.train.tokenizer import HFTokenizer

    moved: list[Path] = []
    output = train_tokenizer(args.files, args.output, args.vocab, args.overwrite, moved)
    size = HFTokenizer(output).vocab_size
    short = f"; the corpus gave fewer merges than --vocab {args.vocab}" if size < args.vocab else ""
    aside = f"; moved the former files to {' and '.join(path.name for path in moved)}" if moved else ""
    print(f"orangetron tokenizer train: wrote {output}/tokenizer.json ({size:,} ids{short}){aside}", file=sys.stderr)
    if args.json:
        print(json.dumps({"output": str(output), "vocab_size": size}))
    return 0


# ---- tokenizer export -------------------------------------------------------------------------------------

def export_tokenizer(run: str | Path, output: str | Path, overwrite: bool = False,
                     moved: list[Path] | None = None) -> dict[str, Any]:
    """Write the tokenizer files `run`'s latest checkpoint (or the checkpoint `run`) keeps into folder `output`;
    returns the checkpoint, the output and the files' names. A run on bytes, which has no files, and a
    checkpoint written before checkpoints kept them (2026-12-06) are refused. `moved`, when given, gets where
    `overwrite` moved the former files. Never into the checkpoints, whose manifests list their files."""
    from orangetron.train.checkpoint import read_state
    from orangetron.train.export import find_checkpoint
    from orangetron.train.tokenizer import SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG, TOKENIZER_JSON

    checkpoint = find_checkpoint(run)
    record = read_state(checkpoint)
    kept = record.get("tokenizer_files")
    if not kept:
        why = ("it ran on the byte tokenizer, which has no files" if record.get("tokenizer", "byte") == "byte" else
               f"the checkpoint predates kept tokenizers; its tokenizer was read from {record['tokenizer']}")
        raise ValueError(f"RUN_DIR {str(run)!r}: {checkpoint} keeps no tokenizer files: {why}")
    output = Path(output).resolve()
    # A run's checkpoints folder, or a checkpoint on its own: a manifest lists every file in it
    guarded = checkpoint.parent if checkpoint.parent.name == "checkpoints" else checkpoint
    if output.is_relative_to(guarded.resolve()):
        raise ValueError(f"-o {str(output)!r}: inside {guarded}, whose checkpoints' manifests list their files; "
                         "choose another folder")
    # Every file the tokenizer reads, not only those the run had: a stale tokenizer_config.json left beside the
    # copy would change its BOS and EOS
    names = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)
    _move_former(_free_tokenizer_files(output, overwrite, names), overwrite, moved)
    output.mkdir(parents=True, exist_ok=True)
    for name, text in kept.items():
        (output / name).write_text(text, encoding="utf-8")
    return {"checkpoint": str(checkpoint), "output": str(output), "files": sorted(kept)}


def _run_tokenizer_export(args: argparse.Namespace) -> int:
    moved: list[Path] = []
    result = export_tokenizer(args.run_dir, args.output, args.overwrite, moved)
    aside = f"; moved the former files to {' and '.join(path.name for path in moved)}" if moved else ""
    print(f"orangetron tokenizer export: wrote {', '.join(result['files'])} into {result['output']} from "
          f"{result['checkpoint']}{aside}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0
