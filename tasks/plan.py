"""Check every launch input before anything stages or trains; turn them into a Config and a Topology.

Bad input fails here, in seconds, with a message that names the workflow input and the fix, instead
of minutes later inside a worker (or, for ``nnodes > 1`` outside a cluster, after a 15-minute
rendezvous timeout).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from flytekit import task
from flytekit.core.context_manager import FlyteContextManager

from tasks.backends import BACKENDS, CAPACITIES, SLURM_BACKEND
from tasks.errors import UserFacingError
from tasks.resources import parse_resources
from tasks.slurm.job import SIGNAL_MARGIN_S, time_limit_s, warning_lead_s
from tasks.slurm.ssh import SlurmTarget
from tasks.storage import is_uri, local_path, source_storage_options
from tasks.types import NodeResources, SlurmSettings, Topology
from traincore.config import PRESETS, Config, ConfigError, DataConfig, build_config, parse_source
from traincore.data import StagingError, check_partitions, source_fingerprint
from traincore.files import uri_problem
from traincore.model import InitError, read_init_header
from traincore.run import (
    OutputError,
    check_model_input,
    check_param_groups,
    elastic_config,
    ensure_writable_dir,
    node_range,
)


class LaunchInputError(UserFacingError):
    """A workflow input is invalid; the message names the input and how to fix it."""


def check_resources(resources: str) -> dict[str, NodeResources]:
    """The ``resources`` input parsed (tasks.resources), or a LaunchInputError naming what is wrong."""
    try:
        return parse_resources(resources)
    except ValueError as exc:
        raise LaunchInputError(f"input resources={resources!r} {exc}") from None


def check_stage_partitions(partitions: int) -> None:
    """Refuse a partition count below 0 (the staging is cached without it, so stage_dataset may not run)."""
    try:
        check_partitions(partitions)
    except StagingError as exc:
        raise LaunchInputError(f"input stage_{exc}") from None


INPUT_LABELS = {"preset": "input preset", "overrides": "input config_overrides",
                "data.source": "input source", "train.max_steps": "input max_steps",
                "train.epochs": "input epochs", "dist.parallelism": "input parallelism"}


def launch_config(preset_name: str, config_overrides: str, source: str, epochs: int, max_steps: int,
                  parallelism: str = "") -> Config:
    """Preset, then the JSON overrides, then the explicit inputs (source, epochs or max_steps, parallelism;
    an empty one keeps the preset's)."""
    if epochs and max_steps:
        raise LaunchInputError(f"epochs={epochs} and max_steps={max_steps} are both set: give one of them "
                               "(0 keeps the preset's)")
    settings: dict[str, Any] = {"data.source": source} if source else {}
    if max_steps:
        settings["train.max_steps"] = max_steps
    if epochs:
        settings.update({"train.epochs": epochs, "train.max_steps": 0})
    if parallelism:
        settings["dist.parallelism"] = parallelism
    try:
        return build_config(preset_name, config_overrides, settings, INPUT_LABELS)
    except ConfigError as exc:
        raise LaunchInputError(str(exc)) from exc


# Where checkpoints, searches and registries may live: object stores, whose writes are whole objects (and
# memory://, fsspec's in-process store). A read-only or host-to-host scheme (http, ftp, ...) is refused.
WRITABLE_SCHEMES = ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "memory")


def check_protocol(location: str, label: str, writable: bool = False) -> None:
    """A URI's scheme must name a filesystem fsspec knows and can load (with ``writable``, one a root may
    live in: ``WRITABLE_SCHEMES``), and it must name a bucket or host; nothing is contacted. ``label`` names
    the value in the error, e.g. "input checkpoint_uri='...'"."""
    problem = uri_problem(location)
    if problem:
        raise LaunchInputError(f"{label}: {problem}")
    protocol = location.partition("://")[0]
    if writable and protocol not in WRITABLE_SCHEMES:
        raise LaunchInputError(f"{label}: {protocol}:// cannot hold checkpoints or models: use a local path "
                               f"or an object store ({', '.join(s + '://' for s in WRITABLE_SCHEMES[:4])})")


def source_origin(source: str, preset_name: str, cfg: Config) -> str:
    """Where the run's source came from: the workflow's ``source`` input when given (it replaces the
    preset's), else config_overrides when they changed it, else the preset."""
    if source:
        return "input source"
    if cfg.data.source != PRESETS[preset_name]().data.source:
        return "config_overrides' data.source"
    return f"preset {preset_name}'s source"


