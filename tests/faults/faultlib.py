"""Tools the fault-injection tests share: real processes, killed the way nodes die, and CLI runs."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ranks import process_tree, start_script

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


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process and every descendant, as a node failure would."""
    for victim in process_tree(pid):
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


# ---- Flyte attempts: a task run the way a pod runs it ----------------------------------------------------

def write_flyte_inputs(task, path: Path, sandbox: Path, **inputs) -> Path:
    """``inputs`` as the LiteralMap a pod's ``--inputs`` names; directories are uploaded under ``sandbox``."""
    from flytekit.core import utils
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.data_persistence import FileAccessProvider
    from flytekit.core.type_engine import TypeEngine

    access = FileAccessProvider(local_sandbox_dir=str(sandbox), raw_output_prefix=str(sandbox / "raw"))
    context = FlyteContextManager.current_context().with_file_access(access).build()
    with FlyteContextManager.with_context(context.new_builder()) as ctx:
        literals = TypeEngine.dict_to_literal_map(ctx, inputs, task.python_interface.inputs)
    utils.write_proto_to_file(literals.to_flyte_idl(), str(path))
    return path


def flyte_attempt_command(task, inputs: Path, attempt_dir: Path, previous: Path | None = None) -> list[str]:
    """The container command ``task`` serialises (``pyflyte-execute ... --resolver ...``), its templates
    filled in as propeller fills them for one attempt: outputs, raw data and Flyte's checkpoint under
    ``attempt_dir``, ``previous`` the prior attempt's directory."""
    from flytekit.configuration import Image, ImageConfig, SerializationSettings

    settings = SerializationSettings(image_config=ImageConfig(default_image=Image(name="default", fqn="local",
                                                                                  tag="test")))
    filled = {"{{.input}}": str(inputs), "{{.outputPrefix}}": str(attempt_dir / "outputs"),
              "{{.rawOutputDataPrefix}}": str(attempt_dir / "raw"),
              "{{.checkpointOutputPrefix}}": str(attempt_dir / "flyte-checkpoint"),
              "{{.prevCheckpointPrefix}}": str(previous / "flyte-checkpoint") if previous else '""'}
    command = [filled.get(arg, arg) for arg in task.get_command(settings)]
    return [str(Path(sys.executable).parent / command[0]), *command[1:]]


def flyte_attempt_env(attempt: int, tmp: Path, **extra: str) -> dict[str, str]:
    """A pod's environment for attempt ``attempt`` (0-based, as FLYTE_ATTEMPT_NUMBER counts), with a private
    TMPDIR: flytekit's sandbox, torch-elastic's log directory and the node cache land there."""
    tmp.mkdir(parents=True, exist_ok=True)
    return child_env(FLYTE_INTERNAL_EXECUTION_ID="retry-test", FLYTE_INTERNAL_EXECUTION_PROJECT="flytesnacks",
                     FLYTE_INTERNAL_EXECUTION_DOMAIN="development", FLYTE_ATTEMPT_NUMBER=str(attempt),
                     TMPDIR=str(tmp), **extra)


def flyte_error(attempt_dir: Path) -> tuple[str, str] | None:
    """(kind, message) of the error document an attempt wrote, or None when it wrote none. Propeller retries
    a kind RECOVERABLE error while retries are left and fails the node on NON_RECOVERABLE."""
    from flyteidl.core import errors_pb2

    path = attempt_dir / "outputs" / "error.pb"
    if not path.is_file():
        return None
    document = errors_pb2.ErrorDocument()
    document.ParseFromString(path.read_bytes())
    return errors_pb2.ContainerError.Kind.Name(document.error.kind), document.error.message


def flyte_output(task, attempt_dir: Path):
    """The task's (single) output that an attempt wrote to ``outputs.pb``."""
    from flyteidl.core import literals_pb2
    from flytekit.core import utils
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import LiteralMap

    proto = utils.load_proto_from_file(literals_pb2.LiteralMap, str(attempt_dir / "outputs" / "outputs.pb"))
    values = TypeEngine.literal_map_to_kwargs(FlyteContextManager.current_context(),
                                              LiteralMap.from_flyte_idl(proto), task.python_interface.outputs)
    return values["o0"]


