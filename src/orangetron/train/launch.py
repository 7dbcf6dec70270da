"""Local launcher: run a function on N processes of this machine with torch's elastic launcher.

The rendezvous listens on 127.0.0.1 unless the caller names another address, so a training run never
opens a port to the network by default. Each process joins a gloo process group (NCCL when every rank
has a GPU) before the function runs, and the function's return values come back in rank order.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


class LaunchError(RuntimeError):
    """A launched rank failed; the message carries its rank and error."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else "gloo"


def _run_rank(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    torch.set_num_threads(1)  # N ranks share this machine's cores
    dist.init_process_group(_backend())
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch_local(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), host: str = "127.0.0.1") -> list:
    """Run `fn(*args)` on `world_size` local processes inside a process group; return results by rank.

    `fn` must be importable by name. A failing rank raises `LaunchError` with that rank's error.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # A failed rank is reported once, by the LaunchError below, not by the agent's own error log.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"orangetron-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"{host}:{_free_port(host)}", max_restarts=0, local_addr=host,
        start_method="spawn",
    )
    try:
        results = elastic_launch(config, _run_rank)(fn, args)
    except ChildFailedError as err:
        rank, failure = min(err.failures.items())
        message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
        raise LaunchError(f"rank {rank} failed: {message or f'exit code {failure.exitcode}'}") from None
    return [results[rank] for rank in range(world_size)]


@contextmanager
def process_group() -> Iterator[None]:
    """Use the current process group, or make a private one-rank gloo group for the block."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
