"""`ParallelMesh`: the process groups of a `Layout`, one per mesh dimension and per combined dimension.

Built on `torch.distributed.device_mesh`, so gloo (CPU) and NCCL (GPU) share one code path. The dense
mesh is (pp, dp, cp, tp), tp fastest; combined groups are flattened from it (dp_cp for sharding dense
optimizer state, tp_cp), and the expert groups unflatten dp_cp into (edp, ep), ep fastest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from orangetron.spec.layout import Coordinates, Layout, LayoutError

GROUP_NAMES = ("tp", "cp", "pp", "dp", "dp_cp", "tp_cp", "ep", "edp")


class MeshError(RuntimeError):
    """The mesh cannot be built in this process (no process group, or the wrong world size)."""


def check_runnable_layout(layout: Layout) -> None:
    """Refuse (LayoutError, one line) the layout fields the planner prices but the runtime does not build: a
    folded expert mesh, expert tensor parallelism. `TrainConfig` calls it before any rank starts."""
    if layout.expert_fold or layout.etp != 1:
        raise LayoutError(f"etp={layout.etp} expert_fold={layout.expert_fold}: the runtime shards experts with etp=1 "
                          "only and does not fold experts over their own mesh (the planner prices both)")


@dataclass(frozen=True)
class MeshGroup:
    """One process group as this rank sees it: its name, members and this rank's place among them."""

    name: str
    group: dist.ProcessGroup
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int  # this rank's index in `ranks`

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """Global rank of the member at `index` (taken modulo the size, for ring neighbours)."""
        return self.ranks[index % self.size]


def _mesh_group(mesh: DeviceMesh, name: str) -> MeshGroup:
    group = mesh.get_group(name)
    ranks = tuple(dist.get_process_group_ranks(group))
    return MeshGroup(name=name, group=group, ranks=ranks, rank=ranks.index(dist.get_rank()))


def _world_timeout(size: int) -> C10dBackend.Options | None:
    """device_mesh options that give a new group of `size` ranks the world group's timeout (`--timeout-s`).

    device_mesh builds new groups with torch's default timeout (30 minutes on gloo), so without them a rank
    hung in a tp or dp subgroup's collective kept its peers waiting half an hour. None where nothing is needed:
    a group of one rank never waits, and one over the whole world is the world group itself (naming it would
    make device_mesh build a copy). Gloo only: NCCL groups would take NCCL's own options type.
    """
    if dist.get_backend() != "gloo" or not 1 < size < dist.get_world_size():
        return None
    world = dist.distributed_c10d._get_default_group()
    return C10dBackend.Options("gloo", world._get_backend(torch.device("cpu")).options._timeout)


def _world_timeouts(names: Sequence[str], sizes: Sequence[int]) -> dict[str, C10dBackend.Options]:
    """`_world_timeout` for each named mesh dimension that needs it, as device_mesh's `backend_override`."""
    return {name: opts for name, size in zip(names, sizes, strict=True) if (opts := _world_timeout(size))}


