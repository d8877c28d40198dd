"""Staging progress, for every source: a bar redrawn in place on a terminal, else log lines.

A large source stages for minutes (30 GB of 4096 px images took 3), so silence reads as a hang. On a
terminal the bar is redrawn at most every BAR_EVERY_S; elsewhere (a pod's log, a Slurm output file,
CI) a line every LINE_EVERY_S says how many samples are done, at what rate, and the time left.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_EVERY_S = 0.2
LINE_EVERY_S = 10.0
BAR_WIDTH = 30


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class ProgressMeter:
    """Counts ``total`` samples as they are staged and shows how far it got."""

    def __init__(self, total: int, report: Callable[[str], None], stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.report, self.clock = max(total, 1), report, clock
        self.stream = stream if stream is not None else sys.stderr
        self.bar = self.stream.isatty()
        self.done = 0
        self.start = self._shown = clock()

    def advance(self, samples: int) -> None:
        """``samples`` more are staged; redraw or report when it is time."""
        self.done += samples
        now = self.clock()
        if now - self._shown >= (BAR_EVERY_S if self.bar else LINE_EVERY_S) or self.done >= self.total:
            self._shown = now
            self._show(now)

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.bar:
            self.stream.write("\n")
            self.stream.flush()

    def status(self, now: float) -> str:
        """``1,234 / 5,000 samples (25%), 410 samples/s, 9s left``."""
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "done" if self.done >= self.total else f"{_duration(left)} left" if rate > 0 else "..."
        return (f"{self.done:,} / {self.total:,} samples ({100 * self.done / self.total:.0f}%), "
                f"{rate:,.0f} samples/s, {eta}")

    def _show(self, now: float) -> None:
        if self.bar:
            filled = int(BAR_WIDTH * min(self.done / self.total, 1.0))
            self.stream.write(f"\rstaging [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.status(now)}")
            self.stream.flush()
        else:
            self.report(f"staging: {self.status(now)}")
