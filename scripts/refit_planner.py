"""Refit every fitted constant of the planner from the calibration rows alone and print the values.

The constants, the rows each is fitted on and the fitting rule are in src/orangetron/plan/validation_runs.toml
(`[refit]`, `[[fitted]]` for GPU presets, `[[fitted_overhead]]` for the memory overhead; docs/planner.md,
'Validation protocol'). Only rows whose split is "calibration" may be named; a constant's value is the point of
its grid with the least sum of squared log errors over its rows. tests/test_plan_validation.py checks that this
fit reproduces the shipped values.

    python scripts/refit_planner.py            # fitted and shipped value of each constant
    python scripts/refit_planner.py --curve    # and the loss at every grid point
"""

from __future__ import annotations

import argparse

from orangetron.plan import reserved, validation


def _report(name: str, where: str, value: float, shipped: float, rows: int) -> bool:
    differs = value != shipped
    print(f"{name} ({where}): fitted {value:.2f} on {rows} calibration rows, shipped {shipped:.2f}"
          + ("  <- differs" if differs else ""))
    return differs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curve", action="store_true", help="print the loss at every grid point")
    args = parser.parse_args()
    runs, changed = validation.load_runs(), 0
    for fitted in validation.load_fitted():
        if args.curve:
            for value in validation.grid_values(fitted):
                print(f"  {fitted.name} {value:.2f}: {validation.fit_loss(fitted, value, runs):.5f}")
        value = validation.refit(fitted, runs)
        changed += _report(fitted.name, ", ".join(fitted.presets), value, fitted.value, len(fitted.rows))
    rows = reserved.load_reserved()
    for fitted in reserved.load_fitted_overhead():
        if args.curve:
            for value in validation.grid_points(fitted.grid):
                print(f"  {fitted.name} {value:.2f}: {reserved.fit_loss(fitted, value, rows):.5f}")
        value = reserved.refit(fitted, rows)
        changed += _report(fitted.name, f"MemoryOverhead.{fitted.field}", value, fitted.value, len(fitted.rows))
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
