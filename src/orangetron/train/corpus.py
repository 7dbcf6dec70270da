"""Training text: the embedded standard-library corpus and user files. No torch here: the CLI and the config
read these names before any rank starts."""

from __future__ import annotations

import codecs
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

DEFAULT_CORPUS_BYTES = 2_000_000
FILE_SEPARATOR = "\n\n\n"
JSON_LINES = (".jsonl", ".json", ".ndjson")  # one document per line, its "text" string; any case
# Directories of the stdlib that are not "ordinary" library code: third-party packages, the huge
# regression-test suites (mostly repetitive asserts) and IDLE's GUI code.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES, root: str | os.PathLike[str] | None = None) -> str:
    """Concatenate the running interpreter's standard-library `.py` files into one string.

    Files are visited in sorted path order (so the corpus is the same run after run), skipping any
    directory named in SKIPPED_DIRS, joined by FILE_SEPARATOR and cut to at most `max_bytes` UTF-8
    bytes. `root` overrides the stdlib directory (for tests). Raises FileNotFoundError if no file is found.
    """
    return "".join(stdlib_documents(max_bytes, root))


def stdlib_documents(max_bytes: int = DEFAULT_CORPUS_BYTES, root: str | os.PathLike[str] | None = None) -> list[str]:
    """`stdlib_corpus` as its documents: each file's text with the FILE_SEPARATOR after it, the last one cut so
    that the whole is the corpus (packed documents take one file as one document)."""
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
    budget = max_bytes - sum(len(p.encode("utf-8")) for p in pieces[:-1])
    # The cut may split a multi-byte character; drop the partial tail rather than emit U+FFFD.
    pieces[-1] = pieces[-1].encode("utf-8")[:budget].decode("utf-8", errors="ignore")
    return pieces


def _stdlib_files(base: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]  # pruning in place stops the descent
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    # Sorting whole relative paths (not os.walk's order) makes the corpus the same on every filesystem.
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def read_text_files(paths: Sequence[str | os.PathLike[str]]) -> str:
    """Read UTF-8 text files and join them with FILE_SEPARATOR (`read_text_documents`, joined)."""
    return "".join(read_text_documents(paths))


def read_text_documents(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The documents of the files (`file_documents`: a text file is one, a JSON Lines file one per line), all but
    the last followed by FILE_SEPARATOR. An empty one is left out, as `prepare-data` leaves it out: it would be a
    separator alone.

    Raises FileNotFoundError naming the first path that is missing or not a file, ValueError naming the
    first file (and line) that is not UTF-8 text or not a document, and ValueError if `paths` is empty or
    all files are empty.
    """
    if not paths:
        raise ValueError("no data files given")
    texts = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"data file {str(path)!r} does not exist or is not a file")
        texts += [text for text, _ in file_documents(path) if text]
    if not texts:
        raise ValueError(f"data files {[str(p) for p in paths]} are all empty")
    return [text + FILE_SEPARATOR for text in texts[:-1]] + texts[-1:]


def file_documents(path: Path) -> Iterator[tuple[str, int]]:
    """(text, bytes of the file it took) for each document of one data file, as `train --data`, `prepare-data`
    and `tokenizer train` all read it: a text file is one document; a JSON Lines file (JSON_LINES) one per
    non-blank line, its "text" string. A byte-order mark opening the file is not text."""
    if path.suffix.lower() not in JSON_LINES:
        data = path.read_bytes()
        yield _utf8(data.removeprefix(codecs.BOM_UTF8), path), len(data)
        return
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            text = _utf8(line.removeprefix(codecs.BOM_UTF8) if number == 1 else line, path, number)
            if text.strip():
                yield _text_field(text, path, number), len(line)


def _utf8(data: bytes, path: Path, line: int = 0) -> str:
    # Strict: a binary file decoded with replacement would train the model on U+FFFD, silently.
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f", line {line}," if line else ""
        raise ValueError(f"data file {str(path)!r}{where} is not UTF-8 text (byte {err.start}: "
                         f"{err.object[err.start:err.start + 1]!r})") from None


def _text_field(line: str, path: Path, number: int) -> str:
    """The "text" string of one JSON Lines record; anything else (another type of "text" included, which str()
    would have turned into Python's spelling of it: None, a list) is refused, naming the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = None
    text = record.get("text") if isinstance(record, dict) else None
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON may escape half a surrogate pair, which no tokenizer takes
            raise ValueError(f'{path}:{number}: "text" holds {text[err.start]!r}, half of a UTF-16 surrogate pair, '
                             "which is not text") from None
        return text
    why = f' ("text" is {json.dumps(text)})' if isinstance(record, dict) and "text" in record else ""
    if number == 1 and line.lstrip().startswith("["):
        why = " (JSON Lines holds one object per line; this file opens a JSON array)"
    raise ValueError(f'{path}:{number}: not a JSON object with a "text" string{why}')
