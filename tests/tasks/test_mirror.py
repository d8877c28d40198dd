"""The checkpoint mirror against an in-memory object store: publish order, restore, pruning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tasks.mirror import CheckpointMirror, local_checkpoint_root, synced_checkpoints
from tasks.storage import is_uri
from traincore.checkpoint_files import MARKER, complete_steps, step_dir


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
    """The memory filesystem, remembering the order of uploads."""

    uploads: list[str] = []

    def put_file(self, lpath, rpath, **kwargs):
        self.uploads.append(rpath)
        return super().put_file(lpath, rpath, **kwargs)


@pytest.fixture
def store(request):
    fs = RecordingFS()
    fs.uploads = []
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


def test_publish_deletes_remote_steps_the_local_root_pruned(tmp_path, store):
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


def test_background_publishing_finishes_on_exit(tmp_path, store):
    fs, remote = store
    mirror = CheckpointMirror(remote, tmp_path, fs, interval_s=3600)
    with mirror:
        write_step(tmp_path, 7)
    assert mirror.remote_steps() == [7]


def test_local_roots_are_used_in_place_and_uris_get_a_node_local_stand_in(tmp_path):
    assert local_checkpoint_root(str(tmp_path)) == tmp_path
    assert local_checkpoint_root(f"file://{tmp_path}") == tmp_path
    assert is_uri("s3://bucket/run") and not is_uri(str(tmp_path))
    stand_in = local_checkpoint_root("s3://bucket/run")
    assert stand_in == local_checkpoint_root("s3://bucket/run") != local_checkpoint_root("s3://bucket/other")


def test_a_restored_checkpoint_is_not_uploaded_again(tmp_path, store):
    fs, remote = store
    write_step(tmp_path / "writer", 3)
    CheckpointMirror(remote, tmp_path / "writer", fs).publish()
    fs.uploads.clear()
    node = CheckpointMirror(remote, tmp_path / "node", fs)
    assert node.restore() == 3
    assert node.publish() == [] and fs.uploads == []


def test_a_retry_on_a_fresh_node_resumes_from_the_object_store(tmp_path, monkeypatch):
    import tasks.mirror

    remote = "memory://durable-root/run-1"
    monkeypatch.setattr(tasks.mirror, "NODE_CACHE", tmp_path / "first-pod")
    with synced_checkpoints(remote) as local:  # the first attempt checkpoints, then dies
        write_step(local, 40)
    monkeypatch.setattr(tasks.mirror, "NODE_CACHE", tmp_path / "second-pod")
    with synced_checkpoints(remote) as local:  # the retry lands on a fresh pod
        assert local.is_relative_to(tmp_path / "second-pod") and complete_steps(local) == [40]
    MemoryFileSystem().rm("/durable-root", recursive=True)
