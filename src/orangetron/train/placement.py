"""Where a run's ranks compute: the device flag's default and rules, the process-group backend, how local ranks
start, and the device each rank binds.

On `cpu` every rank joins a plain gloo group, as the CPU wheel (no NCCL) allows. On `cuda` rank r of a machine
binds `cuda:r` (torchrun's LOCAL_RANK) and joins with `device_id`, on a mixed backend: NCCL carries the device
tensors, gloo the host bookkeeping (`comm.host_tensor`). Local CUDA ranks start from a fork server or by spawn,
never by forking a process that may have touched CUDA. torch is imported on use: `TrainConfig` checks the rules
here without making the CLI's `--help` import torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DEVICES = ("cpu", "cuda")
CUDA_BACKEND = "cpu:gloo,cuda:nccl"  # device tensors over NCCL, host tensors over gloo


class PlacementError(ValueError):
    """A device the run cannot use here; the message names the flag and the fix."""


def default_device() -> str:
    """`cuda` when torch sees a CUDA GPU, else `cpu`."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, local_ranks: int) -> None:
    """Refuse, in one line, a device name outside DEVICES, `cuda` without a GPU, or more local ranks than GPUs."""
    if device not in DEVICES:
        raise PlacementError(f"device={device!r} (--device): choose one of {', '.join(DEVICES)}")
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise PlacementError("device='cuda' (--device): torch sees no CUDA GPU on this machine "
                             "(torch.cuda.is_available() is False); use --device cpu")
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise PlacementError(f"device='cuda' (--device): the layout needs {local_ranks} ranks on this machine, "
                             f"one per GPU, and torch sees {gpus} GPU(s); use a smaller layout or --device cpu")


def local_ranks(world_size: int) -> int:
    """Ranks this machine runs: torchrun's LOCAL_WORLD_SIZE, else the whole layout (the local launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def backend_for(device: str) -> str:
    """The process-group backend of ranks on `device`: gloo on cpu, NCCL with a gloo half on cuda."""
    return CUDA_BACKEND if device == "cuda" else "gloo"


def start_method_for(device: str, platform: str = sys.platform) -> str:
    """How local ranks start: fork on Linux CPU runs (fast, torch already imported); a fork server elsewhere
    and for every CUDA run, since a child forked after CUDA was initialised cannot use it."""
    return "fork" if device == "cpu" and platform.startswith("linux") else "forkserver"


def bind(device: str, local_rank: int) -> Any:
    """The torch.device this rank computes on; on cuda it also becomes the current device (`cuda:local_rank`)."""
    import torch

    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


@contextmanager
def deterministic_mode(enabled: bool, device: str) -> Iterator[None]:
    """With `enabled`: torch's deterministic algorithms for the block (an op without one raises, naming itself),
    and on cuda the cuBLAS workspace setting that makes its GEMMs repeatable (set before any rank's first
    cuBLAS call, unless the caller set it). The previous setting comes back afterwards."""
    if not enabled:
        yield
        return
    import torch

    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def init_options(device: str, local_rank: int) -> dict[str, Any]:
    """`init_process_group` keywords for a rank on `device`: the backend, and on cuda the bound `device_id`
    (NCCL then connects eagerly to the right GPU)."""
    if device != "cuda":
        return {"backend": "gloo"}
    return {"backend": CUDA_BACKEND, "device_id": bind(device, local_rank)}
