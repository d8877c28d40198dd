"""Where task data lives: local views of FlyteDirectory inputs and the durable checkpoint root."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import tempfile
import uuid
from pathlib import Path

import flytekit
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.data_persistence import get_fsspec_storage_options
from flytekit.types.directory import FlyteDirectory

from traincore.checkpoint import Store, complete_steps, is_uri
from traincore.config import parse_source

NODE_CACHE = Path(tempfile.gettempdir()) / "flyte-torch-pipeline"
# The execution id name flytekit gives every execution outside a cluster (FlyteContextManager.initialize).
LOCAL_EXECUTION_NAME = "local"


def local_path(location: str) -> Path:
    """A plain path or a file:// URI as a Path."""
    return Path(location.removeprefix("file://"))


def storage_options(location: str) -> dict:
    """The fsspec options for an object-store URI: the settings flytekit is configured with (FLYTE_AWS_* for
    s3://), as Flyte reads its own data; none for a local path. Where flytekit has none, the store's own
    defaults apply (AWS_*, ~/.aws, an instance role)."""
    if not is_uri(location):
        return {}
    data_config = FlyteContextManager.current_context().file_access.data_config
    return get_fsspec_storage_options(location.split("://", 1)[0], data_config)


def source_storage_options(source: str) -> dict:
    """The fsspec options to read the data source ``source`` (``imagefolder:s3://...``) with; none for a
    built-in source."""
    kind, location = parse_source(source)
    return storage_options(location) if kind == "imagefolder" else {}


STORE_SECRET_KEYS = ("aws_access_key_id", "aws_secret_access_key")
"""The keys of the Flyte secret named by the workflow input ``store_secret``: an s3:// store's credentials."""


def store_secret_options(group: str) -> dict:
    """s3fs's ``key`` and ``secret`` from the Flyte secret ``group`` mounted as files (read here, passed to
    fsspec, never put in the environment, a spec or a log); none without a group."""
    if not group:
        return {}
    values = []
    for key in STORE_SECRET_KEYS:
        path = Path(flytekit.current_context().secrets.get_secrets_file(group, key))
        if not path.is_file():
            raise ValueError(f"input store_secret={group!r}: its key {key!r} is not mounted at {path}: "
                             f"create the secret {group!r} with the keys {' and '.join(STORE_SECRET_KEYS)} "
                             "where the execution runs (docs/backends.md), or leave store_secret empty to "
                             "use the pods' FLYTE_AWS_* settings")
        values.append(path.read_text().strip())
    return dict(zip(("key", "secret"), values, strict=True))


def checkpoint_store(root: str, secret_group: str = "") -> Store:
    """The checkpoint root as traincore reads and writes it: a local directory, or the object-store prefix
    every rank writes its own files into, with the store's credentials (Flyte's settings, or the mounted
    ``secret_group``; never in a spec or a log)."""
    if not is_uri(root):
        return Store(local_path(root))
    return Store(root, {**storage_options(root), **store_secret_options(secret_group)})


def local_directory(directory: FlyteDirectory) -> Path:
    """A local path to ``directory``: used in place when it is local, else downloaded once per node.

    Every training process on a node calls this; a file lock makes the first one download while the
    others wait and then reuse the copy, and the rename publishes only a complete download.
    """
    source = directory.remote_source
    if not source:
        return Path(directory.path)
    target = NODE_CACHE / hashlib.sha256(source.encode()).hexdigest()[:20]
    NODE_CACHE.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            partial = target.with_name(f"{target.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            FlyteContextManager.current_context().file_access.get_data(source, str(partial),
                                                                       is_multipart=True)
            partial.rename(target)
    return target


def dataset_location(directory: FlyteDirectory, secret_group: str = "") -> Path | Store:
    """Where a train task reads a staged dataset: a local directory in place, or, in an object store, the
    store itself with its credentials (the run streams it, traincore.data.stream: no node copies the whole
    dataset)."""
    source = directory.remote_source
    if not source or not is_uri(source):
        return local_directory(directory)
    return Store(source, {**storage_options(source), **store_secret_options(secret_group)})


def default_checkpoint_root() -> str:
    """``<raw output prefix>/checkpoints/<key>``: one root per execution, stable across Flyte retries.

    The key is the execution id's name in a cluster. Outside one (local ``pyflyte run``, or anything run
    without FLYTE_INTERNAL_EXECUTION_ID) flytekit names every execution ``local``, and two runs with the same
    raw output prefix would share a root: the second would resume from the first's checkpoints. There the
    key is ``local-<12 random hex digits>``, new on every call.

    Called once, where the train node is created (the launching @dynamic), so a retried attempt receives
    the same root as an input and resumes from the last complete checkpoint in it.
    """
    ctx = flytekit.current_context()
    key = ctx.execution_id.name
    if key == LOCAL_EXECUTION_NAME:
        key = f"{LOCAL_EXECUTION_NAME}-{uuid.uuid4().hex[:12]}"
    return f"{ctx.raw_output_prefix.rstrip('/')}/checkpoints/{key}"


def resume_note(checkpoint_root: str, secret_group: str = "") -> str:
    """The step a retry resumes from, read from the checkpoint root (local or in an object store)."""
    if not checkpoint_root:
        return "a retry resumes from the latest complete checkpoint in the checkpoint root"
    try:
        steps = complete_steps(checkpoint_store(checkpoint_root, secret_group))
    except Exception:  # an unreachable store must not hide the failure being reported
        return f"a retry resumes from the latest complete checkpoint in {checkpoint_root}"
    if not steps:
        return f"no complete checkpoint in {checkpoint_root} yet: a retry starts from the beginning"
    return f"latest complete checkpoint: step {steps[-1]} in {checkpoint_root}; a retry resumes from it"
