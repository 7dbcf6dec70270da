"""Whole-GPU memory against published figures: the `[[reserved]]` rows of src/orangetron/plan/validation_runs.toml
(torchtitan's peaks of reserved memory, and layouts published as out of memory), and the overhead fraction
fitted on the calibration ones (docs/planner.md, 'Validation protocol'). Bands are what the current figures
satisfy, so a change that moves them fails here."""

from __future__ import annotations

from dataclasses import replace
from datetime import date

import pytest

from orangetron.plan import reserved
from orangetron.plan.memory import memory_per_gpu
from orangetron.plan.overhead import DEFAULT_OVERHEAD, NO_OVERHEAD
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job

ROWS = reserved.load_reserved()
PEAKS = [r for r in ROWS if r.metric == "reserved_gib"]
OOM = [r for r in ROWS if r.metric == "oom"]
FITTED = reserved.load_fitted_overhead()
GIB = 1024**3
# The splits the rule gave the peak rows (alternate in the source's order, calibration first), in file order
# after Tables 1 and 3 left, then those tables' four BF16 rows, added later (2026-12-07) and so validation rows:
# a row cannot move to the other split.
SPLIT_BY_RULE = "vcvccvcvcvcv" + "vvvv"
REFIT = date(2026, 12, 3)  # the overhead's fit; rows added after it are reported apart
# torch.compile's runs of Tables 1 and 3 reserved 5.4 and 5.0 GiB less than the eager ones beside them, which the
# planner prices alike: each reserved less than the fit check needs. Strict: a change that makes them hold says so.
BELOW_THE_NEED = {"torchtitan Llama 3.1 8B FSDP + torch.compile, 8 H100, op-level selective checkpointing",
                  "torchtitan Llama 3.1 8B FSDP + torch.compile, 128 H100, op-level selective checkpointing"}


def test_rows_have_a_source_a_date_and_the_split_of_the_rule():
    assert len({r.name for r in ROWS}) == len(ROWS)
    for row in ROWS:
        assert row.source and row.added <= date.today() and row.split in ("calibration", "validation"), row.name
    assert "".join(r.split[0] for r in PEAKS) == SPLIT_BY_RULE
    assert all(r.split == "validation" and r.published == 0 for r in OOM)
    assert len(PEAKS) == 16 and len(OOM) == 3


def test_error_and_fit_check_by_hand():
    """A tiny model on a GPU of 1 GiB: the predicted bytes are the tensors plus 1 GiB of context (one rank, no
    groups) plus 19% of activations and buffers; published 10% above that is an error of 1/1.1 - 1."""
    model = ModelSpec(name="t", hidden_size=64, num_layers=2, num_heads=4, vocab_size=256, ffn_hidden_size=256)
    job = Job(seq_len=128)
    tensors = memory_per_gpu(model, Degrees(), job)
    expected = tensors["total"] + GIB + int(0.19 * (tensors["activations"] + tensors.get("buffers", 0)))
    row = reserved.ReservedRow("t", "g", "validation", date(2026, 12, 3), "s", "reserved_gib",
                               1.1 * expected / GIB, "h100", model, Degrees(), job, gpu_memory_gib=1.0)
    assert reserved.predicted_bytes(row) == expected
    assert reserved.reserved_error(row) == pytest.approx(1 / 1.1 - 1)
    assert not reserved.judged_fitting(row)  # over 1 GiB with the context alone
    assert reserved.judged_fitting(row, NO_OVERHEAD)
    # The fit check counts 2% of activations and buffers, not 19%: a GPU between the two totals holds the layout.
    need = tensors["total"] + GIB + int(0.02 * (tensors["activations"] + tensors.get("buffers", 0)))
    assert reserved.needed_bytes(row) == need < expected
    roomy = replace(row, gpu_memory_gib=(need + expected) / 2 / GIB)
    assert reserved.judged_fitting(roomy) and reserved.predicted_bytes(roomy) > reserved.capacity_bytes(roomy)


