"""The object store stand-in and the paths propeller gives each node execution.

The store is a local directory (a stand-in for the bucket) or an ``s3://`` prefix, reached through the
filesystem flytekit configures (FLYTE_AWS_ENDPOINT, FLYTE_AWS_ACCESS_KEY_ID, FLYTE_AWS_SECRET_ACCESS_KEY).
Layout, as propeller's: ``metadata/propeller/<project>-<domain>-<execution>/<node>/data/inputs.pb`` and
``.../data/<attempt>/`` as the output prefix (outputs.pb, futures.pb, error.pb); raw data under
``raw/<shard>/<execution>-<node>-<attempt>/`` with the checkpoints in ``_flytecheckpoints`` below it.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

INPUTS, OUTPUTS, FUTURES, ERROR = "inputs.pb", "outputs.pb", "futures.pb", "error.pb"


@dataclass(frozen=True)
class Execution:
    """The identifiers a Flyte execution hands every pod it starts."""

    project: str
    domain: str
    name: str  # the execution id's name
    workflow: str
    version: str


@dataclass(frozen=True)
class NodePaths:
    """Where one attempt of one node reads and writes."""

    inputs: str  # {{.input}}
    output_prefix: str  # {{.outputPrefix}}
    raw_output_prefix: str  # {{.rawOutputDataPrefix}}
    checkpoint_prefix: str  # {{.checkpointOutputPrefix}}
    prev_checkpoint_prefix: str  # {{.prevCheckpointPrefix}}: empty on the first attempt


class Store:
    """Reads and writes whole objects under one root (a directory or an s3:// prefix)."""

    def __init__(self, root: str):
        self.root = root.rstrip("/") if "://" in root else str(Path(root).resolve())
        self._fs = None
        if "://" in root:
            from flytekit.core.data_persistence import FileAccessProvider

            provider = FileAccessProvider(tempfile.mkdtemp(prefix="replay-fs-"), raw_output_prefix=self.root)
            self._fs = provider.get_filesystem_for_path(self.root)

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *(p.strip("/") for p in parts)])

    def write(self, path: str, data: bytes) -> None:
        if self._fs is None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_bytes(data)
            return
        with self._fs.open(path, "wb") as f:
            f.write(data)

    def read(self, path: str) -> bytes:
        if self._fs is None:
            return Path(path).read_bytes()
        with self._fs.open(path, "rb") as f:
            return f.read()

    def copy(self, source: str, target: str) -> None:
        """One object to another key of the same store (a recovered node's inputs): on an object store a
        copy the store makes itself, without the bytes passing through this process."""
        if self._fs is not None:
            self._fs.copy(source, target)
            return
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)

    def exists(self, path: str) -> bool:
        return Path(path).exists() if self._fs is None else self._fs.exists(path)

    def _raw_prefix(self, execution: Execution, node_id: str, attempt: int) -> str:
        key = f"{execution.name}-{node_id}-{attempt}"
        shard = hashlib.sha1(key.encode()).hexdigest()[:2]  # propeller shards raw data by a short prefix
        return self.join("raw", shard, key)

    def execution_prefix(self, execution: Execution) -> str:
        """Where propeller keeps the execution's own metadata (its inputs) and every node's."""
        return self.join("metadata", "propeller", f"{execution.project}-{execution.domain}-{execution.name}")

    def node_paths(self, execution: Execution, node_id: str, attempt: int = 0) -> NodePaths:
        """Propeller's layout for ``node_id`` (sub-nodes of a dynamic node carry their parent's prefix)."""
        data = f"{self.execution_prefix(execution)}/{node_id}/data"
        raw = self._raw_prefix(execution, node_id, attempt)
        previous = ""
        if attempt:  # the previous attempt's checkpoints, under that attempt's own raw prefix
            previous = f"{self._raw_prefix(execution, node_id, attempt - 1)}/_flytecheckpoints"
        return NodePaths(inputs=f"{data}/{INPUTS}", output_prefix=f"{data}/{attempt}", raw_output_prefix=raw,
                         checkpoint_prefix=f"{raw}/_flytecheckpoints", prev_checkpoint_prefix=previous)