def check_source(source: str, origin: str = "input source") -> None:
    """A local imagefolder path must exist; of a URI, only the scheme is checked here (no network yet):
    fingerprint_source, run last, lists it. ``origin`` (:func:`source_origin`) is named in the error."""
    kind, location = parse_source(source)
    if kind != "imagefolder":
        return
    if is_uri(location):
        check_protocol(location, f"{origin}={source!r}")
        return
    path = local_path(location)
    if not path.is_dir():
        fix = ("give the source input (--source imagefolder:<your folder or URI>, or another source)"
               if origin.startswith("preset") else
               "point it at <root>/<class>/<image> files or use a URI (s3://, gs://)")
        raise LaunchInputError(f"{origin}={source!r}: the dataset path {path} does not exist or is not a "
                               f"directory; {fix}")


def check_splits(data: DataConfig) -> None:
    """The workflow validates on the val split and evaluates on the test split: a fraction of 0 would stage
    an empty one, and the run would fail only after staging (val) or after training (test)."""
    for name in ("val_fraction", "test_fraction"):
        if getattr(data, name) == 0:
            raise LaunchInputError(f"input config_overrides: data.{name}=0 stages an empty "
                                   f"{name.split('_')[0]} split, which the workflow "
                                   f"{'validates' if name == 'val_fraction' else 'evaluates'} on: give it a "
                                   f"fraction above 0, e.g. {getattr(DataConfig(), name)}")


def parse_nodes(nnodes: str) -> tuple[int, int]:
    """The nnodes input, "N" or "MIN:MAX", as (MIN, MAX); a LaunchInputError naming the form otherwise."""
    try:
        return node_range(nnodes)
    except ValueError as exc:
        raise LaunchInputError(f"input {exc}") from exc


def check_range_input(cfg: Config, topology: Topology) -> Config:
    """A range of nodes only where nodes can come and go (Kubernetes pods), with restarts to re-form the
    run after a loss, and a global batch every node count of the range splits into whole batches (fixed at
    the largest world when config_overrides leave train.global_batch unset: traincore.run.elastic_config)."""
    if not topology.elastic:
        return cfg
    nodes, backend = topology.nodes, topology.backend
    if backend == "local":
        raise LaunchInputError(
            f"input nnodes={nodes!r} is a range, but backend='local' runs one agent on this machine, which "
            "cannot lose or gain a node: set nnodes=1, or start torchrun agents yourself with --nnodes "
            f"{nodes} (docs/reliability.md, a node range)")
    if backend == SLURM_BACKEND:
        raise LaunchInputError(
            f"input nnodes={nodes!r} is a range, but a Slurm job's allocation has a fixed node count: give "
            f"nnodes={topology.nnodes}; a node that fails ends the job's attempt, and a Flyte retry resumes "
            "from the last committed checkpoint")
    if topology.max_restarts < 1:
        raise LaunchInputError(
            f"input nnodes={nodes!r} is a range: the survivors of a lost node go on by restarting their "
            "workers, so give max_restarts >= 1 (one per loss the run should survive)")
    try:
        return elastic_config(cfg, (topology.min_nnodes, topology.nnodes), topology.nproc_per_node)
    except ConfigError as exc:
        raise LaunchInputError(f"input nnodes={nodes!r}: {exc}") from exc


def check_capacity(capacity: str, backend: str) -> None:
    """``capacity`` is one of CAPACITIES; "preemptible" only where Flyte schedules pods (Kubernetes)."""
    if capacity not in CAPACITIES:
        raise LaunchInputError(f"input capacity={capacity!r} is unknown: use one of {', '.join(CAPACITIES)}")
    if capacity == "preemptible" and backend != "kubernetes":
        fix = ("pick a preemptible partition or QOS with slurm_partition or slurm_sbatch_flags"
               if backend == SLURM_BACKEND else "set backend='kubernetes'")
        raise LaunchInputError(f"input capacity='preemptible' puts train pods on spot / preemptible "
                               f"Kubernetes nodes, but backend={backend!r}: {fix}, or leave capacity "
                               "'on-demand'")


