"""Run a function on N local gloo ranks and hand each rank's result back to the caller.

Starting ranks is the expensive part (each imports torch), so worker processes are started once per
world size and reused for every call: a test suite pays the launch cost a few times, not per check.
A rank that raises surfaces with its rank and traceback; a rank that hangs fails the call after
`timeout` seconds. Either way the workers of that world size are torn down, because a process group
that saw a failure cannot be trusted, and the next call starts fresh ones. Between calls a worker holds the
world group alone (`_release_groups`).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DistributedError", "run_distributed", "shutdown_workers"]

_STOP = None
_DEATH_GRACE_S = 5.0


class DistributedError(RuntimeError):
    """A rank raised, died or hung during `run_distributed`."""


def _worker_main(rank: int, world_size: int, store: str, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from orangetron import comm

    torch.set_num_threads(1)
    # A file store in a private folder: the ranks meet without any listening socket.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    gc.freeze()  # torch's own objects: the collections after each task need not walk them
    while (task := tasks.get()) is not _STOP:
        task_id, payload = task
        comm.reset_ledger()
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = (task_id, rank, True, pickle.dumps(fn(*args, **kwargs)))
            # Before the reply, so the next task starts with the world group alone. Not after a failure: a
            # group's shutdown waits for this rank's collectives in flight, which its peers may never join, and
            # the caller tears a pool that failed down anyway.
            _release_groups()
        except BaseException:  # noqa: BLE001 - everything goes back to the caller
            reply = (task_id, rank, False, f"rank {rank}:\n{traceback.format_exc()}")
        results.put(reply)
    dist.destroy_process_group()


def _release_groups() -> None:
    """Destroy every process group but the world's, the cached meshes' included. Each gloo group keeps a thread
    that wakes every few milliseconds; a worker that kept the groups of every layout a test suite builds held
    hundreds of them, and idle pools took over a core of two from the tests that ran."""
    import torch.distributed as dist

    from orangetron.mesh import forget_meshes

    forget_meshes()
    for group in list(dist.distributed_c10d._world.pg_map):  # no public list of the groups there are
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    gc.collect()  # meshes and their submeshes hold each other: only a collection frees the groups' threads


def _context() -> mp.context.BaseContext:
    # A fork server imports torch once and forks every rank from that warm process: launching 8 ranks
    # then costs milliseconds instead of 8 torch imports. Spawn is the fallback where it is missing.
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "orangetron.comm", "orangetron.mesh"])
    return ctx


class _WorkerPool:
    """`world_size` processes that share one gloo process group and take tasks in lockstep."""

    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.folder = tempfile.mkdtemp(prefix="orangetron-ranks-")
        store = os.path.join(self.folder, "store")
        self.procs = [
            ctx.Process(target=_worker_main, args=(r, world_size, store, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._next_task = 0

    def run(self, payload: bytes, timeout: float) -> list[Any]:
        task_id, self._next_task = self._next_task, self._next_task + 1
        for q in self.tasks:
            q.put((task_id, payload))
        replies: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            if any(not ok for ok, _ in replies.values()):
                # One rank failed: give its peers a moment to fail too, then stop waiting.
                deadline = min(deadline, time.monotonic() + _DEATH_GRACE_S)
            try:
                tid, rank, ok, body = self.results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline or self._dead_ranks():
                    break
                continue
            if tid == task_id:
                replies[rank] = (ok, body)
        return self._collect(replies, timeout)

    def _dead_ranks(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if not p.is_alive()]

    def _collect(self, replies: dict[int, tuple[bool, Any]], timeout: float) -> list[Any]:
        errors = [body for ok, body in replies.values() if not ok]
        missing = [r for r in range(self.world_size) if r not in replies]
        if errors or missing:
            dead = self._dead_ranks()
            self.close(force=True)
            lines = errors[:]
            if missing:
                if dead:
                    why = f"died (ranks {dead})"
                elif errors:
                    why = "did not finish after another rank failed (blocked in a collective?)"
                else:
                    why = f"did not answer within {timeout:.0f}s"
                lines.append(f"ranks {missing} {why}")
            raise DistributedError("\n".join(lines))
        return [pickle.loads(replies[r][1]) for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(_STOP)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)


# Worker processes by world size, kept between calls so a test suite forks ranks a few times rather than per
# check; one pool per world size, replaced after a failure, stopped by `shutdown_workers()` and at exit.
_pools: dict[int, _WorkerPool] = {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` local gloo ranks; return the results in rank order.

    `fn` must be importable by name (a module-level function) and its arguments and results picklable.
    Raises `DistributedError` naming the rank and its traceback if any rank raises, dies or exceeds
    `timeout` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    pool = _pools.get(world_size)
    if pool is not None and pool._dead_ranks():
        pool.close(force=True)  # its surviving ranks cannot work without the dead one
        pool = None
    if pool is None:
        pool = _pools[world_size] = _WorkerPool(world_size)
    try:
        return pool.run(payload, timeout)
    except DistributedError:
        _pools.pop(world_size, None)
        raise


def shutdown_workers(world_size: int | None = None) -> None:
    """Stop the cached worker pool of `world_size` ranks, or every pool (called automatically at exit)."""
    sizes = list(_pools) if world_size is None else [world_size]
    for size in sizes:
        pool = _pools.pop(size, None)
        if pool is not None:
            pool.close()


atexit.register(shutdown_workers)
