"""What a run records of a Hugging Face folder, read without torch: paths, hashes and sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orangetron.spec.digest import file_sha256
from orangetron.spec.hf_config import CONFIG_FILE, read_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"


def check_weight_files(path: str | Path) -> None:
    """Read each safetensors file's header (not its tensors): a truncated or corrupt file is a ValueError naming
    it here, on the launching process, not an error on every rank later."""
    from safetensors import SafetensorError, safe_open

    for name in weight_files(path):
        try:
            with safe_open(Path(path) / name, framework="pt"):
                pass
        except SafetensorError as err:
            raise ValueError(f"{name} is not a readable safetensors file ({err}); copy it again") from None


def read_generation_config(path: str | Path) -> dict[str, Any] | None:
    """The folder's generation_config.json (the token ids and defaults `generate` reads), or None where there is
    none or it is not a JSON object: training does not need it, so a broken one stops nothing."""
    file = Path(path) / GENERATION_FILE
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def weight_files(path: str | Path) -> list[str]:
    """The safetensors files of the folder: those its index lists, or model.safetensors."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))
        return sorted(set(index["weight_map"].values()))
    if (path / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}")


def describe_folder(path: str | Path) -> dict[str, Any]:
    """A Hugging Face folder as a run records it: its absolute path, the SHA-256 of its config.json and of its
    safetensors index (when sharded), each safetensors file's size, and its dtype."""
    path = Path(path).resolve()
    files = [{"name": name, "bytes": (path / name).stat().st_size} for name in weight_files(path)]
    record: dict[str, Any] = {"path": str(path), "config_sha256": file_sha256(path / CONFIG_FILE), "files": files}
    if (path / INDEX_FILE).is_file():
        record["index_sha256"] = file_sha256(path / INDEX_FILE)
    config = read_config(path)
    record["dtype"] = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return record


def eos_token_ids(config: dict[str, Any], generation: dict[str, Any] | None) -> frozenset[int]:
    """The ids transformers' `generate` ends a sequence at for a folder: `eos_token_id` (an id or a list) of its
    generation_config.json when it has one (`generation`; transformers then reads no other), else of config.json."""
    value = (generation if generation is not None else config).get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))
