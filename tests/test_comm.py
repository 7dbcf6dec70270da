"""Collectives on 2, 4 and 8 gloo ranks: values, gradients, and ledger bytes against closed forms.

All checks for one world size run in one launch; each rank asserts its own values and gradients and
returns its ledger, which the test compares with byte counts written out by hand.
"""

import pytest
import torch

from orangetron import comm
from orangetron.mesh import init_mesh
from orangetron.spec.layout import Layout, LayoutError
from orangetron.testing import run_distributed

F64 = 8  # bytes per float64 element


def value(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    """A tensor every rank can compute for any other rank."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def leaf(rank: int, *shape: int, salt: int = 0) -> torch.Tensor:
    return value(rank, *shape, salt=salt).requires_grad_()


def check_all_gather(g):
    x = leaf(g.rank, 2, 3)
    out = comm.all_gather(x, g, dim=1)
    torch.testing.assert_close(out, torch.cat([value(i, 2, 3) for i in range(g.size)], dim=1), rtol=0, atol=0)
    (out * value(g.rank, 2, 3 * g.size, salt=1)).sum().backward()
    expected = sum(value(i, 2, 3 * g.size, salt=1) for i in range(g.size))[:, 3 * g.rank:3 * g.rank + 3]
    torch.testing.assert_close(x.grad, expected)


def check_reduce_scatter(g):
    x = leaf(g.rank, 2 * g.size, 3)
    out = comm.reduce_scatter(x, g, dim=0)
    total = sum(value(i, 2 * g.size, 3) for i in range(g.size))
    torch.testing.assert_close(out, total[2 * g.rank:2 * g.rank + 2])
    (out * value(g.rank, 2, 3, salt=2)).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([value(i, 2, 3, salt=2) for i in range(g.size)]), rtol=0, atol=0)


def check_all_reduce_pair(g):
    x = leaf(g.rank, 4)
    out = comm.all_reduce(x, g)
    torch.testing.assert_close(out, sum(value(i, 4) for i in range(g.size)))
    (out * value(g.rank, 4, salt=3)).sum().backward()
    torch.testing.assert_close(x.grad, value(g.rank, 4, salt=3), rtol=0, atol=0)
    y = leaf(g.rank, 4)
    copied = comm.copy_to_group(y, g)
    torch.testing.assert_close(copied, y, rtol=0, atol=0)
    (copied * value(g.rank, 4, salt=4)).sum().backward()
    torch.testing.assert_close(y.grad, sum(value(i, 4, salt=4) for i in range(g.size)))


def rows(src: int, dst: int) -> int:
    return (src + 2 * dst) % 3  # includes zero-row transfers on purpose


def check_all_to_all(g):
    send = [rows(g.rank, j) for j in range(g.size)]
    recv = [rows(j, g.rank) for j in range(g.size)]
    # Row k of the block sent i->j holds (i, j, k) so every row is identifiable.
    blocks = [torch.tensor([[g.rank, j, k] for k in range(send[j])], dtype=torch.float64).reshape(-1, 3)
              for j in range(g.size)]
    x = torch.cat(blocks).requires_grad_()
    out = comm.all_to_all(x, g, send, recv)
    expected = torch.cat([torch.tensor([[i, g.rank, k] for k in range(recv[i])], dtype=torch.float64).reshape(-1, 3)
                          for i in range(g.size)])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (out * (out + 1)).sum().backward()  # d/dout = 2*out + 1, which travels back to the row's sender
    torch.testing.assert_close(x.grad, 2 * x.detach() + 1, rtol=0, atol=0)
    pending = comm.all_to_all_start(x.detach(), g, send, recv)  # the asynchronous form: same rows, same record
    torch.testing.assert_close(pending.wait(), expected, rtol=0, atol=0)
    return sum(send), sum(recv)


def check_broadcast(g):
    src = g.size - 1
    x = leaf(g.rank, 5)
    out = comm.broadcast(x, g, src=src)
    torch.testing.assert_close(out, value(src, 5), rtol=0, atol=0)
    (out * value(g.rank, 5, salt=5)).sum().backward()
    expected = sum(value(i, 5, salt=5) for i in range(g.size)) if g.rank == src else torch.zeros(5, dtype=torch.float64)
    torch.testing.assert_close(x.grad, expected)


def check_ring(g):
    ring = comm.RingExchange(g)
    with pytest.raises(RuntimeError, match="wait called before start"):
        ring.wait()
    x = leaf(g.rank, 3, 2)
    ring.start(x * 2)
    with pytest.raises(RuntimeError, match="start called twice"):
        ring.start(x)
    local = x.sum()  # compute that overlaps the transfer
    received = ring.wait()
    torch.testing.assert_close(received, 2 * value((g.rank - 1) % g.size, 3, 2), rtol=0, atol=0)
    (received * value(g.rank, 3, 2, salt=6)).sum().add(local).backward()
    expected = 2 * value((g.rank + 1) % g.size, 3, 2, salt=6) + 1
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def run_checks(layout: Layout, dims: list[str]):
    """Each collective once per dimension; returns this rank's ledger and all-to-all row counts."""
    mesh = init_mesh(layout)
    a2a_rows = {}
    for dim in dims:
        g = mesh[dim]
        check_all_gather(g)
        check_reduce_scatter(g)
        check_all_reduce_pair(g)
        a2a_rows[dim] = check_all_to_all(g)
        check_broadcast(g)
        check_ring(g)
    groups = {name: (mesh[name].ranks, mesh[name].rank) for name in mesh.groups}
    return [(r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in comm.ledger()], a2a_rows, groups


def expected_ledger(n: int, group_rank: int, dim: str, a2a: tuple[int, int], a2a_self: int):
    """Hand-written record list for one run of the checks over a group of n ranks."""
    full_ag, full_rs = 2 * 3 * n * F64, 2 * n * 3 * F64
    share = lambda full: full * (n - 1) // n
    sent_rows, recv_rows = a2a
    src = n - 1
    # Broadcast as a chain src, src+1, ... (mod n): all but the last member (src - 1) send, all but src receive.
    last = (src - 1) % n
    chain = (0 if group_rank == last else 5 * F64, 0 if group_rank == src else 5 * F64)
    records = [
        ("all_gather", dim, full_ag, share(full_ag), share(full_ag)),
        ("reduce_scatter", dim, full_ag, share(full_ag), share(full_ag)),  # backward of all-gather
        ("reduce_scatter", dim, full_rs, share(full_rs), share(full_rs)),
        ("all_gather", dim, full_rs, share(full_rs), share(full_rs)),  # backward of reduce-scatter
        ("all_reduce", dim, 4 * F64, 2 * share(4 * F64), 2 * share(4 * F64)),
        ("all_reduce", dim, 4 * F64, 2 * share(4 * F64), 2 * share(4 * F64)),  # backward of copy_to_group
        ("all_to_all", dim, sent_rows * 3 * F64, (sent_rows - a2a_self) * 3 * F64, (recv_rows - a2a_self) * 3 * F64),
        ("all_to_all", dim, recv_rows * 3 * F64, (recv_rows - a2a_self) * 3 * F64, (sent_rows - a2a_self) * 3 * F64),
        ("all_to_all", dim, sent_rows * 3 * F64, (sent_rows - a2a_self) * 3 * F64, (recv_rows - a2a_self) * 3 * F64),
        ("broadcast", dim, 5 * F64, *chain),
        ("reduce", dim, 5 * F64, *reversed(chain)),  # the mirror: partial sums flow down the chain to src
        ("send_recv", dim, 6 * F64, 6 * F64, 6 * F64),
        ("send_recv", dim, 6 * F64, 6 * F64, 6 * F64),  # backward of the ring shift
    ]
    return records


CASES = [
    (Layout(dp=2), ["dp"]),
    (Layout(tp=2, dp=2), ["tp", "dp"]),
    (Layout(tp=2, cp=2, dp=2, ep=2), ["dp_cp", "cp", "ep", "tp_cp"]),
]


@pytest.mark.parametrize("layout, dims", CASES, ids=lambda v: str(v) if isinstance(v, Layout) else None)
def test_collectives_values_grads_and_ledger(layout, dims):
    results = run_distributed(run_checks, layout.world_size, args=(layout, dims))
    for rank, (records, a2a_rows, groups) in enumerate(results):
        expected = []
        for dim in dims:
            members, group_rank = groups[dim]
            expected += expected_ledger(len(members), group_rank, dim, a2a_rows[dim], rows(group_rank, group_rank))
        assert records == expected, f"rank {rank}"


def test_mesh_groups_match_hand_table():
    layout = Layout(tp=2, cp=2, dp=2, ep=2)
    results = run_distributed(run_checks, 8, args=(layout, []))
    groups = results[5][2]
    assert groups["tp"] == ((4, 5), 1)
    assert groups["cp"] == ((5, 7), 0)
    assert groups["dp"] == ((1, 5), 1)
    assert groups["pp"] == ((5,), 0)
    assert groups["dp_cp"] == ((1, 3, 5, 7), 2)
    assert groups["tp_cp"] == ((4, 5, 6, 7), 1)
    assert groups["ep"] == ((5, 7), 0)
    assert groups["edp"] == ((1, 5), 1)
    assert results[2][2]["ep"] == ((0, 2), 1)  # tp=0, cp=1, dp=0: dp_cp index 1


def check_single_rank_groups_are_identity():
    mesh = init_mesh(Layout())
    x = torch.ones(3, requires_grad=True)
    g = mesh["tp"]
    outs = [comm.all_gather(x, g), comm.reduce_scatter(x, g), comm.all_reduce(x, g), comm.copy_to_group(x, g),
            comm.all_to_all(x, g, [3], [3]), comm.broadcast(x, g)]
    started = comm.all_to_all_start(x, g, [3], [3]).wait()
    return all(o is x for o in outs) and started is x and comm.RingExchange(g).exchange(x) is x and comm.ledger() == []


def test_group_of_one_returns_input_untouched():
    assert run_distributed(check_single_rank_groups_are_identity, 1) == [True]


def flat_collectives(g) -> list[torch.Tensor]:
    """The four flat-buffer collectives' results on one rank (distinct values per rank)."""
    x = value(g.rank, 2 * g.size, 3)
    shard = value(g.rank, 4, salt=1)
    into = torch.empty(4 * g.size, dtype=torch.float64)
    comm.all_gather_into(into, shard, g)
    scattered = comm.reduce_scatter_start(value(g.rank, 2 * g.size, salt=2), g).wait()
    return [comm.all_gather(x, g, dim=1), comm.reduce_scatter(x, g, dim=0), into, scattered]


def check_flat_collectives_on_torch_without_single_names():
    """torch 2.11 has `all_gather_into_tensor` and `reduce_scatter_tensor` only; 2.13 adds the `*_single` names
    and warns on the former ones. Neither torch may change a value, and 2.13 must not be asked for a
    deprecated name."""
    import warnings

    import torch.distributed as dist

    g = init_mesh(Layout(dp=2))["dp"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        current = flat_collectives(g)
    hidden = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")
              if hasattr(dist, name)}
    try:
        for name in hidden:
            delattr(dist, name)
        former = flat_collectives(g)
    finally:
        for name, fn in hidden.items():
            setattr(dist, name, fn)
    expected = [torch.cat([value(i, 4, 3) for i in range(2)], dim=1),
                sum(value(i, 4, 3) for i in range(2))[2 * g.rank:2 * g.rank + 2],
                torch.cat([value(i, 4, salt=1) for i in range(2)]),
                sum(value(i, 4, salt=2) for i in range(2))[2 * g.rank:2 * g.rank + 2]]
    for got in (current, former):
        for out, want in zip(got, expected, strict=True):
            torch.testing.assert_close(out, want, rtol=0, atol=1e-15)
    return True


def test_flat_collectives_run_on_torch_with_and_without_the_single_names():
    assert run_distributed(check_flat_collectives_on_torch_without_single_names, 2) == [True, True]


def check_bad_splits():
    g = init_mesh(Layout(dp=2))["dp"]
    with pytest.raises(ValueError, match="need 2 split sizes"):
        comm.all_to_all(torch.ones(2), g, [2], [2])
    with pytest.raises(ValueError, match="send_rows sum to 3 but x has 2 rows"):
        comm.all_to_all(torch.ones(2), g, [1, 2], [1, 1])
    with pytest.raises(ValueError, match="not divisible by the group size 2"):
        comm.reduce_scatter(torch.ones(3), g)
    with pytest.raises(ValueError, match="src=2 is not a member index"):
        comm.broadcast(torch.ones(3), g, src=2)
    with pytest.raises(LayoutError, match="etp=2 expert_fold=False: the runtime shards experts with etp=1 only"):
        init_mesh(Layout(tp=2, etp=2))  # a layout the planner prices but the runtime cannot build
    with pytest.raises(LayoutError, match="expert_fold=True: .* does not fold experts"):
        init_mesh(Layout(tp=2, ep=2, expert_fold=True))
    return True


def test_bad_arguments_are_rejected_before_communicating():
    assert run_distributed(check_bad_splits, 2) == [True, True]


def test_nested_measure_scopes_close_in_order():
    from orangetron.mesh import MeshGroup

    fake = MeshGroup(name="dp", group=None, ranks=(0, 1), rank=0)
    with comm.measure() as outer:  # empty when the inner scope opens: equal to it as a list
        with comm.measure() as inner:
            comm._record("all_gather", fake, 16, (8, 8))
        comm._record("all_reduce", fake, 16, (16, 16))
    assert [r.op for r in inner] == ["all_gather"]
    assert [r.op for r in outer] == ["all_gather", "all_reduce"]
    assert comm._scopes == []


def check_all_gather_objects():
    import torch.distributed as dist

    rank = dist.get_rank()
    return comm.all_gather_objects({"rank": rank, "payload": "x" * (10 + rank)}), comm.ledger()


def test_all_gather_objects_returns_every_ranks_object_and_is_recorded():
    results = run_distributed(check_all_gather_objects, 3)
    for objects, records in results:
        assert objects == [{"rank": r, "payload": "x" * (10 + r)} for r in range(3)]
        assert [(r.op, r.dim) for r in records] == [("all_gather", "world"), ("all_gather", "world")]
        assert records[0].payload_bytes == 3 * 8  # one int64 size per rank


def test_measure_scopes_records():
    from orangetron.mesh import MeshGroup

    fake = MeshGroup(name="dp", group=None, ranks=(0, 1), rank=0)
    with comm.measure() as outer:
        comm._record("all_gather", fake, 16, (8, 8))
        with comm.measure() as inner:
            comm._record("all_reduce", fake, 16, (16, 16))
    assert [r.op for r in outer] == ["all_gather", "all_reduce"]
    assert [r.op for r in inner] == ["all_reduce"]
    assert comm.bytes_by_key(outer) == {"all_gather/dp": 8, "all_reduce/dp": 16}


def check_uneven_payloads():
    """Collectives whose payload does not divide by the group size (3 ranks); returns this rank's ledger."""
    g = init_mesh(Layout(dp=3))["dp"]
    comm.all_reduce(torch.ones(5), g)  # 5 float32 = 20 B
    comm.all_reduce(torch.ones(10, dtype=torch.uint8), g)  # 10 B
    matrix = [[1, 2, 0], [3, 0, 1], [2, 2, 2]]  # rows rank i sends to rank j, 3 float32 (12 B) a row
    send, recv = matrix[g.rank], [matrix[i][g.rank] for i in range(3)]
    comm.all_to_all(torch.zeros(sum(send), 3), g, send, recv)
    x = torch.ones(5, requires_grad=True)
    comm.broadcast(x, g, src=1).sum().backward()  # backward: reduce to member 1
    return [(r.op, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in comm.ledger()]


def test_uneven_payloads_on_three_ranks_match_hand_numbers():
    # all_reduce 20 B: each ring phase 2 * 20 // 3 = 13, so 26; 10 B: 2 * (20 // 3) = 12.
    # all_to_all rows [[1, 2, 0], [3, 0, 1], [2, 2, 2]] of 12 B: rank 0 hands in 3 rows, sends 2 away and
    # gets 3 + 2 from the others; rank 1 hands in 4, sends 3 + 1, gets 2 + 2; rank 2 hands in 6, sends
    # 2 + 2, gets 0 + 1.
    # broadcast from member 1 of 20 B, chain 1 -> 2 -> 0; the reduce back to 1 runs 0 -> 2 -> 1.
    expected = [
        [("all_reduce", 20, 26, 26), ("all_reduce", 10, 12, 12), ("all_to_all", 36, 24, 60),
         ("broadcast", 20, 0, 20), ("reduce", 20, 20, 0)],
        [("all_reduce", 20, 26, 26), ("all_reduce", 10, 12, 12), ("all_to_all", 48, 48, 48),
         ("broadcast", 20, 20, 0), ("reduce", 20, 0, 20)],
        [("all_reduce", 20, 26, 26), ("all_reduce", 10, 12, 12), ("all_to_all", 72, 48, 12),
         ("broadcast", 20, 20, 20), ("reduce", 20, 20, 20)],
    ]
    assert run_distributed(check_uneven_payloads, 3) == expected


def test_ledger_outside_scopes_stays_bounded_and_never_reads_incomplete():
    import tracemalloc

    from orangetron.mesh import MeshGroup

    fake = MeshGroup(name="dp", group=None, ranks=(0, 1), rank=0)
    comm.reset_ledger()
    tracemalloc.start()  # before the first records, so the ones dropped later are traced when freed
    for _ in range(10_000):
        comm._record("all_reduce", fake, 16, (16, 16))
    assert len(comm._records) == comm.LEDGER_LIMIT == 4096
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(10_000):  # a plain list would grow by ~1 MB here
        comm._record("all_reduce", fake, 16, (16, 16))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 64 * 1024, grown
    with pytest.raises(comm.LedgerOverflow, match="20000 records since the last reset_ledger"):
        comm.ledger()
    comm.reset_ledger()
    assert comm.ledger() == []
    with comm.measure() as records:  # a scope is not bounded: it holds what its block made
        for _ in range(5000):
            comm._record("all_gather", fake, 16, (8, 8))
    assert len(records) == 5000
    with pytest.raises(comm.LedgerOverflow, match="5000 records"):
        comm.ledger()
    comm.reset_ledger()
    comm._record("all_gather", fake, 16, (8, 8))
    assert comm.ledger() == [comm.CommRecord("all_gather", "dp", 16, 8, 8)]
    comm.reset_ledger()
