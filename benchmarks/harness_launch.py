"""Cost of running a function on N local gloo ranks: orangetron.testing vs torch.multiprocessing.spawn.

torch.multiprocessing.spawn starts N fresh interpreters per call, each importing torch and joining a new
process group; run_distributed forks its ranks from a warm fork server once and reuses them. Prints one
JSON line per (world size, measurement).

idle_pools: what idle worker pools cost the process that runs next. Pools of 2, 4 and 8 ranks each build the
meshes of every layout of their ranks, then sit idle while this process runs a fixed pure-Python loop;
ratio = the loop's time with no pool alive / with the idle pools (1.0: they cost nothing). Each gloo group
keeps a thread that wakes every few milliseconds, so pools that kept their tasks' groups slowed all else.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from orangetron import comm
from orangetron.mesh import init_mesh
from orangetron.spec.layout import Layout
from orangetron.testing import run_distributed, shutdown_workers


def one_all_reduce() -> float:
    group = init_mesh(Layout(dp=dist.get_world_size()))["dp"]
    return float(comm.all_reduce(torch.ones(4), group).sum())


def layouts(world_size: int) -> list[Layout]:
    """Every layout of `world_size` ranks over tp, cp, pp and dp, with ep 1 or 2 where it divides dp x cp."""
    out = []
    for tp, cp, pp, ep in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2)):
        dp, rest = divmod(world_size, tp * cp * pp)
        if not rest and dp and (dp * cp) % ep == 0:
            out.append(Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep))
    return out


def build_mesh(layout: Layout) -> None:
    init_mesh(layout)  # returns nothing: a mesh holds process groups, which cannot travel back to the caller


def busy_loop_s(n: int = 20_000_000) -> float:
    start, total = time.perf_counter(), 0
    for i in range(n):
        total += i & 7
    return time.perf_counter() - start


def idle_pools_line() -> str:
    shutdown_workers()
    alone = statistics.median(busy_loop_s() for _ in range(3))
    built = 0
    for world_size in (2, 4, 8):
        for layout in layouts(world_size):
            run_distributed(build_mesh, world_size, args=(layout,))
            built += 1
    beside = statistics.median(busy_loop_s() for _ in range(3))
    shutdown_workers()
    return json.dumps({"name": "harness_launch", "config": {"pools": [2, 4, 8], "meshes_built": built},
                       "metric": "idle_pools", "value": round(beside, 4), "unit": "s",
                       "baseline": round(alone, 4), "ratio": round(alone / beside, 2)})


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_spawn(world_size: int) -> float:
    start = time.perf_counter()
    torch_mp.spawn(_spawned_rank, args=(world_size, _free_port()), nprocs=world_size)
    return time.perf_counter() - start


def time_call(world_size: int) -> float:
    start = time.perf_counter()
    run_distributed(one_all_reduce, world_size)
    return time.perf_counter() - start


def line(world_size: int, metric: str, value: float, baseline: float) -> str:
    return json.dumps({
        "name": "harness_launch", "config": {"world_size": world_size, "backend": "gloo"}, "metric": metric,
        "value": round(value, 4), "unit": "s", "baseline": round(baseline, 4), "ratio": round(baseline / value, 2),
    })


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for world_size in (2, 4, 8):
        spawn_s = time_spawn(world_size)
        cold_s = time_call(world_size)  # starts (forks) the pool for this world size
        warm_s = statistics.median(time_call(world_size) for _ in range(5))
        print(line(world_size, "first_call_s_vs_torch_spawn", cold_s, spawn_s), flush=True)
        print(line(world_size, "reused_call_s_vs_torch_spawn", warm_s, spawn_s), flush=True)
    shutdown_workers()
    print(idle_pools_line(), flush=True)


if __name__ == "__main__":
    main()
