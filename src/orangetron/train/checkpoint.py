"""Checkpoints that every rank writes its own shards of, complete or absent, verified on load, any layout.

A checkpoint is a folder `step-00000123/` holding:
- `__<rank>_0.distcp`: each rank's boxes of the whole tensors, written by `torch.distributed.checkpoint`
  (`orangetron.train.sharded`); a box held by several ranks (replicas) is written by one of them;
- `.metadata`: DCP's index of those boxes (which file, which offsets), written by rank 0;
- `state.json`: everything that is not a tensor (step, losses, schedule, model config ...);
- `manifest.json`: the size and SHA-256 of every file above, written last.

No rank gathers the model: each writes the shard it holds, and loading reads, on each rank, only the
parts of the saved boxes that overlap what it holds on its own layout. A checkpoint is written in a
staging folder and renamed into place by rank 0 once every rank has reported its files written and
checksummed, so a crash leaves no half-written checkpoint behind; overwriting a step moves the old
checkpoint aside until the new one is in place, so a crash never loses it. On load every file is checked
against the manifest (by the ranks in turn, each file once) and a mismatch is refused with a message
naming the file, before anything is read into the model. Nothing loaded can run code: tensors are read
with `torch.load(weights_only=True)`, DCP's pickled metadata with an unpickler that constructs only its
metadata records, and the rest is JSON.

Checkpoints of format 1 (one `state.pt` gathered on rank 0) are refused with a message saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.state import Shards
from orangetron.spec.digest import file_sha256
from orangetron.train.sharded import (
    METADATA_FILE,
    CheckpointError,
    load_shards,
    read_metadata,
    save_shards,
    saved_shapes,
)

__all__ = ["CheckpointError", "Checkpoint", "checkpoint_dir", "earlier_checkpoint", "latest_checkpoint",
           "load_checkpoint", "load_into", "open_checkpoint", "read_state", "save_checkpoint"]

FORMAT_VERSION = 2
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"


def _entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def checkpoint_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}"


# ---- nested state <-> flat names -------------------------------------------------------------------

def _split(state: dict[str, Any], prefix: str = "") -> tuple[dict[str, Shards], dict[str, Any]]:
    """Tensors (whole, or `Shards`) by "a/b/c" name, and the nested rest (JSON values)."""
    tensors: dict[str, Shards] = {}
    plain: dict[str, Any] = {}
    for key, value in state.items():
        if "/" in key:
            raise ValueError(f"state key {key!r}: '/' separates nested names")
        name = f"{prefix}{key}"
        if isinstance(value, Shards):
            tensors[name] = value
        elif isinstance(value, torch.Tensor):
            tensors[name] = Shards.whole(value.detach())
        elif isinstance(value, dict) and any(isinstance(v, (dict, torch.Tensor, Shards)) for v in value.values()):
            inner_tensors, inner_plain = _split(value, f"{name}/")
            tensors |= inner_tensors
            if inner_plain:
                plain[key] = inner_plain
        else:
            plain[key] = value
    return tensors, plain


def _nest(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> dict[str, Any]:
    out = dict(plain)
    for name, tensor in tensors.items():
        *path, leaf = name.split("/")
        node = out
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = tensor
    return out


# ---- writing ---------------------------------------------------------------------------------------

def save_checkpoint(folder: str | Path, step: int, state: dict[str, Any], group: MeshGroup | None = None) -> Path:
    """Write `state` as the checkpoint of `step` under `folder`, atomically; returns its path.

    `state` nests dicts whose leaves are tensors (whole, the same on every rank), `Shards` (each rank's
    boxes of a whole tensor) or JSON values (taken from rank 0). Collective over `group` (None: this process
    alone): every rank writes its own boxes. An existing checkpoint of that step is renamed aside, not
    deleted, until the new one is in place, so a crash at any point leaves a complete checkpoint of `step`
    (`latest_checkpoint` finds the aside copy).
    """
    final = checkpoint_dir(folder, step)
    rank = group.rank if group is not None else 0
    staging = final.with_name(_agreed(f".{final.name}.partial-{uuid.uuid4().hex[:8]}", group))
    tensors, plain = _split(state)
    save_shards(staging, tensors, group)  # every rank creates the folder if it is not there yet
    # DCP names each rank's files __<rank>_<n>.distcp; every rank checksums its own, in parallel.
    mine = {f.name: _entry(f) for f in sorted(staging.glob(f"__{rank}_*"))}
    every = _gather(mine, group)  # also the barrier: each rank's files are written (and synced by DCP)
    if rank == 0:
        files = {name: entry for rank_files in every for name, entry in rank_files.items()}
        _write_json(staging / STATE_FILE, plain)
        for name in (METADATA_FILE, STATE_FILE):
            files[name] = _entry(staging / name)
        _write_json(staging / MANIFEST_FILE, {"format": FORMAT_VERSION, "step": step, "files": files})
        _fsync(staging)
        _put_in_place(staging, final, step)
    _gather(None, group)  # every rank returns with the checkpoint in place
    return final


def _put_in_place(staging: Path, final: Path, step: int) -> None:
    if final.exists():
        os.replace(final, final.with_name(f"{_aside_prefix(step)}{uuid.uuid4().hex[:8]}"))
    os.replace(staging, final)
    _fsync(final.parent)  # the renames themselves reach the disk
    for aside in _aside_copies(final.parent, step):
        shutil.rmtree(aside)  # superseded: the new checkpoint of this step is in place
    # A save killed before its rename left its staging folder; the folder is this run's (its lock), so every
    # staging folder left now is a dead one, which no resume reads: it only held the disk.
    for stale in final.parent.glob(".*.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _agreed(value: Any, group: MeshGroup | None) -> Any:
    """Rank 0's `value`, on every rank."""
    return _gather(value, group)[0]


