"""scikit-learn's bundled 8x8 digits (1797 images), read from the installed package without importing it.

``read_digits`` returns the arrays ``sklearn.datasets.load_digits()`` returns, equal in values, dtypes and
shapes: it reads the same file (``sklearn/datasets/data/digits.csv.gz``) the same way (``np.loadtxt`` on
the decompressed text, the last column the target). ``from sklearn.datasets import load_digits`` costs
about 1.5 s of CPU (it imports scipy.stats and most of sklearn), paid by every process that fingerprints or
stages the digits (each Flyte pod of a run, the staging CLI) for a file numpy reads in 20 ms.
scikit-learn stays a dependency: the file ships with it.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import NamedTuple

import numpy as np

from traincore.data.manifest import StagingError

DATA_FILE = "datasets/data/digits.csv.gz"  # inside the sklearn package


class Digits(NamedTuple):
    """The digits as ``load_digits()`` gives them: pixel values are 0..16."""

    data: np.ndarray  # (1797, 64) float64, one flattened image a row
    target: np.ndarray  # (1797,) int64, the digit
    images: np.ndarray  # (1797, 8, 8) float64, a view of ``data``


def digits_file() -> Path:
    """Where the installed scikit-learn keeps the digits; ``StagingError`` naming the fix when it does not.

    ``find_spec`` of a top-level package finds its directory without executing its ``__init__``."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise StagingError(f"the digits source reads sklearn/{DATA_FILE}, which ships with scikit-learn, and "
                           "scikit-learn is not installed: install it (pip install scikit-learn)")
    locations = list(spec.submodule_search_locations or [])
    for location in locations:
        path = Path(location) / DATA_FILE
        if path.is_file():
            return path
    raise StagingError(f"the digits source reads sklearn/{DATA_FILE}, which is missing from the installed "
                       f"scikit-learn ({', '.join(locations)}): reinstall it (pip install --force-reinstall "
                       "scikit-learn)")


def read_digits() -> Digits:
    """The bundled digits, equal to ``sklearn.datasets.load_digits()``'s data, target and images."""
    with gzip.open(digits_file(), mode="rt", encoding="utf-8") as text:
        table = np.loadtxt(text, delimiter=",")
    # As load_digits builds them: the target is the last column as int, the images are the rest, reshaped.
    target = table[:, -1].astype(int, copy=False)
    data = table[:, :-1]
    return Digits(data, target, data.reshape(-1, 8, 8))