def check_topology(topology: Topology, local_run: bool) -> None:
    """Backend, node count, processes and GPUs: every rule that would otherwise fail inside the launch."""
    backend = topology.backend
    if backend not in BACKENDS:
        raise LaunchInputError(f"input backend={backend!r} is unknown: use one of {', '.join(BACKENDS)}")
    for name, low in (("nnodes", 1), ("nproc_per_node", 1), ("gpus_per_node", 0), ("max_restarts", 0)):
        value = getattr(topology, name)
        if value < low:
            raise LaunchInputError(f"input {name}={value} is invalid: it must be >= {low}")
    if topology.nnodes > 1 and backend == "local":
        raise LaunchInputError(f"input nnodes={topology.nnodes} needs backend='kubernetes' or 'slurm': "
                               "backend='local' runs every process on this machine; set nnodes=1")
    if topology.nnodes > 1 and local_run and backend == "kubernetes":
        raise LaunchInputError(f"input nnodes={topology.nnodes} needs a Flyte cluster: launch with "
                               "`pyflyte run --remote ...`, or set nnodes=1 to train here")
    if topology.accelerator and not topology.gpus_per_node:
        raise LaunchInputError(f"input accelerator={topology.accelerator!r} needs gpus_per_node >= 1")
    if topology.gpus_per_node and topology.nproc_per_node > topology.gpus_per_node:
        raise LaunchInputError(f"input nproc_per_node={topology.nproc_per_node} exceeds gpus_per_node="
                               f"{topology.gpus_per_node}: run one process per GPU")
    devices = torch.cuda.device_count() if local_run and backend == "local" else topology.gpus_per_node
    if topology.gpus_per_node > devices:  # it would train on the CPU without a word
        raise LaunchInputError(f"input gpus_per_node={topology.gpus_per_node}: this machine has {devices} "
                               "CUDA device(s): lower gpus_per_node (0 trains on the CPU), or train on a "
                               "cluster backend")


