"""ZeRO-3's data-parallel time left exposed, unit by unit.

Under ZeRO-3 every unit (`params.zero3_units`: the embedding, each layer, the head) is all-gathered before it
runs, in forward and again in backward, and its gradients are reduce-scattered after its backward
(docs/data_parallel.md, 'ZeRO-3 by unit'). A transfer hides only behind the compute that runs while it is in
flight:

- forward, with prefetch: entering unit u starts the gather of unit u + 1, which hides behind u's compute; the
  first unit's gather has nothing before it. Without prefetch every gather waits whole.
- backward, in the order the units' backward runs: the first unit's gather waits whole; while a unit computes,
  the gather of the next one (with prefetch) and the reduce-scatter of the one before it, which has just
  finished, are in flight on the same links. The last reduce-scatter starts after the pass's last compute and
  is waited for when the pass ends (the runtime retires every reduction at the end of backward, as FSDP does).
- whatever hides still costs `contention` of its time (communication kernels take SMs and memory bandwidth
  from compute, as everywhere in `timing`).
- reductions that cannot overlap (partial gradients first summed over tp, or `overlap_grad_reduce` off) run
  after the last backward, all exposed.

A unit's compute is its share of the micro-batch's forward FLOPs times the micro-batch's forward or backward
time (`UnitTraffic.share`; the embedding's share is nil, so the gather after it is exposed too). The caller
lists the units in each pass's order (`timing._zero3_units`): a unit gathered for a whole pass comes first in
both, and its reduce-scatter may come apart from its gather, as a unit of its own at the end of backward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitTraffic:
    """One unit's transfers of one pass and its share of a micro-batch's compute."""

    gather: float  # seconds of its all-gathers
    reduce: float  # seconds of its reduce-scatters
    share: float  # its share of the micro-batch's compute (the shares of a stage's units sum to 1)


def hide(comm: float, window: float, contention: float) -> float:
    """Seconds `comm` adds when it overlaps `window` seconds of compute."""
    hidden = min(comm, window)
    return comm - hidden + contention * hidden


def forward_exposed(units: list[UnitTraffic], forward: float, prefetch: bool, contention: float) -> float:
    """Exposed gather seconds of one forward pass of `forward` compute seconds."""
    if not units:
        return 0.0
    if not prefetch:
        return sum(u.gather for u in units)
    behind = (hide(nxt.gather, forward * u.share, contention) for u, nxt in zip(units[:-1], units[1:], strict=True))
    return units[0].gather + sum(behind)


def backward_exposed(order: list[UnitTraffic], backward: float, gathers: bool, reduces: bool, prefetch: bool,
                     contention: float) -> tuple[float, float]:
    """(exposed seconds during one backward pass of `backward` compute seconds over the units in the order their
    backward runs, the last reduce-scatter, which runs after it). `gathers`: the units are gathered again;
    `reduces`: this pass reduce-scatters them."""
    if not order:
        return 0.0, 0.0
    exposed = order[0].gather if gathers else 0.0
    for j, unit in enumerate(order):
        prefetched = order[j + 1].gather if gathers and j + 1 < len(order) else 0.0
        if gathers and not prefetch:
            exposed, prefetched = exposed + prefetched, 0.0
        reducing = order[j - 1].reduce if reduces and j > 0 else 0.0
        exposed += hide(prefetched + reducing, backward * unit.share, contention)
    return exposed, order[-1].reduce if reduces else 0.0


def step_exposed(forward_order: list[UnitTraffic], backward_order: list[UnitTraffic], forward: float,
                 backward: float, microbatches: int, rounds: int, prefetch: bool, keep: bool, overlap_reduce: bool,
                 contention: float) -> float:
    """Exposed seconds of one step's ZeRO-3 traffic on one GPU: `microbatches` forward and backward passes, the
    last `rounds` of which reduce-scatter (one: only the last, the others' gradients wait in `.grad`), each
    waiting for its last reduce-scatter. With `keep` the forward's units stay gathered until their backward;
    without `overlap_reduce` every reduction waits for the last backward."""
    m = microbatches
    total = m * forward_exposed(forward_order, forward, prefetch, contention)
    quiet, _ = backward_exposed(backward_order, backward, not keep, False, prefetch, contention)
    if not overlap_reduce:
        return total + m * quiet + rounds * sum(u.reduce for u in backward_order)
    busy, tail = backward_exposed(backward_order, backward, not keep, True, prefetch, contention)
    return total + (m - rounds) * quiet + rounds * (busy + tail)
