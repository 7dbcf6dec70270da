"""Sharded tensors in and out of `torch.distributed.checkpoint` (DCP): each rank writes and reads its own boxes.

DCP stores every tensor of a checkpoint as chunks of a whole ("logical") tensor, each chunk a box given by
its offsets and sizes, and its load planner reads, for each box a rank asks for, exactly the overlapping
parts of the saved chunks. That is all resharding needs. Its built-in ways to describe a rank's boxes do
not fit orangetron's buffers: DTensor places one shard per mesh dimension along a tensor dimension, while
a ZeRO shard is a flat range that starts and ends mid-row (up to 2N - 1 boxes of an N-d tensor); and
ShardedTensor insists that shards never overlap across ranks, while DDP replicas and tp copies of a
weight hold identical boxes. So the two planners below take `Shards` (`orangetron.parallel.state`:
boxes with views of the rank's own memory) and speak DCP's plan language directly:

- saving: one `WriteItem` per box; DCP's global planner drops the identical boxes of replicas (its
  de-duplication of equal `MetadataIndex` entries keeps one copy), checks that the remaining boxes of each
  tensor neither overlap nor leave a hole, and each rank writes its boxes to its own `__<rank>_0.distcp`;
- loading: DCP's `create_read_items_for_chunk_list` intersects the boxes a rank asks for with the saved
  chunks, and the data lands in the views, that is, in the rank's buffers.

Safety: DCP writes its `.metadata` file with `pickle` and reads it back with an unrestricted
`pickle.load`, which could run code. Here it is read by `read_metadata`, an unpickler that only
constructs DCP's metadata records, `torch.Size`, dtypes, layouts and paths, after the checkpoint's
manifest has vouched for its SHA-256. Tensors are read by DCP with `torch.load(weights_only=True)`, and
nothing is saved as pickled bytes (DCP would load those with `weights_only=False`).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from orangetron import comm
from orangetron.mesh import MeshGroup
from orangetron.parallel.state import Shards

METADATA_FILE = ".metadata"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt."""


class _SavePlanner(DefaultSavePlanner):
    """One write item per box of every `Shards`; DCP's global step de-duplicates and validates them."""

    def __init__(self, tensors: dict[str, Shards]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors = tensors
        self.boxes = {(name, torch.Size(p.offsets)): p.data for name, s in tensors.items() for p in s.pieces}

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, shards in self.tensors.items():
            for piece in shards.pieces:
                offsets = torch.Size(piece.offsets)
                items.append(WriteItem(
                    index=MetadataIndex(name, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size(piece.sizes)),
                                                properties=TensorProperties.create_from_tensor(piece.data),
                                                size=torch.Size(shards.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.boxes[(write_item.index.fqn, write_item.index.offset)]


class _LoadPlanner(DefaultLoadPlanner):
    """Reads, for every box of every `Shards`, the overlapping parts of the saved chunks into its view."""

    def __init__(self, tensors: dict[str, Shards]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors = tensors

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for name, shards in self.tensors.items():
            chunks = [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in shards.pieces]
            items += create_read_items_for_chunk_list(name, self.metadata.state_dict_metadata[name], chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self.tensors[read_item.dest_index.fqn].pieces[read_item.dest_index.index]
        view = piece.data
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            view = view.narrow(dim, start, length)
        return view

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn}: pickled bytes in a checkpoint are never loaded")


class _Reader(dcp.FileSystemReader):
    """DCP's file reader with the metadata already read safely, and unreadable shards named."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self.metadata, self.folder = metadata, path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as err:  # checksummed yet unreadable: the manifest was rewritten to match
                # torch's own message is a page of advice to load with weights_only=False (never taken here).
                raise CheckpointError(f"{self.folder / name}: matches its manifest but is not a state this "
                                      f"program wrote ({type(err).__name__}); refusing to load it") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


# ---- the metadata file, read without running pickled code ------------------------------------------------

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "TensorProperties",
                 "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata record")


def read_metadata(path: Path) -> Metadata:
    """DCP's `.metadata` of the checkpoint at `path`, constructing only allowed record types."""
    file = path / METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as err:
        raise CheckpointError(f"{file}: not checkpoint metadata this program wrote ({err}); refusing to load "
                              "it") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


def saved_shapes(metadata: Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each saved tensor's whole shape and dtype, by name."""
    return {name: (tuple(md.size), md.properties.dtype) for name, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


# ---- save and load --------------------------------------------------------------------------------------

@contextmanager
def _dcp_errors() -> Iterator[None]:
    """DCP gathers every rank's exception into one CheckpointException (a BaseException); raise the first
    rank's own exception instead, so a caller sees the same error on one rank or many."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as err:
        failures = err.failures
        first = failures[min(failures)][0] if failures else None
        if isinstance(first, Exception):
            raise first from None
        raise


def _everywhere(step: Callable[[], Any], group: MeshGroup | None) -> list[Any]:
    """Run `step` on this rank and share the outcome through `comm` (so the ledger sees it): every rank gets every
    rank's result in rank order, or every rank raises, its own exception if it failed, else the lowest failing
    rank's, so that no rank goes on alone."""
    try:
        with _dcp_errors():
            mine: Any = step()
    except Exception as err:
        mine = err
    alone = group is None or group.size == 1
    outcomes = [mine] if alone else comm.all_gather_objects(_picklable(mine), group)
    if isinstance(mine, Exception):
        raise mine
    failed = [o for o in outcomes if isinstance(o, Exception)]
    if failed:
        raise failed[0]
    return outcomes


def _picklable(outcome: Any) -> Any:
    if not isinstance(outcome, Exception):
        return outcome
    try:
        pickle.dumps(outcome)
        return outcome
    except Exception:
        return CheckpointError(f"{type(outcome).__name__}: {outcome}")


def save_shards(folder: Path, tensors: dict[str, Shards], group: MeshGroup | None) -> None:
    """Every rank of `group` writes its boxes of `tensors` under `folder` (one file per rank), rank 0 also
    DCP's `.metadata`; replicated boxes are written once. Collective: every rank calls it.

    DCP's own save coordinates the ranks with torch.distributed directly; these steps are its steps, with the
    plans and write results exchanged by `comm.all_gather_objects` and the global plan made on every rank (it is
    deterministic), so the checkpoint's traffic is in the ledger."""
    rank = group.rank if group is not None else 0
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=True, thread_count=1)
    planner = _SavePlanner(tensors)

    def local_plan() -> SavePlan:
        writer.reset()
        planner.set_up_planner({}, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    plans = _everywhere(local_plan, group)
    global_plans, metadata = planner.create_global_plan(plans)  # the same on every rank, errors included
    global_plans = writer.prepare_global_plan(global_plans)

    def write() -> list[Any]:
        written = writer.write_data(planner.finish_plan(global_plans[rank]), planner)
        written.wait()
        return written.value()

    results = _everywhere(write, group)
    _everywhere(lambda: writer.finish(metadata=metadata, results=results) if rank == 0 else None, group)


def load_shards(folder: Path, metadata: Metadata, tensors: dict[str, Shards], group: MeshGroup | None) -> None:
    """Fill the boxes of `tensors` from the checkpoint at `folder` (saved on any layout). The names and whole
    shapes must be in `metadata` (check with `saved_shapes`). Collective: every rank calls it.

    Each rank plans and reads its own boxes (a load needs nothing from the other ranks); the outcome is shared
    through `comm`, so a rank that fails stops every rank."""
    _everywhere(lambda: dcp.load({}, storage_reader=_Reader(folder, metadata), planner=_LoadPlanner(tensors),
                                 no_dist=True), group)
