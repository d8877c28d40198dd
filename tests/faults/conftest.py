"""Fixtures of the fault-injection suite: a small staged dataset each test may damage a copy of, and the
uninterrupted runs that faulted runs are compared with."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from faultlib import train_args
from ranks import train_forked

REFERENCE_EVERY = 10  # the reference runs' checkpoint interval: a run's weights do not depend on it


@pytest.fixture(scope="session")
def fault_data(train_data: Path) -> Path:
    """A staged synthetic dataset (3x12x12, 4 classes, 384 training samples; tests/conftest.py's
    ``train_data``, shared with tests/traincore/); never modify it."""
    return train_data


@pytest.fixture
def damaged_copy(fault_data: Path, tmp_path: Path) -> Path:
    """A private copy of ``fault_data`` for tests that corrupt it."""
    return Path(shutil.copytree(fault_data, tmp_path / "staged"))


@pytest.fixture(scope="session")
def uninterrupted_run(fault_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``uninterrupted_run(steps)``: the checkpoint root of an uninterrupted two-worker run of faultlib's TINY
    config on ``fault_data`` for ``steps`` steps (a checkpoint every REFERENCE_EVERY steps and at the last),
    its workers forked by the train CLI, which itself forks from the tests' preloaded server (faultlib's
    ``train_forked``): seconds cheaper than torchrun's fresh interpreters, the same ranks and bitwise the same
    weights. Only read it.

    Each run happens once per test run, for every file that compares with it (test_preempted_runs.py and
    test_restarts.py train the same steps), also when pytest-xdist gives those files to different workers:
    the first worker to ask makes it, under a lock, in the base temporary directory the workers share; the
    others wait for it. Each worker stages ``fault_data`` itself, to the same bytes."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(steps: int) -> Path:
        output = shared / f"uninterrupted-{steps}"
        with open(shared / f"uninterrupted-{steps}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (output / "done").is_file():  # a worker that failed or died left no marker: run again
                shutil.rmtree(output, ignore_errors=True)
                train_uninterrupted(fault_data, output, steps)
                (output / "done").touch()
        return output / "checkpoints"
    return get


def train_uninterrupted(data: Path, output: Path, steps: int) -> None:
    """Train TINY on ``data`` for ``steps`` steps on the CLI's two forked workers, into ``output``."""
    args = train_args(data, output, "--max-steps", str(steps), "--checkpoint-every", str(REFERENCE_EVERY))
    train_forked(["--nproc-per-node", "2", *args], output.with_name(f"{output.name}.log"))
