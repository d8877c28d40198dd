"""Local workers for one command, forked where safe from a process that has already imported torch and
traincore (:func:`start_method`).

``python -m traincore.train --nproc-per-node N`` starts its N workers here, through torch's public elastic
API (the agent torchrun runs, with a function entrypoint), instead of torchrun's N fresh interpreters that
each import torch and traincore again. The workers get torch elastic's environment (RANK, WORLD_SIZE,
MASTER_ADDR, the agent's store), restarts and error files exactly as under torchrun.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from traincore.config import ConfigError


def refuse_under_torchrun(option: str) -> None:
    """ConfigError when this process is already one of a launcher's workers (torchrun sets LOCAL_RANK)."""
    if "LOCAL_RANK" in os.environ:
        raise ConfigError(f"{option} launches workers itself, but this process is already a worker of "
                          f"torchrun (LOCAL_RANK={os.environ['LOCAL_RANK']}): drop {option}, or run "
                          f"`python -m traincore.train {option} N ...` without torchrun")


def start_method(threads: int, cuda: bool) -> str:
    """How to start workers that each run ``threads`` intra-op threads (and use CUDA or not): "fork" where
    that is safe, else "spawn".

    "fork" shares the parent's imports (seconds of start-up per worker), but a forked child keeps its
    parent's OpenMP pool state without the pool's threads: when the parent has already run a multi-threaded
    op (preflight's forward, a user's own code), a child that runs a parallel op with more than one thread
    waits forever for threads that do not exist in it. Measured here (torch 2.14.1, 2 cores): a parent that
    ran one 1500x1500 matmul, then a forked child building and calling a Conv2d at the default thread
    count, hung; the same child at one thread took 0.03 s. One thread never enters the pool, so forked
    workers are single-threaded ones only (the default for several per node); a worker that wants the
    node's cores starts in a fresh interpreter. With CUDA, "spawn" always: a CUDA context does not survive
    a fork, and the parent has already asked CUDA for its devices (preflight's backend check). Whoever
    forks calls :func:`open_start_gate` first: a lock another of its threads holds would stay locked in a
    child forked meanwhile, and the rendezvous store's server thread takes one for every worker that
    connects.
    """
    return "fork" if threads == 1 and not cuda else "spawn"


def worker_threads(nproc_per_node: int) -> int:
    """Intra-op threads per worker: OMP_NUM_THREADS when set, else torchrun's default (1 for N > 1)."""
    default = 1 if nproc_per_node > 1 else torch.get_num_threads()
    try:
        return max(int(os.environ.get("OMP_NUM_THREADS", default)), 1)
    except ValueError as exc:
        raise ConfigError(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']!r} is not an integer: set it to "
                          "the threads each worker may use, e.g. 1, or unset it") from exc


def shutdown_timeout_s() -> int:
    """Seconds torch elastic's agent waits after signalling its workers before it SIGKILLs them:
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, read as torch reads it (a whole number), else torch's 30. A ConfigError
    for a value torch cannot read: its launcher would end in a bare ValueError traceback after preflight,
    and a fractional value such as 45.5 is refused there too."""
    value = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    try:
        seconds = int(value)
    except ValueError:
        seconds = -1
    if seconds < 0:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={value!r} is not a whole number of seconds >= 0: "
                          "set it to how long torch elastic waits after signalling its workers before it "
                          "SIGKILLs them, e.g. 30 (the default), or unset it")
    return seconds


START_GATE_TIMEOUT_S = 300  # a worker waits this long for its siblings (a dead one ends the attempt sooner)
_start_gate: mmap.mmap | None = None  # one byte per local worker, shared with forked ones (open_start_gate)