def _gather(value: Any, group: MeshGroup | None) -> list[Any]:
    if group is None or group.size == 1:
        return [value]
    return comm.all_gather_objects(value, group)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1))
    _fsync(path)


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
    """The checkpoint of the highest step under `folder`, or None (`_checkpoints`). Nothing is renamed or deleted
    here: every rank may call this at once."""
    steps = _checkpoints(Path(folder))
    return steps[max(steps)] if steps else None


def earlier_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint of the highest step below that of checkpoint `path`, beside it (unchecked), or None."""
    steps = _checkpoints(Path(path).parent)
    mine = [step for step, found in steps.items() if found == Path(path)]
    below = [step for step in steps if mine and step < mine[0]]
    return steps[max(below)] if below else None


def _checkpoints(folder: Path) -> dict[int, Path]:
    """The checkpoints under `folder` by step. Partial (staging) folders never match. Where an overwrite crashed
    after moving the old checkpoint of a step aside and before the new one took its place, the aside copy is
    that step's checkpoint."""
    steps = {int(p.name[len("step-"):]): p for p in folder.glob("step-*") if p.is_dir() and _is_step_name(p.name)}
    for aside in sorted(folder.glob(".step-*.old-*")):
        digits = aside.name[len(".step-"):].split(".", 1)[0]
        if aside.is_dir() and digits.isdigit() and int(digits) not in steps:
            steps[int(digits)] = aside
    return steps


def _is_step_name(name: str) -> bool:
    return name[len("step-"):].isdigit()


