"""How `make test` shares the suite between pytest-xdist workers: a worker takes a whole scope (a test file,
or a group of files that share one machine-wide resource) and runs it in order, and the workers take the
longest scopes first.

Why scopes and not single tests: module and session fixtures (a 2-pod replay, a staged dataset) are built
once per worker that needs them, and the Slurm tests read the one loopback cluster's job list, which another
worker's jobs would change under them. Why longest first: the suite's end-to-end files take minutes each; one
that starts last leaves the other worker idle for its whole length. `tests/durations.json` holds the seconds
each file took in a measured run (`pytest --budget-durations tests/durations.json`, tests/budget.py); a file
missing from it counts as quick. Loaded from tests/conftest.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

# Files that share one machine-wide resource whose state their tests read: the loopback Slurm cluster (its job
# list, its nodes' CPUs). Every other test file is a scope of its own.
SHARED_SCOPES = ("tests/slurm/",)
DURATIONS = Path(__file__).with_name("durations.json")


def scope_of(nodeid: str) -> str:
    """The unit of work a worker takes whole: a shared scope or the test's file."""
    path = nodeid.split("::", 1)[0]
    return next((prefix for prefix in SHARED_SCOPES if path.startswith(prefix)), path)


def longest_scope_first(items: list[pytest.Item]) -> Callable[[pytest.Item], tuple[float, int]]:
    """A sort key: the measured seconds of an item's scope, descending, then where the scope was first
    collected (a stable sort keeps the tests of a scope in their order)."""
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    seconds: dict[str, float] = {}
    for path, spent in measured.items():
        seconds[scope_of(path)] = seconds.get(scope_of(path), 0.0) + spent
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(scope_of(item.nodeid), index)
    return lambda item: (-seconds.get(scope_of(item.nodeid), 0.0), first_seen[scope_of(item.nodeid)])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, order the tests longest scope first: the scheduler hands out scopes in collection
    order, and every worker sorts the same collection the same way."""
    if hasattr(config, "workerinput"):
        items.sort(key=longest_scope_first(items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scope scheduling (a worker runs a whole scope, in collection order), over
    ``scope_of``."""
    from xdist.scheduler import LoadScopeScheduling

    # xdist would reorder the scopes by their number of tests (--loadscope-reorder, its default): keep the
    # collection's order, longest measured first.
    config.option.loadscopereorder = False

    class ScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ScopeScheduling(config, log)
