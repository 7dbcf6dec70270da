"""The loss curve of a run folder as a PNG: training loss per step (and its 10-step mean), held-out loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, one per step, in step order."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_loss_curve(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Draw `records` (metrics.jsonl rows) to `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
    held_out = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="training loss")
    ax.plot(steps, smooth, color="tab:blue", linewidth=1.5, label="mean of the last 10 steps")
    if held_out:
        ax.plot(*zip(*held_out, strict=True), "o-", color="tab:orange", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross entropy (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
