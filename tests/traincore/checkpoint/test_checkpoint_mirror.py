"""The checkpoint mirror against an in-memory object store: publish order, restore, pruning."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from traincore.checkpoint.layout import MARKER, complete_steps, parse_step_name, step_dir
from traincore.checkpoint.mirror import CheckpointMirror


def write_step(root: Path, step: int, complete: bool = True) -> Path:
    """A step directory with a payload file (and a nested one, as DCP writes) and, if complete, its marker."""
    directory = step_dir(root, step)
    (directory / "parts").mkdir(parents=True)
    (directory / "state.pt").write_bytes(bytes([step % 256]) * 100)
    (directory / "parts" / "rank1.distcp").write_text(f"part of {step}")
    if complete:
        (directory / MARKER).write_text(json.dumps({"step": step}))
    return directory


class RecordingFS(MemoryFileSystem):
    """The memory filesystem, remembering the order of uploads and of file deletions."""

    uploads: list[str] = []
    deletions: list[str] = []

    def put_file(self, lpath, rpath, **kwargs):
        self.uploads.append(rpath)
        return super().put_file(lpath, rpath, **kwargs)

    def rm_file(self, path):
        self.deletions.append(path)
        return super().rm_file(path)


@pytest.fixture
def store(request):
    fs = RecordingFS()
    fs.uploads, fs.deletions = [], []
    remote = f"memory://ckpt-{request.node.name}"
    yield fs, remote
    if fs.exists(remote):
        fs.rm(remote, recursive=True)


def test_publish_uploads_complete_steps_with_the_marker_last(tmp_path, store):
    fs, remote = store
    write_step(tmp_path, 10)
    write_step(tmp_path, 20, complete=False)  # torn: never published
    mirror = CheckpointMirror(remote, tmp_path, fs)
    assert mirror.publish() == [10]
    assert mirror.remote_steps() == [10]
    step_uploads = [u for u in fs.uploads if "step-000010" in u]
    assert len(step_uploads) == 3 and step_uploads[-1].endswith(MARKER)
    assert mirror.publish() == []  # nothing new
    (step_dir(tmp_path, 20) / MARKER).write_text("{}")
    assert mirror.publish() == [20] and mirror.remote_steps() == [10, 20]


def test_restore_fetches_the_latest_complete_remote_step(tmp_path, store):
    fs, remote = store
    writer = tmp_path / "writer"
    for step in (5, 15):
        write_step(writer, step)
    CheckpointMirror(remote, writer, fs).publish()
    fresh = tmp_path / "fresh"
    assert CheckpointMirror(remote, fresh, fs).restore() == 15
    assert complete_steps(fresh) == [15]
    restored, original = step_dir(fresh, 15), step_dir(writer, 15)
    for name in ("state.pt", "parts/rank1.distcp", MARKER):
        assert (restored / name).read_bytes() == (original / name).read_bytes()
    assert CheckpointMirror(remote, fresh, fs).restore() is None  # already up to date


def test_publish_deletes_remote_steps_the_local_root_pruned_marker_first(tmp_path, store):
    fs, remote = store
    for step in (1, 2):
        write_step(tmp_path, step)
    mirror = CheckpointMirror(remote, tmp_path, fs)
    mirror.publish()
    write_step(tmp_path, 3)
    for name in ("state.pt", "parts/rank1.distcp", MARKER):  # the Checkpointer pruned step 1
        (step_dir(tmp_path, 1) / name).unlink()
    assert mirror.publish() == [3]
    assert mirror.remote_steps() == [2, 3]
    deleted = [path for path in fs.deletions if "step-000001" in path]
    assert len(deleted) == 3 and deleted[0].endswith(f"step-000001/{MARKER}")
    assert not fs.exists(f"{remote}/step-000001")


def test_background_publishing_finishes_on_exit(tmp_path, store):
    fs, remote = store
    mirror = CheckpointMirror(remote, tmp_path, fs, interval_s=3600)
    with mirror:
        write_step(tmp_path, 7)
    assert mirror.remote_steps() == [7]


def test_a_restored_checkpoint_is_not_uploaded_again(tmp_path, store):
    fs, remote = store
    write_step(tmp_path / "writer", 3)
    CheckpointMirror(remote, tmp_path / "writer", fs).publish()
    fs.uploads.clear()
    node = CheckpointMirror(remote, tmp_path / "node", fs)
    assert node.restore() == 3
    assert node.publish() == [] and fs.uploads == []


def test_remote_directories_named_unlike_step_dir_are_not_checkpoints(tmp_path, store):
    fs, remote = store
    for name in ("step-7", "step-0000007", "steps-000007"):
        fs.pipe_file(f"{remote}/{name}/{MARKER}", b"{}")
    assert CheckpointMirror(remote, tmp_path, fs).remote_steps() == []
    assert parse_step_name("step-000007") == 7 and parse_step_name("step-1234567") == 1234567
    assert parse_step_name("step-7") is None and parse_step_name(".step-000007.partial") is None


def test_a_local_directory_works_as_the_remote_filesystem(tmp_path):
    write_step(tmp_path / "node-a", 12)
    remote = f"file://{tmp_path / 'durable'}"
    fs = fsspec.filesystem("file", auto_mkdir=True)  # put_file does not create the step directories
    CheckpointMirror(remote, tmp_path / "node-a", fs).publish()
    assert complete_steps(tmp_path / "durable") == [12]
    assert CheckpointMirror(remote, tmp_path / "node-b", fs).restore() == 12
    assert (step_dir(tmp_path / "node-b", 12) / "parts" / "rank1.distcp").read_text() == "part of 12"
