"""Fixtures of the fault-injection suite: a small staged dataset each test may damage a copy of."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def fault_data(train_data: Path) -> Path:
    """A staged synthetic dataset (3x12x12, 4 classes, 384 training samples; tests/conftest.py's
    ``train_data``, shared with tests/traincore/); never modify it."""
    return train_data


@pytest.fixture
def damaged_copy(fault_data: Path, tmp_path: Path) -> Path:
    """A private copy of ``fault_data`` for tests that corrupt it."""
    return Path(shutil.copytree(fault_data, tmp_path / "staged"))
