"""Tools the fault-injection tests share: real processes, killed the way nodes die, and CLI runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Tiny, fast and deterministic: a CNN of width 8 on 12x12 synthetic images, logging every step.
TINY = {"model": {"name": "small_cnn", "width": 8}, "optim": {"lr": 3e-3, "warmup_steps": 2},
        "loader": {"batch_size": 8}, "telemetry": {"log_every": 1, "tensorboard": False}}


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: one thread per process, unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def torchrun(nproc: int, module: str, *args: str, max_restarts: int = 0) -> list[str]:
    """A ``torchrun --standalone`` command line for ``python -m module args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "-m", module, *args]


def train_args(data: Path, output: Path, *extra: str, config: dict | None = None) -> list[str]:
    """Arguments of ``traincore.train`` for the tiny config."""
    return ["--data", str(data), "--output", str(output), "--preset", "debug", "--config",
            json.dumps(config or TINY), *extra]


def run(cmd: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion with captured text output."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), **kwargs)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (elastic workers start their own sessions, so walk /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        found.append(queue.pop())
        queue.extend(children.get(found[-1], []))
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process and every descendant, as a node failure would."""
    for victim in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, sig)


def wait_for(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.02) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def metric_rows(output: Path, kind: str = "train") -> list[dict]:
    """Records of ``output/metrics.jsonl`` of one kind (a torn last line is skipped)."""
    path = output / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return [row for row in rows if row.get("kind") == kind]
