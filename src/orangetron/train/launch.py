"""Local launcher: run a function on N processes of this machine, each inside a process group (gloo on CPU;
on CUDA rank r binds `cuda:r` and joins NCCL with a gloo half, `train.placement`).

On CPU the ranks are forked from this process, which has already imported torch and orangetron, so starting
them costs milliseconds rather than one torch import per rank; where fork is unsafe (macOS, and every CUDA run:
a child forked after CUDA was initialised cannot use it) a fork server with them preloaded stands in. The
ranks meet through a file store in a private temporary folder, so starting a job opens no network rendezvous;
gloo's own connections are pinned to the loopback interface (GLOO_SOCKET_IFNAME=lo on Linux, unless the caller
set it). Each rank's return value comes back through a file in that folder.

Failures end every rank, never a hang. This process watches its ranks; once one fails, the others get
`faults.FAILURE_GRACE_S` to report and are then killed. A rank that raises a `ValueError` (bad input found
on a rank) is raised again as that error naming the rank; a rank that dies is named with its signal or exit
code and what it was doing (`rank 2 died (signal 9) during step 5 (backward)`); a rank that hangs makes its
peers' collectives time out after `timeout_s`, and is named as the one still running
(`rank 1 stopped responding during step 3 (backward)`); an OSError (a full disk, a folder made read-only) is a
`LaunchError` with its message, anything else one with the rank's traceback.

Signals: the ranks run in process groups of their own, as torchrun's workers do, so a terminal's Ctrl-C reaches
this process alone, and a rank whose parent dies gets SIGTERM (Linux). With `relay_signals` (the trainer), each
SIGINT or SIGTERM this process receives while the ranks run is passed on to every rank once
(`stopping.relay_to`), where it only asks for a stop, and the ranks stop after the step they agree on; they are
not killed for it: this process keeps waiting, and a rank that fails meanwhile still ends every rank. A second
SIGINT aborts at once (KeyboardInterrupt here, every rank killed). Without it a signal ends every rank at once.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orangetron.mesh import forget_meshes
from orangetron.train import faults, placement, stopping
from orangetron.train.faults import DEFAULT_TIMEOUT_S

_PRELOAD = ["torch", "torch.distributed", "orangetron.train.trainer"]


class LaunchError(RuntimeError):
    """A launched rank failed, died or hung; the message carries its rank and what went wrong."""


def _pin_gloo_to_loopback() -> None:
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _start_context(start_method: str | None, device: str = "cpu") -> mp.context.BaseContext:
    # Linux CPU runs: fork this warm process (torch's CPU state survives a fork into a rank that sets its own
    # thread count, as DataLoader workers do). Elsewhere fork is unsafe; a fork server imports torch once instead.
    method = start_method or placement.start_method_for(device)
    if device == "cuda" and method == "fork":
        raise ValueError("start_method='fork': CUDA ranks start by forkserver or spawn; a child forked after "
                         "CUDA was initialised cannot use it")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@contextmanager
def _forkable(ctx: mp.context.BaseContext) -> Iterator[None]:
    """Fork with no garbage to collect in the child: a process group this process let go of (its objects in
    a reference cycle) would otherwise be destroyed by a rank's garbage collector, whose join of the group's
    threads, long gone in the child, never returns. Collect it here, and freeze what is left."""
    if ctx.get_start_method() != "fork":
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _own_process_group() -> None:
    """Leave the launcher's process group, so that signals reach this rank through the launcher only (once),
    and ask for SIGTERM when the parent (the launcher, or its fork server) dies: a terminal's hangup, which
    ends the launcher, no longer reaches this rank itself."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the request took hold
            os.kill(os.getpid(), signal.SIGTERM)


def _run_rank(rank: int, world_size: int, folder: str, fn: Callable[..., Any], args: Sequence[Any],
              timeout_s: float, cells: Any, relay_signals: bool, device: str) -> None:
    # The handlers first, so that no signal the launcher passes on comes before them.
    with stopping.stop_on_signals() if relay_signals else nullcontext():
        _own_process_group()
        _run_rank_in_group(rank, world_size, folder, fn, args, timeout_s, cells, device)


def _run_rank_in_group(rank: int, world_size: int, folder: str, fn: Callable[..., Any], args: Sequence[Any],
                       timeout_s: float, cells: Any, device: str) -> None:
    torch.set_num_threads(1)  # N ranks share this machine's cores
    _pin_gloo_to_loopback()
    faults.attach(faults.SharedBoard(cells, rank))
    outcome: tuple[str, Any]
    try:
        faults.enter("joining the process group")
        dist.init_process_group(init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **placement.init_options(device, rank))
        outcome = ("ok", fn(*args))
        faults.enter("finishing")
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
        outcome = _failure(err)
    with open(Path(folder) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)
    if outcome[0] != "ok":
        sys.exit(1)  # without tearing the group down: a peer may be gone, and this process ends anyway


def _failure(err: BaseException) -> tuple[str, Any]:
    message = f"{type(err).__name__}: {err}"
    if isinstance(err, ValueError):
        return ("value_error", (type(err), str(err)))
    if faults.is_collective_failure(err):
        return ("collective", message)
    if isinstance(err, OSError):  # the machine's, not the code's: a full disk, a folder made read-only
        return ("error", message)
    return ("error", f"{message}\n{traceback.format_exc()}")


@dataclass
class _Ending:
    exit_codes: list[int | None]  # None: still running when the others had failed (then killed)
    posts: list[tuple[int, int]]  # each rank's last (step, phase)


