"""Golden outputs of `estimate --json` and `plan --json` over every preset and a fixed grid of layouts.

`python scripts/plan_goldens.py --write` records them in tests/golden/plan_cli.jsonl; tests/test_plan_golden.py
runs the same commands and requires byte-identical lines, so a refactor of the cost model cannot move a number
unnoticed. Only configurations that price without error are kept; `plan`'s search time is dropped (a timing).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "plan_cli.jsonl"

LAYOUTS = [
    "--tp 1 --dp 8",
    "--tp 8 --sequence-parallel --pp 4 --dp 2 --zero-stage 1 --recompute full --global-batch 64",
    "--tp 4 --cp 2 --pp 2 --virtual-stages 2 --dp 2 --distributed-optimizer --global-batch 32 --seq 16384",
    "--tp 2 --cp 4 --cp-mode allgather --dp 2 --zero-stage 3 --seq 32768",
    "--tp 2 --cp 4 --cp-mode ulysses --dp 2 --zero-stage 2 --seq 32768 --sequence-parallel",
    "--tp 2 --cp 4 --cp-mode usp --ulysses-degree 2 --dp 2 --seq 32768 --recompute selective",
    "--tp 2 --cp 2 --cp-mode rsa --dp 2 --attention-kernel eager --seq 8192",
    "--tp 4 --pp 4 --dp 4 --pp-schedule gpipe --global-batch 64",
    "--tp 4 --pp 4 --dp 4 --pp-schedule zb-h1 --global-batch 64",
    "--tp 8 --pp 2 --dp 4 --recompute full --recompute-layers 1 --fp8 --fp8-recipe blockwise --global-batch 64",
    "--tp 2 --sequence-parallel --pp 2 --dp 16 --ep 8 --global-batch 64",
    "--tp 2 --sequence-parallel --pp 2 --dp 16 --ep 8 --ep-overlap-chunks 2 --grad-bucket-numel 1000000",
    "--tp 2 --sequence-parallel --pp 2 --dp 16 --ep 8 --dispatcher capacity --capacity-factor 1.25",
    "--tp 2 --sequence-parallel --pp 2 --dp 16 --ep 8 --dispatcher allgather --zero-stage 3",
    "--tp 1 --pp 4 --dp 16 --ep 16 --dispatcher deepep --global-batch 128",
    "--tp 1 --pp 4 --dp 16 --ep 16 --dispatcher deepep --ep-comm-sms-reserved --transport ibgda",
    "--tp 4 --cp 2 --dp 8 --ep 4 --etp 4 --sequence-parallel",
    "--tp 4 --cp 1 --dp 8 --ep 8 --edp 4 --etp 1 --sequence-parallel",
]
GPU_LAYOUT = "--tp 8 --sequence-parallel --pp 2 --dp 2 --zero-stage 1 --global-batch 32"


def commands() -> list[list[str]]:
    """Every command the goldens cover, in a fixed order."""
    from orangetron.spec.hardware import gpu_names
    from orangetron.spec.model import DualEncoderSpec, load_model, preset_names

    out: list[list[str]] = []
    for name in preset_names():
        if isinstance(load_model(name), DualEncoderSpec):
            out.append(["plan", "--model", name, "--gpus", "16", "--json"])
            continue
        out += [["estimate", "--model", name, *layout.split(), "--json"] for layout in LAYOUTS]
        out.append(["plan", "--model", name, "--gpus", "64", "--top", "5", "--json"])
    out += [["estimate", "--model", "llama3-8b", "--gpu", gpu, *GPU_LAYOUT.split(), "--json"] for gpu in gpu_names()]
    out.append(["plan", "--model", "llama3-70b", "--gpus", "128", "--seq", "8192", "--fp8", "--top", "5", "--json"])
    return out


def run(argv: list[str]) -> str | None:
    """The command's JSON line with the search time dropped, or None when it fails."""
    from orangetron.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(argv)
    if rc:
        return None
    result = json.loads(stdout.getvalue().strip().splitlines()[-1])
    result.pop("search_s", None)
    return json.dumps({"argv": argv, "result": result}, sort_keys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the goldens (only before a refactor)")
    args = parser.parse_args()
    lines = [line for line in map(run, commands()) if line is not None]
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} goldens" + (f" written to {GOLDEN}" if args.write else ""))


if __name__ == "__main__":
    main()
