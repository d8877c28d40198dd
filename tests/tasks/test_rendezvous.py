"""A failed rendezvous says what timed out, where, and how many nodes of how many arrived.

The arrival counts come from real c10d rendezvous: the train task's own launcher (elastic_launch through the
kfpytorch plugin) on a loopback endpoint, with a 5 s timeout, and, where a second node is needed, a
rendezvous handler in a subprocess.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
from flytekit.exceptions.user import FlyteRecoverableException
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from tasks.rendezvous import RendezvousStateUnpickler
from tasks.train import ElasticTrainTask
from tasks.types import StagedDataset, Topology
from traincore.config.presets import preset
from traincore.data.manifest import Manifest

TIMEOUT_S = 5
RUN_ID = "local"  # flytekit's execution id name outside a cluster: the run id the plugin gives torch

# Another node: joins rendezvous RUN_ID at argv[1] and waits. It stays alive after the rendezvous closes (as a
# slow node would), so the store it may host outlives the task's failure until the test ends it.
OTHER_NODE = textwrap.dedent("""
    import sys, time
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    params = RendezvousParameters(backend="c10d", endpoint=sys.argv[1], run_id=sys.argv[2],
                                  min_nodes=int(sys.argv[3]), max_nodes=int(sys.argv[3]), join_timeout=120)
    handler = get_rendezvous_handler(params)  # held: it owns the store, which outlives a closed rendezvous
    try:
        handler.next_rendezvous()
    except Exception as exc:
        print(type(exc).__name__, exc, flush=True)
    time.sleep(120)
""")


@pytest.fixture
def dataset(synthetic_dir) -> StagedDataset:
    return StagedDataset.from_manifest(synthetic_dir, Manifest.load(synthetic_dir))


@pytest.fixture
def endpoint(monkeypatch) -> str:
    """A loopback endpoint on a free port, as the training operator would set it in every pod."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("PET_RDZV_ENDPOINT", f"127.0.0.1:{port}")
    monkeypatch.delenv("PET_NNODES", raising=False)
    return f"127.0.0.1:{port}"


def train_task(nnodes: int) -> ElasticTrainTask:
    return ElasticTrainTask(Topology(backend="kubernetes", nnodes=nnodes, nproc_per_node=1,
                                     rdzv_timeout_s=TIMEOUT_S), wandb_secret=False)


def failure_of(task: ElasticTrainTask, dataset: StagedDataset, tmp_path) -> str:
    """The message of the recoverable error the task raises (flytekit's str() wraps it in more text)."""
    with pytest.raises(FlyteRecoverableException) as caught:
        task.execute(config=preset("debug"), dataset=dataset, checkpoint_root=str(tmp_path))
    return caught.value.args[0]


def test_unreachable_store_is_named_instead_of_a_count(monkeypatch, endpoint, dataset, tmp_path):
    def no_store(self, **kwargs):  # what a node raises when the store's host never came up
        try:
            raise TimeoutError("client socket has timed out after 5000ms while trying to connect")
        except TimeoutError as exc:
            raise RendezvousConnectionError() from exc  # no message, as users saw it

    monkeypatch.setattr(PytorchElasticFunctionTask, "execute", no_store)
    started = time.monotonic()
    message = failure_of(train_task(2), dataset, tmp_path)
    assert time.monotonic() - started < 15  # the probe is bounded
    assert message.startswith(
        "rendezvous failed: RendezvousConnectionError (no message), caused by TimeoutError: client socket")
    assert f"c10d rendezvous '{RUN_ID}' at {endpoint} waited up to {TIMEOUT_S} s for 2 nodes" in message
    assert f"the rendezvous store at {endpoint} could not be reached (" in message
    assert message.endswith("the first node never came up, or the address/port is wrong")
    assert "had arrived" not in message


def test_one_of_two_nodes_arrived(endpoint, dataset, tmp_path):
    message = failure_of(train_task(2), dataset, tmp_path)
    assert message.startswith("rendezvous failed: RendezvousTimeoutError"), message
    assert f"'{RUN_ID}' at {endpoint} waited up to {TIMEOUT_S} s for 2 nodes" in message
    assert message.endswith("1 of 2 nodes had arrived when it failed (this node included)"), message


def wait_for_participants(endpoint: str, count: int, timeout_s: float = 60) -> None:
    """Block until ``count`` nodes have joined rendezvous RUN_ID at ``endpoint``."""
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2),
                             wait_for_workers=False)
            found = C10dRendezvousBackend(store, RUN_ID).get_state()
            if found and len(pickle.loads(found[0]).participants) >= count:
                return
        except Exception:  # noqa: BLE001 - the other node is still starting its store
            pass
        time.sleep(0.2)
    raise AssertionError(f"{count} node(s) never joined the rendezvous at {endpoint}")


def test_a_node_waiting_elsewhere_is_counted(endpoint, dataset, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", OTHER_NODE, endpoint, RUN_ID, "3"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_participants(endpoint, 1)  # the other node joined and hosts the store
        message = failure_of(train_task(3), dataset, tmp_path)
    finally:
        other.kill()
        other.wait()
    assert f"waited up to {TIMEOUT_S} s for 3 nodes" in message
    assert message.endswith("2 of 3 nodes had arrived when it failed (this node included)"), message


def test_the_state_reader_builds_no_class_but_torchs_rendezvous_state():
    class Sneaky:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="posix.system is not part of a rendezvous state"):
        RendezvousStateUnpickler(io.BytesIO(pickle.dumps(Sneaky()))).load()
