"""Which processes are torch elastic's workers, for tests that watch or kill them."""

from __future__ import annotations

from pathlib import Path

from traincore.run import WORKER_NAME


def elastic_workers(pid: int) -> list[int]:
    """torch elastic's workers below ``pid``, exactly: the processes that named themselves as workers
    (traincore.run.WORKER_NAME, whatever started them: fork, forkserver or spawn) and spawned ones still on
    their way there (multiprocessing's ``spawn_main`` in the command line of a child of ``pid``). A
    ``subprocess`` child, the resource tracker and a worker's own children (which inherit its name) are not
    workers."""
    processes = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            command = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        name, parent = stat[stat.index("(") + 1:stat.rindex(")")], int(stat.rsplit(")", 1)[1].split()[1])
        processes[int(proc.name)] = (parent, name.startswith(WORKER_NAME), command)

    def below(child: int) -> bool:
        while child in processes and child != pid:
            child = processes[child][0]
        return child == pid

    workers = []
    for child, (parent, named, command) in processes.items():
        parent_named = parent in processes and processes[parent][1]
        spawned = parent == pid and b"spawn_main" in command
        if child != pid and below(child) and ((named and not parent_named) or spawned):
            workers.append(child)
    return sorted(workers)
