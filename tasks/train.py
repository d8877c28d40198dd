"""Distributed training: a torch-elastic Flyte task whose width is a launch-time input.

One task object per Topology (tasks/launch.py builds them and rebuilds them in a pod or a Slurm job from
the task key their command carries): flytekit fixes an Elastic task's type and node range when the task
object is built. flytekit names a function task after its function, so each topology's task runs its own
function, :func:`train_model` under the topology's name (:func:`train_function`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import flytekit
import torch.distributed as dist
from flytekit import FlyteContextManager, Resources, Secret
from flytekit.configuration import SerializationSettings
from flytekit.core.base_task import TaskMetadata
from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserRuntimeException
from flytekit.extend import IgnoreOutputs
from flytekit.extras.accelerators import GPUAccelerator
from flytekit.types.directory import FlyteDirectory
from flytekitplugins.kfpytorch import CleanPodPolicy, Elastic, RunPolicy
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError

from tasks.errors import UserFacingError
from tasks.failures import STDERR_DIR_ENV, captured_stderr, first_failure, vanished_workers
from tasks.rendezvous import rendezvous_failure
from tasks.resources import CACHE_MARGIN, gib, quantity
from tasks.storage import STORE_SECRET_KEYS, checkpoint_store, dataset_location, is_uri, resume_note
from tasks.types import StagedDataset, Topology, TrainResult
from traincore.checkpoint import as_store
from traincore.config import Config
from traincore.data import DEFAULT_CACHE_BYTES, NODE_CACHE_ENV, dataset_manifest
from traincore.exitcodes import PREEMPTED_EXIT_CODE
from traincore.run import (
    Preempted,
    Trainer,
    open_start_gate,
    preflight,
    read_record,
    settle_worker,
    shutdown_timeout_s,
    start_method,
    worker_threads,
)
from traincore.telemetry import RecordsSync, attempt_records, format_summary, next_attempt, process_start_time

STORE_SECRET_ENV = "TRAIN_STORE_SECRET"
"""Set by the train task for its workers: the Flyte secret group with the object store's credentials."""
RECORDS_ATTEMPT_ENV = "TRAIN_RECORDS_ATTEMPT"
"""Set by the train task for its workers: the attempt number their records go under, so that the workers'
records and this node's stderr tails (tasks copies them) land in one ``records/attempt-<N>/``."""
WANDB_SECRET = Secret(group="wandb", key="api_key", mount_requirement=Secret.MountType.FILE)
CPU_PER_PROCESS, MEM_GIB_PER_PROCESS = 2, 6
TRAIN_RETRIES = 3  # recoverable faults only (rendezvous timeouts, lost peers); user errors fail at once
LAST_CALL_S = 5  # seconds a re-formed elastic world (its minimum of nodes at least) waits for more


def train_model(config: Config, dataset: StagedDataset, checkpoint_root: str) -> TrainResult:
    """Train in one elastic worker process; global rank 0's return value becomes the task output."""
    output = Path(flytekit.current_context().working_directory) / "run"
    if "LOCAL_WORLD_SIZE" in os.environ:  # an elastic worker, maybe forked from the task's process
        settle_worker(worker_threads(int(os.environ["LOCAL_WORLD_SIZE"])))
    try:
        with captured_stderr(int(os.environ.get("RANK", "0"))):
            store = checkpoint_store(checkpoint_root, os.environ.get(STORE_SECRET_ENV, ""))
            data = dataset_location(dataset.directory, os.environ.get(STORE_SECRET_ENV, ""))
            # The task's execute ran preflight once for this node's workers (the resume check reads the
            # store, and verifies the checkpoint it would load): they take the manifest it checked.
            summary = Trainer(config, data, output, store, started_at=process_start_time(),
                              manifest=dataset_manifest(as_store(data)), attempt=records_attempt()).train()
    except dist.DistError as exc:  # a peer vanished or the store timed out: infrastructure, worth a retry
        raise FlyteRecoverableException(f"distributed training failed transiently: {exc}") from exc
    except Preempted as exc:  # the step reached is saved: a retry resumes from it, losing nothing
        raise FlyteRecoverableException(str(exc)) from exc
    if int(os.environ.get("RANK", "0")) == 0:
        logdir = (summary.records.rsplit("/", 1)[0] if summary.records
                  else Path(summary.output_dir) / "tensorboard")
        print(f"train: {format_summary(summary)}; TensorBoard: tensorboard --logdir {logdir}", flush=True)
    checkpoints = checkpoint_root if is_uri(checkpoint_root) else summary.checkpoint_dir
    return TrainResult(checkpoints=FlyteDirectory(checkpoints), logs=FlyteDirectory(summary.output_dir),
                       summary=summary)


