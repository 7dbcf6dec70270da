"""What a run shows and keeps per step: losses, tokens/s, the progress bar and metrics.jsonl."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orangetron.train.config import TrainConfig
from orangetron.train.progress import ProgressBar


@dataclass
class Resumed:
    step: int  # steps already taken
    losses: list[float]  # their losses
    path: Path | None = None  # the checkpoint they come from


def final_losses(losses: list[float]) -> dict[str, float]:
    """final_loss: the last step's loss, one batch and noisy; final_loss_mean10: the mean of the last 10
    steps (fewer in a shorter run), the trend the progress bar and the summary show."""
    recent = losses[-10:]
    return {"final_loss": losses[-1], "final_loss_mean10": sum(recent) / len(recent)}



class RunLog:
    """Per-step bookkeeping: losses, tokens/s (step 0 excluded), progress bar, metrics.jsonl."""

    def __init__(self, cfg: TrainConfig, bar: ProgressBar, write: bool = True, start: Resumed | None = None):
        self.cfg, self.bar, self.write = cfg, bar, write
        self.first_step = 1 if start is None else start.step + 1  # 1-based number of this run's first step
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.losses: list[float] = [] if start is None else list(start.losses)
        self.timed_s, self.timed_tokens = 0.0, 0
        self.started = time.perf_counter()
        self.file = None

    def __enter__(self) -> RunLog:
        if self.cfg.out is not None and self.write:
            folder = Path(self.cfg.out)
            folder.mkdir(parents=True, exist_ok=True)
            mode = "a" if self.first_step > 1 else "w"  # a resumed run continues the same file
            if self.first_step > 1:
                _keep_records_before(folder / "metrics.jsonl", self.first_step)
            self.file = open(folder / "metrics.jsonl", mode, encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()

    def tokens_per_s(self) -> float | None:
        return self.timed_tokens / self.timed_s if self.timed_s > 0 else None

    def step(self, record: dict[str, Any], seconds: float) -> None:
        self.losses.append(record["loss"])
        step = record["step"]
        if step > self.first_step or self.cfg.steps == self.first_step:
            self.timed_s += seconds
            self.timed_tokens += self.tokens_per_step
        record["tokens"] = step * self.tokens_per_step
        record["tokens_per_s"] = self.tokens_per_s()
        # Single-batch losses are noisy; the bar shows the mean of the last 10 so the trend reads.
        recent = self.losses[-10:]
        self.bar.update(step, sum(recent) / len(recent), record["tokens_per_s"])
        if record.get("eval_loss") is not None:
            self.bar.log(f"step {step}: held-out loss {record['eval_loss']:.4f}")
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()


def _keep_records_before(path: Path, step: int) -> None:
    """Drop the records of `step` and later: a run resumed from an older checkpoint takes those steps again,
    and a line cut short by a crash is dropped with them."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            if json.loads(line)["step"] < step and line.endswith("\n"):
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    path.write_text("".join(kept), encoding="utf-8")
