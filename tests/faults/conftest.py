"""Fixtures of the fault-injection suite: a small staged dataset each test may damage a copy of."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from traincore.config.schema import DataConfig
from traincore.data.staging import stage

FAULT_DATA = DataConfig(source="synthetic", image_size=12, synthetic_samples=480, synthetic_classes=4,
                        samples_per_shard=100)


@pytest.fixture(scope="session")
def fault_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A staged synthetic dataset (3x12x12, 4 classes, 384 training samples); never modify it."""
    output = tmp_path_factory.mktemp("fault-data") / "staged"
    stage(FAULT_DATA, output)
    return output


@pytest.fixture
def damaged_copy(fault_data: Path, tmp_path: Path) -> Path:
    """A private copy of ``fault_data`` for tests that corrupt it."""
    return Path(shutil.copytree(fault_data, tmp_path / "staged"))
