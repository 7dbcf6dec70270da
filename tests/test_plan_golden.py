"""`estimate --json` and `plan --json` equal, byte for byte, what they printed before the spec refactor
(tests/golden/plan_cli.jsonl, written by scripts/plan_goldens.py --write): a moved formula moves no number."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _goldens_module():
    spec = importlib.util.spec_from_file_location("plan_goldens", ROOT / "scripts" / "plan_goldens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_difference(want: object, got: object, path: str = "") -> str:
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(want) | set(got)):
            if want.get(key, "<missing>") != got.get(key, "<missing>"):
                return _first_difference(want.get(key, "<missing>"), got.get(key, "<missing>"), f"{path}.{key}")
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if w != g:
                return _first_difference(w, g, f"{path}[{i}]")
    return f"{path}: golden {want!r}, now {got!r}"


def test_estimate_and_plan_json_equal_the_goldens():
    goldens = _goldens_module()
    recorded = {tuple(json.loads(line)["argv"]): line for line in goldens.GOLDEN.read_text().splitlines()}
    assert len(recorded) >= 150, "the golden file lost its rows"
    for argv in goldens.commands():
        if tuple(argv) not in recorded:
            continue  # a grid point that failed when the goldens were written
        line = goldens.run(argv)
        assert line is not None, f"{' '.join(argv)} now fails"
        if line != recorded[tuple(argv)]:
            want, got = json.loads(recorded[tuple(argv)]), json.loads(line)
            raise AssertionError(f"{' '.join(argv)}: {_first_difference(want['result'], got['result'])}")
