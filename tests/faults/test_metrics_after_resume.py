"""metrics.jsonl and TensorBoard after a relaunch: a two-worker run (the CLI's --nproc-per-node, torch
elastic's agent and its workers) SIGKILLed after a checkpoint, then run again with the same command, reports
every step exactly once; a resume that fails writes nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultlib import TINY, child_env, kill_tree, metric_rows, run, train_args, wait_for

from traincore.checkpoint import CheckpointError, complete_steps
from traincore.config.presets import preset
from traincore.data.manifest import Manifest
from traincore.run.trainer import Trainer

MAX_STEPS, EVERY = 60, 10
CONFIG = {**TINY, "telemetry": {**TINY["telemetry"], "tensorboard": True}}


def logged_steps(output: Path) -> list[int]:
    return [row["step"] for row in metric_rows(output)]


def kill_with_orphans(process: subprocess.Popen, output: Path) -> tuple[int, int]:
    """SIGKILL the tree once a checkpoint exists and steps after it were logged; (checkpoint, last step).

    The tree is frozen (SIGSTOP) while its state is read, so what is read is what the kill leaves; if no
    step was logged after the latest checkpoint yet, it runs on a little and is looked at again.
    """
    checkpoints = output / "checkpoints"
    for _ in range(200):
        wait_for(lambda: complete_steps(checkpoints) or process.poll() is not None, 240, "a first checkpoint")
        assert process.poll() is None, "the run finished before it could be killed"
        kill_tree(process.pid, signal.SIGSTOP)
        saved, logged = complete_steps(checkpoints)[-1], max(logged_steps(output), default=0)
        if logged > saved:
            kill_tree(process.pid, signal.SIGKILL)
            process.wait(30)
            return saved, logged
        kill_tree(process.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("never caught the run between a checkpoint and its next logged step")


def test_a_relaunched_run_reports_every_step_once(fault_data, tmp_path):
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    output = tmp_path / "run"
    # The launcher is not what is tested: the CLI's workers fork from one interpreter, torchrun starts three.
    flags = ("--nproc-per-node", "2", "--max-steps", str(MAX_STEPS), "--checkpoint-every", str(EVERY))
    command = [sys.executable, "-m", "traincore.train",
               *train_args(fault_data, output, *flags, config=CONFIG)]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        saved, logged = kill_with_orphans(first, output)
    finally:
        kill_tree(first.pid)
    before = (output / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert logged_steps(output) == list(range(1, logged + 1)) and saved < logged < MAX_STEPS

    second = run(command)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from step {saved}" in second.stdout + second.stderr
    # Every train step once; steps <= the checkpoint keep the killed run's records, byte for byte.
    assert logged_steps(output) == list(range(1, MAX_STEPS + 1))
    kept = [line for line in before if line.endswith("\n") and json.loads(line)["step"] <= saved]
    assert (output / "metrics.jsonl").read_text().splitlines(keepends=True)[:len(kept)] == kept
    assert [row["step"] for row in metric_rows(output, "eval")] == [MAX_STEPS]
    # TensorBoard shows one point per step too: the resumed writer purged the killed run's later events.
    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Tensors("train/loss")] == list(range(1, MAX_STEPS + 1))


def run_files(output: Path) -> dict[str, bytes]:
    """Every file of a run directory but its checkpoints, by relative path, with its bytes; a W&B run's files
    by name only: wandb's service process may still write its last records and log lines to them after the
    run that started it has finished (seen: the offline run file and debug-internal.log), while a W&B run
    that a failed resume started would add names."""
    files = {}
    for path in sorted(output.rglob("*")):
        parts = path.relative_to(output).parts
        if path.is_file() and "checkpoints" not in parts:
            files["/".join(parts)] = b"" if parts[0] == "wandb" else path.read_bytes()
    return files


def test_a_resume_that_fails_writes_no_metrics(fault_data, tmp_path, monkeypatch):
    """A checkpoint that does not fit the model (width 8 saved, width 16 built) fails the Trainer while it
    resumes, as in a worker (given the manifest: the launcher ran preflight). metrics.jsonl stays byte for
    byte as it was, records after the checkpoint and a torn last line included (a premature resume would
    have dropped them), and no TensorBoard file or W&B run is added; in a new output directory nothing is
    created. The right model then resumes and reports every step once."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = preset("debug").with_overrides(TINY).with_overrides(
        {"telemetry.tensorboard": True, "telemetry.wandb_mode": "offline", "checkpoint.every": 2})
    manifest = Manifest.load(fault_data)
    output = tmp_path / "run"
    Trainer(config.with_overrides({"train.max_steps": 4}), fault_data, output).train()
    with open(output / "metrics.jsonl", "a") as metrics:  # a killed later attempt's steps 5-6, torn at 6
        metrics.write('{"step": 5, "time": 1.0, "kind": "train", "loss": 1.0}\n{"step": 6, "time"')
    before = run_files(output)

    wider = config.with_overrides({"train.max_steps": 6, "model.width": 16})
    with pytest.raises(CheckpointError, match="does not fit this run"):
        Trainer(wider, fault_data, output, manifest=manifest)
    assert run_files(output) == before
    with pytest.raises(CheckpointError, match="does not fit this run"):
        Trainer(wider, fault_data, tmp_path / "new", output / "checkpoints", manifest=manifest)
    assert run_files(tmp_path / "new") == {}

    Trainer(config.with_overrides({"train.max_steps": 6}), fault_data, output, manifest=manifest).train()
    assert logged_steps(output) == list(range(1, 7))
