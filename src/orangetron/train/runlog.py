"""What a run shows and keeps: losses, tokens/s and MFU per step and running, the progress bar, and the run folder's
config.toml, metrics.jsonl and loss.png."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orangetron.train.config import TrainConfig
from orangetron.train.loss_curve import plot_loss_curve, read_metrics
from orangetron.train.progress import ProgressBar
from orangetron.train.run_folder import describe_data, write_record

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss.png"


@dataclass
class Resumed:
    step: int  # steps already taken
    losses: list[float]  # their losses
    path: Path | None = None  # the checkpoint they come from
    samples: int = 0  # the global sample cursor: samples the steps consumed (the data continues after them)


def final_losses(losses: list[float]) -> dict[str, float]:
    """final_loss: the last step's loss, one batch and noisy; final_loss_mean10: the mean of the last 10
    steps (fewer in a shorter run), the trend the progress bar and the summary show."""
    recent = losses[-10:]
    return {"final_loss": losses[-1], "final_loss_mean10": sum(recent) / len(recent)}


class RunLog:
    """Per-step bookkeeping: losses, tokens/s and MFU (step 0 excluded), progress bar, and the run folder's
    files (config.toml, metrics.jsonl, loss.png), each named on standard error when written."""

    def __init__(self, cfg: TrainConfig, bar: ProgressBar, write: bool = True, start: Resumed | None = None,
                 flops_per_step: float = 0.0, peak_flops: float | None = None):
        self.cfg, self.bar, self.write = cfg, bar, write
        self.first_step = 1 if start is None else start.step + 1  # 1-based number of this run's first step
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.flops_per_step = flops_per_step  # this rank's share of the model FLOPs of one step
        self.peak_flops = peak_flops
        self.losses: list[float] = [] if start is None else list(start.losses)
        self.timed_s, self.timed_tokens, self.timed_flops = 0.0, 0, 0.0
        self.started = time.perf_counter()
        self.file = None

    @property
    def folder(self) -> Path | None:
        return Path(self.cfg.out) if self.cfg.out is not None and self.write else None

    def __enter__(self) -> RunLog:
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            written = write_record(self.cfg, describe_data(self.cfg), self.first_step - 1)
            self.bar.log(f"wrote {written}")
            mode = "a" if self.first_step > 1 else "w"  # a resumed run continues the same file
            if self.first_step > 1:
                _keep_records_before(self.folder / METRICS_FILE, self.first_step)
            self.file = open(self.folder / METRICS_FILE, mode, encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.bar.close()
        if self.file is None:
            return
        self.file.close()
        self.bar.log(f"wrote {self.folder / METRICS_FILE}")
        records = read_metrics(self.folder / METRICS_FILE)
        if exc_type is None and records:
            curve = self.folder / CURVE_FILE
            plot_loss_curve(records, curve, f"{self.cfg.model_config().name}, "
                            f"layout {self.cfg.layout}, {self.cfg.batch_size} x {self.cfg.seq_len} tokens per step")
            self.bar.log(f"wrote {curve}")

    def tokens_per_s(self) -> float | None:
        return self.timed_tokens / self.timed_s if self.timed_s > 0 else None

    def mfu(self) -> float | None:
        """Model FLOPs utilization over the timed steps (the first, which also measures memory, left out)."""
        if not (self.peak_flops and self.timed_s > 0):
            return None
        return self.timed_flops / self.timed_s / self.peak_flops

    def step(self, record: dict[str, Any], seconds: float, flops: float | None = None) -> None:
        """Log one step that took `seconds`; `flops`: this rank's share of its model FLOPs where they are its
        own (packed documents), else `flops_per_step`."""
        flops = self.flops_per_step if flops is None else flops
        self.losses.append(record["loss"])
        step = record["step"]
        if step > self.first_step or self.cfg.steps == self.first_step:
            self.timed_s += seconds
            self.timed_tokens += self.tokens_per_step
            self.timed_flops += flops
        record["tokens"] = step * self.tokens_per_step
        # Running figures (every timed step so far) and this step's alone, side by side; the first step
        # measures memory, so the running ones start at the second (None before).
        record["tokens_per_s"] = self.tokens_per_s()
        record["mfu"] = self.mfu()
        record["step_tokens_per_s"] = self.tokens_per_step / seconds if seconds > 0 else None
        record["step_mfu"] = flops / seconds / self.peak_flops if self.peak_flops and seconds > 0 else None
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
