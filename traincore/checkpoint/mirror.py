"""Keep a local checkpoint root in step with a root on any fsspec filesystem (s3://, gs://, abfs://...).

The Checkpointer writes to a local path. When the durable root is an object store, training checkpoints
into a local directory instead and this mirror (a) restores the latest complete remote checkpoint before
the workers start and (b) uploads every newly completed one while they run and once more after they stop.
It keeps the layout of traincore.checkpoint.layout on both sides: the commit marker is uploaded last and
deleted first, so the remote root, like the local one, never holds a complete-looking checkpoint that is not.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from pathlib import Path, PurePosixPath

import fsspec
import fsspec.core

from traincore.checkpoint.layout import MARKER, complete_steps, parse_step_name, step_dir

log = logging.getLogger(__name__)


class CheckpointMirror:
    """Restores from and publishes to ``remote`` on ``fs``; ``with mirror:`` publishes in the background."""

    def __init__(self, remote: str, local: Path, fs: fsspec.AbstractFileSystem, interval_s: float = 15.0):
        self.remote, self.local, self.fs, self.interval_s = remote.rstrip("/"), Path(local), fs, interval_s
        # how fs.find() spells paths under the root
        self._remote_path = fsspec.core.strip_protocol(self.remote)
        self._uploaded: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def remote_steps(self) -> list[int]:
        """Complete checkpoints in the remote root, oldest first."""
        names = (PurePosixPath(path).parent.name for path in self.fs.glob(f"{self.remote}/step-*/{MARKER}"))
        return sorted(step for step in map(parse_step_name, names) if step is not None)

    def restore(self) -> int | None:
        """Download the latest complete remote checkpoint unless the local root already has it or newer."""
        remote = self.remote_steps()
        local = complete_steps(self.local)
        self._uploaded.update(set(remote) & set(local))  # already there: never upload them again
        if not remote or (local and local[-1] >= remote[-1]):
            return None
        target = step_dir(self.local, remote[-1])
        partial = target.with_name(f".{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        remote_dir = PurePosixPath(self._remote_path) / target.name
        for path in self.fs.find(f"{self.remote}/{target.name}"):
            destination = partial / PurePosixPath(path).relative_to(remote_dir)
            destination.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(destination))
        # The rename publishes only a complete download; a crash before it leaves just the .partial.
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        self._uploaded.add(remote[-1])
        log.info("restored checkpoint step %d from %s", remote[-1], self.remote)
        return remote[-1]

    def publish(self) -> list[int]:
        """Upload complete local checkpoints not uploaded yet; delete uploads the local root has pruned."""
        local = complete_steps(self.local)
        published = []
        for step in local:
            if step not in self._uploaded and self._upload(step):
                self._uploaded.add(step)
                published.append(step)
        for step in sorted(self._uploaded - set(local)):
            if local and step < local[0]:
                self._remove(step)
                self._uploaded.discard(step)
        return published

    def _upload(self, step: int) -> bool:
        directory = step_dir(self.local, step)
        files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER)
        try:
            for path in [*files, directory / MARKER]:  # the marker last: it declares the rest complete
                self.fs.put_file(str(path), f"{self.remote}/{path.relative_to(self.local).as_posix()}")
        except FileNotFoundError:
            return False  # pruned locally while uploading: a newer checkpoint supersedes it
        log.info("published checkpoint step %d to %s", step, self.remote)
        return True

    def _remove(self, step: int) -> None:
        directory = f"{self.remote}/{step_dir(self.local, step).name}"
        # The marker first, as remove_step does locally: a crash half-way leaves a torn directory, which
        # restore ignores, never a complete-looking one with files missing.
        with contextlib.suppress(FileNotFoundError):  # gone already if an earlier removal failed half-way
            self.fs.rm_file(f"{directory}/{MARKER}")
        self.fs.rm(directory, recursive=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception as exc:  # a flaky store must not kill the thread; the next round retries
                log.warning("publishing checkpoints to %s failed (%s); retrying in %.0f s", self.remote, exc,
                            self.interval_s)

    def __enter__(self) -> CheckpointMirror:
        self._thread = threading.Thread(target=self._loop, name="checkpoint-mirror", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.publish()  # also after a failure: whatever completed is worth resuming from
