"""Every collective orangetron runs, autograd-aware, and the ledger that counts their bytes.

Each public collective is one `torch.autograd.Function` whose backward is the mirror collective, so
model code composes them like ordinary ops. A collective over a group of one rank returns its input
untouched and records nothing. Each call that moves data appends a `CommRecord` to this process's
ledger, with bytes from `orangetron.spec.collectives`, the formulas the cost model uses too. The
process-wide ledger keeps a bounded window of recent records; `measure()` scopes keep everything.
"""

from __future__ import annotations

import math
import pickle
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from orangetron.mesh import MeshGroup
from orangetron.spec import collectives as formulas
from orangetron.spec.collectives import CommRecord

__all__ = [
    "CommRecord", "LEDGER_LIMIT", "LedgerOverflow", "Pending", "PendingAllReduce",
    "RingExchange", "all_gather", "all_gather_into", "all_gather_into_start", "all_gather_objects", "all_reduce",
    "all_reduce_max", "all_reduce_start", "all_to_all", "all_to_all_start", "broadcast", "bytes_by_key",
    "copy_to_group", "host_tensor", "ledger", "measure", "P2PCall", "PendingP2P", "post_p2p", "reduce_scatter",
    "reduce_scatter_start", "reset_ledger", "trace_p2p", "unmeasured", "world_group", "Started", "all_to_all_async",
    "reduce_scatter_async",
]

# ---- the ledger -------------------------------------------------------------------------------------

LEDGER_LIMIT = 4096
"""Records `ledger()` keeps outside `measure` scopes: a long run must not grow memory without bound."""


class LedgerOverflow(RuntimeError):
    """`ledger()` was asked for records it has already dropped (more than LEDGER_LIMIT since the reset)."""


# The ledger is per process (one process is one rank): collectives record from deep inside autograd's backward,
# where no handle could be passed down. Bounded by LEDGER_LIMIT; `reset_ledger()` clears it and every
# `measure()` scope leaves `_scopes` when its block ends (docs/runtime.md, "Process-wide state").
_records: deque[CommRecord] = deque(maxlen=LEDGER_LIMIT)
_dropped = 0
_scopes: list[list[CommRecord]] = []


def _record(op: str, group: MeshGroup, payload: int, sent_received: tuple[int, int]) -> None:
    global _dropped
    record = CommRecord(op, group.name, payload, *sent_received)
    if len(_records) == LEDGER_LIMIT:
        _dropped += 1  # the deque drops its oldest record; remember that it is no longer complete
    _records.append(record)
    for scope in _scopes:
        scope.append(record)


def ledger() -> list[CommRecord]:
    """Every record this process made since the last `reset_ledger()`, oldest first.

    Only the latest `LEDGER_LIMIT` records are kept; if more were made since the reset this raises
    `LedgerOverflow` rather than return an incomplete list. To count a long run, open `measure()`.
    """
    if _dropped:
        raise LedgerOverflow(f"{_dropped + len(_records)} records since the last reset_ledger(), only the latest "
                             f"{LEDGER_LIMIT} are kept; count long runs inside comm.measure() or reset more often")
    return list(_records)


def reset_ledger() -> None:
    global _dropped
    _records.clear()
    _dropped = 0


@contextmanager
def measure() -> Iterator[list[CommRecord]]:
    """Collect every record made inside the block into the yielded list (scopes may nest; no limit)."""
    scope: list[CommRecord] = []
    _scopes.append(scope)
    try:
        yield scope
    finally:
        # By identity: an inner scope may hold records equal to an outer one's (or none, like it).
        del _scopes[next(i for i, s in enumerate(_scopes) if s is scope)]


@contextmanager
def unmeasured() -> Iterator[None]:
    """Records made inside reach the ledger but no open `measure` scope: bookkeeping such as checkpoints."""
    hidden = _scopes[:]
    _scopes.clear()
    try:
        yield
    finally:
        _scopes[:] = hidden


