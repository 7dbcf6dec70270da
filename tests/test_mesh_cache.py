"""The mesh cache never hands out a mesh of a destroyed process group."""

import pytest
import torch.distributed as dist

from orangetron import mesh as mesh_module
from orangetron.mesh import MeshError, init_mesh
from orangetron.spec.layout import Layout


def start_group(folder, name: str) -> None:
    # One process, a file store in a private folder: no socket listens.
    dist.init_process_group("gloo", init_method=f"file://{folder / name}", rank=0, world_size=1)


def test_mesh_is_rebuilt_after_the_process_group_is_replaced(tmp_path, monkeypatch):
    # Python may give a new group the id of a destroyed one; make that certain, so a cache keyed by
    # id(dist.group.WORLD) would hand back the dead mesh.
    monkeypatch.setattr(mesh_module, "id", lambda obj: 0, raising=False)
    assert not dist.is_initialized()
    start_group(tmp_path, "first")
    try:
        first = init_mesh(Layout())
        assert init_mesh(Layout()) is first  # reused while its group lives
        assert first.world is dist.group.WORLD
        dist.destroy_process_group()
        with pytest.raises(MeshError, match="not initialized"):
            init_mesh(Layout())  # no group: no mesh, cached or not
        start_group(tmp_path, "second")
        second = init_mesh(Layout())
        assert second is not first
        assert second.world is dist.group.WORLD
        assert second["dp"].group is not first["dp"].group
        assert dist.get_process_group_ranks(second["dp"].group) == [0]  # a live group of the new world
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        mesh_module.forget_meshes()
