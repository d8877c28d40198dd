"""Workflow tests run with flytekit's local cache in a temporary directory, never the user's ~/.flyte."""

from __future__ import annotations

import pytest
from flytekit.core import local_cache


@pytest.fixture(scope="module", autouse=True)
def isolated_local_cache(tmp_path_factory):
    """A fresh local task cache per module: hits come from this module's runs only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_cache, "CACHE_LOCATION", str(tmp_path_factory.mktemp("flyte-local-cache")))
        patch.setattr(local_cache.LocalTaskCache, "_initialized", False)
        yield
