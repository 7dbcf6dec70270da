"""Every asynchronous collective keeps the tensors it hands the backend alive until its wait, and lets them go
after; checked in one process against a stand-in backend that, unlike gloo, holds no reference of its own
(as a GPU library reading a buffer on its own stream may not)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from orangetron import comm
from orangetron.mesh import MeshGroup

GROUP = MeshGroup("ep", None, (0, 1), 0)


class _Work:
    def wait(self) -> bool:
        return True


@pytest.fixture
def handed(monkeypatch) -> list[weakref.ref]:
    """Weak references to every tensor a collective was asked to send."""
    refs: list[weakref.ref] = []

    def take(x: torch.Tensor) -> _Work:
        refs.append(weakref.ref(x))
        return _Work()

    monkeypatch.setattr(dist, "all_to_all_single", lambda out, x, *args, **kwargs: take(x))
    for flat in ("reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor", "all_gather_into_tensor"):
        if hasattr(dist, flat):  # the *_single names are torch 2.13's; 2.11 has only the former ones
            monkeypatch.setattr(dist, flat, lambda out, x, **kwargs: take(x))
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, *args: SimpleNamespace(op=op, tensor=tensor))
    monkeypatch.setattr(dist, "batch_isend_irecv",
                        lambda ops: [take(op.tensor) if op.op is dist.isend else _Work() for op in ops])
    return refs


def _strided(*shape: int) -> torch.Tensor:
    """A tensor that is not contiguous, so each collective sends a copy only it holds."""
    return torch.arange(2 * torch.Size(shape).numel(), dtype=torch.float64).view(*shape[:-1], -1)[..., ::2]


STARTS = {
    "all_to_all_start": lambda: comm.all_to_all_start(_strided(4, 3), GROUP, [2, 2], [2, 2]),
    "all_to_all_async": lambda: comm.all_to_all_async(_strided(4, 3), GROUP, [2, 2], [2, 2]),
    "reduce_scatter_start": lambda: comm.reduce_scatter_start(_strided(6), GROUP),
    "reduce_scatter_async": lambda: comm.reduce_scatter_async(_strided(4, 3), GROUP),
    "all_gather_into_start": lambda: comm.all_gather_into_start(torch.zeros(12, dtype=torch.float64),
                                                                _strided(6), GROUP),
}


@pytest.mark.parametrize("name", list(STARTS))
def test_send_buffers_live_until_the_wait(name, handed):
    in_flight = STARTS[name]()
    gc.collect()
    assert handed and all(ref() is not None for ref in handed), f"{name}: a send buffer died before the wait"
    in_flight.wait()
    gc.collect()
    assert all(ref() is None for ref in handed), f"{name}: the send buffer outlives the wait"


def test_ring_exchange_keeps_its_send_buffer_until_the_wait(handed):
    ring = comm.RingExchange(GROUP)
    ring.start(_strided(2, 3))
    gc.collect()
    assert handed and all(ref() is not None for ref in handed)
    ring.wait()
    gc.collect()
    assert all(ref() is None for ref in handed)


def test_started_collectives_refuse_a_second_wait_and_check_their_split(handed):
    started = comm.all_to_all_async(_strided(4, 3), GROUP, [2, 2], [2, 2])
    started.wait()
    with pytest.raises(RuntimeError, match="wait called twice"):
        started.wait()
    with pytest.raises(ValueError, match="dim 0 of size 3 is not divisible by the group size 2"):
        comm.reduce_scatter_async(_strided(3, 2), GROUP)
