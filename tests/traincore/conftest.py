"""Fixtures of the training-core tests."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ranks import train_forked
from trainruns import CHECKPOINTED, train_cmd


@pytest.fixture(scope="session")
def data_dir(train_data: Path) -> Path:
    """The staged dataset of every test that trains through the CLI (tests/conftest.py's ``train_data``)."""
    return train_data


@pytest.fixture(scope="session")
def forked_train() -> Callable[..., str]:
    """``forked_train(data, output, nproc, *flags, config=None)``: the command trainruns.train_cmd builds,
    run as a child forked from the tests' preloaded server (tests/ranks.py) instead of a fresh interpreter:
    a process of its own (its ranks forked from it), without the imports a fresh one spends (~9 CPU-s of
    a 10-step run's ~13 on 2 cores). Fails unless it exits 0; returns what it printed (stdout and stderr
    together). For runs whose own start-up, or which stream a line goes to, no test checks."""
    def run(data: Path, output: Path, nproc: int, *flags: str, config: dict | None = None) -> str:
        args = train_cmd(data, output, nproc, *flags, config=config)[3:]  # without python -m traincore.train
        return train_forked(args, output.with_name(f"{output.name}.log"))  # appended to by each run
    return run


@pytest.fixture(scope="session")
def saved(data_dir: Path, forked_train: Callable[..., str],
          tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``saved("<parallelism>-<mode>-<ranks>")``: the checkpoint root (steps 5 and 10) of a 10-step CLI run
    (``forked_train``) of CHECKPOINTED on ``data_dir`` written that way, e.g. "fsdp-dcp-2"; its parent is
    the run's output directory (metrics.jsonl). Each run happens once per session, for every test that
    asks for it: only read what it wrote, and copy a root before resuming from it."""
    roots: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in roots:
            parallelism, mode, nproc = name.split("-")
            out = tmp_path_factory.mktemp(name) / "run"
            forked_train(data_dir, out, int(nproc), "--max-steps", "10", "--checkpoint-mode", mode,
                         "--parallelism", parallelism, config=CHECKPOINTED)
            roots[name] = out / "checkpoints"
        return roots[name]
    return get


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], None]]:
    """``install(name, source)``: a module of the user's (a dataset factory), importable here and in the
    decode and partition processes staging starts; datasets opened before are forgotten."""
    from traincore.data.pysource import open_dataset

    site, names = tmp_path / "site", []
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))  # the processes staging starts import it too

    def install(name: str, source: str) -> None:
        (site / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        open_dataset.cache_clear()

    yield install
    open_dataset.cache_clear()
    for name in names:
        sys.modules.pop(name, None)