def signal_pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` waits to be delivered to ``pid`` (e.g. sent to a stopped process)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (sig - 1)) for mask in masks)


# ---- checkpoint faults: ranks forked from the server of ranks.py, which has torch imported -----------------

class Job:
    """``world_size`` ranks of one script, each a forked child process with RANK / WORLD_SIZE set and a file
    rendezvous in FAULT_INIT; a rank that fails or dies takes the others down (SIGKILL), as torchrun's agent
    does."""

    def __init__(self, script: Path, args: list[str], world_size: int, workdir: Path, name: str):
        workdir.mkdir(parents=True, exist_ok=True)
        self.name, self.logs = name, [workdir / f"{name}.rank{rank}.log" for rank in range(world_size)]
        rendezvous = workdir / f"{name}.rendezvous-{time.monotonic_ns()}"
        self.processes = []
        for rank, log in enumerate(self.logs):
            env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                   "FAULT_INIT": f"file://{rendezvous}"}
            self.processes.append(start_script(script, args, log, env, name=f"{name}-rank{rank}"))

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def codes(self) -> list[int | None]:
        return [process.exitcode for process in self.processes]

    def poll(self) -> bool:
        """Whether every rank has exited; once one exits non-zero, the others are killed."""
        codes = self.codes()
        if any(code not in (None, 0) for code in codes) and None in codes:
            self.kill()
            codes = self.codes()
        return None not in codes

    def kill(self) -> None:
        """SIGKILL every rank still running (and anything below it)."""
        for process in self.processes:
            if process.exitcode is None:
                kill_tree(process.pid)
        for process in self.processes:
            process.join(timeout=30)

    def wait(self, timeout: float) -> list[int]:
        """Exit codes (negative: killed by that signal) once every rank is done; fails after ``timeout``."""
        wait_jobs([self], timeout)
        return self.codes()

    def output(self, tail: int = 4000) -> str:
        """The end of every rank's log, for failure messages."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.is_file() else "(no log)"
            parts.append(f"--- {log.name} ---\n{text[-tail:]}")
        return "\n".join(parts)


def wait_jobs(jobs: list[Job], timeout: float) -> None:
    """Wait for every job to finish; kill them all and fail after ``timeout`` seconds."""
    import multiprocessing.connection

    deadline = time.monotonic() + timeout
    while not all(job.poll() for job in jobs):
        if time.monotonic() > deadline:
            for job in jobs:
                job.kill()
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for "
                                 f"{[job.name for job in jobs if None in job.codes()]}:\n"
                                 + "\n".join(job.output(1500) for job in jobs))
        sentinels = [p.sentinel for job in jobs for p in job.processes if p.exitcode is None]
        multiprocessing.connection.wait(sentinels, timeout=0.05)


class TinyRun:
    """A tiny, deterministic training run registered as the Trainer registers its state (model, AdamW,
    schedule, loader position, progress, run meta, per-rank RNG); DDP inside a process group.

    A step's batch depends only on (step, rank), plus draws from the global torch, Python and NumPy RNG
    streams, so a resume must restore those too to continue bit for bit.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, width: int = 256, seed: int = 0):
        import random

        import numpy as np
        import torch
        import torch.distributed as dist
        from torch import nn

        from traincore.run.state import Progress, training_registry

        self.rank, self.world_size = rank, world_size
        torch.manual_seed(seed)
        random.seed(seed * 1000 + rank)  # a forked child inherits the server's streams: start from known ones
        np.random.seed(seed * 1000 + rank)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
        if dist.is_initialized():
            model = nn.parallel.DistributedDataParallel(model)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: 1.0 / (1 + 0.01 * step))
        self.loader = _Position()
        self.progress = Progress()
        meta = {"config": {"model": {"name": "tiny_mlp", "width": width}}, "shape": [1, 8, 8],
                "classes": [str(c) for c in range(10)], "world_size": world_size}
        self.registry = training_registry(model, self.optimizer, self.scheduler, self.loader, self.progress,
                                          meta)

    @property
    def step(self) -> int:
        return self.progress.step

    def train_step(self) -> None:
        import random

        import numpy as np
        import torch
        import torch.nn.functional as F

        gen = torch.Generator().manual_seed(1000 * self.step + self.rank)
        x = torch.randn(8, 1, 8, 8, generator=gen) + 0.01 * torch.randn(8, 1, 8, 8)
        y = torch.randint(0, 10, (8,), generator=gen)
        scale = 1.0 + 0.001 * (random.random() + float(np.random.rand()))
        F.cross_entropy(self.model(x) * scale, y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.loader.position["consumed"] += 8 * self.world_size
        self.progress.step += 1

    def digests(self) -> tuple[str, str]:
        """(shared, per-rank): sha256 prefixes of every byte and value the registry would save."""
        return state_digest(self.registry.shared_state()), state_digest(self.registry.rank_state())


class _Position:
    """A loader's resumable position."""

    def __init__(self) -> None:
        self.position = {"seed": 0, "epoch": 0, "consumed": 0}

    def state_dict(self) -> dict:
        return dict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = dict(state)


def state_digest(tree: object) -> str:
    """A digest of a state tree: tensors by dtype, shape and bytes, everything else by repr."""
    import hashlib

    digest = hashlib.sha256()
    _feed(digest, tree)
    return digest.hexdigest()[:20]


def _feed(digest, value: object) -> None:
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{flat.dtype}{tuple(value.shape)}:".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}:".encode() + value.tobytes())
    elif isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode() + b":")
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
            digest.update(b",")
        digest.update(b"]")
    else:
        digest.update(repr(value).encode())


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines log a killed process wrote (a torn last line is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` (e.g. "1m") on ``path``; returns why it could not, or None once mounted."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount -t tmpfs failed: {exc}"
    if done.returncode != 0:
        return f"mount -t tmpfs failed ({done.returncode}): {done.stderr.strip()}"
    return None


