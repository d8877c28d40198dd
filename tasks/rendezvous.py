"""What a failed torch-elastic rendezvous looked like, for the error a user reads.

torch's RendezvousError often carries no message at all (users saw ``rendezvous failed: , cause=``), yet the
two usual causes need different fixes: a node that came up late (wait longer, or find why it is stuck) and a
store nobody can reach (the node that should host it never started, or the address or port is wrong). The
message therefore names the rendezvous (endpoint, backend, run id, timeout, expected nodes) and, read back
from the c10d store, how many nodes had arrived.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT, C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

# Bounds each step of the probe (TCP connect, store handshake, read): long enough for a live store across a
# cluster network or on a node whose cores are all busy, short enough that a failed task still fails
# promptly (a refused connection returns at once).
PROBE_TIMEOUT_S = 5


class RendezvousStateUnpickler(pickle.Unpickler):
    """Unpickles torch's dynamic-rendezvous state and nothing else: the bytes come over the network from
    whatever listens at the endpoint, so no other class may be built from them."""

    _ALLOWED = {("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
                ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
                ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state: refused")


def arrived_nodes(store: TCPStore, run_id: str) -> int | None:
    """How many nodes had joined rendezvous ``run_id`` in the c10d ``store``, this one included; None when
    no node had written any state.

    Reads the state as torch's own nodes do: C10dRendezvousBackend.get_state() returns the pickled
    dynamic-rendezvous state, whose participants and wait_list are the nodes that arrived. A node that timed
    out removes itself from them before it raises, so this node is counted apart, by its FQDN and pid (the
    address and pid in its torch _NodeDesc; flytekit's launcher sets no local_addr).
    """
    # The backend first writes torch's "no state yet" sentinel where the key is missing, as every joining
    # node does: without it the read would block until the store's timeout.
    found = C10dRendezvousBackend(store, run_id).get_state()
    if found is None:
        return None
    state = RendezvousStateUnpickler(io.BytesIO(found[0])).load()
    this_node = (socket.getfqdn(), os.getpid())
    others = {node for node in (*state.participants, *state.wait_list) if (node.addr, node.pid) != this_node}
    return len(others) + 1


def first_line(exc: BaseException) -> str:
    """``Type: message`` cut at its first line: torch's store errors append multi-line C++ traces."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else '(no message)'}"


def arrivals(endpoint: str, run_id: str, min_nodes: int, max_nodes: int) -> str:
    """``N of M nodes had arrived``, or why that cannot be known: best effort, a few PROBE_TIMEOUT_S at
    most, and never an exception (it only words the error the task raises anyway)."""
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    except ValueError as exc:
        return f"how many nodes arrived is unknown: {exc}"
    if port == 0:  # the store bound a free port at launch; only the failed launcher knew which
        return "how many nodes arrived is unknown: the store's port was picked at launch (endpoint port 0)"
    try:  # a plain connection first: TCPStore would retry a refused one and log C++ traces while it does
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        # A client only: the probe must never start a store of its own.
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=PROBE_TIMEOUT_S),
                         wait_for_workers=False)
    except Exception as exc:  # DistNetworkError, DistStoreError, TimeoutError, a name that cannot resolve
        return (f"the rendezvous store at {host}:{port} could not be reached ({first_line(exc)}): "
                f"the first node never came up, or the address/port is wrong")
    try:
        arrived = arrived_nodes(store, run_id)
    except Exception as exc:  # a store that answers but holds no state this torch can read
        return f"the rendezvous state at {host}:{port} could not be read ({type(exc).__name__}: {exc})"
    if arrived is None:
        return f"no node had joined the rendezvous in the store at {host}:{port}"
    expected = str(min_nodes) if min_nodes == max_nodes else f"at least {min_nodes} (at most {max_nodes})"
    return f"{arrived} of {expected} nodes had arrived when it failed (this node included)"


def rendezvous_failure(error: BaseException, *, endpoint: str, run_id: str, timeout_s: object,
                       min_nodes: int, max_nodes: int) -> str:
    """The message for a RendezvousError: what timed out, where, and how many nodes of how many arrived."""
    what = f"{type(error).__name__}: {error}" if str(error) else f"{type(error).__name__} (no message)"
    if error.__cause__ is not None:  # e.g. RendezvousConnectionError: "See inner exception for details."
        what += f", caused by {type(error.__cause__).__name__}: {error.__cause__}"
    expected = f"{min_nodes} node" if min_nodes == max_nodes == 1 else (
        f"{min_nodes} nodes" if min_nodes == max_nodes else f"{min_nodes} to {max_nodes} nodes")
    return (f"rendezvous failed: {what}. The c10d rendezvous '{run_id}' at {endpoint} waited up to "
            f"{timeout_s} s for {expected}; {arrivals(endpoint, run_id, min_nodes, max_nodes)}")
