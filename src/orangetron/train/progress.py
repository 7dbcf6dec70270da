"""A dependency-free progress bar on standard error, quiet enough for logs and CI."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    """Shows `step/total`, the loss (the caller's mean of the last 10 steps) and tokens/s.

    On a terminal the line is redrawn in place with `\\r`; otherwise (a log file, a pipe) one line is
    written each time another ~10% of the steps is done, plus the last step, so logs stay short.
    A disabled bar writes nothing but warnings, and those only where `warns` (on one rank of many).
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool = True, warns: bool = True,
                 width: int = 24):
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.warns = enabled or warns
        self.width = width
        self.tty = enabled and _isatty(self.stream)
        self._next_decile = 1
        self._line_open = False

    def update(self, step: int, loss: float, tokens_per_s: float | None = None) -> None:
        """Report that `step` (1-based) of `total` finished with `loss`."""
        if not self.enabled:
            return
        text = self._format(step, loss, tokens_per_s)
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
            self._line_open = True
        elif step * 10 >= self._next_decile * self.total or step == self.total:
            self.stream.write(text + "\n")
            while self._next_decile * self.total <= step * 10:
                self._next_decile += 1
        self.stream.flush()

    def log(self, message: str) -> None:
        """Write a message on its own line without garbling the bar."""
        if not self.enabled:
            return
        self._end_line()
        self.stream.write(message + "\n")
        self.stream.flush()

    def warn(self, message: str) -> None:
        """A line `log` writes, written by a quiet bar too: a quiet run hides its log, not what may be a mistake."""
        if self.warns:
            self._end_line()
            self.stream.write(f"orangetron train: warning: {message}\n")  # named as the other commands' are
            self.stream.flush()

    def notice(self, message: str) -> None:
        """A line `log` writes, written by a quiet bar too, where `warns`: what the user must do next (a stopped
        run's way to continue), which a quiet run's exit status alone does not say."""
        if self.enabled:
            self.log(message)
        elif self.warns:
            self.stream.write(f"orangetron train: {message}\n")
            self.stream.flush()

    def close(self) -> None:
        """Finish the in-place line so later output starts on a fresh line."""
        if self.enabled:
            self._end_line()
            self.stream.flush()

    def _end_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self._line_open = False

    def _format(self, step: int, loss: float, tokens_per_s: float | None) -> str:
        filled = self.width * min(step, self.total) // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        digits = len(str(self.total))
        text = f"[{bar}] step {step:>{digits}}/{self.total}  loss_mean10 {loss:.4f}"  # as the summary names it
        if tokens_per_s is not None:
            text += f"  {tokens_per_s:,.0f} tok/s"
        return text


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