# A Kubernetes secret's name, a DNS-1123 subdomain: at most 253 characters (the lookahead, which
# deploy/create-secrets.sh checks as a length), each '.'-separated label starting and ending alphanumeric.
SECRET_NAME = re.compile(r"^(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_store_secret(topology: Topology, checkpoint_uri: str) -> None:
    """``store_secret`` names a Kubernetes secret, for an s3:// root (given, or the cluster's raw output
    prefix), on the backends whose pods mount Flyte secrets."""
    secret = topology.store_secret
    if not secret:
        return
    if not SECRET_NAME.match(secret):
        raise LaunchInputError(f"input store_secret={secret!r} is not a Kubernetes secret name: use "
                               "lower-case letters, digits, '-' and '.', each '.'-separated part starting "
                               "and ending with a letter or digit, at most 253 characters, e.g. "
                               "'checkpoint-store'")
    if topology.backend == SLURM_BACKEND:
        raise LaunchInputError("input store_secret is for backend 'local' or 'kubernetes': on Slurm the "
                               "connector forwards its own FLYTE_AWS_* / AWS_* settings to the job; leave "
                               "store_secret empty")
    if checkpoint_uri and not checkpoint_uri.startswith("s3://"):
        raise LaunchInputError(f"input store_secret={secret!r} holds s3:// credentials, but checkpoint_uri="
                               f"{checkpoint_uri!r} is not on s3://: leave store_secret empty")


def check_model(cfg: Config) -> None:
    """The model must take the images staging will produce (data.channels x data.image_size squared) in
    batches of loader.batch_size: vit_b_16 on 12 px data fails here, not after staging; and each of
    optim.param_groups' patterns must name some of its parameters (a typo would leave a layer unfrozen)."""
    data = cfg.data
    shape = (data.channels, data.image_size, data.image_size)
    try:
        model = check_model_input(cfg.model, 2, shape, f"data.image_size={data.image_size}, data.channels="
                                  f"{data.channels}", cfg.loader.batch_size)
        check_param_groups(model, cfg.optim.param_groups)
    except ValueError as exc:
        raise LaunchInputError(f"input config_overrides (or preset): {exc}") from exc


def check_init_from(cfg: Config, local_run: bool) -> None:
    """In a local run, a local model.init_from must be a weights file: its header is read (not its tensors),
    so that a typo fails now and not in the train task after staging. A URI, or a path on a cluster (which
    the plan pod need not mount), is checked by the train task's preflight."""
    location = cfg.model.init_from
    if not location or is_uri(location) or not local_run:
        return
    try:
        read_init_header(location)
    except InitError as exc:
        raise LaunchInputError(f"input config_overrides (or preset): {exc}") from exc


def check_backend(cfg: Config, topology: Topology, local_run: bool) -> None:
    """An NCCL process group needs GPUs: CUDA on this machine for a local run, gpus_per_node on a cluster."""
    if "nccl" not in cfg.dist.backend:
        return
    on_this_machine = local_run and topology.backend != SLURM_BACKEND  # Slurm nodes have their own GPUs
    has_gpus = torch.cuda.is_available() if on_this_machine else topology.gpus_per_node > 0
    if not has_gpus:
        where, other = (("this machine has no CUDA device", "run on a machine with one") if on_this_machine
                        else ("gpus_per_node=0 gives the nodes no GPU", "request GPUs with gpus_per_node"))
        raise LaunchInputError(f"input config_overrides: dist.backend={cfg.dist.backend!r} needs GPUs, but "
                               f"{where}: set '{{\"dist\": {{\"backend\": \"auto\"}}}}' in config_overrides, "
                               f"or {other}")


def check_checkpoint_uri(checkpoint_uri: str, local_run: bool) -> None:
    """An object-store URI must have a known scheme; a local path (in a local run: a cluster's plan pod need
    not mount the train pods' filesystem) must be a directory this process can write, created if missing,
    so that a read-only or mistyped root fails now rather than at the first save after training."""
    if not checkpoint_uri:
        return
    if is_uri(checkpoint_uri):
        check_protocol(checkpoint_uri, f"input checkpoint_uri={checkpoint_uri!r}", writable=True)
        return
    if not local_run:
        return
    try:
        ensure_writable_dir(local_path(checkpoint_uri), "checkpoint directory", "checkpoint_uri")
    except OutputError as exc:
        raise LaunchInputError(f"input checkpoint_uri={checkpoint_uri!r}: {exc}") from exc


def fingerprint_source(data: DataConfig) -> str:
    """The source's fingerprint as it is now, which the staging cache key includes, so a grown folder is
    staged again. An imagefolder is listed here (never opened), with progress lines, so a bad tree fails
    the plan, naming the input, before anything stages."""
    try:
        return source_fingerprint(data, progress=lambda line: print(f"plan: {line}", flush=True),
                                  storage_options=source_storage_options(data.source))
    except StagingError as exc:
        raise LaunchInputError(f"input source={data.source!r}: {exc}") from exc


def check_slurm(topology: Topology, cfg: Config, local_run: bool) -> Topology:
    """Slurm inputs, as given: only with backend='slurm', a target that can be an ssh Host alias or a host
    name, sbatch flags in shell syntax, a time limit sbatch reads (:func:`check_time_limit`). Nothing is
    contacted here: a cluster's plan pod need not reach the
    login node, so the connector checks the cluster (reachable, its Slurm commands, the partition's size) at
    submission. A local run's job activates this run's Python environment unless ``slurm_setup`` says
    otherwise (the loopback cluster shares this filesystem)."""
    slurm = topology.slurm
    if topology.backend != SLURM_BACKEND:
        if slurm != SlurmSettings():
            raise LaunchInputError(f"inputs slurm_* are set but backend={topology.backend!r}: set "
                                   "backend='slurm' to train on Slurm, or leave the slurm_* inputs empty")
        return topology
    if not slurm.target:
        raise LaunchInputError("input backend='slurm' needs slurm_target: the ssh Host alias (in "
                               "~/.ssh/config) or hostname of the cluster's login node, e.g. slurm-loopback "
                               "after `scripts/slurm-loopback up`")
    try:
        SlurmTarget(host=slurm.target)
    except ValueError as exc:
        raise LaunchInputError(f"input slurm_target={slurm.target!r}: {exc}") from exc
    try:
        shlex.split(slurm.sbatch_flags)
    except ValueError as exc:
        raise LaunchInputError(f"input slurm_sbatch_flags={slurm.sbatch_flags!r} is not valid shell syntax "
                               f"({exc}): quote or escape it, e.g. '--comment=\"two words\"'") from exc
    check_time_limit(topology, cfg.checkpoint.preemption_grace_s)
    if not slurm.setup and local_run and sys.prefix != sys.base_prefix:
        slurm = replace(slurm, setup=f"source {shlex.quote(sys.prefix)}/bin/activate")
    return replace(topology, slurm=slurm)


def check_time_limit(topology: Topology, grace_s: float) -> None:
    """The job's time limit is one sbatch reads and outlasts the warning signal's lead
    (:func:`~tasks.slurm.job.warning_lead_s`), or a LaunchInputError naming the inputs and the fix: a job
    signalled as it starts would save and stop at once, on every retry. Checked from the inputs alone."""
    text = topology.slurm.time_limit.strip()
    limit, lead = time_limit_s(text), warning_lead_s(grace_s)
    if limit is None and text and text.upper() not in ("UNLIMITED", "INFINITE"):
        raise LaunchInputError(f"input slurm_time_limit={text!r} is not a Slurm time limit: write minutes, "
                               "M:S, H:M:S, D-H, D-H:M or D-H:M:S (e.g. 2:00:00), or leave it empty for the "
                               "partition's default")
    if limit is None or limit > lead:
        return
    raise LaunchInputError(
        f"input slurm_time_limit={topology.slurm.time_limit!r} ({limit} s) is not longer than the warning "
        f"signal's lead of {lead} s (checkpoint.preemption_grace_s={grace_s:g}, rounded up, plus "
        f"{SIGNAL_MARGIN_S} s for the agents' shutdown): Slurm would signal the job to save and stop as soon "
        "as it starts. Raise slurm_time_limit, or lower checkpoint.preemption_grace_s")


class RunPlan(NamedTuple):
    config: Config
    data: DataConfig
    topology: Topology
    source_fingerprint: str  # the source as it was when this run started (traincore.data.fingerprint)
    stage_resources: NodeResources  # each staging partition pod's requests (the resources input's "stage")


@task
def plan_run(source: str, preset: str, config_overrides: str, epochs: int, max_steps: int, backend: str,
             nnodes: str, nproc_per_node: int, gpus_per_node: int, accelerator: str, max_restarts: int,
             parallelism: str, checkpoint_uri: str, slurm_target: str, slurm_partition: str,
             slurm_account: str, slurm_time_limit: str, slurm_sbatch_flags: str, slurm_setup: str,
             store_secret: str = "", capacity: str = "on-demand", stage_partitions: int = 0,
             resources: str = "") -> RunPlan:
    """Validate the launch inputs and resolve them into the run's Config and Topology; fingerprint the
    source (uncached: every run sees the source as it is now)."""
    slurm = SlurmSettings(target=slurm_target, partition=slurm_partition, account=slurm_account,
                          time_limit=slurm_time_limit, sbatch_flags=slurm_sbatch_flags, setup=slurm_setup)
    cfg = launch_config(preset, config_overrides, source, epochs, max_steps, parallelism)
    origin = source_origin(source, preset, cfg)
    check_source(cfg.data.source, origin)
    check_splits(cfg.data)
    requests = check_resources(resources)
    low, high = parse_nodes(nnodes)
    topology = Topology(backend=backend, nnodes=high, min_nnodes=low if low < high else 0,
                        nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node, accelerator=accelerator,
                        max_restarts=max_restarts, rdzv_timeout_s=cfg.dist.init_timeout_s, slurm=slurm,
                        store_secret=store_secret, resources=requests["train"])
    local_run = FlyteContextManager.current_context().execution_state.is_local_execution()
    cfg = check_range_input(cfg, topology)
    check_topology(topology, local_run)
    check_capacity(capacity, backend)
    check_stage_partitions(stage_partitions)
    check_store_secret(topology, checkpoint_uri)
    check_backend(cfg, topology, local_run)
    check_model(cfg)
    check_init_from(cfg, local_run)
    check_checkpoint_uri(checkpoint_uri, local_run)  # it may create the directory
    topology = check_slurm(topology, cfg, local_run)
    fingerprint = fingerprint_source(cfg.data)  # last: a large remote folder takes longest
    length = f"{cfg.train.max_steps} steps" if cfg.train.max_steps else f"{cfg.train.epochs} epochs"
    print(f"plan: preset {preset}, source {cfg.data.source} ({origin}; {fingerprint}), "
          f"model {cfg.model.name}, "
          f"{length}; {topology.nodes} node(s) x {nproc_per_node} process(es) on {backend}, "
          f"{cfg.dist.parallelism}", flush=True)
    return RunPlan(config=cfg, data=cfg.data, topology=topology, source_fingerprint=fingerprint,
                   stage_resources=requests["stage"])