def _watch(procs: list[Any], cells: Any) -> _Ending:
    """Wait until every rank exits, or until FAILURE_GRACE_S after the first one fails; kill the rest."""
    deadline = None
    running = list(procs)
    while running:
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        wait([p.sentinel for p in running], timeout=timeout)
        running = [p for p in procs if p.exitcode is None]
        if deadline is None and any(p.exitcode not in (None, 0) for p in procs):
            deadline = time.monotonic() + faults.FAILURE_GRACE_S
        if deadline is not None and time.monotonic() >= deadline:
            break
    exit_codes = [p.exitcode for p in procs]
    posts = [(cells[2 * r], cells[2 * r + 1]) for r in range(len(procs))]
    return _Ending(exit_codes, posts)


def _kill(procs: list[Any]) -> None:
    """End the started ones (a Ctrl-C may come before the last starts: killing one never started raised over it)."""
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.exitcode is None:
            p.kill()
    for p in started:
        p.join()


def launch_local(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str | None = None,
                 relay_signals: bool = False, device: str = "cpu") -> list[Any]:
    """Run `fn(*args)` on `world_size` local processes inside one process group; results by rank.

    `device`: "cpu" (gloo) or "cuda" (rank r bound to `cuda:r`, `placement.init_options`).
    `fn` must be importable by name, and its arguments and results picklable. `timeout_s` bounds every
    collective (and the rendezvous): a rank that stops responding is named after about that long.
    `start_method` overrides how ranks start ("fork", "forkserver" or "spawn"; default: the fastest safe one).
    Raises ValueError (a rank's bad input) or LaunchError (a rank that failed, died or hung); either way no
    rank outlives the call. `relay_signals`: pass SIGINT and SIGTERM on to every rank, where they only ask for a
    stop (`train.stopping`), and keep waiting, for an `fn` that stops by itself as the trainer does after a
    step; a second SIGINT then raises KeyboardInterrupt here. Otherwise a signal ends every rank at once.
    """
    ctx = _start_context(start_method, device)
    cells = ctx.RawArray("q", 2 * world_size)  # (step, phase) per rank, see faults.SharedBoard
    with tempfile.TemporaryDirectory(prefix="orangetron-launch-") as folder:  # private: mode 0700
        procs = [ctx.Process(target=_run_rank, daemon=True, name=f"orangetron-rank{rank}",
                             args=(rank, world_size, folder, fn, tuple(args), timeout_s, cells, relay_signals,
                                   device))
                 for rank in range(world_size)]
        try:
            with _forkable(ctx):
                for p in procs:
                    p.start()
            with stopping.relay_to([p.pid for p in procs]) if relay_signals else nullcontext():
                ending = _watch(procs, cells)
        finally:
            _kill(procs)
        outcomes = []
        for rank in range(world_size):
            report = Path(folder) / f"rank{rank}.pkl"
            outcomes.append(pickle.loads(report.read_bytes()) if report.exists() else None)
    return _results(outcomes, ending, timeout_s)


def _results(outcomes: list[tuple[str, Any] | None], ending: _Ending, timeout_s: float) -> list[Any]:
    """Every rank's result, or the error that explains the failure best: bad input, a death, a hang, an error."""
    if all(o is not None and o[0] == "ok" for o in outcomes):
        return [o[1] for o in outcomes]  # type: ignore[index]
    value_errors = [(r, o[1]) for r, o in enumerate(outcomes) if o is not None and o[0] == "value_error"]
    if value_errors:
        rank, (cls, message) = value_errors[0]
        raise _rebuild(cls, f"rank {rank}: {message}")
    died = [r for r, (o, code) in enumerate(zip(outcomes, ending.exit_codes, strict=True))
            if o is None and code is not None]
    if died:
        raise LaunchError("; ".join(f"rank {r} {_death(ending.exit_codes[r])} during "
                                    f"{faults.doing(*ending.posts[r])}" for r in died))
    errors = [(r, o[1]) for r, o in enumerate(outcomes) if o is not None and o[0] == "error"]
    if errors:
        rank, body = errors[0]
        raise LaunchError(f"rank {rank} failed: {body}")
    hung = [r for r, code in enumerate(ending.exit_codes) if code is None]
    waiting = ", ".join(str(r) for r, o in enumerate(outcomes) if o is not None and o[0] == "collective")
    if not hung:
        raise LaunchError(f"ranks {waiting}: a collective failed on every rank: {outcomes[0][1]}")  # type: ignore[index]
    named = "; ".join(f"rank {r} stopped responding during {faults.doing(*ending.posts[r])}" for r in hung)
    raise LaunchError(f"{named} (rank(s) {waiting} gave up waiting for it after {timeout_s:g} s, --timeout-s)")


def _death(code: int | None) -> str:
    return f"died (signal {-code})" if code is not None and code < 0 else f"exited (code {code})"


def _rebuild(cls: type, message: str) -> ValueError:
    try:
        err = cls(message)
    except Exception:  # noqa: BLE001 - a ValueError subclass with another constructor
        return ValueError(message)
    return err if isinstance(err, ValueError) else ValueError(message)


@contextmanager
def process_group(device: str = "cpu") -> Iterator[None]:
    """Use the current process group, or make a private one-rank group for the block (gloo on cpu; on cuda
    bound to torchrun's LOCAL_RANK GPU, else the first)."""
    if dist.is_initialized():
        yield
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1,
                            **placement.init_options(device, local_rank))
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()
