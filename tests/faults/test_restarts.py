"""Torch elastic restarts the worker group in place: one worker SIGKILLed three times within one run.

Each run has ``--max-restarts 3`` and two workers; in each of its first three attempts one worker is killed
at a step drawn at random after the attempt's first new checkpoint. The run must finish (exit 0) with final
weights bitwise identical to an uninterrupted run of the same config (CPU, gloo, fixed seed), and each fault
may cost at most the checkpoint interval: lost = the attempt's last step in rank 0's log - the step the next
attempt logs "resumed from step S". Run with ``pytest -s`` to see the figures; TRAINCORE_FAULT_SEED
replays a draw.

Once through the Flyte train task executed locally (flytekit runs elastic_launch in-process) in a child
process whose spawned workers the test kills, once through the CLI (torchrun). The Flyte test comes first:
the shorter of the two also waits for the uninterrupted run when no other test has made it yet.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faultlib import (
    Fault,
    attempts,
    child_env,
    child_processes,
    kill_after_checkpoints,
    kill_tree,
    torchrun,
    train_args,
)
from workers import elastic_workers

from traincore.checkpoint import step_dir
from traincore.checkpoint.format import read_checkpoint
from traincore.run import WORKER_NAME

MAX_STEPS, EVERY, FAULTS = 100, 10, 3
RUN_ARGS = ("--max-steps", str(MAX_STEPS), "--checkpoint-every", str(EVERY))
SEED = int(os.environ.get("TRAINCORE_FAULT_SEED", time.time_ns() % 2**32))
# Generous: a restart re-imports torch (and flytekit) in every worker, slow on a busy 2-core machine.
KILLS_TIMEOUT_S, FINISH_TIMEOUT_S = 420, 300

FLYTE_CHILD = '''
"""Run the Flyte train task locally with torch-elastic restarts; write rank 0's TrainSummary as JSON."""
import json
import sys
from dataclasses import asdict

from tasks.launch import train_task_for
from tasks.types import StagedDataset, Topology
from traincore.data.manifest import Manifest
from traincore.run.cli import config_from_args, parse_args


def main():
    argv, root, result = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    args = parse_args(argv)
    config = config_from_args(args)  # the CLI's config, so both runs train the same
    dataset = StagedDataset.from_manifest(args.data, Manifest.load(args.data))
    task = train_task_for(Topology(nproc_per_node=2, max_restarts=int(sys.argv[4])), config)
    summary = task(config=config, dataset=dataset, checkpoint_root=root).summary
    with open(result, "w") as out:
        json.dump(asdict(summary), out)


if __name__ == "__main__":  # spawned workers import this file again
    main()
'''


def final_weights(root: Path) -> dict[str, bytes]:
    """The model tensors of the run's last checkpoint, as raw bytes (bitwise comparison)."""
    weights, info = read_checkpoint(step_dir(root, MAX_STEPS))
    assert info["step"] == MAX_STEPS
    return {name: tensor.contiguous().numpy().tobytes() for name, tensor in weights.items()}


@pytest.fixture(scope="module")
def reference(uninterrupted_run) -> dict[str, bytes]:
    """Final weights of an uninterrupted two-worker run of the same config (conftest.py's, shared with
    test_preempted_runs.py)."""
    return final_weights(uninterrupted_run(MAX_STEPS))


def faulted_run(command: list[str], log: Path, workers: Callable[[int], list[int]], **popen) -> tuple[
        int, list[Fault]]:
    """Start ``command`` (a torch-elastic agent), kill one of its workers in each of its first FAULTS
    attempts, wait for it to end; returns its exit code and the faults."""
    print(f"\nfault seed {SEED} (set TRAINCORE_FAULT_SEED={SEED} to replay)")
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=child_env(),
                                   start_new_session=True, **popen)
    try:
        faults = kill_after_checkpoints(process, log, lambda: workers(process.pid), FAULTS, EVERY,
                                        random.Random(SEED), KILLS_TIMEOUT_S)
        return process.wait(timeout=FINISH_TIMEOUT_S), faults
    finally:
        if process.poll() is None:  # an assertion or a timeout got here first (a reaped pid may be reused)
            kill_tree(process.pid)
            process.wait()


def check_recovery(label: str, code: int, log: Path, faults: list[Fault], root: Path,
                   reference: dict[str, bytes]) -> None:
    """Exit 0, one attempt per fault plus the first, work lost per fault within EVERY, same final weights."""
    text = log.read_text(errors="replace")
    assert code == 0, f"{label} run exited {code}:\n{text[-6000:]}"
    runs = attempts(text)
    assert len(runs) == FAULTS + 1, f"{label}: {len(runs)} attempts logged, expected {FAULTS + 1}"
    for fault in faults:
        before, after = runs[fault.attempt], runs[fault.attempt + 1]
        lost = before.last_step - after.resumed_from
        print(f"{label} fault {fault.attempt + 1}: worker pid {fault.pid} SIGKILLed after step "
              f"{fault.killed_at} (target {fault.target}, checkpoint {fault.checkpoint} committed); last "
              f"step logged {before.last_step}, resumed from step {after.resumed_from}: lost {lost} steps "
              f"(bound {EVERY})")
        assert after.resumed_from >= fault.checkpoint, (label, fault, after)  # not an older checkpoint
        assert 0 <= lost <= EVERY, (label, fault, before.last_step, after.resumed_from)
    assert runs[-1].last_step == MAX_STEPS
    assert final_weights(root) == reference, f"{label}: final weights differ from the uninterrupted run's"


def test_flyte_task_survives_a_worker_killed_three_times(fault_data, reference, tmp_path):
    script, root = tmp_path / "flyte_train.py", tmp_path / "checkpoints"
    result, log = tmp_path / "summary.json", tmp_path / "flyte.log"
    script.write_text(FLYTE_CHILD)
    argv = train_args(fault_data, tmp_path / "unused", *RUN_ARGS)  # the task writes its own output directory
    command = [sys.executable, str(script), json.dumps(argv), str(root), str(result), str(FAULTS)]
    code, faults = faulted_run(command, log, elastic_workers, cwd=tmp_path)
    check_recovery("Flyte", code, log, faults, root, reference)
    summary = json.loads(result.read_text())
    assert (summary["steps"], summary["world_size"]) == (MAX_STEPS, 2)
    assert summary["resumed_from"] == attempts(log.read_text())[-1].resumed_from


def test_cli_run_survives_a_worker_killed_three_times(fault_data, reference, tmp_path):
    output, log = tmp_path / "run", tmp_path / "torchrun.log"
    command = torchrun(2, "traincore.train", *train_args(fault_data, output, *RUN_ARGS), max_restarts=FAULTS)
    code, faults = faulted_run(command, log, lambda pid: named(child_processes(pid, b"traincore.train")))
    check_recovery("CLI", code, log, faults, output / "checkpoints", reference)


def named(workers: list[int]) -> list[int]:
    """``workers``, each checked to have named itself for `ps` and `top` (a worker of torchrun names itself
    when it starts; this attempt has logged steps, so each of its workers has)."""
    names = {}
    for pid in workers:
        with contextlib.suppress(OSError):  # it ended since it was listed
            names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    assert all(name.startswith(WORKER_NAME) for name in names.values()), names
    return workers
