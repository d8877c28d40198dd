"""Child processes for the tests, forked in ~0.1 s from one server that has torch and traincore imported.

A fresh interpreter per child (``torch.multiprocessing.spawn``, ``python script.py``) imports torch,
torch.distributed, DCP and traincore again: 3-8 s each on a busy 2-core machine. Here one forkserver per
test process (one per pytest-xdist worker) imports them once and every child forks from it: still a real,
separate process (its own gloo rank, signals and exit code) with nothing of the test's state in it. Never
fork from the test process itself: it has run torch's intra-op thread pool, and a forked child that runs
more than one thread would hang.

The server's preload list is fixed when it first starts, so every test starts its children through here.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path

import traincore

# What the children import. DDP imports torch._dynamo (3 s of CPU), DCP takes 1.5 s, torch 3 s. The server
# skips a module it cannot import (faultlib where tests/faults/ is not on sys.path).
TRAIN_SCRIPT = Path(traincore.__file__).parent / "train.py"  # what `python -m traincore.train` runs
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "numpy", "pytest",
           "traincore.checkpoint.checkpointer", "traincore.run.state", "traincore.run.dist",
           "traincore.model.build", "traincore.data.loader", "traincore.telemetry.reporting",
           "traincore.artifacts.registry", "faultlib"]


def forkserver() -> ForkServerContext:
    """The forkserver context, with PRELOAD for its server (which starts with the first child)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def warm() -> None:
    """Start the server now, so that it imports while the caller does other work (the first child would
    otherwise wait for those imports)."""
    forkserver()
    multiprocessing.forkserver.ensure_running()


def start_ranks(fn: Callable[..., None], args: tuple = (), nprocs: int = 2, join: bool = True):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join)`` with forked children.

    Each runs ``fn(rank, *args)`` with this process's environment as it is now (a monkeypatched variable
    included, as a spawned child would inherit it) and one intra-op thread. Returns the ProcessContext
    when ``join`` is false; with ``join`` a failed rank raises as in torch.
    """
    import torch.multiprocessing as mp

    forkserver()
    return mp.start_processes(_rank_main, args=(fn, dict(os.environ), args), nprocs=nprocs, join=join,
                              start_method="forkserver")


def start_script(script: Path, args: list, log: Path, env: dict[str, str] | None = None,
                 name: str | None = None) -> multiprocessing.Process:
    """Start ``python script args`` as a forked child: ``script`` runs as __main__ with its stdout and
    stderr appended to ``log``, in this process's environment plus ``env``."""
    process = forkserver().Process(target=_script_main, name=name or script.stem,
                                   args=(str(script), [str(arg) for arg in args],
                                         {**os.environ, **(env or {})}, str(log)))
    process.start()
    return process


def start_train(args: list, log: Path, env: dict[str, str] | None = None) -> multiprocessing.Process:
    """``python -m traincore.train args`` as a forked child (``start_script``): a process of its own that
    forks its workers, without the seconds of imports a fresh interpreter spends. For runs whose own start-up
    no test checks."""
    return start_script(TRAIN_SCRIPT, args, log, env)


def train_forked(args: list, log: Path, timeout: float = 300) -> str:
    """``start_train`` until the run ends, which must be with exit code 0: what it printed (stdout and
    stderr together)."""
    start = log.stat().st_size if log.is_file() else 0
    code = wait_exit(start_train(args, log), timeout)
    printed = log.read_bytes()[start:].decode(errors="replace")
    assert code == 0, printed[-6000:]
    return printed


def wait_exit(process: multiprocessing.Process, timeout: float) -> int:
    """``process``'s exit code (negative: killed by that signal); after ``timeout``, SIGKILL it and fail
    with where each process of its tree waited (hang_report)."""
    process.join(timeout)
    if process.exitcode is None:
        where = hang_report(process.pid)
        process.kill()
        process.join()
        raise AssertionError(f"{process.name} still ran after {timeout:.0f} s; where its processes waited:\n"
                             f"{where}")
    return process.exitcode


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (/proc's children lists)."""
    tree = [pid]
    for parent in tree:
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                tree += [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # ended meanwhile
                pass
    return tree


def hang_report(pid: int, dump_timeout_s: float = 30) -> str:
    """Each process of ``pid``'s tree: its command line, state and kernel wait channel, and every thread's
    Python and native stack (py-spy, a dev dependency): what a hung run waited for, read before the kill."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    lines = []
    for member in process_tree(pid):
        proc = Path(f"/proc/{member}")
        try:
            command = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in proc.joinpath("status").read_text().splitlines()
                         if line.startswith("State:"))
            lines.append(f"pid {member} [{command.strip()[:160]}] {state}, waits in "
                         f"{proc.joinpath('wchan').read_text() or '-'}")
        except OSError:
            continue
        if spy:
            try:
                dumped = subprocess.run([spy, "dump", "--native", "--pid", str(member)], capture_output=True,
                                        text=True, timeout=dump_timeout_s)
                lines += [line for line in (dumped.stdout or dumped.stderr).splitlines()
                          if line.startswith(("Thread ", "    "))]
            except subprocess.TimeoutExpired:
                lines.append("    (py-spy did not answer)")
    return "\n".join(lines)


def _settle(env: dict[str, str]) -> None:
    """In a forked child: ``env`` as the whole environment (a child otherwise keeps the one the server
    started with) and one intra-op thread (the server's OpenMP read OMP_NUM_THREADS long before)."""
    import torch

    os.environ.clear()
    os.environ.update({**env, "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)


def _rank_main(rank: int, fn: Callable[..., None], env: dict[str, str], args: tuple) -> None:
    _settle(env)
    fn(rank, *args)


def _script_main(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    import runpy

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    _settle(env)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
