"""Fixtures of the training-core tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from trainruns import CHECKPOINTED, run_train


@pytest.fixture(scope="session")
def data_dir(train_data: Path) -> Path:
    """The staged dataset of every test that trains through the CLI (tests/conftest.py's ``train_data``)."""
    return train_data


@pytest.fixture(scope="session")
def saved(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``saved("<parallelism>-<mode>-<ranks>")``: the checkpoint root (steps 5 and 10) of a 10-step CLI run
    of CHECKPOINTED on ``data_dir`` written that way, e.g. "fsdp-dcp-2"; its parent is the run's output
    directory (metrics.jsonl). Each run happens once per session, for every test that asks for it: only
    read what it wrote, and copy a root before resuming from it."""
    roots: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in roots:
            parallelism, mode, nproc = name.split("-")
            out = tmp_path_factory.mktemp(name)
            run_train(data_dir, out, int(nproc), "--max-steps", "10", "--checkpoint-mode", mode,
                      "--parallelism", parallelism, config=CHECKPOINTED)
            roots[name] = out / "checkpoints"
        return roots[name]
    return get