class ParallelMesh:
    """Process groups for every dimension of `layout` on `device_type` ("cpu" or "cuda", the run's `--device`:
    a mixed backend carries both, so the backend's name cannot say which); build it inside an initialized
    process group (on cuda, after binding this rank's GPU)."""

    def __init__(self, layout: Layout, device_type: str = "cpu") -> None:
        if device_type not in ("cpu", "cuda"):
            raise MeshError(f"device_type={device_type!r}: cpu or cuda")
        if not dist.is_initialized():
            raise MeshError("torch.distributed is not initialized; call init_process_group first")
        check_runnable_layout(layout)
        if dist.get_world_size() != layout.world_size:
            raise MeshError(
                f"world size {dist.get_world_size()} does not match layout {layout} "
                f"(tp*cp*pp*dp={layout.world_size})"
            )
        self.layout = layout
        self.device_type = device_type
        self.world = dist.group.WORLD  # the process group this mesh was built in
        self.rank = dist.get_rank()
        self.coords: Coordinates = layout.coordinates(self.rank)
        dims = ("pp", "dp", "cp", "tp")
        dense = init_device_mesh(device_type, layout.mesh_shape(), mesh_dim_names=dims,
                                 backend_override=_world_timeouts(dims, layout.mesh_shape()))
        # Flatten/unflatten are private in torch.distributed today; torchtitan builds its meshes the same way.
        dp_cp = dense["dp", "cp"]._flatten("dp_cp", _world_timeout(layout.dp * layout.cp))
        tp_cp = dense["cp", "tp"]._flatten("tp_cp", _world_timeout(layout.cp * layout.tp))
        expert_sizes = (layout.edp, layout.ep)
        expert = dp_cp._unflatten(0, expert_sizes, ("edp", "ep"), _world_timeouts(("edp", "ep"), expert_sizes))
        sources = {"tp": dense, "cp": dense, "pp": dense, "dp": dense, "dp_cp": dp_cp, "tp_cp": tp_cp,
                   "ep": expert, "edp": expert}
        self.groups = {name: _mesh_group(source, name) for name, source in sources.items()}
        self._dense = dense
        self._pipeline_ends: tuple[MeshGroup | None] | None = None  # built by `pipeline_ends` on first use
        self._check_against_layout()

    def _check_against_layout(self) -> None:
        # The device mesh and Layout.coordinates must agree on who is where, or ledgers mislabel bytes.
        c = self.coords
        expected = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp, "dp_cp": c.dp_cp, "ep": c.ep, "edp": c.edp,
                    "tp_cp": c.cp * self.layout.tp + c.tp}
        for name, index in expected.items():
            if self.groups[name].rank != index:
                found = self.groups[name].rank
                raise MeshError(f"{name}: device mesh puts rank {self.rank} at index {found}, layout at {index}")

    def __getitem__(self, name: str) -> MeshGroup:
        if name not in self.groups:
            raise KeyError(f"unknown mesh dimension {name!r}; known: {', '.join(GROUP_NAMES)}")
        return self.groups[name]

    def size(self, name: str) -> int:
        return self[name].size

    def split_cp(self, ulysses: int) -> tuple[MeshGroup, MeshGroup]:
        """(cp_ring, cp_ulysses): the cp group as ring x Ulysses, Ulysses fastest (consecutive cp ranks).

        Builds the process groups on first use for this `ulysses` degree; every rank must call it.
        """
        cp = self.layout.cp
        if ulysses < 1 or cp % ulysses:
            raise MeshError(f"ulysses_degree={ulysses}: must divide cp={cp}")
        names = ("cp_ring", "cp_ulysses")
        key = f"{names[1]}/{ulysses}"
        if key not in self.groups:
            sizes = (cp // ulysses, ulysses)
            split = self._dense["cp"]._unflatten(0, sizes, names, _world_timeouts(names, sizes))
            self.groups[f"{names[0]}/{ulysses}"] = _mesh_group(split, names[0])
            self.groups[key] = _mesh_group(split, names[1])
        return self.groups[f"{names[0]}/{ulysses}"], self.groups[key]

    def pipeline_ends(self) -> MeshGroup | None:
        """The first and the last pipeline rank with this rank's dp, cp and tp coordinates, named "pp" (None on a
        stage in between): a tied model's two embedding copies sum their gradients over it.

        For pp = 2 it is the pp group itself; otherwise one group per (dp, cp, tp) coordinate, built on first
        use by every rank in the same order, as torch.distributed.new_group requires: every rank must call it.
        """
        if self.layout.pp <= 2:
            return self["pp"] if self.layout.pp == 2 else None
        if self._pipeline_ends is None:
            ranks = self._dense.mesh  # [pp, dp, cp, tp] global ranks
            timeout = _world_timeout(2)
            mine = None
            for pair in torch.stack([ranks[0], ranks[-1]], dim=-1).reshape(-1, 2).tolist():
                group = dist.new_group(pair, timeout=timeout._timeout if timeout else None)
                if self.rank in pair:
                    mine = MeshGroup("pp", group, tuple(pair), pair.index(self.rank))
            self._pipeline_ends = (mine,)
        return self._pipeline_ends[0]

    def device(self) -> torch.device:
        """The device every tensor a collective of this mesh touches lives on (this rank's bound GPU on cuda)."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        return f"ParallelMesh({self.layout}, rank={self.rank})"


# Each mesh with the world group it was built in. The group object itself is kept (not its id, which
# Python may hand to a new group once the old one is destroyed), so a cached mesh is reused only while
# its world is the current one. Process-wide because building a mesh creates process groups, a collective
# step every rank of the process's world takes once; one entry per layout and device, dropped with its world or by
# `forget_meshes()`.
_meshes: dict[tuple[Layout, str], tuple[dist.ProcessGroup, ParallelMesh]] = {}


def forget_meshes() -> None:
    """Drop cached meshes (call after destroying the process group they were built in)."""
    _meshes.clear()


def init_mesh(layout: Layout, device_type: str = "cpu") -> ParallelMesh:
    """The `ParallelMesh` of `layout` on `device_type` for the current process group (built once, then reused).

    A mesh cached under an earlier process group (destroyed and initialized again since) is rebuilt.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    for stale in [key for key, (built_in, _) in _meshes.items() if built_in is not world]:
        del _meshes[stale]  # its groups died with their world; never hand them out again
    key = (layout, device_type)
    if key not in _meshes:
        _meshes[key] = (world, ParallelMesh(layout, device_type))
    return _meshes[key][1]
