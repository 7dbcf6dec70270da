"""Pipeline schedules: dependencies hold, and the simulated bubble and in-flight activations equal the cost
model's closed forms."""

import pytest

from orangetron.plan.activations import in_flight
from orangetron.spec.options import Degrees, Job
from orangetron.spec.rules import LayoutError, RuleError
from orangetron.spec.schedule import ScheduleError, actions, bubble_fraction, peak_in_flight, simulate

CASES = [("gpipe", 1, 4, 8), ("gpipe", 1, 3, 2), ("1f1b", 1, 4, 8), ("1f1b", 1, 4, 2), ("1f1b", 1, 8, 16),
         ("interleaved", 2, 4, 8), ("interleaved", 2, 4, 4), ("interleaved", 3, 2, 6), ("interleaved", 4, 4, 12)]


@pytest.mark.parametrize("schedule, v, pp, m", CASES)
def test_every_pass_runs_once_after_its_inputs(schedule, v, pp, m):
    slots = simulate(pp, m, schedule, v)
    end = {(s.action.kind, s.action.chunk * pp + s.rank, s.action.microbatch): s.end for s in slots}
    assert len(end) == len(slots) == 2 * pp * v * m  # every (pass, virtual stage, micro-batch) exactly once
    for s in slots:
        g, i = s.action.chunk * pp + s.rank, s.action.microbatch
        if s.action.kind == "F" and g > 0:
            assert s.start >= end[("F", g - 1, i)]
        if s.action.kind == "B":
            assert s.start >= end[("B", g + 1, i)] if g < v * pp - 1 else s.start >= end[("F", g, i)]
    for rank in range(pp):  # one pass at a time per rank
        mine = sorted((s.start, s.end) for s in slots if s.rank == rank)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:], strict=False))


@pytest.mark.parametrize("schedule, v, pp, m", CASES)
def test_simulation_equals_the_cost_models_closed_forms(schedule, v, pp, m):
    slots = simulate(pp, m, schedule, v, forward_cost=1.0, backward_cost=2.0)
    # Narayanan et al. 2021: a step takes (m + (pp-1)/v) stage times, so the bubble is (pp-1)/(v*m + pp-1).
    assert max(s.end for s in slots) == pytest.approx((m + (pp - 1) / v) * 3.0)
    assert bubble_fraction(slots, pp) == pytest.approx((pp - 1) / (v * m + pp - 1))
    job = Job(seq_len=8, global_batch=m, pp_schedule=schedule, virtual_stages=v)
    deg = Degrees(pp=pp)
    for rank in range(pp):  # the activation model's in-flight counts, in chunk-micro-batches
        assert peak_in_flight(slots, rank) == pytest.approx(in_flight(deg, job, rank) * v), f"rank {rank}"


def test_one_f_one_b_order_by_hand():
    # pp=2, m=3: rank 0 warms up with one forward, then alternates; rank 1 alternates from the start.
    names = [[f"{a.kind}{a.microbatch}" for a in rank] for rank in actions(2, 3, "1f1b")]
    assert names == [["F0", "F1", "B0", "F2", "B1", "B2"], ["F0", "B0", "F1", "B1", "F2", "B2"]]


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(pp=0, microbatches=4), r"pp=0: must be a positive integer"),
    (dict(pp=2, microbatches=4, schedule="zigzag"), r"pp_schedule='zigzag': must be one of gpipe"),
    (dict(pp=2, microbatches=4, virtual_stages=2), r"virtual_stages=2: needs pp_schedule 'interleaved'"),
    (dict(pp=4, microbatches=6, schedule="interleaved", virtual_stages=2), r"microbatches=6: .* multiple of pp=4"),
])
def test_bad_schedules(kwargs, pattern):
    with pytest.raises(LayoutError, match=pattern):  # ScheduleError and the shared RuleError alike
        actions(**kwargs)


def test_schedule_command(capsys, tmp_path):
    import json

    from orangetron.cli import main

    chart = tmp_path / "s.png"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "-o", str(chart), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bubble_fraction"] == pytest.approx(3 / 11) and result["peak_in_flight"] == [4, 3, 2, 1]
    assert result["order"][3][:4] == ["F0", "B0", "F1", "B1"]
    assert chart.read_bytes()[:4] == b"\x89PNG"
    drawn = chart.read_bytes()
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "-o", str(chart)]) == 2  # never replaced unasked
    assert "exists; choose another name, or add --overwrite" in capsys.readouterr().err and chart.read_bytes() == drawn
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "-o", str(chart), "--overwrite"]) == 0
    assert (tmp_path / "s.png.previous-1").read_bytes() == drawn and "the former file moved to" in \
        capsys.readouterr().out
    assert main(["schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved",
                 "--virtual-stages", "2"]) == 2
    assert "microbatches=6" in capsys.readouterr().err


def test_interleaved_peak_walks_the_same_actions_for_any_number_of_micro_batches() -> None:
    """The activation peak walks a prefix taken from a shorter schedule; it must be the long schedule's own."""
    from orangetron.plan.activations import _interleaved_prefix

    for pp in (2, 3, 4):
        for v in (2, 3):
            length = 16 * pp * v
            for m in range(pp, 40 * pp + 1, pp):
                full = actions(pp, m, "interleaved", v)
                for stage in range(pp):
                    assert list(_interleaved_prefix(pp, m, v, stage)) == full[stage][:length], (pp, v, m, stage)