def bytes_by_key(records: Sequence[CommRecord]) -> dict[str, int]:
    """Bytes sent per "op/dim", e.g. {"all_gather/dp": 1024}."""
    totals: dict[str, int] = {}
    for r in records:
        totals[r.key] = totals.get(r.key, 0) + r.bytes_sent
    return totals


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat(name: str, former: str) -> Callable[..., Any]:
    """`torch.distributed.<name>`, or `<former>` where torch predates it: 2.13 renamed the flat-buffer
    collectives `*_single` and deprecates their former names, which 2.11 (the oldest torch the GPU check
    supports, docs/runtime.md) has alone. Looked up per call, so that a test can take the new names away."""
    return getattr(dist, name, None) or getattr(dist, former)


# ---- raw collectives (no autograd) ------------------------------------------------------------------


def _all_gather_raw(x: torch.Tensor, group: MeshGroup, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    _flat("all_gather_single", "all_gather_into_tensor")(out, x, group=group.group)
    _record("all_gather", group, _nbytes(out), formulas.all_gather_bytes(_nbytes(out), group.size))
    return out.movedim(0, dim)


def _reduce_scatter_raw(x: torch.Tensor, group: MeshGroup, dim: int) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"reduce_scatter over {group.name}: dim {dim} of size {x.shape[dim]} "
                         f"is not divisible by the group size {group.size}")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    _flat("reduce_scatter_single", "reduce_scatter_tensor")(out, x, group=group.group)
    _record("reduce_scatter", group, _nbytes(x), formulas.reduce_scatter_bytes(_nbytes(x), group.size))
    return out.movedim(0, dim)


def _all_reduce_raw(x: torch.Tensor, group: MeshGroup, op: str = "sum") -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=_REDUCE_OPS[op], group=group.group)
    _record("all_reduce", group, _nbytes(out), formulas.all_reduce_bytes(_nbytes(out), group.size))
    return out


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _all_to_all_raw(x: torch.Tensor, group: MeshGroup, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv_rows, send_rows, group=group.group)
    _record("all_to_all", group, _nbytes(x), _all_to_all_bytes(x, group, send_rows, recv_rows))
    return out


def _all_to_all_bytes(x: torch.Tensor, group: MeshGroup, send_rows: list[int], recv_rows: list[int]) -> tuple[int, int]:
    row = math.prod(x.shape[1:]) * x.element_size()
    return formulas.all_to_all_bytes([n * row for n in send_rows], [n * row for n in recv_rows], group.rank)


def _broadcast_raw(x: torch.Tensor, group: MeshGroup, src: int) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.broadcast(out, group=group.group, group_src=src)
    _record("broadcast", group, _nbytes(out), formulas.broadcast_bytes(_nbytes(out), group.size, group.rank, src))
    return out


def _reduce_raw(x: torch.Tensor, group: MeshGroup, dst: int) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.reduce(out, group=group.group, group_dst=dst)
    _record("reduce", group, _nbytes(out), formulas.reduce_bytes(_nbytes(out), group.size, group.rank, dst))
    return out if group.rank == dst else torch.zeros_like(out)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: MeshGroup) -> None:
    """Fill the flat buffer `out` with every member's `shard` in group order, in place, without autograd.

    For parameter buffers (ZeRO): the write bypasses autograd's version counter, so tensors saved for
    backward that view `out` see the gathered values rather than failing a version check.
    """
    all_gather_into_start(out, shard, group).wait()


def all_gather_into_start(out: torch.Tensor, shard: torch.Tensor, group: MeshGroup) -> Pending:
    """`all_gather_into` that returns at once (ZeRO-3's prefetch of the next unit); `wait()` before reading
    `out`. `shard` must stay untouched until then."""
    if out.numel() != shard.numel() * group.size:
        raise ValueError(f"all_gather_into over {group.name}: out has {out.numel()} elements, "
                         f"expected {group.size} x {shard.numel()}")
    if group.size == 1:
        out.data.copy_(shard.reshape(out.shape))
        return Pending(out, None)
    shard = shard.contiguous()
    all_gather = _flat("all_gather_single", "all_gather_into_tensor")
    work = all_gather(out, shard, group=group.group, async_op=True)
    _record("all_gather", group, _nbytes(out), formulas.all_gather_bytes(_nbytes(out), group.size))
    return Pending(out, work, keep=shard)


