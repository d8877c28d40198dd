"""An optional torch.profiler window over a range of training steps, one Chrome trace per rank."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class ProfilerWindow:
    """Records a torch.profiler trace for the steps in ``train.profile_steps`` (rank-local).

    ``on_step(step)`` is called before each step runs: the window records steps ``start`` up to, not
    including, ``end``. ``close()`` writes a window that the run did not reach the end of.
    """

    def __init__(self, window: tuple[int, int] | None, output: Path, rank: int):
        self.window, self.trace = window, Path(output) / "profile" / f"trace-rank{rank}.json"
        self.profiler: torch.profiler.profile | None = None

    def on_step(self, step: int) -> None:
        """Start the profiler at the window's first step, stop and write it at its end."""
        if self.window and step == self.window[0]:
            self.profiler = torch.profiler.profile(record_shapes=True, profile_memory=True)
            self.profiler.start()
        elif self.window and step == self.window[1] and self.profiler is not None:
            self.close()
            log.info("profiler trace for steps %d-%d written to %s", *self.window, self.trace)

    def close(self) -> None:
        """Stop a running profiler and write its trace (idempotent)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.trace.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.trace))
            self.profiler = None
