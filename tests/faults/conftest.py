"""Fixtures of the fault-injection suite: a small staged dataset each test may damage a copy of, and the
uninterrupted runs that faulted runs are compared with."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from faultlib import run, train_args

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
    its workers forked by the train CLI: seconds cheaper than torchrun's fresh interpreters, the same ranks
    and bitwise the same weights. Each run happens once per session, for every file that compares with it
    (tests/faults/test_preempted_runs.py and test_restarts.py train the same steps): only read it."""
    roots: dict[int, Path] = {}

    def get(steps: int) -> Path:
        if steps not in roots:
            output = tmp_path_factory.mktemp(f"uninterrupted-{steps}")
            command = [sys.executable, "-m", "traincore.train", "--nproc-per-node", "2", *train_args(
                fault_data, output, "--max-steps", str(steps), "--checkpoint-every", str(REFERENCE_EVERY))]
            done = run(command, timeout=300)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
            roots[steps] = output / "checkpoints"
        return roots[steps]
    return get
