"""Refit every fitted constant of the planner from the calibration rows alone and print the values.

The constants, the rows each is fitted on and the fitting rule are in src/orangetron/plan/validation_runs.toml
(`[refit]`, `[[fitted]]` for GPU presets, `[[fitted_efficiency]]` for the compute model's global constants,
`[[fitted_overhead]]` for the memory overhead; docs/planner.md,
'Validation protocol'). Only rows whose split is "calibration" may be named; a constant's value is the point of
its grid with the least sum of squared log errors over its rows, or for a `rule = "bound"` overhead constant
the largest grid point at which no row's need exceeds its published peak (the curve then counts the rows that
do). tests/test_plan_validation.py and tests/test_plan_reserved.py check that the fit reproduces the shipped
values.

    python scripts/refit_planner.py            # fitted and shipped value of each constant
    python scripts/refit_planner.py --curve    # and the loss at every grid point
"""

from __future__ import annotations

import argparse

from orangetron.plan import reserved, validation


def _refit(fitted, where: str, loss, refit, curve: bool) -> bool:
    """Refit one constant (`loss(fitted, value)`, `refit(fitted)`), print it, and say whether it differs from the
    shipped value."""
    if curve:
        for value in validation.grid_points(fitted.grid):
            print(f"  {fitted.name} {_shown(where, value)}: {loss(fitted, value):.5f}")
    value = refit(fitted)
    differs = value != fitted.value
    print(f"{fitted.name} ({where}): fitted {_shown(where, value)} on {len(fitted.rows)} calibration rows, shipped "
          f"{_shown(where, fitted.value)}" + ("  <- differs" if differs else ""))
    return differs


def _shown(where: str, value: float) -> str:
    """A constant as its reader knows it: seconds (a field named `*_s`) in microseconds."""
    return f"{value * 1e6:g} us" if where.endswith("_s") else f"{value:g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curve", action="store_true", help="print the loss at every grid point")
    args = parser.parse_args()
    runs, rows, changed = validation.load_runs(), reserved.load_reserved(), 0
    for fitted in validation.load_fitted():
        changed += _refit(fitted, ", ".join(fitted.presets), lambda f, v: validation.fit_loss(f, v, runs),
                          lambda f: validation.refit(f, runs), args.curve)
    for fitted in validation.load_fitted_efficiency():
        changed += _refit(fitted, f"Efficiency.{fitted.field}",
                          lambda f, v: validation.efficiency_fit_loss(f, v, runs),
                          lambda f: validation.refit_efficiency(f, runs), args.curve)
    for fitted in reserved.load_fitted_overhead():
        changed += _refit(fitted, f"MemoryOverhead.{fitted.field}", lambda f, v: reserved.fit_loss(f, v, rows),
                          lambda f: reserved.refit(f, rows), args.curve)
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
