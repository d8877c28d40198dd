"""Shared fixtures: small staged datasets (built once per test session) and a JPEG ImageFolder writer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from traincore.config.schema import DataConfig
from traincore.data.staging import stage

# tests/budget.py: no test over 120 s, the run's wall time; tests/scopes.py: how pytest-xdist workers share
# the suite (`make test`).
pytest_plugins = ["budget", "scopes"]

# 100 synthetic samples split 80/10/10; 32 per shard puts the train split in three shards (32, 32, 16),
# so reads cross shard boundaries. Every image carries its own noise, so image bytes identify a sample.
SYNTHETIC = DataConfig(source="synthetic", image_size=8, synthetic_samples=100, synthetic_classes=4,
                       samples_per_shard=32)
DIGITS = DataConfig(source="digits", image_size=16, channels=1)

# One clearly different colour per class, so a staged image's colour tells which class it came from.
CLASS_COLOURS = ((220, 30, 30), (30, 200, 40), (40, 50, 210), (230, 220, 40))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def isolated_user_cache(tmp_path_factory):
    """Local stagings go under $XDG_CACHE_HOME (tasks.stage): keep the tests' out of the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="module", autouse=True)
def isolated_local_cache(tmp_path_factory):
    """flytekit's local task cache in a temporary directory per module, never the user's ~/.flyte:
    cache hits come from this module's runs only."""
    from flytekit.core import local_cache

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_cache, "CACHE_LOCATION", str(tmp_path_factory.mktemp("flyte-local-cache")))
        patch.setattr(local_cache.LocalTaskCache, "_initialized", False)
        yield


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A 127.0.0.1 port that takes connections and answers nothing (tests/ports.py)."""
    from ports import listening

    with listening() as port:
        yield port


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A local S3 server (moto) with one empty bucket; fails under CI=true when it cannot start."""
    from s3_server import start_s3_server

    yield from start_s3_server(tmp_path_factory.mktemp("s3"))


@pytest.fixture(scope="session")
def synthetic_config() -> DataConfig:
    """The DataConfig behind ``synthetic_dir``."""
    return SYNTHETIC


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A staged synthetic dataset: 3x8x8, 4 classes, train/val/test = 80/10/10."""
    output = tmp_path_factory.mktemp("staged") / "synthetic"
    stage(SYNTHETIC, output)
    return output


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scikit-learn digits staged at 1x16x16."""
    output = tmp_path_factory.mktemp("staged") / "digits"
    stage(DIGITS, output)
    return output


@pytest.fixture(scope="session")
def class_colours() -> np.ndarray:
    """The RGB colour each ``write_image_folder`` class is drawn in, one row per class."""
    return np.array(CLASS_COLOURS, dtype=np.float64)


def write_image_folder(root: Path, per_class: int = 6, classes: int = 3, size: tuple[int, int] = (20, 14),
                       seed: int = 0) -> Path:
    """Write ``<root>/class_k/img_i.jpg``: noisy images in class k's colour, deterministic for ``seed``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = size
    for label in range(classes):
        directory = root / f"class_{label}"
        directory.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            noise = rng.integers(-25, 26, size=(height, width, 3))
            pixels = np.clip(np.array(CLASS_COLOURS[label]) + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(directory / f"img_{index:03d}.jpg", quality=95)
    return root


@pytest.fixture
def image_folder_factory(tmp_path: Path) -> Callable[..., Path]:
    """``make(name, **kwargs)`` writes a JPEG ImageFolder tree under this test's tmp_path."""

    def make(name: str = "images", **kwargs) -> Path:
        return write_image_folder(tmp_path / name, **kwargs)

    return make


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared 3-class JPEG ImageFolder with 10 images per class (20x14 pixels, not square)."""
    return write_image_folder(tmp_path_factory.mktemp("imagefolder") / "images", per_class=10)


# 480 synthetic 12x12 samples of 4 classes, split 384/48/48 in shards of 100: the dataset of the tests that
# train through the CLI, in tests/traincore/ (data_dir) and tests/faults/ (fault_data) alike.
TRAIN_DATA = DataConfig(source="synthetic", image_size=12, synthetic_samples=480, synthetic_classes=4,
                        samples_per_shard=100)


@pytest.fixture(scope="session")
def train_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``TRAIN_DATA`` staged once per test session; never modify it (copy it first)."""
    output = tmp_path_factory.mktemp("train-data") / "staged"
    stage(TRAIN_DATA, output)
    return output
