"""Local workers for one command, forked where safe from a process that has already imported torch and
traincore (:func:`start_method`).

``python -m traincore.train --nproc-per-node N`` starts its N workers here, through torch's public elastic
API (the agent torchrun runs, with a function entrypoint), instead of torchrun's N fresh interpreters that
each import torch and traincore again. The workers get torch elastic's environment (RANK, WORLD_SIZE,
MASTER_ADDR, the agent's store), restarts and error files exactly as under torchrun.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
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
    a fork, and the parent has already asked CUDA for its devices (preflight's backend check).
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

    threads = worker_threads(nproc_per_node)
    method = start_method(threads, torch.cuda.is_available())
    if method == "spawn":
        # A forkserver instead: one fresh interpreter imports the entrypoint's module, and each worker (and
        # each restart) forks from it, never from this process. Measured to the end of a 1-step digits run
        # with one worker and a restart budget: forkserver 8.0-8.8 s, spawn 9.2-9.5 s (2 cores).
        method = "forkserver"
        multiprocessing.get_context(method).set_forkserver_preload([entrypoint.__module__])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          start_method=method)
    return elastic_launch(config, _run)(entrypoint, threads, *args)
