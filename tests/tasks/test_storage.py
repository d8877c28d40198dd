"""Local views of FlyteDirectory inputs (in place when local, one download per node when remote) and the
default checkpoint root (one per execution)."""

from __future__ import annotations

import pickle
import re

import flytekit
import pytest
from flytekit.core.context_manager import ExecutionParameters, FlyteContextManager
from flytekit.core.data_persistence import FileAccessProvider
from flytekit.core.type_engine import TypeEngine
from flytekit.models.core.identifier import WorkflowExecutionIdentifier
from flytekit.types.directory import FlyteDirectory

import tasks.storage as storage


def remote_directory(fs, uri: str) -> FlyteDirectory:
    """A FlyteDirectory as a task receives it for an object-store literal."""
    fs.pipe({f"{uri}/manifest.json": b"{}", f"{uri}/train-00000.u8": bytes(range(256))})
    ctx = FlyteContextManager.current_context()
    literal = TypeEngine.to_literal(ctx, FlyteDirectory(uri), FlyteDirectory,
                                    TypeEngine.to_literal_type(FlyteDirectory))
    return TypeEngine.to_python_value(ctx, literal, FlyteDirectory)


def test_local_directories_are_used_in_place(tmp_path):
    assert storage.local_directory(FlyteDirectory(str(tmp_path))) == tmp_path


def test_remote_directories_download_once_per_node(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setattr(storage, "NODE_CACHE", tmp_path / "node-cache")
    fs = fsspec.filesystem("memory")
    directory = remote_directory(fs, "memory://bucket/staged")
    assert directory.remote_source == "memory://bucket/staged"
    assert pickle.loads(pickle.dumps(directory)).remote_source == directory.remote_source  # sent to workers

    downloads = []
    original = FileAccessProvider.get_data

    def counted(self, *args, **kwargs):
        downloads.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FileAccessProvider, "get_data", counted)
    first = storage.local_directory(directory)
    second = storage.local_directory(directory)
    assert first == second and downloads == ["memory://bucket/staged"]
    assert (first / "train-00000.u8").read_bytes() == bytes(range(256))
    assert not list((tmp_path / "node-cache").glob("*.partial"))
    fs.rm("memory://bucket/staged", recursive=True)


def test_local_executions_get_a_checkpoint_root_of_their_own():
    prefix = flytekit.current_context().raw_output_prefix.rstrip("/")
    assert flytekit.current_context().execution_id.name == "local"  # flytekit's placeholder outside a cluster
    first, second = storage.default_checkpoint_root(), storage.default_checkpoint_root()
    assert first != second
    for root in (first, second):
        assert re.fullmatch(rf"{re.escape(prefix)}/checkpoints/local-[0-9a-f]{{12}}", root), root


def test_cluster_executions_key_the_checkpoint_root_by_execution_id():
    ctx = FlyteContextManager.current_context()
    params = ExecutionParameters.new_builder(ctx.user_space_params)
    params.execution_id = WorkflowExecutionIdentifier(project="flytesnacks", domain="development",
                                                      name="f3a9c1e2b4d5")
    params.raw_output_prefix = "s3://bucket/raw/"
    state = ctx.new_execution_state().with_params(user_space_params=params.build())
    with FlyteContextManager.with_context(ctx.with_execution_state(state)):
        roots = {storage.default_checkpoint_root() for _ in range(2)}  # what a retried attempt would compute
    assert roots == {"s3://bucket/raw/checkpoints/f3a9c1e2b4d5"}


def test_a_mounted_store_secret_gives_the_object_store_its_credentials(tmp_path, monkeypatch):
    from tasks.storage import STORE_SECRET_KEYS, checkpoint_store

    monkeypatch.setattr(flytekit.current_context().secrets, "_base_dir", str(tmp_path))
    with pytest.raises(ValueError, match=r"input store_secret='ckpt-store': its key 'aws_access_key_id' is "
                                         r"not mounted at .*create the secret"):
        checkpoint_store("s3://bucket/run", "ckpt-store")
    (tmp_path / "ckpt-store").mkdir()
    for key, value in zip(STORE_SECRET_KEYS, ("AKIAEXAMPLE", "s3cr3t-value"), strict=True):
        (tmp_path / "ckpt-store" / key).write_text(value + "\n")
    store = checkpoint_store("s3://bucket/run", "ckpt-store")
    assert (store.options["key"], store.options["secret"]) == ("AKIAEXAMPLE", "s3cr3t-value")
    assert "s3cr3t" not in repr(store) + str(store)
    assert checkpoint_store(str(tmp_path / "local"), "ckpt-store").local  # a local root needs no secret