def unmount(path: Path) -> None:
    """Unmount ``path`` (lazily if still busy)."""
    done = subprocess.run(["umount", str(path)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, text=True, timeout=60)


# ---- torch-elastic restarts: rank 0's log per attempt, and workers killed after checkpoints ----------------

# Rank 0's lines (any logger name: "__main__" under `-m traincore.train`, "traincore.train" elsewhere).
_ATTEMPT_LINE = re.compile(r"\[rank 0\] [\w.]+: training .* for \d+ steps, "
                           r".*?(?:, resumed from step (\d+) in .*)?$")
_STEP_LINE = re.compile(r"\[rank 0\] [\w.]+: step (\d+)/\d+ \|")
_COMMIT_LINE = re.compile(r"\[rank 0\] [\w.]+: checkpoint step=(\d+) committed")


@dataclass
class Attempt:
    """One start of the worker group as rank 0 logged it: the step it resumed from (0 when fresh), the steps
    it logged and the checkpoints it committed."""

    resumed_from: int
    steps: list[int] = field(default_factory=list)
    commits: list[int] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return max(self.steps, default=self.resumed_from)


def attempts(log: str) -> list[Attempt]:
    """The attempts in a run's combined output, in order; every step shows with telemetry.log_every=1."""
    found: list[Attempt] = []
    for line in log.splitlines():
        if match := _ATTEMPT_LINE.search(line):
            found.append(Attempt(int(match.group(1) or 0)))
        elif found and (match := _STEP_LINE.search(line)):
            found[-1].steps.append(int(match.group(1)))
        elif found and (match := _COMMIT_LINE.search(line)):
            found[-1].commits.append(int(match.group(1)))
    return found


def child_processes(pid: int, marker: bytes) -> list[int]:
    """Live direct children of ``pid`` whose command line contains ``marker`` (torchrun's workers)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            command = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and marker in command:
            found.append(int(proc.name))
    return sorted(found)


def still_running(pids: list[int], marker: bytes) -> list[int]:
    """Those of ``pids`` still alive (not zombies) and still running ``marker`` (not a reused pid)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if state != "Z" and marker in command:
            alive.append(pid)
    return alive


def watch_log(process: subprocess.Popen, log: Path, deadline: float, what: str,
              found: Callable[[list[Attempt]], int | None]) -> int:
    """Poll ``log`` until ``found(attempts)`` gives a step; fail if ``process`` exits or time runs out."""
    while True:
        value = found(attempts(log.read_text(errors="replace")) if log.is_file() else [])
        if value is not None:
            return value
        if process.poll() is not None or time.monotonic() > deadline:
            status = "timed out" if process.returncode is None else f"exited with {process.returncode}"
            text = log.read_text(errors="replace") if log.is_file() else "(no log)"
            raise AssertionError(f"the run {status} before {what}; its log ends:\n{text[-4000:]}")
        time.sleep(0.02)  # a step takes ~10 ms idle: a step or two of overshoot is fine, more blurs the draw


@dataclass
class Fault:
    """One worker SIGKILLed: in which attempt, after which checkpoint it committed, at which logged step."""

    attempt: int
    checkpoint: int  # the attempt's first committed checkpoint; the kill came after it
    target: int  # the step drawn at random that the kill waited for
    killed_at: int  # rank 0's last logged step when the signal was sent
    pid: int


def kill_after_checkpoints(process: subprocess.Popen, log: Path, workers: Callable[[], list[int]],
                           faults: int, every: int, rng: random.Random, timeout: float) -> list[Fault]:
    """SIGKILL one worker of ``process`` (a torch-elastic agent) in each of its first ``faults`` attempts.

    In each attempt the kill waits for the attempt's first new checkpoint, then for a step drawn at random
    from the ``every - 1`` that follow it; ``workers()`` lists the live workers, one of which is killed.
    """
    deadline = time.monotonic() + timeout
    return [_kill_in_attempt(process, log, workers, index, every, rng, deadline) for index in range(faults)]


def _kill_in_attempt(process: subprocess.Popen, log: Path, workers: Callable[[], list[int]], index: int,
                     every: int, rng: random.Random, deadline: float) -> Fault:
    checkpoint = watch_log(process, log, deadline, f"a checkpoint in attempt {index}",
                           lambda runs: runs[index].commits[0] if len(runs) > index and runs[index].commits
                           else None)
    target = checkpoint + rng.randint(1, every - 1)
    watch_log(process, log, deadline, f"step {target} in attempt {index}",
              lambda runs: runs[index].last_step if runs[index].last_step >= target else None)
    victims = workers()
    assert victims, f"no worker of attempt {index} found below pid {process.pid}"
    victim = rng.choice(victims)
    os.kill(victim, signal.SIGKILL)
    killed_at = attempts(log.read_text(errors="replace"))[index].last_step
    return Fault(index, checkpoint, target, killed_at, victim)
