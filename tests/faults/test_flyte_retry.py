"""Flyte retries of the train task, emulated with real processes.

Each attempt runs the command the task serialises (``pyflyte-execute ... --resolver
tasks.launch.train_task_resolver ...``) in a fresh process, with the same inputs.pb and durable checkpoint
root and ``FLYTE_ATTEMPT_NUMBER`` set as a pod gets it (flytekit 1.16 does not read it). Its verdict is the
error document it writes: propeller retries an error of kind RECOVERABLE while retries are left and fails the
node on NON_RECOVERABLE. Workers are real spawned processes, so the test can kill one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from faultlib import (
    TINY,
    flyte_attempt_command,
    flyte_attempt_env,
    flyte_error,
    flyte_output,
    kill_tree,
    metric_rows,
    signal_pending,
    wait_for,
    write_flyte_inputs,
)
from workers import elastic_workers

from tasks.launch import train_task_for
from tasks.types import StagedDataset, Topology
from traincore.checkpoint import complete_steps
from traincore.config.presets import preset
from traincore.data.manifest import Manifest

MAX_STEPS, EVERY = 60, 10
# Two local workers, no torch-elastic restarts: a lost worker fails the attempt and Flyte's retry takes over.
TOPOLOGY = Topology(nproc_per_node=2, max_restarts=0, rdzv_timeout_s=3)
# The rendezvous store's host, as a pod sees worker-0 before its DNS record exists.
UNREACHABLE_STORE = "train-worker-0.invalid:29400"


def retry_config(**overrides):
    return preset("debug").with_overrides(TINY).with_overrides(
        {"train.max_steps": MAX_STEPS, "checkpoint.every": EVERY, **overrides})


@pytest.fixture(scope="module")
def job(fault_data, tmp_path_factory):
    """One train node: its task, inputs.pb (written once, as Flyte keeps a node's inputs) and durable root."""
    base = tmp_path_factory.mktemp("flyte-retry")
    task = train_task_for(TOPOLOGY, retry_config())
    dataset = StagedDataset.from_manifest(fault_data, Manifest.load(fault_data))

    def inputs(name: str, root: Path, **overrides) -> Path:
        return write_flyte_inputs(task, base / name, base / "upload", config=retry_config(**overrides),
                                  dataset=dataset, checkpoint_root=str(root))

    return SimpleNamespace(task=task, base=base, inputs=inputs)


@pytest.fixture(scope="module", autouse=True)
def bad_config(job):
    """An attempt with a config that cannot work, started with the module so that it runs while the first
    test waits for its rendezvous; a thread records every worker it ever has."""
    root = job.base / "untouched-checkpoints"
    inputs = job.inputs("bad-config.pb", root, **{"loader.batch_size": 500})
    process, directory = start_attempt(job, inputs, 0)
    seen: set[int] = set()

    def watch() -> None:
        while process.poll() is None:
            seen.update(elastic_workers(process.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield SimpleNamespace(process=process, directory=directory, root=root, seen=seen, watcher=watcher)
    kill_tree(process.pid)


def start_attempt(job, inputs: Path, attempt: int, **env: str) -> tuple[subprocess.Popen, Path]:
    directory = job.base / f"{inputs.stem}-attempt-{attempt}"
    previous = job.base / f"{inputs.stem}-attempt-{attempt - 1}" if attempt else None
    directory.mkdir()
    with open(directory / "stdout", "w") as out, open(directory / "stderr", "w") as err:
        process = subprocess.Popen(flyte_attempt_command(job.task, inputs, directory, previous),
                                   env=flyte_attempt_env(attempt, directory / "tmp", **env), stdout=out,
                                   stderr=err)
    return process, directory


def finish(process: subprocess.Popen, directory: Path, timeout: float = 300) -> Path:
    try:
        process.wait(timeout)
    finally:
        kill_tree(process.pid)
    return directory


def logs(directory: Path) -> str:
    return (directory / "stdout").read_text() + (directory / "stderr").read_text()


def test_rendezvous_failure_and_lost_worker_are_retried_and_the_last_attempt_resumes(job):
    root = job.base / "durable-checkpoints"
    inputs = job.inputs("retried.pb", root)

    # Attempt 0: the rendezvous store cannot be reached, so no worker starts.
    started = time.monotonic()
    first = finish(*start_attempt(job, inputs, 0, PET_RDZV_ENDPOINT=UNREACHABLE_STORE))
    rendezvous_s = time.monotonic() - started
    kind, message = flyte_error(first) or ("no error document", logs(first))
    assert kind == "RECOVERABLE", message
    assert "rendezvous failed" in message and "train-worker-0.invalid" in message
    assert not list((first / "tmp").glob("torchelastic_*/*/attempt_*")) and complete_steps(root) == []

    # Attempt 1: one of two workers is SIGKILLed after the first checkpoint. The other is frozen first, so
    # it cannot report the lost peer itself (as one blocked in a collective cannot): the agent's only
    # failure is the killed worker, which leaves no error file.
    process, second = start_attempt(job, inputs, 1)
    frozen = None
    try:
        wait_for(lambda: complete_steps(root) or process.poll() is not None, 240,
                 "attempt 1's first checkpoint")
        workers = elastic_workers(process.pid)
        assert len(workers) == 2 and process.poll() is None, (workers, logs(second))
        frozen, victim = workers
        os.kill(frozen, signal.SIGSTOP)
        os.kill(victim, signal.SIGKILL)
        # The agent stops the remaining worker once it has recorded the failure.
        wait_for(lambda: signal_pending(frozen, signal.SIGTERM) or process.poll() is not None, 60,
                 "the agent to stop the frozen worker")
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        finish(process, second)
    kind, message = flyte_error(second) or ("no error document", logs(second))
    assert kind == "RECOVERABLE", message
    assert "killed by a signal from outside" in message and "SIGKILL" in message, message
    resumed = complete_steps(root)[-1]
    assert EVERY <= resumed < MAX_STEPS

    # Attempt 2: same inputs, same root: resumes from the latest complete checkpoint and finishes.
    third = finish(*start_attempt(job, inputs, 2))
    assert flyte_error(third) is None, logs(third)
    result = flyte_output(job.task, third)
    summary = result.summary
    assert (summary.steps, summary.resumed_from, summary.world_size) == (MAX_STEPS, resumed, 2)
    assert complete_steps(root)[-1] == MAX_STEPS
    steps = [row["step"] for row in metric_rows(Path(result.logs.download()))]
    assert steps == list(range(resumed + 1, MAX_STEPS + 1))
    print(f"rendezvous failure reported after {rendezvous_s:.1f} s; attempt 2 resumed from step {resumed}")


def test_bad_config_is_a_user_error_raised_before_any_worker(bad_config):
    process, directory = bad_config.process, bad_config.directory
    finish(process, directory)
    bad_config.watcher.join(10)
    kind, message = flyte_error(directory) or ("no error document", logs(directory))
    assert kind == "NON_RECOVERABLE", message
    assert "loader.batch_size=500 exceeds the 384 training samples" in message
    assert "FlyteRecoverableException" not in message
    # No worker process, no torch-elastic launch (its log directory), nothing under the checkpoint root.
    assert not bad_config.seen and not list((directory / "tmp").glob("torchelastic_*"))
    assert not bad_config.root.exists()
