"""How often a worker forked beside a rendezvous store hangs at start-up, with and without the start gate.

    python bench/fork_gate.py [--launches 150] [--workers 3] [--timeout-s 40]

Not part of `make bench` (a hung launch costs its whole timeout). Each launch is what `--nproc-per-node N`
does on a CPU machine, reduced to its start-up: a process that hosts a TCPStore (as torch elastic's agent
does) forks N workers one after another; each connects to the store and joins a gloo group. Without the
gate a worker connects as soon as it is forked, while the next one is being forked; with it
(traincore.run.launch.open_start_gate), every worker waits until all N exist. A launch counts as hung
when a worker has not finished within ``--timeout-s``; the script then prints where it waited (py-spy,
where installed). Run it beside a busy loop per core to see what a loaded node sees. Measured on this
2-core VM with torch 2.14.1 (2026-11-28), 3 workers: without the gate 4 launches in 150 hung alone, 10
in 127 beside other work and 3 in 42 with both cores busy, every one in glibc's ``__resolv_context_get``
under the TCPStore client's connect; with it 0 in 300 alone and 0 in 300 with both cores busy.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

import torch.distributed as dist  # noqa: E402

from traincore.run import launch  # noqa: E402


def worker(port: int, rank: int, world: int, launch_number: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), TORCHELASTIC_RESTART_COUNT=str(launch_number))
    launch.settle_worker(1)  # as every worker starts: with a gate opened before the fork, it waits there
    timeout = datetime.timedelta(seconds=30)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"launch-{launch_number}", client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    dist.barrier()
    dist.destroy_process_group()


def hung_launches(launches: int, workers: int, timeout_s: float, gated: bool) -> int:
    """Launches in which a worker did not finish within ``timeout_s``."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fork, hung = multiprocessing.get_context("fork"), 0
    for number in range(launches):
        if gated:
            launch.open_start_gate(workers)
        started = [fork.Process(target=worker, args=(server.port, rank, workers, number))
                   for rank in range(workers)]
        for process in started:
            process.start()
        for process in started:
            process.join(timeout_s)
        stuck = [process for process in started if process.exitcode is None]
        hung += bool(stuck)
        for process in stuck:
            print(f"launch {number}: worker {process.pid} still runs after {timeout_s:.0f} s", flush=True)
            spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
            if spy:
                subprocess.run([spy, "dump", "--native", "--pid", str(process.pid)])
            process.kill()
            process.join()
    return hung


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=150)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=40)
    args = parser.parse_args(argv)
    for gated in (False, True):
        began = time.monotonic()
        hung = hung_launches(args.launches, args.workers, args.timeout_s, gated)
        print(f"{'with' if gated else 'without'} the start gate: {hung} of {args.launches} launches of "
              f"{args.workers} forked workers hung ({time.monotonic() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
