"""The README's walk-through block, run as a new user would: own data, custom model, stop, resume, repeat,
extend on another layout, sample. Each command is the README's own text; only `.venv/bin/orangetron` is this
checkout's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _walkthrough() -> str:
    readme = (REPO / "README.md").read_text()
    marker = readme.index("<!-- walkthrough:")
    return re.search(r"```bash\n(.*?)```", readme[marker:], re.S).group(1)


def _losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_the_readme_walkthrough_runs_and_does_what_it_says(tmp_path) -> None:
    launcher = tmp_path / ".venv" / "bin" / "orangetron"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m orangetron "$@"\n')
    launcher.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(["bash", "-e", "-c", _walkthrough()], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    mine, again = tmp_path / "runs" / "mine", tmp_path / "runs" / "again"
    losses = _losses(mine)
    assert len(losses) == 80 and (mine / "checkpoints" / "step-00000080").is_dir()
    assert _losses(again) == losses[:60]  # stopped, resumed and repeated from the record: bitwise one run
    record = tomllib.loads((mine / "config.toml").read_text())
    assert record["model"]["hidden_size"] == 64 and record["data_record"]["files"][0]["path"] == str(
        tmp_path / "mine.txt")
    change = json.loads((mine / "changes.jsonl").read_text())
    assert change == {"from_step": 61, "changed": {"steps": [60, 80], "schedule_steps": [None, 60], "dp": [1, 2]}}
    assert done.stdout.startswith("the quick brown") and len(done.stdout.strip()) > len("the quick brown")
