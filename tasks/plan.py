"""Check every launch input before anything stages or trains; turn them into a Config and a Topology.

Bad input fails here, in seconds, with a message that names the workflow input and the fix, instead
of minutes later inside a worker (or, for ``nnodes > 1`` outside a cluster, after a 15-minute
rendezvous timeout).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flytekit import task
from flytekit.core.context_manager import FlyteContextManager

from tasks.backends import BACKENDS, PLANNED_BACKENDS
from tasks.storage import is_uri, local_path
from tasks.types import Topology
from traincore.config import Config, ConfigError, DataConfig, parse_source
from traincore.presets import preset


class LaunchInputError(ValueError):
    """A workflow input is invalid; the message names the input and how to fix it."""


def build_config(preset_name: str, config_overrides: str, source: str, epochs: int, max_steps: int) -> Config:
    """Preset, then the JSON overrides, then the explicit inputs (source, epochs or max_steps)."""
    if epochs and max_steps:
        raise LaunchInputError(f"epochs={epochs} and max_steps={max_steps} are both set: give one of them "
                               "(0 keeps the preset's)")
    try:
        cfg = preset(preset_name)
    except ConfigError as exc:
        raise LaunchInputError(f"input preset: {exc}") from exc
    cfg = _override(cfg, config_overrides, "config_overrides")
    if source:
        cfg = _override(cfg, {"data.source": source}, "source")
    if max_steps:
        cfg = _override(cfg, {"train.max_steps": max_steps}, "max_steps")
    if epochs:
        cfg = _override(cfg, {"train.epochs": epochs, "train.max_steps": 0}, "epochs")
    return cfg


def _override(cfg: Config, overrides: dict[str, Any] | str, input_name: str) -> Config:
    try:
        return cfg.with_overrides(overrides)
    except ConfigError as exc:
        raise LaunchInputError(f"input {input_name}: {exc}") from exc


def check_source(source: str) -> None:
    """A local imagefolder path must exist; URIs are checked by the staging task that can reach them."""
    kind, location = parse_source(source)
    if kind != "imagefolder" or is_uri(location):
        return
    path = local_path(location)
    if not path.is_dir():
        raise LaunchInputError(f"input source={source!r}: the dataset path {path} does not exist or is not a "
                               "directory; point it at <root>/<class>/<image> files or use a URI (s3://, gs://)")


def check_topology(topology: Topology, local_run: bool) -> None:
    """Backend, node count, processes and GPUs: every rule that would otherwise fail inside the launch."""
    backend = topology.backend
    if backend in PLANNED_BACKENDS:
        raise LaunchInputError(f"input backend={backend!r} is not yet supported: use one of "
                               f"{', '.join(BACKENDS)} (Slurm support is planned)")
    if backend not in BACKENDS:
        raise LaunchInputError(f"input backend={backend!r} is unknown: use one of {', '.join(BACKENDS)}")
    for name, low in (("nnodes", 1), ("nproc_per_node", 1), ("gpus_per_node", 0), ("max_restarts", 0)):
        value = getattr(topology, name)
        if value < low:
            raise LaunchInputError(f"input {name}={value} is invalid: it must be >= {low}")
    if topology.nnodes > 1 and backend == "local":
        raise LaunchInputError(f"input nnodes={topology.nnodes} needs backend='kubernetes': backend='local' "
                               "runs every process on this machine; set nnodes=1")
    if topology.nnodes > 1 and local_run:
        raise LaunchInputError(f"input nnodes={topology.nnodes} needs a Flyte cluster: launch with "
                               "`pyflyte run --remote ...`, or set nnodes=1 to train here")
    if topology.accelerator and not topology.gpus_per_node:
        raise LaunchInputError(f"input accelerator={topology.accelerator!r} needs gpus_per_node >= 1")
    if topology.gpus_per_node and topology.nproc_per_node > topology.gpus_per_node:
        raise LaunchInputError(f"input nproc_per_node={topology.nproc_per_node} exceeds gpus_per_node="
                               f"{topology.gpus_per_node}: run one process per GPU")


def check_checkpoint_root(cfg: Config, topology: Topology, checkpoint_uri: str) -> None:
    """Several nodes without a shared filesystem checkpoint node-locally and sync through an object store.

    That works for rank 0's single-file ``sync`` checkpoints restored at the start of each Flyte attempt;
    per-rank DCP parts and in-place torch-elastic restarts need every node to see one directory.
    """
    if topology.nnodes == 1 or (checkpoint_uri and not is_uri(checkpoint_uri)):
        return
    if cfg.checkpoint.mode != "sync":
        raise LaunchInputError(
            f"checkpoint.mode={cfg.checkpoint.mode!r} with nnodes={topology.nnodes} writes one part per "
            "rank, so it needs checkpoint_uri on a filesystem every node mounts; with an object-store root "
            'set \'{"checkpoint": {"mode": "sync"}}\' in config_overrides')
    if topology.max_restarts:
        raise LaunchInputError(
            f"input max_restarts={topology.max_restarts} with nnodes={topology.nnodes} and an object-store "
            "checkpoint root would restart ranks from different node-local copies: set max_restarts=0 (Flyte "
            "retries resume instead) or give checkpoint_uri on a filesystem every node mounts")


class RunPlan(NamedTuple):
    config: Config
    data: DataConfig
    topology: Topology


@task
def plan_run(source: str, preset: str, config_overrides: str, epochs: int, max_steps: int, backend: str,
             nnodes: int, nproc_per_node: int, gpus_per_node: int, accelerator: str, max_restarts: int,
             checkpoint_uri: str) -> RunPlan:
    """Validate the launch inputs and resolve them into the run's Config and Topology."""
    cfg = build_config(preset, config_overrides, source, epochs, max_steps)
    check_source(cfg.data.source)
    topology = Topology(backend=backend, nnodes=nnodes, nproc_per_node=nproc_per_node,
                        gpus_per_node=gpus_per_node, accelerator=accelerator, max_restarts=max_restarts,
                        rdzv_timeout_s=cfg.dist.init_timeout_s)
    local_run = FlyteContextManager.current_context().execution_state.is_local_execution()
    check_topology(topology, local_run)
    check_checkpoint_root(cfg, topology, checkpoint_uri)
    length = f"{cfg.train.max_steps} steps" if cfg.train.max_steps else f"{cfg.train.epochs} epochs"
    print(f"plan: preset {preset}, source {cfg.data.source}, model {cfg.model.name}, {length}; "
          f"{nnodes} node(s) x {nproc_per_node} process(es) on {backend}", flush=True)
    return RunPlan(config=cfg, data=cfg.data, topology=topology)
