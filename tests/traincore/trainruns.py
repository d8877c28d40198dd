"""Running the train CLI for tests: commands over a small staged dataset, killing a run's whole process tree
as a node failure would, and reading what a run leaves."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from traincore.artifacts.export import export
from traincore.checkpoint import complete_steps

TINY = {"model": {"name": "small_cnn", "width": 8}, "optim": {"lr": 3e-3, "warmup_steps": 2},
        "loader": {"batch_size": 8}, "telemetry": {"log_every": 2}}
CHECKPOINTED = {**TINY, "checkpoint": {"every": 5}}  # the config of the runs of conftest.py's ``saved``


def train_cmd(data: Path, output: Path, nproc: int, *extra: str, config: dict | None = None) -> list[str]:
    """The train CLI on ``nproc`` ranks: ``--nproc-per-node`` forks the workers from one process that has
    imported torch and traincore once (with OMP_NUM_THREADS=1, as the callers set it), seconds cheaper per
    run than torchrun's fresh interpreter per rank, with the same ranks, environment and bitwise results.
    One rank trains in the CLI's own process: torchrun's single worker has no process group either."""
    ranks = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    return [sys.executable, "-m", "traincore.train", "--data", str(data), "--output", str(output),
            "--preset", "debug", "--config", json.dumps(config or TINY), *ranks, *extra]


def run_train(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(train_cmd(*args, **kwargs), capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def kill_tree(pid: int) -> None:
    """SIGKILL a process tree, as a node failure would (elastic workers get their own sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, queue = [], [pid]
    while queue:
        doomed.append(queue.pop())
        queue.extend(children.get(doomed[-1], []))
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def final_weights(output: Path) -> dict[str, torch.Tensor]:
    model = output / "model.safetensors"
    export(output / "checkpoints", model)
    from safetensors.torch import load_file

    return load_file(model)


def train_losses(output: Path) -> list[float]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row.get("kind") == "train"]


def killed_and_resumed(data: Path, output: Path, steps: int, *flags: str,
                       config: dict | None = None) -> tuple[int, subprocess.CompletedProcess]:
    """Train on 2 ranks for ``steps``, SIGKILL the whole run once two checkpoints are complete, then run the
    same command again: (the last step the killed run had saved, the resumed run)."""
    args = (data, output, 2, "--max-steps", str(steps), *flags)
    proc = subprocess.Popen(train_cmd(*args, config=config), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(complete_steps(output / "checkpoints")) < 2:
        time.sleep(0.05)
    kill_tree(proc.pid)
    proc.wait(timeout=30)
    reached = complete_steps(output / "checkpoints")
    assert reached and reached[-1] < steps, f"the run was not interrupted mid-way: {reached}"
    done = run_train(*args, config=config)
    assert f"resumed from step {reached[-1]}" in done.stdout + done.stderr
    return reached[-1], done

