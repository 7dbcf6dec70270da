"""Local launcher: run a function on N processes of this machine, each inside a gloo process group.

The ranks meet through a file store in a private temporary folder, so starting a job opens no network
rendezvous; gloo's own connections are pinned to the loopback interface (GLOO_SOCKET_IFNAME=lo on Linux,
unless the caller set it). Each rank's return value comes back through a file in that folder. A rank that
raises stops the job; a `ValueError` (bad input found on a rank) is raised again as a `ValueError` naming
the rank, anything else as `LaunchError`, both carrying the rank's message.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from orangetron.mesh import forget_meshes


class LaunchError(RuntimeError):
    """A launched rank failed; the message carries its rank and error."""


def _pin_gloo_to_loopback() -> None:
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _run_rank(rank: int, world_size: int, folder: str, fn: Callable[..., Any], args: Sequence[Any]) -> None:
    torch.set_num_threads(1)  # N ranks share this machine's cores
    _pin_gloo_to_loopback()
    outcome: tuple[str, Any]
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size)
        try:
            outcome = ("ok", fn(*args))
        finally:
            dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
        kind = "value_error" if isinstance(err, ValueError) else "error"
        outcome = (kind, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    with open(Path(folder) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)
    if outcome[0] != "ok":
        sys.exit(1)


def launch_local(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = ()) -> list[Any]:
    """Run `fn(*args)` on `world_size` local processes inside one gloo process group; results by rank.

    `fn` must be importable by name, and its arguments and results picklable.
    """
    with tempfile.TemporaryDirectory(prefix="orangetron-launch-") as folder:  # private: mode 0700
        context = torch_mp.start_processes(_run_rank, args=(world_size, folder, fn, tuple(args)),
                                           nprocs=world_size, join=False, start_method="spawn")
        try:
            while not context.join():
                pass
        except (torch_mp.ProcessExitedException, torch_mp.ProcessRaisedException):
            pass  # the rank's own report, read below, says more than the exit code
        outcomes = []
        for rank in range(world_size):
            report = Path(folder) / f"rank{rank}.pkl"
            outcomes.append(pickle.loads(report.read_bytes()) if report.exists() else ("error", "exited"))
    failures = [(rank, kind, body) for rank, (kind, body) in enumerate(outcomes) if kind != "ok"]
    if failures:
        rank, kind, body = min(failures, key=lambda f: f[1] != "value_error")  # bad input explains the rest
        first_line = body.splitlines()[0]
        if kind == "value_error":
            raise ValueError(f"rank {rank}: {first_line.split(': ', 1)[-1]}")
        raise LaunchError(f"rank {rank} failed: {body}")
    return [body for _, body in outcomes]


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
        forget_meshes()
