"""Stopping a run on SIGINT or SIGTERM after the step its ranks are taking, with that step checkpointed.

Ctrl-C (SIGINT) or a scheduler's SIGTERM (Slurm's at the time limit, torchrun's agent passing on its own) asks
the run to stop. The handler only notes the signal; after each step the trainer asks whether any rank has been
asked (`agreed`: one all-reduce of the signal numbers, MAX), so every rank stops after the same step even when
the signal reaches them at different times. The command then exits 128 + the signal's number (130, 143), as a
process the signal had ended would.

A second SIGINT aborts at once (KeyboardInterrupt), the usual meaning of pressing Ctrl-C again. A repeated
SIGTERM is the same request: a scheduler may deliver it to every process of a job and torchrun's agent passes
on its own copy as well, and both escalate to SIGKILL themselves after their grace period.

Under the local launcher the ranks run in process groups of their own, as torchrun's workers do, so a
terminal's Ctrl-C reaches the launcher alone; it passes each signal on to every rank once (`relay_to`).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from types import FrameType

import torch

from orangetron import comm
from orangetron.mesh import MeshGroup

SIGNALS = (signal.SIGINT, signal.SIGTERM)

# The stop signal this process received while `stop_on_signals` handlers were installed (0: none), and the
# processes it passes signals on to. A handler runs between two bytecodes of the main thread, wherever the run
# is, with no handle to reach it by; each is cleared when its block ends (docs/runtime.md, "Process-wide state").
_requested = 0
_relay_pids: tuple[int, ...] = ()


def _handle(signum: int, frame: FrameType | None) -> None:
    global _requested
    for pid in _relay_pids:
        with suppress(ProcessLookupError):  # a rank that has already exited
            os.kill(pid, signum)
    if signum == signal.SIGINT and _requested:
        raise KeyboardInterrupt  # Ctrl-C again: abort now
    _requested = _requested or signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM only ask for a stop (`requested`); the previous handlers come
    back after it. Blocks nest and share the request. Outside the main thread, where Python delivers no
    signals, it installs nothing."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _handle) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if previous[signal.SIGINT] is not _handle:  # the outermost block
            _requested = 0


@contextmanager
def relay_to(pids: Sequence[int]) -> Iterator[None]:
    """Within the block, pass every SIGINT and SIGTERM this process receives on to `pids` (the launcher's
    ranks), and take them as stop requests here as well (so a second SIGINT aborts the launcher too)."""
    global _relay_pids
    with stop_on_signals():
        _relay_pids = tuple(pids)
        try:
            yield
        finally:
            _relay_pids = ()


def requested() -> int:
    """The stop signal this process has received (0: none)."""
    return _requested


def agreed(group: MeshGroup) -> int:
    """The stop signal that any rank of `group` has received, the same on every rank (0: none).

    One all-reduce (MAX) of an int64 per rank, outside any `comm.measure()` scope: a check, not training
    traffic, like the loss verdict of `train.step`, so it reaches the byte ledger but not the step's records
    that the cost model predicts.
    """
    with comm.unmeasured():
        return int(comm.all_reduce_max(torch.tensor([_requested]), group)[0])


def name(signum: int) -> str:
    """'SIGINT' for 2."""
    return signal.Signals(signum).name


def exit_code(signal_name: str) -> int:
    """The exit status of a run stopped by `signal_name` ('SIGINT': 130, 'SIGTERM': 143), as a shell reports
    a process that the signal ended."""
    return 128 + signal.Signals[signal_name].value
