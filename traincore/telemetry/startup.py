"""Where a run's start-up time goes: phase marks from the start of the process to the first step.

A :class:`StartupClock` counts from an origin, by default the moment the kernel started this process (read
from ``/proc``), so the interpreter's own start and every import are part of the figure a user waits for.
Each :meth:`StartupClock.mark` closes the phase that ran since the previous mark; the Trainer marks its phases
(imports, preflight, process group, loader, model, telemetry, checkpoint look-up, first step), logs the
split on rank 0 and writes it to the metric sinks as one record of kind "startup".

A worker forked by ``python -m traincore.train --nproc-per-node N`` continues its launcher's clock
(:meth:`StartupClock.state_dict`): the launcher's imports and preflight, then "launch" up to the worker's
Trainer, so the figure still counts from the command's start.
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """When the kernel started this process, in seconds since the epoch (``time.time()`` clock).

    Read as the process's age, ``/proc/uptime`` minus the start tick in ``/proc/self/stat`` (10 ms
    resolution): the boot time in ``/proc/stat`` has only whole seconds. Where ``/proc`` is missing, the
    time of the first call stands in (the interpreter's start is then not counted).
    """
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # The command name (field 2) may hold spaces: count the fields after its closing parenthesis.
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            age = float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - max(age, 0.0)


class StartupClock:
    """Durations of named start-up phases, each from the previous mark (the first from ``origin``)."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = time.time() if origin is None else origin
        self._last = self.origin
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Close ``phase``: the seconds since the previous mark are its duration."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + max(now - self._last, 0.0)
        self._last = now

    @property
    def total(self) -> float:
        """Seconds from the origin to the last mark."""
        return self._last - self.origin

    def record(self) -> dict[str, float]:
        """The phases as ``<phase>_s`` numbers, plus ``total_s`` and ``origin`` (epoch seconds), for sinks."""
        record = {f"{phase.replace(' ', '_')}_s": round(seconds, 4) for phase, seconds in self.phases.items()}
        return {**record, "total_s": round(self.total, 4), "origin": self.origin}

    def state_dict(self) -> dict:
        """Origin, last mark and phases: what a worker forked by a launcher continues from."""
        return {"origin": self.origin, "last": self._last, "phases": dict(self.phases)}

    def load_state_dict(self, state: dict) -> None:
        """Continue the clock :meth:`state_dict` describes: the next mark counts from its last mark."""
        self.origin, self._last, self.phases = state["origin"], state["last"], dict(state["phases"])

    def describe(self) -> str:
        """One line, e.g. ``start-up 3.1 s to first step: imports 2.2, process group 0.1, ...``."""
        split = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in self.phases.items())
        return f"start-up {self.total:.1f} s to first step: {split} (seconds)"
