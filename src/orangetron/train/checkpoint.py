"""Checkpoints that are complete or absent, verified on load, and loadable on any layout.

A checkpoint is a folder `step-00000123/` holding `state.pt` (tensors, numbers and strings only, read
back with `torch.load(weights_only=True)`, so loading never runs pickled code) and `manifest.json` with the
size and SHA-256 of every file. It is written under a temporary name and renamed into place, so a crash
leaves no half-written checkpoint behind, and overwriting a step moves the old checkpoint aside until the new
one is in place, so a crash never loses it; on load every file is checked against the manifest and a
mismatch is refused with a message naming the file, before anything is read into the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}"


def save_checkpoint(folder: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Write `state` as the checkpoint of `step` under `folder`, atomically; returns its path.

    An existing checkpoint of that step is renamed aside, not deleted, until the new one is in place, so a
    crash at any point leaves a complete checkpoint of `step` (`latest_checkpoint` finds the aside copy).
    """
    final = checkpoint_dir(folder, step)
    staging = final.with_name(f".{final.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    _write_files(staging, step, state)
    if final.exists():
        os.replace(final, final.with_name(f"{_aside_prefix(step)}{uuid.uuid4().hex[:8]}"))
    os.replace(staging, final)
    _fsync(final.parent)  # the renames themselves reach the disk
    for aside in _aside_copies(final.parent, step):
        shutil.rmtree(aside)  # superseded: the new checkpoint of this step is in place
    return final


def _write_files(staging: Path, step: int, state: dict[str, Any]) -> None:
    torch.save(state, staging / STATE_FILE)
    _fsync(staging / STATE_FILE)
    files = {STATE_FILE: {"bytes": (staging / STATE_FILE).stat().st_size, "sha256": _sha256(staging / STATE_FILE)}}
    manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    _fsync(staging / MANIFEST_FILE)


def _aside_prefix(step: int) -> str:
    return f".step-{step:08d}.old-"


def _aside_copies(folder: Path, step: int) -> list[Path]:
    """Complete checkpoints of `step` moved aside by an overwrite that has not finished, oldest name first."""
    return sorted(p for p in folder.glob(f"{_aside_prefix(step)}*") if p.is_dir())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint of the highest step under `folder`, or None.

    Partial (staging) folders never match. Where an overwrite crashed after moving the old checkpoint of a
    step aside and before the new one took its place, the aside copy is that step's checkpoint. Nothing is
    renamed or deleted here: every rank may call this at once.
    """
    folder = Path(folder)
    steps = {int(p.name[len("step-"):]): p for p in folder.glob("step-*") if p.is_dir() and _is_step_name(p.name)}
    for aside in sorted(folder.glob(".step-*.old-*")):
        digits = aside.name[len(".step-"):].split(".", 1)[0]
        if aside.is_dir() and digits.isdigit() and int(digits) not in steps:
            steps[int(digits)] = aside
    return steps[max(steps)] if steps else None


def _is_step_name(name: str) -> bool:
    return name[len("step-"):].isdigit()


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state saved at `path`, after checking every file against the manifest."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_FILE}; not a complete checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({err})") from None
    if STATE_FILE not in files:
        raise CheckpointError(f"{manifest_path}: lists no {STATE_FILE}")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        if file.stat().st_size != expected["bytes"] or _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file}: size or checksum differs from the manifest; the checkpoint is corrupt")
    try:
        return torch.load(path / STATE_FILE, weights_only=True)
    except Exception as err:  # checksummed yet unreadable: the manifest was rewritten to match
        # torch's own message is a page of advice to load with weights_only=False, which would run pickled code.
        raise CheckpointError(f"{path / STATE_FILE}: matches its manifest but is not a state this program "
                              f"wrote ({type(err).__name__}); refusing to load it") from None