@pytest.mark.parametrize("row", OOM, ids=lambda r: r.name)
def test_layouts_published_as_out_of_memory_are_judged_not_fitting(row):
    assert not reserved.judged_fitting(row)


@pytest.mark.parametrize("fitted", FITTED, ids=lambda f: f.name)
def test_the_fitted_field_names_every_calibration_peak_and_is_shipped(fitted):
    calibration = {r.name for r in PEAKS if r.split == "calibration"}
    assert set(fitted.rows) == calibration and len(fitted.rows) == len(calibration) > 0
    assert getattr(DEFAULT_OVERHEAD, fitted.field) == fitted.value


@pytest.mark.parametrize("fitted", FITTED, ids=lambda f: f.name)
def test_refit_from_calibration_rows_reproduces_the_shipped_value(fitted):
    value = reserved.refit(fitted, ROWS)
    assert value == fitted.value
    low, high, _ = fitted.grid
    assert low < value < high  # a minimum, not an edge of the grid


def test_refit_refuses_a_validation_row():
    validation_row = next(r.name for r in PEAKS if r.split == "validation")
    with pytest.raises(ValueError, match="outside the calibration split"):
        reserved.refit(replace(FITTED[0], rows=(*FITTED[0].rows, validation_row)), ROWS)


def test_refit_moves_with_the_published_figures():
    """Published peaks 20% higher pull the fraction up, 20% lower push it down: the fit reads the rows."""
    fitted = FITTED[0]
    for scale, moves in ((1.2, lambda v: v > fitted.value), (0.8, lambda v: v < fitted.value)):
        scaled = [replace(r, published=r.published * scale) if r.name in fitted.rows else r for r in ROWS]
        assert moves(reserved.refit(fitted, scaled)), scale


@pytest.mark.parametrize("row", [pytest.param(r, marks=pytest.mark.xfail(
    strict=True, reason="torch.compile's memory is not priced apart")) if r.name in BELOW_THE_NEED else r
    for r in PEAKS], ids=lambda r: r.name)
def test_no_published_peak_is_below_what_the_fit_check_needs(row):
    """A run reserves at least what it needs: the pressured share is bounded on the calibration peaks, and the
    held-out ones must hold the bound too."""
    assert reserved.needed_bytes(row) <= row.published * GIB


def test_a_bound_moves_with_the_published_figures_and_refuses_what_no_value_meets():
    (bound,) = [f for f in FITTED if f.rule == "bound"]
    higher = [replace(r, published=r.published * 1.05) if r.name in bound.rows else r for r in ROWS]
    assert reserved.refit(bound, higher) > bound.value
    lower = [replace(r, published=r.published * 0.9) if r.name in bound.rows else r for r in ROWS]
    with pytest.raises(ValueError, match="every grid value"):
        reserved.refit(bound, lower)
    with pytest.raises(ValueError, match="rule"):
        replace(bound, rule="median")


def _mean_worst(split: str, added_after_the_refit: bool = False) -> tuple[float, float]:
    errors = [abs(reserved.reserved_error(r)) for r in PEAKS
              if r.split == split and (r.added > REFIT) == added_after_the_refit]
    return sum(errors) / len(errors), max(errors)


def test_peaks_stay_inside_their_bands():
    """In sample 11.6% / 17.1% (mean / worst |error|), held out 6.7% / 11.8%, with torchtitan's gradient and
    loss paths priced (docs/planner.md, section 6); 26.7% / 42.1% and 23.7% / 51.1% without them. Added after
    the refit, reported apart: Tables 1 and 3 under op-level checkpointing, 13.2% / 18.4%, every one pessimistic."""
    mean, worst = _mean_worst("calibration")
    assert mean <= 0.12 and worst <= 0.18
    mean, worst = _mean_worst("validation")
    assert mean <= 0.07 and worst <= 0.12
    mean, worst = _mean_worst("validation", added_after_the_refit=True)
    assert mean <= 0.14 and worst <= 0.19
    assert all(reserved.reserved_error(r) > 0 for r in PEAKS if r.added > REFIT)
