"""Files by content: the SHA-256 that checkpoint manifests, run records, prepared datasets and imported model
folders identify a file by, read in blocks so a large file is never held whole."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

_BLOCK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """The hex SHA-256 of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: str | Path) -> dict[str, Any]:
    """{"path": absolute path, "bytes": size, "sha256": hash}: how a record names a file it read."""
    return {"path": str(Path(path).absolute()), "bytes": Path(path).stat().st_size, "sha256": file_sha256(path)}