def records_attempt() -> int | None:
    """The number of this attempt's records: the one the launching agent chose for its workers, else the
    Flyte attempt on a cluster (propeller sets FLYTE_ATTEMPT_NUMBER); None elsewhere, where the records take
    the next free number in the checkpoint root."""
    for name in (RECORDS_ATTEMPT_ENV, "FLYTE_ATTEMPT_NUMBER"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def stop_preempted(preempted: Preempted | str, checkpoint_root: str, secret_group: str = "") -> NoReturn:
    """End a preempted attempt (``preempted``: the record of the step saved, or a signal's name when the
    workers were stopped before they trained a step): a recoverable error, which Flyte retries from the
    saved step; in a local ``pyflyte run`` (a Ctrl-C, say), a few lines and exit code 75 instead of a
    traceback."""
    if isinstance(preempted, Preempted):
        headline, message = preempted.headline, str(preempted)
    else:
        headline = (f"stopped by {preempted} before this attempt committed a checkpoint of the step it "
                    "reached (it was starting, or its save outlasted checkpoint.preemption_grace_s)")
        message = f"{headline}; {resume_note(checkpoint_root, secret_group)}"
    if not FlyteContextManager.current_context().execution_state.is_local_execution():
        raise FlyteRecoverableException(message) from None
    advice = f"to resume, run the same pyflyte command with --checkpoint_uri {checkpoint_root}"
    print(headline, advice, sep="\n", file=sys.stderr, flush=True)
    raise SystemExit(PREEMPTED_EXIT_CODE)


def stop_if_preempted(checkpoint_root: str, secret_group: str, signal_name: str | None) -> None:
    """End the attempt as preempted (:func:`stop_preempted`) when it was: its workers left the record of the
    step they saved in the checkpoint root, or ``signal_name`` names the signal that stopped them before they
    committed one (while they started, or a save that outlasted the grace). Returns when neither says so.

    The one place a train task, elastic or Slurm, reads the record: the record names the step saved, so it
    wins over the signal."""
    preempted = read_record(checkpoint_store(checkpoint_root, secret_group)) or signal_name
    if preempted is not None:
        stop_preempted(preempted, checkpoint_root, secret_group)


def agent_signal(error: BaseException) -> str | None:
    """The signal that stopped the elastic agent, when ``error`` is the plugin's IgnoreOutputs for it (raised
    while it handles torch elastic's SignalException); None for any other error, e.g. the IgnoreOutputs of
    a worker pod that is not rank 0's, which is how a normal run ends there."""
    context = error.__context__
    if isinstance(error, IgnoreOutputs) and isinstance(context, SignalException):
        return signal.Signals(context.sigval).name
    return None


def _use_wandb_secret(config: Config) -> None:
    """Point traincore at the mounted W&B key file; the key itself never enters the environment."""
    if config.telemetry.wandb_mode != "online" or "WANDB_API_KEY" in os.environ:
        return
    path = flytekit.current_context().secrets.get_secrets_file(WANDB_SECRET.group, WANDB_SECRET.key)
    if os.path.isfile(path):
        os.environ.setdefault("WANDB_API_KEY_FILE", path)


def train_function(topology: Topology, wandb_secret: bool) -> Callable[..., TrainResult]:
    """:func:`train_model` under the name of the topology's task: flytekit names a function task
    ``<module>.<function>`` (here ``tasks.train.train-local-1x2``), and the task's interface is
    train_model's (its signature, annotations and docstring)."""

    @functools.wraps(train_model)
    def train(*args: Any, **kwargs: Any) -> TrainResult:
        return train_model(*args, **kwargs)

    # flytekit accepts a function built inside another as a task when, like a decorated module-level
    # function, it is functools-wrapped with __name__ == __qualname__; and the name must hold no dot, as
    # flytekit keeps only the part after the last one.
    train.__name__ = train.__qualname__ = function_name(topology, wandb_secret)
    return train


def store_secrets(topology: Topology) -> list[Secret]:
    """The object store's credentials the train pods mount as files: the Flyte secret ``store_secret``."""
    return [Secret(group=topology.store_secret, key=key, mount_requirement=Secret.MountType.FILE)
            for key in STORE_SECRET_KEYS] if topology.store_secret else []


def task_settings(topology: Topology, wandb_secret: bool) -> dict[str, Any]:
    """What a train task's template carries besides its plugin's part, alike on every backend: retries,
    resources, GPUs, /dev/shm, the W&B secret and the environment."""
    return dict(
        shared_memory=True, metadata=TaskMetadata(retries=TRAIN_RETRIES),
        requests=node_requests(topology),
        accelerator=GPUAccelerator(topology.accelerator) if topology.accelerator else None,
        secret_requests=[*([WANDB_SECRET] if wandb_secret else []), *store_secrets(topology)] or None,
        environment={**restart_environment(topology), **cache_environment(topology)})


def node_requests(topology: Topology) -> Resources:
    """Each train node's requests: the ``resources`` input's ``train`` values, else 2 CPUs and 6 GiB per
    process and the node's stream cache plus CACHE_MARGIN of ephemeral storage; the GPUs asked for."""
    given = topology.resources
    storage = given.ephemeral_storage or gib(DEFAULT_CACHE_BYTES + CACHE_MARGIN)
    return Resources(cpu=given.cpu or str(CPU_PER_PROCESS * topology.nproc_per_node),
                     mem=given.mem or f"{MEM_GIB_PER_PROCESS * topology.nproc_per_node}Gi",
                     gpu=str(topology.gpus_per_node) if topology.gpus_per_node else None,
                     ephemeral_storage=storage)


def cache_environment(topology: Topology) -> dict[str, str]:
    """The node's stream cache from its ephemeral-storage request, less CACHE_MARGIN (logs, TensorBoard
    events, a checkpoint's staging): what ``loader.cache_bytes=0`` gives the node's processes."""
    storage = int(quantity(node_requests(topology).ephemeral_storage))
    return {NODE_CACHE_ENV: str(max(storage - CACHE_MARGIN, 0))}


class TopologyTaskMixin:
    """A task of one topology, named by it alone (the name its function carries).

    flytekit prefixes a function task's name with the module being imported when the task object was built
    (``TrackedInstance.instantiated_in``; under ``python -m``, a module path guessed from the working
    directory), unless the name already contains it. A train task is built on demand by whoever first asks
    for its topology: at an import, in a @dynamic, in a pod or a test. It is found by the task resolver of
    tasks/launch.py from its key, never through a module variable, so the module it belongs to is its
    function's, and its name ``tasks.train.train-<topology>`` is the same wherever it is built.
    """

    @property
    def instantiated_in(self) -> str:
        return self.task_function.__module__


class PreflightError(UserFacingError):
    """The run's config does not fit its data, model, machine or outputs: preflight's message, which names
    the problem and the fix (traincore.run.preflight), shown by ``pyflyte run`` without a traceback."""


class WorkerGroupFailed(RuntimeError):
    """Training workers failed: the first failure, its stderr's last lines, then torch elastic's report."""


class ElasticTrainTask(TopologyTaskMixin, PytorchElasticFunctionTask):
    """The Elastic task plus what must happen once per node, around the worker processes."""

    def __init__(self, topology: Topology, wandb_secret: bool):
        self.topology, self.wandb_secret = topology, wandb_secret
        timeout = topology.rdzv_timeout_s
        rdzv = {"timeout": timeout, "join_timeout": timeout, "read_timeout": timeout}
        if topology.elastic:
            # A world re-formed after a loss waits this long for more nodes before it trains (c10d's default
            # 30 s would add to every loss); a node that misses it joins at the next restart.
            rdzv["last_call_timeout"] = LAST_CALL_S
        super().__init__(
            task_config=Elastic(
                nnodes=topology.nodes if topology.elastic else topology.nnodes,
                nproc_per_node=topology.nproc_per_node,
                start_method=worker_start_method(topology),
                monitor_interval=1,  # the agent notices finished workers within 1 s instead of 5
                max_restarts=topology.max_restarts, increase_shared_mem=False,
                # read_timeout too: the c10d store's 60 s default is shorter than a slow pod's start-up.
                rdzv_configs=rdzv,
                run_policy=RunPolicy(clean_pod_policy=CleanPodPolicy.ALL) if topology.nnodes > 1 else None),
            task_function=train_function(topology, wandb_secret), **task_settings(topology, wandb_secret))

    def execute(self, **kwargs):
        """Validate before any worker starts (the checkpoint root too: an object store is probed)."""
        _use_wandb_secret(kwargs["config"])  # before validation checks the key; workers inherit the env
        root = kwargs["checkpoint_root"]
        os.environ[STORE_SECRET_ENV] = self.topology.store_secret  # for the workers, which inherit it
        store = checkpoint_store(root, self.topology.store_secret)
        dataset = dataset_location(kwargs["dataset"].directory, self.topology.store_secret)
        try:
            if not self.single_process:
                shutdown_timeout_s()  # the plugin's launcher reads it, and fails on what this refuses
            preflight(kwargs["config"], dataset, Path(flytekit.current_context().working_directory) / "run",
                      store, world_size=self.topology.nnodes * self.topology.nproc_per_node)
        except ValueError as exc:  # every one of preflight's refusals names the input and the fix
            raise PreflightError(str(exc)) from None
        try:
            return self._train(**kwargs)
        except (IgnoreOutputs, FlyteRecoverableException) as exc:
            # A preempted run's workers saved their step and left a record of it. The plugin says
            # IgnoreOutputs when the signal reached this process too (its agent stopped the workers),
            # or shows the workers' exit codes: the record says what happened instead. A signal that
            # came while the workers were starting left no record, and nothing new to save.
            stop_if_preempted(root, self.topology.store_secret, agent_signal(exc))
            raise
        finally:
            os.environ.pop(STORE_SECRET_ENV, None)

    def _train(self, **kwargs):
        """Train in this process (one process, nothing to launch) or in the plugin's elastic workers."""
        if self.single_process:
            # Nothing to rendezvous or restart: a spawned worker would only import torch (and all the rest)
            # a second time. Errors keep their classes: train_model raises what a worker would.
            return self.task_function(**kwargs)
        if self.task_config.start_method == "fork":
            open_start_gate(self.topology.nproc_per_node)
        stderr_dir = tempfile.mkdtemp(prefix="worker-stderr-",
                                      dir=flytekit.current_context().working_directory)
        os.environ[STDERR_DIR_ENV] = stderr_dir  # the workers inherit it (forked or spawned)
        store = checkpoint_store(kwargs["checkpoint_root"], self.topology.store_secret)
        attempt = records_attempt()
        attempt = attempt if attempt is not None else next_attempt(store)
        os.environ[RECORDS_ATTEMPT_ENV] = str(attempt)  # the workers' records go to the same attempt
        records = RecordsSync(attempt_records(store, attempt), kwargs["config"].telemetry.records_every_s,
                              tails={"stderr": Path(stderr_dir)}).start()
        try:
            return super().execute(**kwargs)
        except RendezvousError as exc:  # not every node came up in time: a retry may find them
            raise FlyteRecoverableException(self._rendezvous_failure(exc)) from exc
        except FlyteUserRuntimeException as exc:  # the plugin's verdict on a failed worker group
            if not isinstance(exc.value, ChildFailedError):
                raise
            failed = first_failure(exc.value, stderr_dir)
            vanished = vanished_workers(exc.value)
            if vanished:  # infrastructure, not the user's code: Flyte's retries apply
                raise FlyteRecoverableException(
                    f"worker {', '.join(vanished)} was killed by a signal from outside (node lost, OOM "
                    f"killer, eviction); a retry resumes from the checkpoint root. {failed}\n{exc}") from exc
            raise FlyteUserRuntimeException(WorkerGroupFailed(f"{failed}\n{exc.value}")) from exc
        finally:
            os.environ.pop(STDERR_DIR_ENV, None)
            os.environ.pop(RECORDS_ATTEMPT_ENV, None)
            records.close()  # the end of every local worker's stderr, however the group ended

    def get_custom(self, settings: SerializationSettings) -> dict[str, Any] | None:
        """The PyTorchJob's spec; for a node range its workers restart on failure.

        The training operator (v1.9, pkg/controller.v1/pytorch UpdateJobStatus) fails a job as soon as a
        worker pod failed under restart policy Never, which the plugin leaves: an elastic job would end at its
        first lost node. OnFailure has a lost node's pod made again (it joins when it is scheduled) while the
        survivors train on; the run policy's backoffLimit of max_restarts bounds the containers that fail and
        restart in place, so that an error in every attempt still ends the job."""
        custom = super().get_custom(settings)
        if self.topology.elastic:
            custom["workerReplicas"]["restartPolicy"] = "RESTART_POLICY_ON_FAILURE"
            custom.setdefault("runPolicy", {})["backoffLimit"] = self.topology.max_restarts
        return custom

    @property
    def single_process(self) -> bool:
        """One node, one process and no restarts: the task trains in its own process, launching nothing."""
        topology = self.topology
        return topology.nnodes == 1 and topology.nproc_per_node == 1 and topology.max_restarts == 0

    def _rendezvous_failure(self, error: RendezvousError) -> str:
        """What timed out, where, and how many nodes of how many arrived: torch's own message is often empty.

        The endpoint and run id are the ones the plugin's execute gave elastic_launch (the kfpytorch task,
        flytekitplugins-kfpytorch 1.16); the node count is read back from the c10d store, best effort. Call
        it while ``error`` is being handled: when this node hosted the store, the store lives only as long as
        the failed launcher's frames, which the error's traceback holds (checked with torch 2.14).
        """
        configs = self.task_config.rdzv_configs
        return rendezvous_failure(
            error, endpoint=os.environ.get("PET_RDZV_ENDPOINT", "localhost:0"),
            run_id=flytekit.current_context().execution_id.name,
            timeout_s=configs.get("join_timeout", configs.get("timeout")),
            min_nodes=self.min_nodes, max_nodes=self.max_nodes)


def worker_start_method(topology: Topology) -> str:
    """"spawn" across nodes, where one pod's agent hosts the rendezvous store of all: forked workers inherit
    its sockets, and the replayed two-pod PyTorchJob did not complete with them (tests/replay/
    test_pod_restarts.py), while spawned workers are the path tested there. On one node, traincore's rule
    (traincore.run.launch.start_method): "fork" for single-threaded workers without GPUs, which then share
    the task process's imports (torch, flytekit, traincore: seconds each), "spawn" otherwise. Decided when
    the task is loaded, in the pod that runs it: its cores and OMP_NUM_THREADS are the workers'.

    What a fork copies. At fork time the task process runs, besides its main thread: the records thread
    that copies the workers' stderr tails into the checkpoint root and, for an object-store root, fsspec's
    I/O thread (traincore.telemetry.records; the workers never use either), the c10d rendezvous' keep-alive
    thread and the agent's TCPStore server threads, and torch's intra-op threads once preflight's forward
    ran, which a worker at one thread never uses. Only the forking thread exists in a child, and a lock
    another thread held at the fork stays locked there. Logging's handlers' locks (os.register_at_fork,
    since Python 3.7) and fsspec's event loop, lock and instance cache (fsspec.asyn and fsspec.spec) are
    re-initialised after a fork; glibc's resolver lock is not, and the store's server thread takes it for
    every worker that connects: the workers therefore wait until all of them are forked before they
    connect (traincore.run.launch.open_start_gate, opened in ``_train``), and a fork waits for a records
    copy under way, whose look-up of the store's host name takes it too (traincore.telemetry.records).
    """
    if topology.nnodes > 1:
        return "spawn"
    return start_method(worker_threads(topology.nproc_per_node), cuda=bool(topology.gpus_per_node))


def restart_environment(topology: Topology) -> dict[str, str]:
    """Env for in-place restarts across nodes: a pod the operator recreates must be able to rejoin.

    With torch's default, the workers share the agent's rendezvous TCPStore, and a surviving agent keeps the
    store address it published in the first round without publishing it again; a replacement pod's agent
    then waits for it until the rendezvous timeout (tests/replay/test_pod_restarts.py). Opting out makes
    rank 0 publish its own store address in every round. Only for several nodes with restarts allowed:
    elsewhere the default is the tested path.
    """
    if topology.nnodes > 1 and topology.max_restarts > 0:
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return {}


def task_key(topology: Topology, wandb_secret: bool) -> str:
    """Everything that tells one train task from another, as the JSON its pod command carries."""
    return json.dumps({"topology": asdict(topology), "wandb_secret": wandb_secret}, sort_keys=True)


def function_name(topology: Topology, wandb_secret: bool) -> str:
    """``train-<backend>-<nodes>x<procs>[-...]``, the task's name after ``tasks.train.``: every part of the
    task key that changes the template, so two different templates never share a task ID; parts at their
    default are left out."""
    default = Topology()
    nodes = topology.nodes.replace(":", "to")  # a range: "1to4x8"
    parts = [topology.backend, f"{nodes}x{topology.nproc_per_node}"]
    if topology.gpus_per_node:
        parts.append(f"gpu{topology.gpus_per_node}")
    if topology.accelerator:  # a Kubernetes label value; a dot would cut the name short (train_function)
        accelerator = topology.accelerator
        parts.append(accelerator if "." not in accelerator else _digest(accelerator))
    if topology.max_restarts:
        parts.append(f"restarts{topology.max_restarts}")
    if topology.rdzv_timeout_s != default.rdzv_timeout_s:
        parts.append(f"rdzv{topology.rdzv_timeout_s}s")
    if topology.slurm != default.slurm:  # free text (set-up lines, flags): a digest keeps the name short
        parts.append(_digest(json.dumps(asdict(topology.slurm), sort_keys=True)))
    if topology.store_secret:
        parts.append(f"store-{_digest(topology.store_secret)}")
    if topology.resources != default.resources:
        parts.append(f"res-{_digest(json.dumps(asdict(topology.resources), sort_keys=True))}")
    if wandb_secret:
        parts.append("wandb")
    return f"train-{'-'.join(parts)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]