# ---- reading ---------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A verified checkpoint: its folder, its JSON values and DCP's index of its tensors."""

    path: Path
    plain: dict[str, Any]
    metadata: Metadata

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Whole shape and dtype of every saved tensor, by "a/b/c" name."""
        return saved_shapes(self.metadata)


def _manifest(path: Path) -> dict[str, dict[str, Any]]:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        latest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if latest is not None:  # a run folder, or its checkpoints folder: not damage
            raise CheckpointError(f"{path}: a folder of checkpoints, not one; its latest is {latest}")
        raise CheckpointError(f"{path}: no {MANIFEST_FILE}; not a complete checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        version = manifest.get("format")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({err})") from None
    if version == 1:
        raise CheckpointError(f"{manifest_path}: format 1 (one state.pt gathered on rank 0), from an orangetron "
                              f"before sharded checkpoints; this version reads format {FORMAT_VERSION} only. "
                              "Finish or export that run with the version that wrote it")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: format {version!r}, expected {FORMAT_VERSION}")
    for name in (METADATA_FILE, STATE_FILE):
        if name not in files:
            raise CheckpointError(f"{manifest_path}: lists no {name}")
    return files


def _problem(path: Path, name: str, expected: dict[str, Any]) -> str | None:
    file = path / name
    if not file.is_file():
        return f"{file}: missing"
    if file.stat().st_size != expected.get("bytes") or file_sha256(file) != expected.get("sha256"):
        return f"{file}: size or checksum differs from the manifest; the checkpoint is corrupt"
    return None


def open_checkpoint(path: str | Path, group: MeshGroup | None = None) -> Checkpoint:
    """The checkpoint at `path`, once every file matches the manifest. Collective over `group`: the ranks
    checksum the shard files in turn (each file once) and all refuse if any differs."""
    path = Path(path)
    files = _manifest(path)
    for name in (METADATA_FILE, STATE_FILE):
        if problem := _problem(path, name, files[name]):
            raise CheckpointError(problem)
    shard_files = sorted(set(files) - {METADATA_FILE, STATE_FILE})
    rank, size = (group.rank, group.size) if group is not None else (0, 1)
    mine = next((p for name in shard_files[rank::size] if (p := _problem(path, name, files[name]))), None)
    problems = [p for p in _gather(mine, group) if p is not None]
    if problems:
        raise CheckpointError(problems[0])
    metadata = read_metadata(path)
    unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - set(files))
    if unlisted:
        raise CheckpointError(f"{path / METADATA_FILE}: refers to {unlisted[0]}, which the manifest does not list")
    return Checkpoint(path, _plain(path), metadata)


def read_state(path: str | Path) -> dict[str, Any]:
    """The JSON values of the checkpoint at `path` (step, model, tokenizer ...), once state.json matches the
    manifest; no shard is read or checked."""
    path = Path(path)
    if problem := _problem(path, STATE_FILE, _manifest(path)[STATE_FILE]):
        raise CheckpointError(problem)
    return _plain(path)


def _plain(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path / STATE_FILE}: not JSON ({err})") from None


def load_into(checkpoint: Checkpoint, state: dict[str, Any], group: MeshGroup | None = None) -> None:
    """Fill the tensors and `Shards` of `state` (nested as saved) from `checkpoint`, saved on any layout.

    Each name must be saved with the same whole shape; a mismatch is refused, naming the tensor, before
    anything is read. Collective over `group`."""
    tensors, _ = _split(state)
    saved = checkpoint.shapes()
    for name, shards in tensors.items():
        if name not in saved:
            raise CheckpointError(f"{checkpoint.path}: holds no tensor {name!r}")
        if saved[name][0] != tuple(shards.shape):
            raise CheckpointError(f"{checkpoint.path}: {name!r} has shape {saved[name][0]}, this run's is "
                                  f"{tuple(shards.shape)}")
    load_shards(checkpoint.path, checkpoint.metadata, tensors, group)


def load_checkpoint(path: str | Path, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The whole state saved at `path`, in this process, after checking every file against the manifest.

    Tensors come back whole (as on one device) in their saved dtype, nested as saved; `only` limits them to
    the named top-level keys (JSON values always come back). Reads the whole model: for inspection and
    export, not for resuming a run (`open_checkpoint` + `load_into` read a rank's share).
    """
    checkpoint = open_checkpoint(path)
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in checkpoint.shapes().items()
               if only is None or name.split("/", 1)[0] in only}
    load_shards(checkpoint.path, checkpoint.metadata, {n: Shards.whole(t) for n, t in tensors.items()}, None)
    return _nest(tensors, checkpoint.plain)
