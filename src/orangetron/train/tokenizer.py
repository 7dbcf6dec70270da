"""Tokenizers: bytes (the default: one token per UTF-8 byte, vocab 256) or a Hugging Face `tokenizers` file.

`Tokenizer` is what the rest of the code asks of a tokenizer. A run names its tokenizer by a string it records:
a name in `TOKENIZERS` ("byte"), or the path of a tokenizer folder (its tokenizer.json, with BOS/EOS from its
tokenizer_config.json) or of a tokenizer.json file; `tokenizer_named` builds either, so `orangetron sample`
decodes with the tokenizer a run trained on (runs that record none used bytes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import torch


class Tokenizer(Protocol):
    """Text <-> token ids in [0, vocab_size)."""

    vocab_size: int
    bos_id: int | None  # the token that opens a document, where the tokenizer adds one
    eos_id: int | None  # the token that ends a document (prepared datasets put it between documents)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Maps text to UTF-8 byte values (0..255) and back.

    No special tokens: the models' vocab_size of 256 covers every id this tokenizer emits.
    """

    vocab_size: int = 256
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of `text` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

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


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (tokenizer.json) that encodes as transformers 5's
    `AutoTokenizer` does, BOS/EOS included.

    `path`: a folder holding tokenizer.json (and perhaps tokenizer_config.json) or a tokenizer.json file. The
    special tokens encoding adds are those of tokenizer.json's post-processor (transformers 5 drops
    tokenizer_config.json's `add_bos_token` / `add_eos_token` when a tokenizer.json exists, and so does this
    class). Which tokens are BOS and EOS comes from tokenizer_config.json (`bos_token`, `eos_token`, as strings or
    added-token objects): prepared datasets put EOS between documents.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as Backend

        self.path = Path(path).resolve()
        self.file = self.path / TOKENIZER_JSON if self.path.is_dir() else self.path
        if not self.file.is_file():
            hint = (f"a run's folder: `orangetron tokenizer export {path} -o DIR` writes the tokenizer its "
                    "checkpoint keeps" if (self.path / "config.toml").is_file() else "give a tokenizer folder or file")
            raise ValueError(f"tokenizer={str(path)!r}: no {TOKENIZER_JSON} ({hint})")
        try:
            self.backend = Backend.from_file(str(self.file))
        except Exception as err:  # the Rust library's own exception type
            raise ValueError(f"tokenizer={str(path)!r}: {self.file} is not a tokenizers file ({err})") from None
        self._special_tokens(_tokenizer_config(self.file.parent))

    @classmethod
    def from_kept(cls, files: dict[str, str], origin: str) -> HFTokenizer:
        """The tokenizer of `kept_files`' texts (a checkpoint's copy), whatever became of `origin`, the path it was
        read from, which `path` and `file` name (`files_sha256` reads them, so it is not for this copy)."""
        from tokenizers import Tokenizer as Backend

        tok = cls.__new__(cls)
        tok.path = Path(origin)
        tok.file = tok.path / TOKENIZER_JSON if tok.path.suffix != ".json" else tok.path
        tok.backend = Backend.from_str(files[TOKENIZER_JSON])
        config = json.loads(files[TOKENIZER_CONFIG]) if TOKENIZER_CONFIG in files else {}
        tok._special_tokens(config if isinstance(config, dict) else {})
        return tok

    def _special_tokens(self, config: dict[str, Any]) -> None:
        """BOS and EOS as tokenizer_config.json names them, and the vocabulary's size, once `backend` is read."""
        self.bos_token, self.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        self.bos_id, self.eos_id = self._id(self.bos_token), self._id(self.eos_token)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer adds (as AutoTokenizer(text).input_ids)."""
        return self.backend.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, the library's threads sharing the work."""
        return [e.ids for e in self.backend.encode_batch(texts)]

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return self.backend.decode(ids, skip_special_tokens=False)

    def files_sha256(self) -> str:
        """Of tokenizer.json and tokenizer_config.json (when there is one): what datasets of 2026-12-04 hold."""
        digest = hashlib.sha256(self.file.read_bytes())
        config = self.file.parent / TOKENIZER_CONFIG
        if config.is_file():
            digest.update(config.read_bytes())
        return digest.hexdigest()

    def kept_files(self) -> dict[str, str]:
        """The texts of the files a checkpoint keeps so that export and sample need not find this path again:
        tokenizer.json, and beside it tokenizer_config.json (BOS and EOS) and special_tokens_map.json where
        there are such files."""
        files = {TOKENIZER_JSON: self.file.read_text(encoding="utf-8")}
        for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
            if (self.file.parent / name).is_file():
                files[name] = (self.file.parent / name).read_text(encoding="utf-8")
        return files

    def ids_sha256(self) -> str:
        """Of what decides the ids: the tokenizer as the tokenizers library reads it (not tokenizer.json's
        formatting) and which tokens are BOS and EOS (not tokenizer_config.json's other keys, a chat template say)."""
        text = f"{self.backend.to_str()}\0{self.bos_token}\0{self.eos_token}"
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer}


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    file = folder / TOKENIZER_CONFIG
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not a JSON file ({err})") from None
    return config if isinstance(config, dict) else {}


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an added-token object."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds a tokenizer.json (a Hugging Face model folder usually does)."""
    return (Path(folder) / TOKENIZER_JSON).is_file()


def tokenizer_named(name: str) -> Tokenizer:
    """The tokenizer `name` names: a key of `TOKENIZERS` ("byte"), or a tokenizer folder or tokenizer.json path;
    ValueError naming the choices otherwise."""
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    if Path(name).exists():
        return HFTokenizer(name)
    raise ValueError(f"tokenizer={name!r}: neither a known name ({', '.join(sorted(TOKENIZERS))}) nor a tokenizer "
                     "folder or tokenizer.json")


def kept_tokenizer(name: str) -> dict[str, Any]:
    """What a checkpoint keeps of the run's tokenizer `name` (empty for a named one, bytes, which has no files): the
    hash of what it encodes to, and its files' texts, so that `export --hf` and `sample` use what the model
    learnt from even once the tokenizer is rewritten or deleted at its path."""
    if name in TOKENIZERS:
        return {}
    tok = HFTokenizer(name)
    return {"tokenizer_ids_sha256": tok.ids_sha256(), "tokenizer_files": tok.kept_files()}


def recorded_tokenizer(record: dict[str, Any], doing: str) -> Tokenizer:
    """The tokenizer of a checkpoint's record: the files it keeps, else (an older checkpoint) the one at its
    path, bytes where it names none, refused for `doing` when it no longer encodes to the ids the record hashed
    (checkpoints older still hashed none and are not checked)."""
    name = str(record.get("tokenizer", "byte"))
    if record.get("tokenizer_files"):
        return HFTokenizer.from_kept(record["tokenizer_files"], name)
    tok = tokenizer_named(name)
    recorded = record.get("tokenizer_ids_sha256")
    if recorded is not None and isinstance(tok, HFTokenizer) and tok.ids_sha256() != recorded:
        raise ValueError(f"the run's tokenizer {name} encodes other ids than when the checkpoint was written "
                         f"(ids sha256 {recorded[:12]} then, {tok.ids_sha256()[:12]} now): it was rewritten at the "
                         f"same path; restore it before {doing}")
    return tok
