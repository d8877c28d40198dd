"""A run's records kept in its durable root while it runs: ``<root>/records/attempt-<N>/``.

The sinks write ``metrics.jsonl`` and TensorBoard's event files into the run's output directory, which on a
cluster is a pod's disk: gone with the pod. :class:`RecordsSync` copies them, every
``telemetry.records_every_s`` and once more when the run ends however it ends (a failure, a preemption,
a save that outlasted the preemption grace: the process then copies them before it exits, within what is
left before the launcher's SIGKILL; see :mod:`traincore.run.preemption`), into the checkpoint root's
``records/attempt-<N>/``, so a failed or preempted attempt keeps them and a running one can be watched
(``tensorboard --logdir <root>/records``). A launcher adds the tails of its workers' stderr copies the same
way.

Object stores have no append: a file that changed since its last copy is uploaded whole. Records are
small (a metrics row is about 300 bytes, an event about 100), so this is cheap next to a checkpoint; a
stderr copy contributes only its last :data:`TAIL_BYTES`.

A process that forks while a copy runs (torch elastic's agent forks its workers, at the start and at every
restart, while its records thread copies their stderr tails) waits for the copy to end: a copy to an object
store resolves the store's host name, glibc's resolver lock is held meanwhile by the thread that resolves,
and a child forked then would inherit it locked and hang at its own first connection (the start-up hang of
:func:`traincore.run.launch.open_start_gate`). Forks of a process with no running copier are untouched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from pathlib import Path

from traincore.checkpoint import Store

RECORDS_DIR = "records"
TAIL_BYTES = 64 << 10  # of a stderr copy: the end of a failure, not the whole log
# How long a fork waits for a running copy: past it (a store that stopped answering) the fork goes ahead,
# with a warning, rather than the workers never starting.
FORK_WAIT_S = 60.0

log = logging.getLogger(__name__)


def attempt_records(root: Store, attempt: int) -> Store:
    """Where attempt ``attempt``'s records go under the checkpoint ``root``."""
    return root.child(RECORDS_DIR).child(f"attempt-{attempt}")


def next_attempt(root: Store) -> int:
    """The number of the next attempt under ``root``: one past the highest ``records/attempt-<N>``."""
    numbers = [int(name.removeprefix("attempt-")) for name in root.child(RECORDS_DIR).entries()
               if name.startswith("attempt-") and name.removeprefix("attempt-").isdigit()]
    return max(numbers, default=-1) + 1


def continue_records(target: Store, metrics: Path) -> None:
    """Before a main rank's first record: where this node has no ``metrics`` file but the attempt's durable
    copy in ``target`` has one (the main rank moved to this node when an elastic run re-formed, or its pod
    was made again), start from that copy, so that the attempt's records go on (and a resume learns the
    last step they hold) instead of being replaced by this node's. Best effort, as every copy here."""
    if metrics.exists():
        return
    try:
        data = target.read_bytes("metrics.jsonl")
    except FileNotFoundError:
        return
    except Exception as exc:  # the store's own errors (auth, network) come in its own classes
        log.warning("reading the run record metrics.jsonl from %s failed (%s); this node's starts afresh",
                    target.uri, exc)
        return
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_bytes(data)


_copying: weakref.WeakSet[RecordsSync] = weakref.WeakSet()  # started and not yet closed, in this process
_forking = threading.local()  # .held: the copy locks taken for the fork this thread is making
_hooks = threading.Lock()
_hooks_registered = False


def _hold_copies() -> None:
    """Before a fork: wait for every running copy to end, and keep the next from starting until forked."""
    deadline, _forking.held = time.monotonic() + FORK_WAIT_S, []
    for sync in list(_copying):
        if sync._lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
            _forking.held.append(sync._lock)
        else:
            log.warning("forking while the run records are copied to %s (a copy still running after %.0f s)",
                        sync.target, FORK_WAIT_S)


def _release_copies() -> None:
    """After a fork, in the parent and in the child: the copy locks taken before it."""
    for lock in getattr(_forking, "held", ()):
        lock.release()
    _forking.held = []


def _register_fork_hooks() -> None:
    """Once per process, when its first copier starts (importing this module registers nothing)."""
    global _hooks_registered
    with _hooks:
        if not _hooks_registered:
            os.register_at_fork(before=_hold_copies, after_in_parent=_release_copies,
                                after_in_child=_release_copies)
            _hooks_registered = True


class RecordsSync:
    """Copies local files and directories into ``target`` now and then, and once more on :meth:`close`.

    ``sources`` maps a name in ``target`` to a local file or directory (a directory's files keep their
    relative paths below the name); ``tails`` does the same for files of which only the end is kept.
    A copy that fails (the store is unreachable for a while) is logged and retried at the next round.
    """

    def __init__(self, target: Store, every_s: float, sources: dict[str, Path] | None = None,
                 tails: dict[str, Path] | None = None):
        self.target, self.every_s = target, every_s
        self.sources, self.tails = dict(sources or {}), dict(tails or {})
        self._copied: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) of the copy in the store
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RecordsSync:
        """Copy in a background thread every ``every_s`` seconds (none when 0); a fork of this process waits
        for a copy under way until :meth:`close`."""
        if self.every_s > 0:
            _register_fork_hooks()
            _copying.add(self)
            self._thread = threading.Thread(target=self._loop, name="records-sync", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sync()

    def _files(self) -> dict[str, tuple[Path, bool]]:
        """Every file to copy: name in the target -> (local path, whether only its tail is kept)."""
        files = {}
        for tail, entries in ((True, self.tails), (False, self.sources)):
            for name, path in entries.items():
                if path.is_file():
                    files[name] = (path, tail)
                elif path.is_dir():
                    files.update({f"{name}/{p.relative_to(path).as_posix()}": (p, tail)
                                  for p in sorted(path.rglob("*")) if p.is_file()})
        return files

    def sync(self) -> None:
        """Copy every file that changed since its last copy; log (never raise) what could not be copied."""
        with self._lock:
            for name, (path, tail) in self._files().items():
                try:
                    stat = path.stat()
                    if self._copied.get(name) == (stat.st_size, stat.st_mtime_ns):
                        continue
                    data = path.read_bytes()
                    self.target.write_bytes(name, data[-TAIL_BYTES:] if tail else data)
                    self._copied[name] = (stat.st_size, stat.st_mtime_ns)
                except Exception as exc:  # the store's own errors (auth, network) come in its own classes
                    log.warning("copying the run record %s to %s failed (%s); retrying at the next round",
                                path, self.target, exc)

    def close(self) -> None:
        """Stop the thread and copy once more: what the run wrote last is in the store. Safe to call from
        two threads at once (a run unwinding while its preemption grace runs out copies from both)."""
        self._stop.set()
        _copying.discard(self)
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self.sync()
