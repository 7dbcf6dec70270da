"""What every rank is doing, so that a rank that dies or hangs can be named with its step and phase.

Each rank posts its step and phase on a board as it goes: `enter("backward")`. Under the local launcher the
board is a small shared-memory array the parent reads when a rank fails; under torchrun it is the job's
key-value store, which the surviving ranks read when a collective fails. Posting is a no-op until a board is
attached, so one-rank runs and the library's other users pay nothing.

A rank that hangs is found by its peers: their next collective waits for it and times out after the process
group's timeout (`TrainConfig.timeout_s`). The ranks whose collective failed are victims; the rank that is
still running, not waiting, is the one that stopped responding.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

PHASES = (
    "starting", "joining the process group", "setup", "resuming", "data", "forward", "backward",
    "forward and backward (pipeline)", "gradient reduction", "optimizer step", "evaluation", "checkpoint",
    "finishing", "failed in a collective",
)
WAITING = PHASES.index("failed in a collective")
DEFAULT_TIMEOUT_S = 45.0  # a blocked collective fails after this; with the grace, a hang ends within 60 s
FAILURE_GRACE_S = 3.0  # after one rank fails, how long its peers get to report before they are named


class Board(Protocol):
    def post(self, step: int, phase: int) -> None: ...


class SharedBoard:
    """Two integers per rank (step, phase) in shared memory that the launching process reads."""

    def __init__(self, cells: Any, rank: int) -> None:
        self.cells, self.rank = cells, rank

    def post(self, step: int, phase: int) -> None:
        self.cells[2 * self.rank] = step
        self.cells[2 * self.rank + 1] = phase


class StoreBoard:
    """One key per rank in a torch.distributed store ("step phase"), readable by every other rank."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank

    def post(self, step: int, phase: int) -> None:
        self.store.set(f"rank{self.rank}", f"{step} {phase}")

    def read(self, world_size: int) -> dict[int, tuple[int, int]]:
        """(step, phase) of every rank that has posted."""
        posts = {}
        for rank in range(world_size):
            if self.store.check([f"rank{rank}"]):
                step, phase = self.store.get(f"rank{rank}").decode().split()
                posts[rank] = (int(step), int(phase))
        return posts


# This rank's board and step. A rank is a process, and its phases are posted from every part of a step without a
# handle passed through them; `attach(None)` detaches (docs/runtime.md, "Process-wide state").
_board: Board | None = None
_step = 0


def attach(board: Board | None) -> None:
    """Post this process's phases on `board` from now on (None: stop posting)."""
    global _board, _step
    _board, _step = board, 0


def enter(phase: str, step: int | None = None) -> None:
    """This rank now does `phase` (one of PHASES), of optimizer step `step` (1-based) when given."""
    global _step
    if _board is None:
        return
    if step is not None:
        _step = step
    _board.post(_step, PHASES.index(phase))


def doing(step: int, phase: int) -> str:
    """'step 3 (backward)', or the phase alone before the first step."""
    name = PHASES[phase] if 0 <= phase < len(PHASES) else "an unknown phase"
    return f"step {step} ({name})" if step > 0 else name


def is_collective_failure(err: BaseException) -> bool:
    """A collective that timed out or lost a peer: the symptom of another rank's fault, not a cause."""
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        needle in text for needle in ("timed out", "timeout", "connection closed", "connection reset",
                                      "broken pipe", "gloo")
    )


def name_culprits(posts: dict[int, tuple[int, int]], world_size: int, me: int) -> str:
    """Seen from rank `me`, whose collective failed: the ranks that are not waiting in one, with their phase."""
    culprits = [r for r in range(world_size) if r != me and posts.get(r, (0, 0))[1] != WAITING]
    if not culprits:
        return f"rank {me}: a collective failed while every rank was waiting in one"
    return "; ".join(f"rank {r} stopped responding during {doing(*posts.get(r, (0, 0)))}" for r in culprits)


def wait_for_peers() -> None:
    """Give the other victims of a fault time to post that they failed too."""
    time.sleep(FAILURE_GRACE_S)