def open_start_gate(nproc_per_node: int) -> None:
    """Call before forking ``nproc_per_node`` workers: each then waits in :func:`settle_worker` until every
    local worker of its attempt has been forked, and only then connects to anything.

    Why: the launcher hosts torch elastic's rendezvous store, whose server thread looks up the name of
    every client that connects (getnameinfo, which takes glibc's resolver lock). A worker forked while
    that thread holds the lock inherits it locked, and hangs for good at its own first connection (c10d's
    TCPStore client formats its address the same way), before any timeout applies: three ranks of a run
    stood in init_process_group until killed. Reproduced with torch 2.14.1 (bench/fork_gate.py: a process
    hosting a TCPStore forks three workers that connect and form a gloo group): 4 launches in 150 hung
    alone, 10 in 127 beside other work, 3 in 42 with both cores busy, each with a worker in glibc's
    ``__resolv_context_get``. Held back until the last fork, no worker connects while another is forked:
    0 in 300, alone and with both cores busy. Spawned workers never pass through here (no gate in them).
    """
    global _start_gate
    _start_gate = mmap.mmap(-1, nproc_per_node)  # anonymous and shared: what a forked worker writes, all see


def _pass_start_gate(timeout_s: float = START_GATE_TIMEOUT_S) -> None:
    """Mark this worker started in this attempt, and wait until its local siblings have too."""
    if _start_gate is None:
        return
    mark = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) % 255 + 1  # a restart's workers mark anew
    _start_gate[int(os.environ["LOCAL_RANK"])] = mark
    deadline = time.monotonic() + timeout_s
    while _start_gate[:].count(mark) < len(_start_gate):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(_start_gate) - _start_gate[:].count(mark)} of this node's "
                               f"{len(_start_gate)} workers did not start within {timeout_s:.0f} s")
        time.sleep(0.002)


WORKER_NAME = "traincore-r"
"""A worker's process name (``ps``, ``top``, /proc/PID/comm) begins with this, its global rank after it: in a
listing of a node's processes the ranks are told apart from their launcher and from one another, and a
watcher can tell a worker from any other child of the launcher (a forked worker keeps its launcher's command
line)."""


def settle_worker(threads: int) -> None:
    """Give a worker what a fresh interpreter has where a fork gave it its launcher's (harmless if spawned),
    and its name (:data:`WORKER_NAME`).

    Signals: the elastic agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by raising an exception in
    Python. A forked worker blocked in a collective (its peer died) would then ignore the agent's SIGTERM
    until the agent's SIGKILL 30 s later; with the default handlers it stops at once. Threads: a forked
    worker keeps the launcher's intra-op pool (every core), which OMP_NUM_THREADS no longer changes once
    torch has started it: N workers would oversubscribe the cores N times.
    """
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(threads)
    name_worker()
    _pass_start_gate()  # forked ones: not a connection before the last fork (open_start_gate)


def name_worker() -> None:
    """Name this worker ``traincore-r<RANK>`` as ``ps`` and ``top`` show it (Linux keeps 15 bytes; elsewhere,
    and where /proc is read-only, the name stays as it was). Only the calling thread's name changes: called
    from the main thread, that is the process's."""
    try:
        Path("/proc/self/comm").write_text(f"{WORKER_NAME}{os.environ.get('RANK', '')}"[:15])
    except OSError:
        pass


def _run(entrypoint: Callable[..., Any], threads: int, *args: Any) -> Any:
    settle_worker(threads)
    return entrypoint(*args)


def launch_local(entrypoint: Callable[..., Any], args: tuple, nproc_per_node: int,
                 max_restarts: int = 0) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``nproc_per_node`` local workers; their return values by global rank.

    A c10d rendezvous on a free local port (torchrun --standalone); up to ``max_restarts`` restarts of the
    whole group after a failure. A worker's failure raises torch elastic's ChildFailedError, which names
    the failed ranks, their exit codes and, from their error files, their tracebacks.
    """
    # Here: a one-process run (which imports this module for its checks) never loads torch elastic's launcher.
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads, shutdown_timeout = worker_threads(nproc_per_node), shutdown_timeout_s()
    method = start_method(threads, torch.cuda.is_available())
    if method == "spawn":
        # A forkserver instead: one fresh interpreter imports the entrypoint's module, and each worker (and
        # each restart) forks from it, never from this process. Measured to the end of a 1-step digits run
        # with one worker and a restart budget: forkserver 8.0-8.8 s, spawn 9.2-9.5 s (2 cores).
        method = "forkserver"
        multiprocessing.get_context(method).set_forkserver_preload([entrypoint.__module__])
    else:
        open_start_gate(nproc_per_node)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          start_method=method, shutdown_timeout=shutdown_timeout)
    return elastic_launch(config, _run)(entrypoint, threads, *args)
