"""Pipeline schedules as data: the order of forward and backward passes on every stage, and their timeline.

A schedule is, for each pipeline rank, the list of (kind, chunk, micro-batch) it runs in order; `simulate`
replays those lists under the true dependencies (a chunk's forward needs the previous virtual stage's
forward of that micro-batch, a backward needs the next virtual stage's backward) with fixed forward and
backward costs, which gives the bubble and how many micro-batches' activations each rank holds at its
peak. The cost model's closed forms (the bubble (p-1)/(v*m + p-1) of Narayanan et al. 2021, the in-flight
counts of Korthikanti et al. 2022) are tested against this simulation.

"zb-h1" is the zero-bubble schedule of Qi et al. 2024 (arXiv:2401.10241, ZB-H1), the one they size at 1F1B's memory:
the backward splits into B (the gradient of the input, on the critical path) and W (the weight gradient,
which nothing downstream waits for), and rank r runs each W r backward passes late, so that the Ws fill the
drain at the end of the step. Its bubble is (pp-1)(F + B - min(W, F, B)) against 1F1B's (pp-1)(F + B + W).

Virtual stage g = chunk * pp + rank: with v chunks, rank r holds chunks r, r + pp, ... of the model.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from orangetron.spec import rules
from orangetron.spec.variants import SCHEDULES, Schedule


class ScheduleError(rules.LayoutError):
    """A schedule that cannot run; the message names the field, the value and the rule."""


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward, "B" backward (input gradient only under zb-h1), "W" weight gradient (zb-h1)
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class Slot:
    """One action placed on the timeline."""

    rank: int
    action: Action
    start: float
    end: float


def _check(pp: int, microbatches: int, schedule: str, virtual_stages: int) -> Schedule:
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r}: must be a positive integer")
    record = SCHEDULES[schedule]
    rules.virtual_stages_need_chunked_schedule(virtual_stages, schedule, record.chunks)
    record.check(pp, microbatches)
    return record


def actions(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> list[list[Action]]:
    """The ordered actions of every pipeline rank, as the schedule's record lists them (spec/schedules.py)."""
    return _check(pp, microbatches, schedule, virtual_stages).actions(pp, microbatches, virtual_stages)


def gpipe(pp: int, m: int, v: int) -> list[list[Action]]:
    """Every forward, then every backward in reverse."""
    return [[Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in reversed(range(m))]
            for _ in range(pp)]


def one_forward_one_backward(pp: int, m: int, v: int) -> list[list[Action]]:
    """1F1B: pp - r - 1 warmup forwards on rank r, then one forward and one backward in turn."""
    return [one_forward_one_backward_rank(m, warmup=min(pp - r - 1, m), chunks=1, pp=pp) for r in range(pp)]