# ---- zb-h1: the backward split into B (input gradient) and W (weight gradient) ------------------------------
ZB_CASES = [(2, 2), (2, 5), (3, 3), (4, 4), (4, 9), (8, 8), (8, 19)]
ZB_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.8), (2.0, 2.0, 1.0), (1.0, 0.5, 1.5), (0.5, 3.0, 2.0), (3.0, 1.0, 0.25)]


@pytest.mark.parametrize("pp, m", ZB_CASES)
def test_zero_bubble_h1_runs_every_pass_once_after_its_inputs_and_holds_what_1f1b_holds_on_stage_0(pp, m):
    slots = simulate(pp, m, "zb-h1", forward_cost=1.0, backward_cost=2.0, weight_cost=0.75)
    end = {(s.action.kind, s.rank, s.action.microbatch): s.end for s in slots}
    assert len(end) == len(slots) == 3 * pp * m
    for s in slots:
        r, i = s.rank, s.action.microbatch
        need = {"F": ("F", r - 1) if r else None, "B": ("B", r + 1) if r < pp - 1 else ("F", r), "W": ("B", r)}
        if need[s.action.kind]:
            assert s.start >= end[(*need[s.action.kind], i)]
        assert s.end - s.start == {"F": 1.0, "B": 1.25, "W": 0.75}[s.action.kind]
    job = Job(seq_len=8, global_batch=m, pp_schedule="zb-h1")
    for rank in range(pp):  # a micro-batch is held from its forward to its W: pp of them on every rank
        assert peak_in_flight(slots, rank) == pp == in_flight(Degrees(pp=pp), job, rank)


@pytest.mark.parametrize("pp, m", ZB_CASES)
@pytest.mark.parametrize("f, b, w", ZB_COSTS)
def test_zero_bubble_h1_makespan_equals_its_closed_form(pp, m, f, b, w):
    from orangetron.spec.schedule import zero_bubble_h1_bubble

    slots = simulate(pp, m, "zb-h1", forward_cost=f, backward_cost=b + w, weight_cost=w)
    assert max(s.end for s in slots) == pytest.approx(m * (f + b + w) + zero_bubble_h1_bubble(pp, f, b, w))


def test_zero_bubble_h1_by_hand():
    """pp=2, m=2, F = B = W = 1. Rank 1 runs each W one backward late: F0 B0 F1 B1 W0 W1, from t=1 to 7.
    Rank 0 runs F0 F1, waits for rank 1's B0 (t=3), then B0 W0 and B1 (rank 1's B1 ended at 5) and W1: both
    end at 7, where 1F1B (backward 2) ends at 9 and the closed form gives 2 * 3 + (2 - 1)(1 + 1 - 1) = 7."""
    names = [[f"{a.kind}{a.microbatch}" for a in rank] for rank in actions(2, 2, "zb-h1")]
    assert names == [["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "B0", "F1", "B1", "W0", "W1"]]
    slots = simulate(2, 2, "zb-h1", forward_cost=1.0, backward_cost=2.0, weight_cost=1.0)
    assert [(s.start, s.end) for s in sorted(slots, key=lambda s: (s.rank, s.start)) if s.rank == 0] == \
        [(0, 1), (1, 2), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert max(s.end for s in simulate(2, 2, "1f1b", forward_cost=1.0, backward_cost=2.0)) == 9


def test_zero_bubble_h1_refuses_fewer_micro_batches_than_stages_and_a_w_longer_than_the_backward():
    with pytest.raises(RuleError, match=r"microbatches=3: the zb-h1 schedule needs at least pp=4"):
        actions(4, 3, "zb-h1")
    with pytest.raises(ScheduleError, match=r"weight_cost=2.0: must lie between 0 and backward_cost=1.0"):
        simulate(2, 2, "zb-h1", backward_cost=1.0, weight_cost=2.0)


def test_schedule_command_zero_bubble_h1(capsys):
    import json

    from orangetron.cli import main

    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb-h1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # F = B = W = 1: idle (4 - 1) * 1 per rank over a makespan of 8 * 3 + 3.
    assert result["bubble_fraction"] == pytest.approx(3 / 27) == result["formula_bubble_fraction"]
    assert result["peak_in_flight"] == [4, 4, 4, 4] and result["order"][3][:6] == ["F0", "B0", "F1", "B1", "F2", "B2"]


def test_a_schedule_without_formulas_is_priced_from_its_action_lists():
    """A registered schedule that gives no in-flight or held-output counts gets them read off its actions:
    interleaved's, so read, equal its closed forms (Korthikanti et al.) on every stage."""
    from dataclasses import replace

    from orangetron.plan.activations import head_in_flight
    from orangetron.spec.variants import SCHEDULES

    bare = replace(SCHEDULES["interleaved"], name="interleaved-bare", in_flight=None, held_outputs=None)
    with SCHEDULES.temporarily(bare):
        for pp, v, m in ((2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6)):
            for stage in range(pp):
                deg = Degrees(pp=pp)
                jobs = [Job(seq_len=64, microbatches=m, virtual_stages=v, pp_schedule=s)
                        for s in ("interleaved", "interleaved-bare")]
                assert in_flight(deg, jobs[1], stage) == in_flight(deg, jobs[0], stage), (pp, v, m, stage)
            assert head_in_flight(deg, jobs[1]) == head_in_flight(deg, jobs[0]) == 1
    assert "interleaved-bare" not in SCHEDULES
