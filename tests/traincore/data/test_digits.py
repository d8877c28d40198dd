"""The bundled digits read without importing scikit-learn: the arrays ``sklearn.datasets.load_digits``
returns (values, dtypes, shapes), the fingerprint every earlier digits staging recorded, and an error naming
the fix when scikit-learn or its data file is missing."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import traincore.data.digits
from traincore.config.schema import DataConfig
from traincore.data.digits import read_digits
from traincore.data.fingerprint import digits_fingerprint, source_fingerprint
from traincore.data.manifest import StagingError

# The fingerprint of the digits since the source exists: part of every digits staging's cache key, so a
# change here would make every cached staging look stale.
DIGITS_FINGERPRINT = "digits:sha256:bb84ed4525b3bdd81142e6afe91f3165"


def test_the_arrays_equal_sklearn_load_digits():
    from sklearn.datasets import load_digits

    ours, theirs = read_digits(), load_digits()
    for name in ("data", "target", "images"):
        mine, reference = getattr(ours, name), getattr(theirs, name)
        assert mine.dtype == reference.dtype and mine.shape == reference.shape, name
        np.testing.assert_array_equal(mine, reference, err_msg=name)
    assert ours.data.shape == (1797, 64) and ours.images.shape == (1797, 8, 8)
    assert ours.target.dtype == np.int64 and ours.data.dtype == np.float64


def test_the_fingerprint_is_the_one_earlier_stagings_recorded():
    digits_fingerprint.cache_clear()  # computed from the file now, not remembered from another test
    assert source_fingerprint(DataConfig(source="digits")) == DIGITS_FINGERPRINT


def test_a_missing_data_file_names_the_fix(monkeypatch):
    monkeypatch.setattr(traincore.data.digits, "DATA_FILE", "datasets/data/no-such-file.csv.gz")
    with pytest.raises(StagingError, match=r"no-such-file\.csv\.gz, which is missing from the installed "
                                           r"scikit-learn .*pip install --force-reinstall scikit-learn"):
        read_digits()


def test_no_scikit_learn_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what the import system reads as "not installed"
    with pytest.raises(StagingError, match=r"scikit-learn is not installed: install it "
                                           r"\(pip install scikit-learn\)"):
        read_digits()
