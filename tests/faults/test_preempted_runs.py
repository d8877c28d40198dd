"""Preemption with real signals to real launchers: torchrun (SIGTERM, as Kubernetes and Slurm send it), the
CLI's own workers (Ctrl-C: SIGINT to the whole foreground process group) and a grace too short to save in.

The run stops at a step boundary all ranks agree on, saves that step, exits 75 naming it, and the same
command resumes from it; on CPU with a fixed seed the final weights are bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faultlib import (
    TINY,
    child_env,
    metric_rows,
    run,
    torchrun,
    train_args,
    wait_for,
)
from ranks import process_tree, start_train, train_forked, wait_exit

from traincore.artifacts.export import export
from traincore.checkpoint import complete_steps, parse_step_name, step_dir, verify_checkpoint
from traincore.checkpoint.layout import is_torn
from traincore.exitcodes import PREEMPTED_EXIT_CODE
from traincore.run.preemption import RECORD_FILE

STEPS, EVERY = 100, 50
DEFAULT_GRACE_S = 20.0


def weights(checkpoints: Path, model: Path) -> dict[str, torch.Tensor]:
    """The weights of the latest checkpoint under ``checkpoints``, exported to ``model`` and loaded back."""
    from safetensors.torch import load_file

    export(checkpoints, model)
    return load_file(model)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (as a terminal's foreground job), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)


def interrupt_mid_run(process: subprocess.Popen, output: Path, sig: int, group: bool = False) -> float:
    """Once the run has logged a few steps, send ``sig`` (to the process group: a Ctrl-C); seconds it took
    the launcher and every process below it to exit."""
    wait_for(lambda: len(metric_rows(output)) >= 5 or process.poll() is not None, 120, "training to start")
    assert process.poll() is None, "the run ended before it could be interrupted"
    tree = process_tree(process.pid)
    sent = time.monotonic()
    os.killpg(process.pid, sig) if group else os.kill(process.pid, sig)
    process.wait(timeout=DEFAULT_GRACE_S + 15)
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in tree), 10, "every process to exit")
    return time.monotonic() - sent


def check_saved(output: Path, log: str, signal_name: str) -> int:
    """The step the message names, after checking its checkpoint is complete and the record names it."""
    line = next(line for line in log.splitlines() if line.startswith("preempted at step "))
    step = int(line.split()[3])
    assert f"preempted at step {step} by {signal_name}: checkpoint step-{step} saved" in line
    assert 0 < step < STEPS and complete_steps(output / "checkpoints")[-1] == step
    verify_checkpoint(step_dir(output / "checkpoints", step))
    record = json.loads((output / "checkpoints" / RECORD_FILE).read_text())
    assert (record["step"], record["signal"]) == (step, signal_name)
    return step


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted run of STEPS steps (conftest.py's, shared with
    test_restarts.py)."""
    return weights(uninterrupted_run(STEPS), tmp_path_factory.mktemp("uninterrupted") / "model.safetensors")