def reduce_scatter_start(x: torch.Tensor, group: MeshGroup) -> Pending:
    """Start summing the flat tensor `x` over the group, keeping this member's 1/n slice, and return at once
    (gradient buckets during backward); `wait()` returns the slice. No autograd."""
    if x.dim() != 1 or x.numel() % group.size:
        raise ValueError(f"reduce_scatter_start over {group.name}: needs a flat tensor whose {x.numel()} "
                         f"elements divide by the group size {group.size}")
    if group.size == 1:
        return Pending(x, None)
    out, x = x.new_empty(x.numel() // group.size), x.contiguous()
    reduce_scatter = _flat("reduce_scatter_single", "reduce_scatter_tensor")
    work = reduce_scatter(out, x, group=group.group, async_op=True)
    _record("reduce_scatter", group, _nbytes(x), formulas.reduce_scatter_bytes(_nbytes(x), group.size))
    return Pending(out, work, keep=x)


class Pending:
    """A collective in flight (`*_start`); `wait()` completes it and returns its result tensor."""

    def __init__(self, tensor: torch.Tensor, work: object | None, keep: torch.Tensor | None = None) -> None:
        self.tensor, self._work = tensor, work
        self._keep = keep  # a send buffer the backend reads until the collective completes

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._keep = None
        return self.tensor


PendingAllReduce = Pending  # the name bucketed DDP has used


def all_reduce_start(x: torch.Tensor, group: MeshGroup) -> Pending:
    """Start summing the contiguous tensor `x` over the group in place and return at once, so compute can
    overlap it (gradient buckets during backward). No autograd."""
    if not x.is_contiguous():
        raise ValueError(f"all_reduce_start over {group.name}: the tensor must be contiguous (it is reduced in place)")
    if group.size == 1:
        return Pending(x, None)
    work = dist.all_reduce(x, group=group.group, async_op=True)
    _record("all_reduce", group, _nbytes(x), formulas.all_reduce_bytes(_nbytes(x), group.size))
    return Pending(x, work)


def all_to_all_start(x: torch.Tensor, group: MeshGroup, send_rows: Sequence[int], recv_rows: Sequence[int]) -> Pending:
    """`all_to_all` that returns at once, so compute can overlap it (chunked expert dispatch); `wait()`
    returns the received rows. No autograd; `x` must stay untouched until then. Recorded at the start, exactly
    as `all_to_all` records it."""
    send_rows, recv_rows = _check_splits("all_to_all_start", x, group, send_rows, recv_rows)
    if group.size == 1:
        return Pending(x, None)
    x = x.detach().contiguous()
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, recv_rows, send_rows, group=group.group, async_op=True)
    _record("all_to_all", group, _nbytes(x), _all_to_all_bytes(x, group, send_rows, recv_rows))
    return Pending(out, work, keep=x)


