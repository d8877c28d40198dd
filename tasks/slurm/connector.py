"""The Slurm backend's Flyte side: the train task type ``slurm_train`` and its connector.

Where the workflow runs (``pyflyte run`` here, or a connector service next to a Flyte cluster), the task is
not executed but submitted: the connector checks the cluster (the login node's Slurm commands, the
partition's size), writes a batch script (tasks/slurm/job.py), submits it over SSH
(tasks/slurm/client.py), polls the job and cancels it on abort. Inside the job, ``pyflyte-execute`` runs
the task's command on every node, and the task resolver (tasks/launch.py) rebuilds from it the elastic
train task of the same topology: torch elastic agents that meet on the first node, checkpoints in the
durable root, rank 0's result as the output.

The task's inputs and outputs live under the execution's output prefix, which the cluster must reach: a
shared filesystem for a local run, an object store the cluster can read and write for a remote one. The
object store's credentials are never part of the task: the connector forwards its own FLYTE_AWS_* and
AWS_* environment to each job at submission.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

from flyteidl.core.execution_pb2 import TaskExecution
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.core.context_manager import FlyteContextManager, SecretsManager
from flytekit.core.python_function_task import PythonFunctionTask
from flytekit.core.type_engine import TypeEngine
from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserException
from flytekit.extend.backend.base_connector import (
    AsyncConnectorBase,
    AsyncConnectorExecutorMixin,
    ConnectorRegistry,
    Resource,
    ResourceMeta,
)
from flytekit.extend.backend.utils import render_task_template
from flytekit.models.literals import LiteralMap
from flytekit.models.task import Resources, TaskTemplate
from rich.markup import escape

from tasks.plan import LaunchInputError, check_time_limit
from tasks.slurm.client import NodeSize, SlurmClient
from tasks.slurm.job import (
    NodeRequest,
    batch_script,
    node_request,
    sbatch_args,
)
from tasks.slurm.report import JobEnd, failure_message, headline, success_message
from tasks.slurm.ssh import SlurmConnectionError, SlurmTarget
from tasks.slurm.states import JobInfo, Outcome, SlurmError
from tasks.train import TopologyTaskMixin, stop_if_preempted, task_settings, train_function
from tasks.types import Topology
from traincore.config import Config

SLURM_TASK_TYPE = "slurm_train"
JOBS_DIR = ".flyte-torch-pipeline/slurm-jobs"  # on the login node, relative to the user's home
KEEP_JOB_DIRS = 20  # newest job directories kept there; older ones go once nothing in them changed for a day
SSH_KEY_SECRET = ("slurm", "ssh_key")  # optional Flyte secret (group, key): the login node's private key
SECRET_REQUIRED_ENV = "SLURM_CONNECTOR_SECRET"  # set by deploy/connector.yaml: the pod's key must be there
SLURM_COMMANDS = ("sbatch", "srun", "scontrol", "scancel", "sinfo")
FORWARDED_ENV = ("FLYTE_AWS_", "AWS_")  # object-store settings and credentials a job needs, by prefix
LAST_KEPT = 256  # finished jobs whose outcome the connector remembers (a local run reads its own)
REQUEUE_WAIT_S = 600.0  # how long a job Slurm requeued (NODE_FAIL, say) may wait to run again
CANCEL_TIMEOUT_S = 30.0  # Ctrl-C: connect and scancel within this
PHASES = {Outcome.QUEUED: TaskExecution.QUEUED, Outcome.RUNNING: TaskExecution.RUNNING,
          Outcome.SUCCEEDED: TaskExecution.SUCCEEDED, Outcome.FAILED: TaskExecution.FAILED,
          Outcome.RETRYABLE: TaskExecution.RETRYABLE_FAILED, Outcome.ABORTED: TaskExecution.ABORTED}

log = logging.getLogger(__name__)


@dataclass
class SlurmJobMeta(ResourceMeta):
    """What the connector keeps of a submitted job."""

    job_id: str
    target: str
    output_prefix: str
    checkpoint_root: str = ""  # the task's input: where a retry resumes from


def ssh_target(host: str) -> SlurmTarget:
    """How to reach ``host``: ~/.ssh/config and ssh-agent, or only the private key of the Flyte secret
    ``slurm/ssh_key`` when it is mounted as a file (a connector pod's usual way to hold a key).

    deploy/connector.yaml mounts its Secret as optional, so that a cluster without it starts the connector
    (a pod would otherwise wait in ContainerCreating with no word in its log), and names the Secret in
    SLURM_CONNECTOR_SECRET: there a missing key is this error, in the task that needed it."""
    key_file = SecretsManager().get_secrets_file(*SSH_KEY_SECRET)
    required = os.environ.get(SECRET_REQUIRED_ENV)
    if required and not os.path.isfile(key_file):
        raise LaunchInputError(
            f"the Slurm connector has no SSH key at {key_file}: the Secret {required!r} in its namespace is "
            "missing or lacks the key ssh_key (also known_hosts and config); create it with "
            "deploy/create-secrets.sh (docs/deploy.md, Secrets), then run the task again")
    return SlurmTarget(host=host, key_file=key_file if os.path.isfile(key_file) else None)


def forwarded_env(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The submitting process's object-store settings and credentials (FLYTE_AWS_*, AWS_*) for the job."""
    return {name: value for name, value in environ.items() if name.startswith(FORWARDED_ENV)}


async def _task_inputs(inputs: LiteralMap | None) -> tuple[Config, str]:
    """The run's Config and checkpoint root from the task's inputs (defaults when there are none)."""
    if inputs is None or "config" not in inputs.literals:
        return Config(), ""
    ctx = FlyteContextManager.current_context()
    config = await TypeEngine.async_to_python_value(ctx, inputs.literals["config"], Config)
    root = inputs.literals.get("checkpoint_root")
    return config, root.scalar.primitive.string_value if root is not None else ""


def template_request(template: TaskTemplate) -> NodeRequest:
    """What each node's task asks for: the task template's resource requests."""
    names = {Resources.ResourceName.CPU: "cpu", Resources.ResourceName.MEMORY: "memory",
             Resources.ResourceName.GPU: "gpu"}
    requests = template.container.resources.requests if template.container else []
    return node_request({names[entry.name]: entry.value for entry in requests if entry.name in names})


async def check_cluster(client: SlurmClient, topology: Topology, request: NodeRequest) -> None:
    """The login node has the Slurm commands, the partition has ``nnodes`` nodes and one of them at least
    the CPUs and memory each node's task asks for, or a LaunchInputError that names the input and the
    fix."""
    slurm = topology.slurm
    missing = await client.missing_commands(SLURM_COMMANDS)
    if missing:
        raise LaunchInputError(f"input slurm_target={slurm.target!r}: the login node has no "
                               f"{', '.join(missing)} on its PATH: is it a Slurm login node?")
    try:
        nodes = await client.partition_nodes(slurm.partition or None)
    except SlurmError as exc:
        raise LaunchInputError(f"input slurm_partition={slurm.partition!r}: {exc}: set slurm_partition to "
                               "one of those, or leave it empty for the default partition") from exc
    if topology.nnodes > nodes:
        where = f"partition {slurm.partition!r}" if slurm.partition else "the default partition"
        raise LaunchInputError(f"input nnodes={topology.nnodes} exceeds the {nodes} node(s) of {where} on "
                               f"{slurm.target}: lower nnodes or choose a larger slurm_partition")
    check_node_size(await client.node_sizes(slurm.partition or None), topology, request)


def check_node_size(sizes: list[NodeSize], topology: Topology, request: NodeRequest) -> None:
    """Some node of the partition (``sizes``) has what each node's task asks for, or a LaunchInputError
    naming the request, where it comes from, the largest node and the fix. Only what is asked is checked and
    named: CPUs or memory that the user's own sbatch flags size (0 in ``request``) are theirs to fit."""
    asked = [name for name, value in (("cpus", request.cpus), ("mem_mb", request.mem_mib)) if value]
    if not sizes or any(size.cpus >= request.cpus and size.mem_mb >= request.mem_mib for size in sizes):
        return
    slurm = topology.slurm
    largest = max(sizes, key=lambda size: [getattr(size, name) for name in asked])
    wants = {"cpus": f"{request.cpus} CPUs", "mem_mb": f"{request.mem_mib} MB of memory"}
    has = {"cpus": f"{largest.cpus} CPUs", "mem_mb": f"{largest.mem_mb} MB"}
    flags = {"cpus": f"--cpus-per-task={largest.cpus}", "mem_mb": f"--mem={largest.mem_mb}M"}
    where = f"partition {slurm.partition!r}" if slurm.partition else "the default partition"
    nproc = topology.nproc_per_node
    raise LaunchInputError(
        f"input nproc_per_node={nproc}: each node's task asks for {' and '.join(wants[n] for n in asked)} "
        f"({nproc} process(es) x the train task's per-process requests), but no node of {where} on "
        f"{slurm.target} has that: the largest, {largest.name}, has {' and '.join(has[n] for n in asked)}. "
        "Lower nproc_per_node, choose another slurm_partition, or size the job yourself in "
        f"slurm_sbatch_flags, e.g. '{' '.join(flags[n] for n in asked)}'")


class SlurmTrainConnector(AsyncConnectorBase):
    """create = check the cluster + sbatch, get = job state (+ the first failure), delete = scancel."""

    name = "flyte-torch-pipeline Slurm train connector"

    def __init__(self) -> None:
        # Version 1: what the task template carries (kfpytorch's Elastic task sets task_type_version=1).
        super().__init__(task_type_name=SLURM_TASK_TYPE, task_type_version=1, metadata_type=SlurmJobMeta)
        self._clients: dict[str, SlurmClient] = {}
        self.requeue_wait_s = REQUEUE_WAIT_S
        self._requeued_since: dict[str, float] = {}  # job id -> first seen waiting after a requeue
        # job id -> final outcome and message: what a local run prints or raises once the job ended. A
        # local run takes its entry; a connector service never does, so only the newest LAST_KEPT are kept.
        self.last: dict[str, JobEnd] = {}
        # The job this process submitted and still follows (a local run follows one at a time): what Ctrl-C
        # cancels, from the moment sbatch answered.
        self.following: SlurmJobMeta | None = None

    async def _client(self, target: str) -> SlurmClient:
        """One SSH connection per target, reopened after a failure."""
        if target not in self._clients:
            self._clients[target] = await SlurmClient(ssh_target(target)).__aenter__()
        return self._clients[target]

    async def _call(self, target: str, method: str, *args: Any) -> Any:
        try:
            return await getattr(await self._client(target), method)(*args)
        except SlurmConnectionError:
            client = self._clients.pop(target, None)
            if client is not None:
                await client.close()
            raise

    async def create(self, task_template: TaskTemplate, inputs: LiteralMap | None = None,
                     output_prefix: str = "", **kwargs: Any) -> SlurmJobMeta:
        """Check the cluster, write the batch script next to the job's logs on the login node, submit it."""
        topology = Topology.from_dict(task_template.custom["topology"])
        target = topology.slurm.target
        config, checkpoint_root = await _task_inputs(inputs)
        entrypoint = list(render_task_template(task_template, output_prefix).container.args)
        job_dir = f"{JOBS_DIR}/{output_prefix.rstrip('/').rsplit('/', 1)[-1] or 'job'}"
        request = template_request(task_template).without(topology.slurm.sbatch_flags)
        check_time_limit(topology, config.checkpoint.preemption_grace_s)
        try:
            await check_cluster(await self._client(target), topology, request)
        except SlurmConnectionError as exc:
            raise LaunchInputError(f"input slurm_target={target!r}: {exc}") from exc
        job_id = await self._call(target, "submit", batch_script(topology, entrypoint), job_dir,
                                  sbatch_args(topology, config.checkpoint.preemption_grace_s, request),
                                  forwarded_env(os.environ))
        log.info("submitted Slurm job %s to %s (%d node(s))", job_id, target, topology.nnodes)
        self.following = SlurmJobMeta(job_id=job_id, target=target, output_prefix=output_prefix,
                                      checkpoint_root=checkpoint_root)
        try:
            await self._call(target, "prune", JOBS_DIR, KEEP_JOB_DIRS)
        except SlurmError as exc:  # housekeeping: never fail a submitted job over it
            log.warning("could not prune old job directories on %s: %s", target, exc)
        return self.following

    async def get(self, resource_meta: SlurmJobMeta, **kwargs: Any) -> Resource:
        """The job's Flyte phase; a finished job's message: its summary, or its first failure."""
        job: JobInfo = await self._call(resource_meta.target, "job", resource_meta.job_id)
        outcome, message = job.outcome, headline(job, resource_meta.target)
        if job.outcome is Outcome.QUEUED and job.restarts:
            outcome, message = await self._waiting_after_requeue(resource_meta, job, message)
        else:
            self._requeued_since.pop(job.job_id, None)
        if job.finished:
            end = await self._final(resource_meta, job)
            outcome, message = end.outcome, end.message
            self.last[job.job_id] = end
        elif outcome not in (Outcome.QUEUED, Outcome.RUNNING):  # cancelled after a requeue's long wait
            self.last[job.job_id] = JobEnd(outcome, message)
        if outcome not in (Outcome.QUEUED, Outcome.RUNNING):
            while len(self.last) > LAST_KEPT:
                del self.last[next(iter(self.last))]  # the oldest: dicts keep insertion order
        return Resource(phase=PHASES[outcome], message=_for_display(message))

    async def _final(self, meta: SlurmJobMeta, job: JobInfo) -> JobEnd:
        async def tail(path: str, lines: int) -> str:
            return await self._call(meta.target, "tail", path, lines)

        if job.outcome is Outcome.SUCCEEDED:
            return JobEnd(Outcome.SUCCEEDED, await success_message(job, meta.target, tail))
        if job.outcome is Outcome.ABORTED:
            return JobEnd(Outcome.ABORTED, headline(job, meta.target))
        return await failure_message(job, meta.target, meta.output_prefix, meta.checkpoint_root, tail)

    async def _waiting_after_requeue(self, meta: SlurmJobMeta, job: JobInfo,
                                     message: str) -> tuple[Outcome, str]:
        """A requeued job waits for nodes; once it has waited longer than ``requeue_wait_s`` it is cancelled
        and the task fails as retryable, saying how long it waited and what to do."""
        since = self._requeued_since.setdefault(job.job_id, time.monotonic())
        waited = time.monotonic() - since
        if waited <= self.requeue_wait_s:
            return Outcome.QUEUED, f"{message}; requeued {job.restarts} time(s), waiting for nodes"
        await self._call(meta.target, "cancel", job.job_id)
        self._requeued_since.pop(job.job_id, None)
        return Outcome.RETRYABLE, (
            f"{message}: Slurm requeued the job {job.restarts} time(s) (a node failed) and it waited "
            f"{waited:.0f} s without starting again, so it was cancelled. Check the nodes (ssh {meta.target} "
            "sinfo -R); a retry submits a new job that resumes from the checkpoint root")

    async def delete(self, resource_meta: SlurmJobMeta, **kwargs: Any) -> None:
        """Cancel the job (a job that already ended is fine)."""
        await self._call(resource_meta.target, "cancel", resource_meta.job_id)

    def cancel_now(self, meta: SlurmJobMeta) -> str:
        """Cancel the job from a signal handler, while this process's event loop is busy: on a loop and an
        SSH connection of its own, in a thread, within CANCEL_TIMEOUT_S. Says what happened."""
        target = replace(ssh_target(meta.target), connect_timeout_s=CANCEL_TIMEOUT_S / 2,
                         command_timeout_s=CANCEL_TIMEOUT_S / 2)

        async def cancel() -> None:
            async with SlurmClient(target) as client:
                await client.cancel(meta.job_id)

        pool = ThreadPoolExecutor(max_workers=1)
        try:
            pool.submit(asyncio.run, cancel()).result(timeout=CANCEL_TIMEOUT_S + 5)
        except Exception as exc:
            return (f"could not cancel Slurm job {meta.job_id} on {meta.target} ({exc}): cancel it with "
                    f"`ssh {meta.target} scancel {meta.job_id}`")
        finally:
            pool.shutdown(wait=False)
        return f"cancelled Slurm job {meta.job_id} on {meta.target}"


def _for_display(message: str) -> str:
    """A local run shows the message in a rich progress line, which would parse worker output such as
    ``[/__w/...]`` as markup: escape it there. A connector service's messages reach Flyte as they are."""
    state = FlyteContextManager.current_context().execution_state
    return escape(message) if state is not None and state.is_local_execution() else message


class SlurmTrainTask(TopologyTaskMixin, AsyncConnectorExecutorMixin, PythonFunctionTask):
    """The train task on Slurm: submitted through the connector; its command, run on the job's nodes,
    trains as the elastic train task of the same topology.

    A function task of its own type rather than an elastic task: the kfpytorch plugin fixes its task type
    ("python-task" or "pytorch"), and the connector is chosen by type. Its function, resources, retries and
    environment are the elastic task's, so the two share a name and an interface.
    """

    def __init__(self, topology: Topology, wandb_secret: bool):
        self.topology, self.wandb_secret = topology, wandb_secret
        # Version 1, as the connector registers it (and as the elastic task's template says).
        super().__init__(task_config=None, task_function=train_function(topology, wandb_secret),
                         task_type=SLURM_TASK_TYPE, task_type_version=1,
                         **task_settings(topology, wandb_secret))

    def get_custom(self, settings) -> dict[str, Any]:
        """What the connector needs: the whole topology (nodes, processes, Slurm settings)."""
        return {"topology": asdict(self.topology)}

    def execute(self, **kwargs):
        """Submit the job and follow it to its end, printing its summary (or raising its first failure:
        recoverable when the job was preempted, timed out or lost a node or a worker)."""
        ctx = FlyteContextManager.current_context()
        # flytekit serialises the template before submitting it and insists on an image; a Slurm job runs
        # in the environment its set-up lines activate, so flytekit's default image name only fills the field.
        settings = ctx.serialization_settings or SerializationSettings(ImageConfig.auto_default_image())
        if on_ctrl_c not in FlyteContextManager.signal_handlers:
            FlyteContextManager.add_signal_handler(on_ctrl_c)
        try:
            with FlyteContextManager.with_context(ctx.with_serialization_settings(settings)):
                outputs = super().execute(**kwargs)
        except FlyteUserException:
            job_id = self.resource_meta.job_id if self.resource_meta else ""
            end = CONNECTOR.last.pop(job_id, None)
            if end is None:  # not the job's verdict (flytekit's own error): as it is
                raise
            if end.preempted_by:  # saved what it reached: as the elastic task ends a preempted attempt
                stop_if_preempted(kwargs["checkpoint_root"], self.topology.store_secret, end.preempted_by)
            if end.outcome is Outcome.RETRYABLE:  # timed out, node or worker lost: retries apply
                raise FlyteRecoverableException(end.message) from None
            raise FlyteUserException(end.message) from None
        finally:
            CONNECTOR.following = None
        print(CONNECTOR.last.pop(self.resource_meta.job_id).message, flush=True)
        return outputs


def on_ctrl_c(signum: int, frame: Any) -> None:
    """Ctrl-C in a local run: cancel the job being followed, if any, say so and exit (130 for SIGINT)
    without a traceback. Registered with flytekit's signal handlers before the job is submitted: flytekit
    adds the task's own handler only once ``create`` has returned, and with no handler a Ctrl-C between
    sbatch's answer and then exits 1 and leaves the job running; this one runs first and exits, so
    flytekit's (which runs the async delete with asyncio.run inside the running event loop, and raises
    before the delete starts, flytekit 1.16) never runs."""
    if CONNECTOR.following is not None:
        print(CONNECTOR.cancel_now(CONNECTOR.following), file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


CONNECTOR = SlurmTrainConnector()
ConnectorRegistry.register(CONNECTOR)