# First of the tests that compare with the uninterrupted run, the cheapest: the one that starts that run (when
# no other test has) takes its time as well.
def test_ctrl_c_on_the_clis_own_workers_saves_the_step_without_a_traceback(fault_data, tmp_path,
                                                                          uninterrupted):
    output = tmp_path / "run"
    cmd = [sys.executable, "-m", "traincore.train", *train_args(fault_data, output, "--max-steps", str(STEPS),
                                                                "--checkpoint-every", str(EVERY),
                                                                "--nproc-per-node", "2")]
    process = start(cmd, tmp_path / "log")
    took = interrupt_mid_run(process, output, signal.SIGINT, group=True)
    log = (tmp_path / "log").read_text()
    assert process.returncode == PREEMPTED_EXIT_CODE and took < DEFAULT_GRACE_S, (process.returncode, log)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    step = check_saved(output, log, "SIGINT")

    resumed = run(cmd)
    assert resumed.returncode == 0 and f"resumed from step {step}" in resumed.stdout + resumed.stderr
    final = weights(output / "checkpoints", output / "model.safetensors")
    assert all(torch.equal(final[name], uninterrupted[name]) for name in uninterrupted)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_to_torchrun_saves_the_step_and_the_same_command_resumes_bitwise(
        fault_data, tmp_path, uninterrupted, mode):
    output = tmp_path / "run"
    cmd = torchrun(2, "traincore.train", *train_args(fault_data, output, "--max-steps", str(STEPS),
                                                     "--checkpoint-every", str(EVERY),
                                                     "--checkpoint-mode", mode))
    process = start(cmd, tmp_path / "log")
    took = interrupt_mid_run(process, output, signal.SIGTERM)
    log = (tmp_path / "log").read_text()
    assert process.returncode != 0 and took < DEFAULT_GRACE_S, (process.returncode, took, log[-3000:])
    step = check_saved(output, log, "SIGTERM")

    resumed = run(cmd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {step}" in resumed.stdout + resumed.stderr
    assert [row["step"] for row in metric_rows(output)] == list(range(1, STEPS + 1))  # none lost, none twice
    final = weights(output / "checkpoints", output / "model.safetensors")
    assert all(torch.equal(final[name], uninterrupted[name]) for name in uninterrupted)
    print(f"{mode}: SIGTERM to torchrun -> step {step} saved and every process gone in {took:.1f} s")


def test_a_save_that_outlasts_the_grace_is_abandoned_the_records_are_kept_and_the_last_complete_loads(
        fault_data, tmp_path):
    # A model whose state takes far longer to write than the grace allows: ~50 MB, a 50 ms grace. Two
    # workers, signalled through their launcher as torchrun's are. The checkpoint root is storage of its own
    # (not inside the output), so the run keeps its records there, here only by the copy made when it ends.
    config = {**TINY, "model": {"name": "mlp", "width": 2048}, "checkpoint": {"preemption_grace_s": 0.05},
              "telemetry": {**TINY["telemetry"], "tensorboard": True, "records_every_s": 0}}
    output, root = tmp_path / "run", tmp_path / "root"

    def cli(steps: int) -> list[str]:  # the train CLI's arguments; its runs fork from the preloaded server
        return [*train_args(fault_data, output, "--max-steps", str(steps), "--checkpoint-every", "20",
                            "--checkpoint-dir", str(root), "--nproc-per-node", "2", config=config)]

    process = start_train(cli(4000), tmp_path / "log")
    # Past the first checkpoint (a step's row is logged after the previous step's save returned), so the
    # signal lands in a step or in a save, and 50 ms later the workers are gone wherever they were.
    wait_for(lambda: any(row["step"] > 20 for row in metric_rows(output)) or process.exitcode is not None,
             120, "a step after the first checkpoint")
    logged = metric_rows(output)
    os.kill(process.pid, signal.SIGTERM)
    assert wait_exit(process, timeout=30) == PREEMPTED_EXIT_CODE
    log = (tmp_path / "log").read_text()
    assert log.count("did not finish within checkpoint.preemption_grace_s=0.05") == 1, log[-3000:]
    assert not (root / RECORD_FILE).exists()
    complete = complete_steps(root)
    assert complete and complete[0] == 20, complete
    # Whatever was being written when the grace ran out has no marker: a torn save, never loaded.
    newer = [p for p in root.iterdir() if (parse_step_name(p.name) or 0) > complete[-1]]
    assert all(is_torn(p) for p in newer), newer
    verify_checkpoint(step_dir(root, complete[-1]))
    named = re.search(r"exiting: the committed checkpoint step (\d+) in (\S+) stays the one a resume loads",
                      log)
    assert named and int(named[1]) in complete and named[2] == str(root), log[-3000:]
    # The records outlive the attempt: every row logged before the signal, and the events, in the root.
    records = root / "records" / "attempt-0"
    kept = metric_rows(records)
    assert len(kept) >= len(logged) and kept == metric_rows(output)[:len(kept)]
    (events,) = (output / "tensorboard").iterdir()
    copied = (records / "tensorboard" / events.name).read_bytes()
    assert copied and events.read_bytes().startswith(copied)

    resumed = train_forked(cli(complete[-1] + 2), tmp_path / "resumed.log")
    assert f"resumed from step {complete[-1]}" in resumed


def test_ctrl_c_on_a_local_pyflyte_run_saves_the_step_and_prints_a_few_lines(tmp_path):
    root, log = tmp_path / "checkpoints", tmp_path / "log"
    pyflyte = str(Path(sys.executable).with_name("pyflyte"))
    cmd = [pyflyte, "run", "workflows/pipeline.py", "training_pipeline", "--max_steps", "3000",
           "--checkpoint_uri", str(root)]
    with open(log, "w") as out:  # a run of its own: nothing cached from another test's pipeline
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=child_env(FLYTE_LOCAL_CACHE_ENABLED="false"))
    wait_for(lambda: " step 20/3000 " in log.read_text() or process.poll() is not None, 180, "training")
    assert process.poll() is None, log.read_text()[-3000:]
    before, tree = len(log.read_text().splitlines()), process_tree(process.pid)
    sent = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=DEFAULT_GRACE_S + 15) == PREEMPTED_EXIT_CODE, log.read_text()[-3000:]
    took = time.monotonic() - sent
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in tree), 10, "every process to exit")
    after = log.read_text().splitlines()[before:]
    assert took < DEFAULT_GRACE_S and "Traceback" not in "\n".join(after), "\n".join(after)
    step = complete_steps(root)[-1]
    assert f"preempted at step {step} by SIGINT: checkpoint step-{step} saved in {root}" in after
    assert f"to resume, run the same pyflyte command with --checkpoint_uri {root}" in after
    assert len(after) <= 15, "\n".join(after)  # the agent's and checkpointer's log lines, then the message
    verify_checkpoint(step_dir(root, step))
