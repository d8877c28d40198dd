"""Fixtures of the training-core tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from traincore.config.schema import DataConfig
from traincore.data.staging import stage


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """480 synthetic 12x12 samples of 4 classes, staged once for every test that trains through the CLI."""
    out = tmp_path_factory.mktemp("train-data") / "staged"
    stage(DataConfig(source="synthetic", image_size=12, synthetic_samples=480, synthetic_classes=4,
                     samples_per_shard=100), out)
    return out
