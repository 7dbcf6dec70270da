"""The multi-rank harness: results in rank order, errors with rank and traceback, hangs become failures."""

import contextlib
import os
import time
from pathlib import Path

import pytest

from orangetron.testing import DistributedError, run_distributed


def rank_and_pid(scale):
    import torch.distributed as dist

    return dist.get_rank() * scale, dist.get_world_size(), os.getpid()


def fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from a worker")
    return "fine"


def hang_on_rank_zero():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(3600)
    return "done"


def test_results_come_back_in_rank_order_and_workers_are_reused():
    first = run_distributed(rank_and_pid, 2, args=(10,))
    assert [r[:2] for r in first] == [(0, 2), (10, 2)]
    second = run_distributed(rank_and_pid, 2, kwargs={"scale": 1})
    assert [r[2] for r in second] == [r[2] for r in first]  # same processes: launch cost paid once


def test_shutting_down_one_world_size_keeps_the_others():
    from orangetron.testing import shutdown_workers

    ones, twos = run_distributed(rank_and_pid, 1, args=(1,)), run_distributed(rank_and_pid, 2, args=(1,))
    shutdown_workers(2)
    assert [r[2] for r in run_distributed(rank_and_pid, 1, args=(1,))] == [r[2] for r in ones]  # kept
    assert not {r[2] for r in run_distributed(rank_and_pid, 2, args=(1,))} & {r[2] for r in twos}  # new ranks


def test_exception_names_rank_and_traceback_then_recovers():
    with pytest.raises(DistributedError) as info:
        run_distributed(fail_on_rank_one, 2)
    message = str(info.value)
    assert "rank 1:" in message and "ValueError: boom from a worker" in message
    assert "fail_on_rank_one" in message  # the traceback, not just the message
    assert [r[0] for r in run_distributed(rank_and_pid, 2, args=(1,))] == [0, 1]


def test_hung_rank_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"ranks \[0\] did not answer within 2s"):
        run_distributed(hang_on_rank_zero, 2, timeout=2)
    assert time.monotonic() - start < 30
    assert [r[0] for r in run_distributed(rank_and_pid, 2, args=(1,))] == [0, 1]


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size=0"):
        run_distributed(rank_and_pid, 0)


def fail_while_peer_waits():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that will never come
    return "unreachable"


def test_failure_while_a_peer_is_blocked_names_both():
    with pytest.raises(DistributedError) as info:
        run_distributed(fail_while_peer_waits, 2, timeout=60)
    message = str(info.value)
    assert "RuntimeError: rank 1 gives up" in message
    assert "ranks [0] did not finish after another rank failed" in message


def die_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    return "alive"


def test_a_dying_rank_is_reported_and_replaced():
    with pytest.raises(DistributedError, match=r"died \(ranks \[1\]\)"):
        run_distributed(die_on_rank_one, 2, timeout=60)
    assert [r[0] for r in run_distributed(rank_and_pid, 2, args=(1,))] == [0, 1]


def gloo_groups_and_threads(layout_fields: dict | None) -> tuple[int, int]:
    """(process groups, gloo transport threads) of this worker, after building the mesh of `layout_fields`."""
    import torch.distributed as dist

    from orangetron.mesh import init_mesh
    from orangetron.spec.layout import Layout

    if layout_fields is not None:
        init_mesh(Layout(**layout_fields))
    names = []
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            names.append(Path(f"/proc/self/task/{thread}/comm").read_text().strip())
    return len(dist.distributed_c10d._world.pg_map), names.count("gloo_tcp_loop")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are counted from /proc")
def test_a_task_leaves_the_worker_with_the_world_group_alone():
    """Each gloo group keeps a thread that wakes every few milliseconds: a pool that kept the meshes of every
    task held hundreds, idle or not, and slowed the whole suite. The next task finds only the world group."""
    fresh = run_distributed(gloo_groups_and_threads, 4, args=(None,))
    built = run_distributed(gloo_groups_and_threads, 4, args=({"tp": 2, "cp": 2},))
    after = run_distributed(gloo_groups_and_threads, 4, args=(None,))
    assert all(groups > 1 and threads > fresh[0][1] for groups, threads in built)
    assert after == fresh and fresh[0][0] == 1


def raise_with_a_collective_in_flight() -> None:
    """Rank 0 starts a sum over a subgroup and raises; rank 1 waits in the world group for a rank that left."""
    import torch
    import torch.distributed as dist

    from orangetron import comm
    from orangetron.mesh import MeshGroup

    world = comm.world_group()
    pair = MeshGroup("pair", dist.new_group([0, 1]), (0, 1), world.rank)  # a group of its own, not the world's
    if world.rank == 0:
        comm.all_reduce_start(torch.ones(2), pair)
        raise ValueError("boom with a sum in flight")
    comm.all_reduce(torch.ones(2), world)


def test_a_rank_that_fails_with_a_collective_in_flight_still_reports_its_traceback():
    """A failed rank replies before any clean-up: shutting its groups down would wait for a collective its
    peers never join, and the caller would hear only that no rank answered."""
    with pytest.raises(DistributedError, match="boom with a sum in flight") as failure:
        run_distributed(raise_with_a_collective_in_flight, 2, timeout=60)
    assert "rank 0:" in str(failure.value)
