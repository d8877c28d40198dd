"""Local views of FlyteDirectory inputs: in place when local, one download per node when remote."""

from __future__ import annotations

import pickle

from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.data_persistence import FileAccessProvider
from flytekit.core.type_engine import TypeEngine
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
