"""Placement on CPU: the --device default and refusals, the backend and start method each device gets, the
mesh's device taken from the run's device, and the device recorded and changeable on resume."""

from __future__ import annotations

import dataclasses
import os
import tomllib

import pytest
import torch

from orangetron.cli import main
from orangetron.mesh import MeshError, ParallelMesh, init_mesh
from orangetron.spec.layout import Layout
from orangetron.train import launch, placement
from orangetron.train.config import TrainConfig, TrainConfigError
from orangetron.train.run_folder import check_resume


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(("count", "expected"), [(0, "cpu"), (1, "cuda"), (8, "cuda")])
def test_the_default_device_is_cuda_when_torch_sees_a_gpu(monkeypatch: pytest.MonkeyPatch, count: int,
                                                          expected: str) -> None:
    _gpus(monkeypatch, count)
    assert placement.default_device() == expected
    assert TrainConfig(model="tiny", steps=2).device == expected  # resolved on construction


def test_cuda_without_a_gpu_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _gpus(monkeypatch, 0)
    with pytest.raises(TrainConfigError, match=r"device='cuda' \(--device\): torch sees no CUDA GPU"):
        TrainConfig(model="tiny", device="cuda")
    assert main(["train", "--model", "tiny", "--steps", "2", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch sees no CUDA GPU" in err and "--device cpu" in err


def test_more_local_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    TrainConfig(model="tiny", device="cuda", dp=2, batch_size=8)  # one rank per GPU: fits
    with pytest.raises(TrainConfigError, match=r"needs 4 ranks on this machine, one per GPU, and torch sees 2"):
        TrainConfig(model="tiny", device="cuda", dp=4, batch_size=8)
    # Under torchrun only this machine's ranks count: 8 ranks over 4 nodes of 2 fit 2 GPUs per node.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    TrainConfig(model="tiny", device="cuda", dp=8, batch_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(TrainConfigError, match="needs 3 ranks"):
        TrainConfig(model="tiny", device="cuda", dp=8, batch_size=8)


def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(TrainConfigError, match=r"device='tpu' \(--device\): choose one of cpu, cuda"):
        TrainConfig(model="tiny", device="tpu")


def test_each_device_gets_its_backend_and_start_method() -> None:
    assert placement.backend_for("cpu") == "gloo"
    assert placement.backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert placement.start_method_for("cpu", "linux") == "fork"
    assert placement.start_method_for("cpu", "darwin") == "forkserver"
    assert placement.start_method_for("cuda", "linux") == "forkserver"  # never fork after CUDA may be initialised
    assert launch._start_context(None, "cuda").get_start_method() == "forkserver"
    assert launch._start_context("spawn", "cuda").get_start_method() == "spawn"
    with pytest.raises(ValueError, match="CUDA ranks start by forkserver or spawn"):
        launch._start_context("fork", "cuda")
    assert placement.init_options("cpu", 3) == {"backend": "gloo"}


def test_cuda_ranks_bind_their_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    options = placement.init_options("cuda", 3)
    assert options == {"backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", 3)}
    assert bound == [3]
    assert placement.bind("cpu", 3) == torch.device("cpu") and bound == [3]


def test_the_mesh_device_comes_from_the_run_not_the_backend() -> None:
    with launch.process_group("cpu"):
        mesh = init_mesh(Layout(), "cpu")
        assert mesh.device_type == "cpu" and mesh.device() == torch.device("cpu")
        with pytest.raises(MeshError, match="device_type='gpu'"):
            ParallelMesh(Layout(), "gpu")


def test_the_device_is_recorded_and_may_change_on_resume(tmp_path) -> None:
    cfg = TrainConfig(model="tiny", steps=4, out=str(tmp_path), resume=True)
    assert cfg.options()["device"] == "cpu"
    check_resume(cfg, {**cfg.options(), "device": "cuda"})  # another device: allowed, as layout flags are
    with pytest.raises(TrainConfigError, match="seed=0"):
        check_resume(cfg, {**cfg.options(), "seed": 1})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deterministic_mode_holds_for_the_block_and_is_restored(monkeypatch: pytest.MonkeyPatch,
                                                                device: str) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with placement.deterministic_mode(True, device):
        assert torch.are_deterministic_algorithms_enabled()
        assert (os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8") == (device == "cuda")
    assert not torch.are_deterministic_algorithms_enabled()
    with placement.deterministic_mode(False, device):
        assert not torch.are_deterministic_algorithms_enabled()


def test_deterministic_reruns_are_bitwise_equal() -> None:
    from orangetron.train.trainer import train

    cfg = TrainConfig(model="tiny-moe", steps=3, seq_len=16, batch_size=4, warmup=0, corpus_bytes=20_000,
                      deterministic=True)
    first, second = train(cfg, progress=False), train(cfg, progress=False)
    assert first["deterministic"] and second["deterministic"]  # the run took the flag
    assert first["losses"] == second["losses"] and len(first["losses"]) == 3
    assert first["eval_loss"] == second["eval_loss"]
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
    plain = train(dataclasses.replace(cfg, deterministic=False), progress=False)
    assert plain["deterministic"] is False and plain["losses"] == first["losses"]  # same kernels on CPU


def test_a_plans_config_leaves_the_device_to_the_machine_that_trains(tmp_path) -> None:
    path = tmp_path / "plan.toml"
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--seq", "16", "--global-batch", "4", "--param-dtype",
                 "float32", "--emit-config", str(path)]) == 0
    options = tomllib.loads(path.read_text())
    assert "device" not in options and options["seq_len"] == 16  # a run's options, the device left out