def all_reduce_max(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """Elementwise maximum of `x` over the group (out of place, no autograd: a maximum used as a shift,
    such as the softmax's, needs no gradient)."""
    return x if group.size == 1 else _all_reduce_raw(x.detach(), group, op="max")


def host_tensor(data: Sequence[float] | Sequence[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of host bookkeeping (row counts, a loss report, a divergence verdict) on the CPU, whatever device
    the model is on: collectives on it run over the gloo half of a mixed `cpu:gloo,cuda:nccl` group, and its
    values come back as Python numbers without a device sync. Everything else a collective touches lives on
    the mesh's device (`tests/test_device_factories.py` holds every other factory to that)."""
    return torch.tensor(data, dtype=dtype, device="cpu")


def world_group() -> MeshGroup:
    """Every rank of the default process group, as a `MeshGroup` named "world"."""
    n = dist.get_world_size()
    return MeshGroup(name="world", group=dist.group.WORLD, ranks=tuple(range(n)), rank=dist.get_rank())


def all_gather_objects(obj: object, group: MeshGroup | None = None) -> list:
    """Every member's picklable `obj`, in group order (results and other bookkeeping, not tensors).

    Two recorded all-gathers: the pickled sizes, then the pickles padded to the largest.
    """
    group = group or world_group()
    if group.size == 1:
        return [obj]
    blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = _all_gather_raw(host_tensor([blob.numel()], torch.int64), group, 0).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: blob.numel()] = blob
    gathered = _all_gather_raw(padded, group, 0).view(group.size, -1)
    return [pickle.loads(gathered[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]


# ---- autograd pairs ---------------------------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: MeshGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_raw(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_raw(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: MeshGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_raw(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_raw(grad, ctx.group, ctx.dim), None, None


class _AllReduce(torch.autograd.Function):
    """All-reduce forward, identity backward (every rank already holds the summed gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
        return _all_reduce_raw(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce backward (a replicated input feeding rank-local compute)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_raw(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """Variable all-to-all forward, the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: MeshGroup, send_rows: list[int], recv_rows: list[int]):
        ctx.group, ctx.send_rows, ctx.recv_rows = group, send_rows, recv_rows
        return _all_to_all_raw(x, group, send_rows, recv_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all_raw(grad, ctx.group, ctx.recv_rows, ctx.send_rows), None, None, None


class _Broadcast(torch.autograd.Function):
    """Broadcast from `src` forward, reduce to `src` backward (other ranks' inputs get zero gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: MeshGroup, src: int) -> torch.Tensor:
        ctx.group, ctx.src = group, src
        return _broadcast_raw(x, group, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_raw(grad, ctx.group, ctx.src), None, None


# ---- public collectives -----------------------------------------------------------------------------


def all_gather(x: torch.Tensor, group: MeshGroup, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in group order; backward reduce-scatters the gradient."""
    return x if group.size == 1 else _AllGather.apply(x, group, dim)


def reduce_scatter(x: torch.Tensor, group: MeshGroup, dim: int = 0) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/n slice along `dim`; backward all-gathers."""
    return x if group.size == 1 else _ReduceScatter.apply(x, group, dim)


def all_reduce(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """Sum `x` over the group (out of place); backward passes the gradient through."""
    return x if group.size == 1 else _AllReduce.apply(x, group)


def copy_to_group(x: torch.Tensor, group: MeshGroup) -> torch.Tensor:
    """Identity; backward sums the gradient over the group."""
    return x if group.size == 1 else _CopyToGroup.apply(x, group)


def all_to_all(x: torch.Tensor, group: MeshGroup, send_rows: Sequence[int], recv_rows: Sequence[int]) -> torch.Tensor:
    """Send `send_rows[j]` consecutive rows of `x` (dim 0) to member j, receive `recv_rows[j]` from it.

    Rows arrive grouped by source in group order. Backward returns each gradient row to its sender.
    """
    send_rows, recv_rows = _check_splits("all_to_all", x, group, send_rows, recv_rows)
    return x if group.size == 1 else _AllToAll.apply(x, group, send_rows, recv_rows)


def _check_splits(op: str, x: torch.Tensor, group: MeshGroup, send_rows: Sequence[int],
                  recv_rows: Sequence[int]) -> tuple[list[int], list[int]]:
    send_rows, recv_rows = [int(n) for n in send_rows], [int(n) for n in recv_rows]
    if len(send_rows) != group.size or len(recv_rows) != group.size:
        raise ValueError(f"{op} over {group.name}: need {group.size} split sizes, "
                         f"got send {len(send_rows)} and receive {len(recv_rows)}")
    if sum(send_rows) != x.shape[0]:
        raise ValueError(f"{op} over {group.name}: send_rows sum to {sum(send_rows)} but x has {x.shape[0]} rows")
    return send_rows, recv_rows


def broadcast(x: torch.Tensor, group: MeshGroup, src: int = 0) -> torch.Tensor:
    """Every member gets member `src`'s `x` (a multicast to this sub-group); backward reduces to `src`."""
    if not 0 <= src < group.size:
        raise ValueError(f"broadcast over {group.name}: src={src} is not a member index in [0, {group.size})")
    return x if group.size == 1 else _Broadcast.apply(x, group, src)


# ---- collectives in flight, with autograd ---------------------------------------------------------------


class _Arrival(torch.autograd.Function):
    """The arrived result of a started collective forward; backward runs the mirror collective, back to the
    tensor that was sent."""

    @staticmethod
    def forward(ctx, sent: torch.Tensor, received: torch.Tensor, mirror) -> torch.Tensor:
        ctx.mirror = mirror
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.mirror(grad), None, None


class Started:
    """A differentiable collective in flight (`all_to_all_async`, `reduce_scatter_async`): compute can run
    until `wait()`, which returns the result; its gradient travels back by the mirror collective (blocking).
    The sent tensor stays referenced until then, and `wait()` twice raises."""

    def __init__(self, sent: torch.Tensor, pending: Pending,
                 mirror: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self._sent, self._pending, self._mirror = sent, pending, mirror

    def wait(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("Started.wait called twice")
        received, self._pending = self._pending.wait(), None
        sent, self._sent = self._sent, None
        return received if received is sent else _Arrival.apply(sent, received, self._mirror)


def all_to_all_async(x: torch.Tensor, group: MeshGroup, send_rows: Sequence[int],
                     recv_rows: Sequence[int]) -> Started:
    """`all_to_all` that returns at once (`Started`); recorded at the start and in backward as `all_to_all`."""
    pending = all_to_all_start(x, group, send_rows, recv_rows)
    send_rows, recv_rows = [int(n) for n in send_rows], [int(n) for n in recv_rows]
    return Started(x, pending, lambda grad: _all_to_all_raw(grad, group, recv_rows, send_rows))


def reduce_scatter_async(x: torch.Tensor, group: MeshGroup) -> Started:
    """`reduce_scatter(x, group, dim=0)` that returns at once (`Started`): [n * m, ...] -> [m, ...]; recorded
    as `reduce_scatter` (backward: `all_gather`)."""
    if group.size == 1:
        return Started(x, Pending(x, None), None)
    if x.shape[0] % group.size:
        raise ValueError(f"reduce_scatter_async over {group.name}: dim 0 of size {x.shape[0]} "
                         f"is not divisible by the group size {group.size}")
    shape, full = (x.shape[0] // group.size, *x.shape[1:]), tuple(x.shape)
    pending = reduce_scatter_start(x.detach().reshape(-1), group)
    started = Started(x, pending, lambda grad: _all_gather_raw(grad.reshape(-1), group, 0).view(full))
    return _Reshaped(started, shape)


class _Reshaped:
    """A `Started` whose flat result is viewed in `shape`."""

    def __init__(self, started: Started, shape: tuple[int, ...]) -> None:
        self._started, self._shape = started, shape

    def wait(self) -> torch.Tensor:
        return self._started.wait().view(self._shape)


# ---- ring exchange ----------------------------------------------------------------------------------


def _shift(x: torch.Tensor, group: MeshGroup, step: int, send: bool = True, receive: bool = True,
           receive_shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor | None, list]:
    """Post send of `x` to member rank+step and receive a tensor like it (of `receive_shape` if given) from
    rank-step; returns (buffer, works). `send` or `receive` False leaves that half out (no buffer without
    `receive`); neither posts nothing."""
    x = x.contiguous()
    received = None
    if receive:
        received = torch.empty_like(x) if receive_shape is None else x.new_empty(receive_shape)
    ops = []
    if send:
        ops.append(dist.P2POp(dist.isend, x, group.global_rank(group.rank + step), group.group))
    if receive:
        ops.append(dist.P2POp(dist.irecv, received, group.global_rank(group.rank - step), group.group))
    if not ops:
        return None, []
    sent_bytes = _nbytes(x) if send else 0
    _record("send_recv", group, sent_bytes,
            formulas.send_recv_bytes(sent_bytes, 0 if received is None else _nbytes(received)))
    return received, dist.batch_isend_irecv(ops)


class _RingLink(torch.autograd.Function):
    """Receive-from-previous forward; backward sends the gradient back to the previous member."""

    @staticmethod
    def forward(ctx, sent: torch.Tensor, received: torch.Tensor, group: MeshGroup) -> torch.Tensor:
        ctx.group = group
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_sent, works = _shift(grad, ctx.group, step=-1)
        for work in works:
            work.wait()
        return grad_sent, None, None


class RingExchange:
    """Send a tensor to the next group member and receive the previous member's, asynchronously.

    `start(x)` posts the transfer and returns at once so compute can overlap; `wait()` completes it and
    returns the received tensor. The result is autograd-aware: its gradient flows back to the sender's
    `x`. Misuse (wait before start, start twice) raises instead of deadlocking.
    """

    def __init__(self, group: MeshGroup) -> None:
        self.group = group
        self._pending: tuple[torch.Tensor, torch.Tensor, list, torch.Tensor] | None = None

    def start(self, x: torch.Tensor, send: bool = True, receive: bool = True,
              receive_shape: tuple[int, ...] | None = None) -> None:
        """Post the transfer. `send=False` keeps x home (the next member must not receive), `receive=False`
        expects nothing from the previous member (which must not send); x then only gives the shape, unless
        `receive_shape` (the previous member sends a tensor of another size) does."""
        if self._pending is not None:
            raise RuntimeError("RingExchange.start called twice without wait")
        if self.group.size == 1:
            self._pending = (x, x if receive else None, [], x)
            return
        sent = x.detach().contiguous()  # what the backend reads until the wait
        received, works = _shift(sent, self.group, step=1, send=send, receive=receive, receive_shape=receive_shape)
        self._pending = (x, received, works, sent)

    def wait(self) -> torch.Tensor | None:
        """The received tensor; None when `start` was told not to receive."""
        if self._pending is None:
            raise RuntimeError("RingExchange.wait called before start")
        sent, received, works, _buffer = self._pending
        self._pending = None
        if self.group.size == 1:
            return received
        for work in works:
            work.wait()
        return None if received is None else _RingLink.apply(sent, received, self.group)

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """`start(x)` then `wait()`: a blocking ring shift."""
        self.start(x)
        return self.wait()


# ---- point to point (pipeline stages) ---------------------------------------------------------------


@dataclass(frozen=True)
class P2PCall:
    """One send or receive as `post_p2p` posted it, for `trace_p2p`: the batch it went out in (counted per
    trace, from 0), its direction, the peer's global rank, its tag and its bytes."""

    batch: int
    op: str  # "send" or "recv"
    peer: int
    tag: int
    nbytes: int


# Open `trace_p2p()` scopes (docs/runtime.md, "Process-wide state"): the pipeline executor posts its transfers
# from deep inside a step, and a test replays them as they were posted. Each scope leaves when its block ends.
_p2p_traces: list[list[P2PCall]] = []


@contextmanager
def trace_p2p() -> Iterator[list[P2PCall]]:
    """Collect every send and receive `post_p2p` posts inside the block, in posting order."""
    calls: list[P2PCall] = []
    _p2p_traces.append(calls)
    try:
        yield calls
    finally:
        _p2p_traces.remove(calls)


def _trace(batch: Sequence[tuple[str, torch.Tensor, int, int]], group: MeshGroup) -> None:
    for calls in _p2p_traces:
        index = calls[-1].batch + 1 if calls else 0
        calls.extend(P2PCall(index, op, group.global_rank(peer), tag, _nbytes(x)) for op, x, peer, tag in batch)


def post_p2p(sends: Sequence[tuple[torch.Tensor, int, int]], recvs: Sequence[tuple[torch.Tensor, int, int]],
             group: MeshGroup) -> PendingP2P:
    """Post sends and receives as one batch (`dist.batch_isend_irecv`) and return at once (no autograd).

    `sends`: (tensor, group member, tag); `recvs`: (buffer to fill, group member, tag). Backends that match
    point-to-point calls in posting order and ignore tags (NCCL) block a send posted alone until its receive is
    posted, so callers post in an order every rank agrees on (the pipeline's: `spec/transfers.py`). Records each
    send as before (payload and bytes sent) and each receive (bytes received); `trace_p2p` sees every call.
    """
    batch = [("send", x.detach().contiguous(), dst, tag) for x, dst, tag in sends]
    batch += [("recv", out, src, tag) for out, src, tag in recvs]
    if not batch:
        return PendingP2P([], [])
    ops = [dist.P2POp(dist.isend if op == "send" else dist.irecv, x, group.global_rank(peer), group.group, tag)
           for op, x, peer, tag in batch]
    works = dist.batch_isend_irecv(ops)
    for op, x, _peer, _tag in batch:
        sent = op == "send"
        _record("send_recv", group, _nbytes(x) if sent else 0,
                formulas.send_recv_bytes(_nbytes(x), 0) if sent else formulas.send_recv_bytes(0, _nbytes(x)))
    _trace(batch, group)
    return PendingP2P([x for _op, x, _peer, _tag in batch], works)


class PendingP2P:
    """A batch in flight: holds every buffer it sends or fills until `wait()` (the backend uses them
    asynchronously)."""

    def __init__(self, buffers: list[torch.Tensor], works: list) -> None:
        self.buffers, self.works = buffers, works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