def zero_bubble_h1(pp: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's forwards and input-gradient backwards, rank r's weight gradients r backwards late."""
    return [_zero_bubble_h1(m, pp, r) for r in range(pp)]


def interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: two extra warmup forwards per rank below, plus a round of the other chunks."""
    return [one_forward_one_backward_rank(m, warmup=min((pp - r - 1) * 2 + (v - 1) * pp, m * v), chunks=v, pp=pp)
            for r in range(pp)]


def peak_held(rank_actions: list[Action], virtual_stages: int) -> float:
    """Most (chunk, micro-batch) pairs a rank's action list holds at once (a forward holds until its backward,
    or its W when the backward splits), in units of the rank's layers (a chunk is 1/v of them)."""
    release = "W" if any(a.kind == "W" for a in rank_actions) else "B"
    held = peak = 0
    for a in rank_actions:
        held += 1 if a.kind == "F" else -1 if a.kind == release else 0
        peak = max(peak, held)
    return peak / virtual_stages


def one_forward_one_backward_rank(m: int, warmup: int, chunks: int, pp: int) -> list[Action]:
    """Warmup forwards, then alternate one forward and one backward, then the remaining backwards."""
    return list(_one_forward_one_backward_order(m, warmup, chunks, pp))


def _zero_bubble_h1(m: int, pp: int, rank: int) -> list[Action]:
    """1F1B's order of forwards and input-gradient backwards, each weight gradient `rank` backwards late."""
    out, waiting = [], []
    for a in _one_forward_one_backward_order(m, warmup=pp - rank - 1, chunks=1, pp=pp):
        out.append(a)
        if a.kind == "B":
            waiting.append(a.microbatch)
            if len(waiting) > rank:
                out.append(Action("W", 0, waiting.pop(0)))
    return out + [Action("W", 0, i) for i in waiting]


def zero_bubble_h1_bubble(pp: int, forward: float, input_grad: float, weight_grad: float) -> float:
    """Idle seconds of each rank in a zb-h1 step (at least pp micro-batches): the drain's Bs wait for the next
    rank as in 1F1B, and each gap takes one deferred W, as long as W fits in it (F and B bound the gaps)."""
    return (pp - 1) * (forward + input_grad - min(weight_grad, forward, input_grad))


def interleaved_prefix(pp: int, microbatches: int, virtual_stages: int, length: int) -> list[list[Action]]:
    """The first `length` actions of every rank in the interleaved schedule (`actions` without the rest)."""
    _check(pp, microbatches, "interleaved", virtual_stages)
    m, v = microbatches, virtual_stages
    return [list(itertools.islice(
        _one_forward_one_backward_order(m, warmup=min((pp - r - 1) * 2 + (v - 1) * pp, m * v), chunks=v, pp=pp),
        length)) for r in range(pp)]


def _one_forward_one_backward_order(m: int, warmup: int, chunks: int, pp: int) -> Iterator[Action]:
    total = m * chunks

    def nth(k: int, backward: bool) -> Action:
        # Micro-batches advance in groups of pp through the chunks (forward: chunk 0 first; backward: last).
        group, within = divmod(k, pp * chunks)
        chunk = within // pp
        if backward:
            chunk = chunks - 1 - chunk
        return Action("B" if backward else "F", chunk, group * pp + within % pp)

    for k in range(warmup):
        yield nth(k, False)
    for k in range(total - warmup):
        yield nth(warmup + k, False)
        yield nth(k, True)
    for k in range(total - warmup, total):
        yield nth(k, True)


def simulate(pp: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1,
             forward_cost: float = 1.0, backward_cost: float = 2.0, weight_cost: float | None = None) -> list[Slot]:
    """Place every action at the earliest time its rank is free and its input has arrived.

    Costs are per chunk (a rank's whole stage costs `forward_cost`, each of its v chunks 1/v of it). Under
    zb-h1 the backward's `weight_cost` (default: half of it) runs as its own W pass after that B.
    """
    weight = backward_cost / 2 if weight_cost is None else weight_cost
    split = SCHEDULES[schedule].split_backward
    if split and not 0 <= weight <= backward_cost:
        raise ScheduleError(f"weight_cost={weight!r}: must lie between 0 and backward_cost={backward_cost!r}")
    cost = {"F": forward_cost, "B": backward_cost - weight if split else backward_cost, "W": weight}
    plan = actions(pp, microbatches, schedule, virtual_stages)
    try:
        return simulate_plan(plan, virtual_stages, cost)
    except ScheduleError:
        raise ScheduleError(f"schedule={schedule!r} deadlocks with pp={pp}, microbatches={microbatches}") from None


def simulate_plan(plan: list[list[Action]], virtual_stages: int, cost: dict[str, float]) -> list[Slot]:
    """`simulate` for given action lists (one per pipeline rank) and per-stage `cost` by kind ("F", "B", "W")."""
    pp, v = len(plan), virtual_stages
    last = v * pp - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    cursor, free = [0] * pp, [0.0] * pp
    slots: list[Slot] = []
    while len(slots) < sum(len(a) for a in plan):
        progressed = False
        for rank in range(pp):
            if cursor[rank] == len(plan[rank]):
                continue
            act = plan[rank][cursor[rank]]
            g = act.chunk * pp + rank
            needs = _needs(act.kind, g, last)
            ready = 0.0 if needs is None else done.get((*needs, act.microbatch))
            if ready is None:
                continue
            start = max(free[rank], ready)
            end = start + cost[act.kind] / v
            done[(act.kind, g, act.microbatch)] = free[rank] = end
            slots.append(Slot(rank, act, start, end))
            cursor[rank] += 1
            progressed = True
        if not progressed:
            raise ScheduleError(f"action lists deadlock with pp={pp}: no rank can start its next action")
    return slots


def _needs(kind: str, g: int, last: int) -> tuple[str, int] | None:
    """The pass (kind, virtual stage) of the same micro-batch that must end before `kind` runs on stage `g`."""
    if kind == "F":
        return ("F", g - 1) if g > 0 else None
    if kind == "W":
        return ("B", g)
    return ("B", g + 1) if g < last else ("F", g)


def bubble_fraction(slots: list[Slot], pp: int) -> float:
    """Idle share of pp ranks over the makespan."""
    makespan = max(s.end for s in slots)
    busy = sum(s.end - s.start for s in slots)
    return 1.0 - busy / (pp * makespan)


def peak_in_flight(slots: list[Slot], rank: int) -> int:
    """Most (chunk, micro-batch) activations `rank` holds at once: from a forward's start to the end of its last
    backward pass (the W under zb-h1, which needs the layer inputs and output gradients)."""
    mine = [s for s in slots if s.rank == rank]
    release = "W" if any(s.action.kind == "W" for s in mine) else "B"
    events = sorted((s.start, 1) if s.action.kind == "F" else (s.end, -1)
                    for s in mine if s.action.kind in ("F", release))
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return peak
