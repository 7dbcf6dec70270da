"""The order in which pipeline ranks post their sends and receives, so that no transfer waits on another in a cycle.

Backends such as NCCL ignore tags: between two ranks the k-th send meets the k-th receive, and a send posted
alone blocks until its receive is posted. Posted the obvious way (each send right after the pass that
produced it, each receive right before the pass that needs it), 1F1B stalls at pp=2 with 4 micro-batches:
each stage sends, and waits for the other to receive, while the other does the same.

The cure here is one global order. `simulate_plan` places every pass on a timeline (unit forward, double
backward); each transfer's tick is the start of the pass that consumes it, and every rank posts its calls in
the order of (tick, stage pair, micro-batch, direction). Then the earliest unfinished transfer is always posted
by both of its ranks: the sender produced it before its tick (the simulation respects every dependency), and
neither rank can be waiting on a later call without having posted this one first. `spec/rendezvous.py` replays
the calls a run posts under those rules (`tests/test_pipeline_p2p.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from orangetron.spec.schedule import Action, simulate_plan

_COST = {"F": 1.0, "B": 2.0, "W": 1.0}


@dataclass(frozen=True, order=True)
class Transfer:
    """One activation (forward) or gradient (backward) between neighbouring virtual stages of a micro-batch.
    Ordered by when it is consumed, then by stage pair, micro-batch and direction: the same order on every rank."""

    tick: float  # simulated start of the pass that consumes it
    low_stage: int  # the lower of the two virtual stages
    microbatch: int
    backward: bool

    @property
    def source(self) -> int:
        return self.low_stage + 1 if self.backward else self.low_stage

    @property
    def target(self) -> int:
        return self.low_stage if self.backward else self.low_stage + 1


def transfer_order(plan: list[list[Action]], virtual_stages: int) -> list[list[tuple[str, Transfer]]]:
    """For each pipeline rank, its calls ("send" or "recv", transfer) in the order it must post them."""
    pp = len(plan)
    last = virtual_stages * pp - 1
    transfers = []
    for slot in simulate_plan(plan, virtual_stages, _COST):
        g = slot.action.chunk * pp + slot.rank
        if slot.action.kind == "F" and g > 0:
            transfers.append(Transfer(slot.start, g - 1, slot.action.microbatch, backward=False))
        elif slot.action.kind == "B" and g < last:
            transfers.append(Transfer(slot.start, g, slot.action.microbatch, backward=True))
    calls: list[list[tuple[str, Transfer]]] = [[] for _ in range(pp)]
    for t in sorted(transfers):
        calls[t.source % pp].append(("send", t))
        calls[t.target % pp].append(("recv", t))
    return calls
