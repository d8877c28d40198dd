"""Fixtures of the replay tests: the two registrations (fast and non-fast), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from replay_helpers import build_package  # noqa: I001  (a module beside this file)


@pytest.fixture(scope="session")
def fast_package(tmp_path_factory) -> Path:
    return build_package(tmp_path_factory.mktemp("pkg-fast") / "fast.tgz", fast=True)


@pytest.fixture(scope="session")
def non_fast_package(tmp_path_factory) -> Path:
    return build_package(tmp_path_factory.mktemp("pkg-non-fast") / "non-fast.tgz", fast=False)
