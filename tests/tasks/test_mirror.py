"""The Flyte side of checkpoint mirroring: node-local roots, and a retry resuming through the object store."""

from __future__ import annotations

from fsspec.implementations.memory import MemoryFileSystem

import tasks.mirror
from tasks.mirror import local_checkpoint_root, synced_checkpoints
from tasks.storage import is_uri
from traincore.checkpoint.layout import MARKER, complete_steps, step_dir


def test_local_roots_are_used_in_place_and_uris_get_a_node_local_stand_in(tmp_path):
    assert local_checkpoint_root(str(tmp_path)) == tmp_path
    assert local_checkpoint_root(f"file://{tmp_path}") == tmp_path
    assert is_uri("s3://bucket/run") and not is_uri(str(tmp_path))
    stand_in = local_checkpoint_root("s3://bucket/run")
    assert stand_in == local_checkpoint_root("s3://bucket/run") != local_checkpoint_root("s3://bucket/other")


def test_a_local_root_is_yielded_in_place(tmp_path):
    with synced_checkpoints(str(tmp_path / "checkpoints")) as local:
        assert local == tmp_path / "checkpoints"


def test_a_retry_on_a_fresh_node_resumes_from_the_object_store(tmp_path, monkeypatch):
    remote = "memory://durable-root/run-1"
    monkeypatch.setattr(tasks.mirror, "NODE_CACHE", tmp_path / "first-pod")
    with synced_checkpoints(remote) as local:  # the first attempt checkpoints, then dies
        directory = step_dir(local, 40)
        directory.mkdir(parents=True)
        (directory / "state.pt").write_bytes(b"weights")
        (directory / MARKER).write_text("{}")
    monkeypatch.setattr(tasks.mirror, "NODE_CACHE", tmp_path / "second-pod")
    with synced_checkpoints(remote) as local:  # the retry lands on a fresh pod
        assert local.is_relative_to(tmp_path / "second-pod") and complete_steps(local) == [40]
        assert (step_dir(local, 40) / "state.pt").read_bytes() == b"weights"
    MemoryFileSystem().rm("/durable-root", recursive=True)
