"""``python -m traincore.train --nproc-per-node N``: forked gloo workers, checked once by their parent."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ranks import process_tree, start_ranks
from workers import elastic_workers

from traincore.checkpoint import complete_steps
from traincore.run import launch
from traincore.run.cli import main
from traincore.run.launch import WORKER_NAME, start_method

TINY = {"model": {"name": "small_cnn", "width": 8}, "loader": {"batch_size": 16},
        "telemetry": {"log_every": 2, "tensorboard": False, "progress": "off"}}


def train(data: Path, output: Path, *extra: str, launcher: tuple[str, ...] = (), config: dict | None = None,
          env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the train CLI, behind ``launcher`` when given (e.g. torchrun's module and flags)."""
    command = [sys.executable, *launcher, "-m", "traincore.train", "--data", str(data), "--output",
               str(output), "--preset", "debug", "--config", json.dumps(config or TINY), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def records(output: Path, kind: str) -> list[dict]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def test_two_forked_workers_train_and_rank_0_reports_once(digits_dir, tmp_path):
    started = time.time()
    done = train(digits_dir, tmp_path / "run", *TWO, "--max-steps", "4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "global batch 32" in done.stderr, done.stderr[-3000:]  # two workers of 16
    assert done.stdout.count("trained 4 steps") == 1, done.stdout
    assert complete_steps(tmp_path / "run" / "checkpoints") == [4]
    assert [row["step"] for row in records(tmp_path / "run", "train")] == [2, 4]
    # One start-up record, rank 0's, counted from the command's start: the parent's imports, its one
    # preflight and the imports it shares with the workers, then the workers' own phases.
    [startup] = records(tmp_path / "run", "startup")
    phases = [key[:-2] for key in startup if key.endswith("_s") and key != "total_s"]
    assert phases == ["imports", "preflight", "dynamo_import", "launch", "process_group", "loader", "model",
                      "telemetry", "checkpoint_look-up", "first_step"]
    assert started - 1 < startup["origin"] < started + startup["imports_s"]
    assert done.stderr.count("to first step: imports") == 1, done.stderr[-3000:]


TWO = ["--nproc-per-node", "2"]


@pytest.mark.parametrize("data, flags, message", [
    ("digits", [*TWO, "--config", '{"loader": {"batch_size": 0}}'], "loader.batch_size=0"),
    ("digits", [*TWO, "--config", '{"loader": {"batch_size": 100000}}'], "lower loader.batch_size"),
    ("absent", TWO, "is not a staged dataset"),
    # One process would fit a step in the digits' training split; two take twice the samples per step.
    ("digits", [*TWO, "--config", '{"loader": {"batch_size": 500}, "train": {"grad_accum_steps": 2}}'],
     "x 2 process(es) = 2000 samples per optimizer step exceed"),
    ("digits", ["--nproc-per-node", "0"], "--nproc-per-node=0 is invalid"),
    ("digits", [*TWO, "--max-restarts", "-1"], "--max-restarts=-1 is invalid"),
    ("digits", ["--max-restarts", "1"], "add --nproc-per-node N"),
])
def test_bad_input_is_refused_by_the_parent_before_any_worker_starts(digits_dir, tmp_path, data, flags,
                                                                     message, monkeypatch, capfd):
    """The CLI's main() in this process, the parent: what reaches file descriptor 2 (a worker's too)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data_dir = digits_dir if data == "digits" else tmp_path / data
    code = main(["--data", str(data_dir), "--output", str(tmp_path / "run"), "--preset", "debug", "--config",
                 json.dumps(TINY), *flags])
    stderr = capfd.readouterr().err
    assert code == 2, stderr[-3000:]
    assert message in stderr and stderr.count("error: ") == 1, stderr[-3000:]
    assert "[rank" not in stderr  # no worker set up its logging
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, value, message", [
    ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "abc", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='abc' is not a whole number"),
    ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45.5", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='45.5' is not a whole number"),
    ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "-1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='-1' is not a whole number"),
    ("OMP_NUM_THREADS", "two", "OMP_NUM_THREADS='two' is not an integer"),
])
def test_a_launcher_setting_torch_cannot_read_is_refused_before_anything_is_written(
        digits_dir, tmp_path, name, value, message, monkeypatch, capfd):
    """torch's launcher reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT with int(): 'abc' ended in its ValueError
    traceback after preflight had created the output directory, as a bad OMP_NUM_THREADS did."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(name, value)
    code = main(["--data", str(digits_dir), "--output", str(tmp_path / "run"), "--preset", "debug",
                 "--config", json.dumps(TINY), *TWO])
    stderr = capfd.readouterr().err
    assert code == 2 and message in stderr and stderr.count("error: ") == 1, stderr[-3000:]
    assert "Traceback" not in stderr and not (tmp_path / "run").exists()


def test_a_worker_error_reaches_the_user_with_a_non_zero_exit(digits_dir, tmp_path):
    # Only rank 0's telemetry reads the peak override, in the worker, after the parent's checks passed.
    done = train(digits_dir, tmp_path / "run", *TWO, "--max-steps", "4", env={"TRAINCORE_PEAK_FLOPS": "fast"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: TRAINCORE_PEAK_FLOPS='fast' is not a positive number" in done.stderr
    # torch elastic's report, as torchrun prints it: the failed rank and its exit code.
    assert "Root Cause (first observed failure)" in done.stderr, done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr
    assert "trained" not in done.stdout


def test_a_killed_worker_is_restarted_and_the_run_resumes(digits_dir, tmp_path):
    output = tmp_path / "run"
    command = [sys.executable, "-m", "traincore.train", "--data", str(digits_dir), "--output", str(output),
               "--preset", "debug", "--config", json.dumps(TINY), *TWO, "--max-restarts", "1",
               "--max-steps", "60", "--checkpoint-every", "5"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not complete_steps(output / "checkpoints") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    workers = elastic_workers(proc.pid)
    assert len(workers) == 2 and proc.poll() is None, workers
    # Each worker names itself with its rank, as `ps` and `top` show it; the launcher keeps its own name.
    names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in workers)
    assert names == ["traincore-r0", "traincore-r1"], names
    assert not Path(f"/proc/{proc.pid}/comm").read_text().startswith("traincore-r")
    os.kill(workers[-1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    assert "trained 60 steps" in stdout and "resumed from step" in stderr
    # Each attempt reports its own start-up; the restarted one counts from its own fork, not the command.
    first, second = records(output, "startup")
    assert "preflight_s" in first and "preflight_s" not in second and "launch_s" in second
    assert second["origin"] > first["time"]


PARENT_POOL_THEN_ONE_WORKER = """
import sys
import torch
torch.set_num_threads(2)
torch.randn(1500, 1500) @ torch.randn(1500, 1500)  # this process's intra-op pool is up, with 2 threads
from traincore.run.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_one_worker_at_the_default_thread_count_trains_after_its_launcher_ran_a_parallel_op(digits_dir,
                                                                                              tmp_path):
    """One worker per node with a restart budget and no OMP_NUM_THREADS (a CPU pod's usual set-up), started
    by a process that has already run a multi-threaded op: a worker forked from it waited forever in its
    first parallel op (the pool's threads do not exist in a child). It must train and exit."""
    output = tmp_path / "run"
    args = ["--data", str(digits_dir), "--output", str(output), "--preset", "debug", "--config",
            json.dumps(TINY), "--nproc-per-node", "1", "--max-restarts", "1", "--max-steps", "3"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen([sys.executable, "-c", PARENT_POOL_THEN_ONE_WORKER, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the worker hung: {stderr[-2000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    assert "trained 3 steps" in stdout
    assert complete_steps(output / "checkpoints") == [3]


@pytest.mark.parametrize(("threads", "cuda", "method"), [(1, False, "fork"), (2, False, "spawn"),
                                                         (1, True, "spawn"), (8, True, "spawn")])
def test_workers_are_forked_only_when_single_threaded_and_without_cuda(threads, cuda, method):
    assert start_method(threads, cuda) == method


def _worker_after_a_sibling(local_rank: int, passed) -> None:
    os.environ.update(LOCAL_RANK=str(local_rank), TORCHELASTIC_RESTART_COUNT="0")
    launch.settle_worker(1)
    passed.put((local_rank, time.monotonic()))


def _fork_two_workers_apart(_) -> None:
    """A launcher's part, in a child of the tests' forkserver: a worker, then its sibling 0.5 s later."""
    launch.open_start_gate(2)
    fork = multiprocessing.get_context("fork")
    passed = fork.SimpleQueue()
    first = fork.Process(target=_worker_after_a_sibling, args=(0, passed))
    first.start()
    time.sleep(0.5)
    second_forked = time.monotonic()
    second = fork.Process(target=_worker_after_a_sibling, args=(1, passed))
    second.start()
    for worker in (first, second):
        worker.join(30)
        assert worker.exitcode == 0, worker.exitcode
    times = dict(passed.get() for _ in range(2))
    assert min(times.values()) >= second_forked, (times, second_forked)  # the first waited for the second


def test_a_forked_worker_connects_to_nothing_until_its_last_sibling_is_forked():
    start_ranks(_fork_two_workers_apart, nprocs=1)


def _gate_seen() -> bytes | None:
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError("the first attempt fails: the restart's workers mark the gate anew")
    return None if launch._start_gate is None else launch._start_gate[:]


def _launch_with_a_restart(_) -> None:
    results = launch.launch_local(_gate_seen, (), nproc_per_node=2, max_restarts=1)
    forked = start_method(launch.worker_threads(2), torch.cuda.is_available()) == "fork"
    assert results == ({0: b"\x02\x02", 1: b"\x02\x02"} if forked else {0: None, 1: None}), results


def test_the_launcher_holds_its_forked_workers_and_their_restart_at_the_gate():
    start_ranks(_launch_with_a_restart, nprocs=1)


def test_nproc_per_node_is_refused_under_torchrun(digits_dir, tmp_path):
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1")
    done = train(digits_dir, tmp_path / "run", *TWO, launcher=torchrun)
    assert done.returncode != 0
    assert ("error: --nproc-per-node launches workers itself, but this process is already a worker of "
            "torchrun (LOCAL_RANK=0)") in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_only_processes_named_as_workers_count_as_workers_however_long_they_live():
    """A child forked by the launcher that is not a worker (a ``subprocess`` held between its fork and its
    exec on a busy machine) keeps the launcher's command line as long as it likes and is never a worker; a
    child that named itself as a worker is one, and its own children (which inherit the name) are not."""

    def child(name: str | None, grandchild: bool = False) -> int:
        pid = os.fork()
        if pid == 0:
            if name:
                Path("/proc/self/comm").write_text(name)
            if grandchild and os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            time.sleep(30)
            os._exit(0)
        return pid

    unnamed, worker = child(None), child(f"{WORKER_NAME}7", grandchild=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(process_tree(worker)) < 2:
            time.sleep(0.01)
        assert process_tree(worker)[1:], "the worker's own child did not start"
        found, own = elastic_workers(os.getpid()), process_tree(worker)[1:]
        assert worker in found and unnamed not in found and not set(own) & set(found), found
    finally:
        for pid in (*process_tree(worker)[1:], unnamed, worker):
            os.kill(pid, signal.SIGKILL)
        for pid in (unnamed, worker):
            os.waitpid(pid, 0)
