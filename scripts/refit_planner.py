"""Refit every fitted constant of the planner from the calibration rows alone and print the values.

The constants, the rows each is fitted on and the fitting rule are in src/orangetron/plan/validation_runs.toml
(`[refit]`, `[[fitted]]`; docs/planner.md, 'Validation protocol'). Only rows whose split is "calibration" may be
named; a constant's value is the point of its grid with the least sum of squared log errors over its rows.
tests/test_plan_validation.py checks that this fit reproduces the shipped values.

    python scripts/refit_planner.py            # fitted and shipped value of each constant
    python scripts/refit_planner.py --curve    # and the loss at every grid point
"""

from __future__ import annotations

import argparse

from orangetron.plan import validation


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
        changed += value != fitted.value
        print(f"{fitted.name} ({', '.join(fitted.presets)}): fitted {value:.2f} on {len(fitted.rows)} calibration "
              f"rows, shipped {fitted.value:.2f}" + ("" if value == fitted.value else "  <- differs"))
    return 1 if changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
