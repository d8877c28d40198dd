"""The Slurm backend's Flyte side: the train task type ``slurm_train`` and its connector.

Where the workflow runs (``pyflyte run`` here, or a connector service next to a Flyte cluster), the task is
not executed but submitted: the connector writes a batch script (tasks/slurm/job.py), submits it over SSH
(tasks/slurm/client.py), polls the job and cancels it on abort. Inside the job, ``pyflyte-execute`` runs
the task's command on every node, and the task resolver (tasks/launch.py) rebuilds from it the elastic
train task of the same topology: torch elastic agents that meet on the first node, checkpoints in the
durable root, rank 0's result as the output.

The task's inputs and outputs live under the execution's output prefix, which the cluster must reach: a
shared filesystem for a local run, an object store the cluster can read and write for a remote one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from flyteidl.core.execution_pb2 import TaskExecution
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.core.context_manager import FlyteContextManager, SecretsManager
from flytekit.core.python_function_task import PythonFunctionTask
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
from flytekit.models.task import TaskTemplate

from tasks.slurm.client import SlurmClient
from tasks.slurm.job import batch_script, sbatch_args, task_error
from tasks.slurm.ssh import SlurmConnectionError, SlurmTarget
from tasks.slurm.states import JobInfo, Outcome
from tasks.train import TopologyTaskMixin, task_settings, train_function
from tasks.types import Topology

SLURM_TASK_TYPE = "slurm_train"
JOBS_DIR = ".flyte-torch-pipeline/slurm-jobs"  # on the login node, relative to the user's home
SSH_KEY_SECRET = ("slurm", "ssh_key")  # optional Flyte secret (group, key): the login node's private key
STDERR_TAIL_LINES = 40  # of a failed job's stderr (and of a finished job's stdout) in its message
LAST_KEPT = 256  # finished jobs whose outcome the connector remembers (a local run reads its own)
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


def ssh_target(host: str) -> SlurmTarget:
    """How to reach ``host``: ~/.ssh/config and ssh-agent, or only the private key of the Flyte secret
    ``slurm/ssh_key`` when it is mounted as a file (a connector pod's usual way to hold a key)."""
    key_file = SecretsManager().get_secrets_file(*SSH_KEY_SECRET)
    return SlurmTarget(host=host, key_file=key_file if os.path.isfile(key_file) else None)


class SlurmTrainConnector(AsyncConnectorBase):
    """create = sbatch, get = job state (+ the job's error on failure), delete = scancel."""

    name = "flyte-torch-pipeline Slurm train connector"

    def __init__(self) -> None:
        # Version 1: what the task template carries (kfpytorch's Elastic task sets task_type_version=1).
        super().__init__(task_type_name=SLURM_TASK_TYPE, task_type_version=1, metadata_type=SlurmJobMeta)
        self._clients: dict[str, SlurmClient] = {}
        # job id -> final outcome and message: what a local run prints or raises once the job ended. A
        # local run takes its entry; a connector service never does, so only the newest LAST_KEPT are kept.
        self.last: dict[str, tuple[Outcome, str]] = {}

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
        """Write the batch script next to the job's logs on the login node and submit it."""
        topology = Topology.from_dict(task_template.custom["topology"])
        entrypoint = list(render_task_template(task_template, output_prefix).container.args)
        job_dir = f"{JOBS_DIR}/{output_prefix.rstrip('/').rsplit('/', 1)[-1] or 'job'}"
        script = batch_script(topology, entrypoint)
        job_id = await self._call(topology.slurm.target, "submit", script, job_dir, sbatch_args(topology))
        log.info("submitted Slurm job %s to %s (%d node(s))", job_id, topology.slurm.target, topology.nnodes)
        return SlurmJobMeta(job_id=job_id, target=topology.slurm.target, output_prefix=output_prefix)

    async def get(self, resource_meta: SlurmJobMeta, **kwargs: Any) -> Resource:
        """The job's Flyte phase; a failed job's message carries the task's error and its stderr's tail."""
        job: JobInfo = await self._call(resource_meta.target, "job", resource_meta.job_id)
        message = f"Slurm job {job.job_id} {job.state}" + (f" ({job.reason})" if job.reason else "")
        if job.outcome in (Outcome.FAILED, Outcome.RETRYABLE, Outcome.ABORTED):
            message = await self._failure_message(resource_meta, job, message)
        elif job.outcome is Outcome.SUCCEEDED and job.stdout_path:
            tail = await self._call(resource_meta.target, "tail", job.stdout_path, STDERR_TAIL_LINES)
            summary = [line for line in tail.splitlines() if line.startswith("train:")]  # rank 0's summary
            message = "\n".join([f"{message} on {job.node_count or '?'} node(s); log {job.stdout_path}",
                                  *summary])
        if job.finished:
            self.last[job.job_id] = (job.outcome, message)
            while len(self.last) > LAST_KEPT:
                del self.last[next(iter(self.last))]  # the oldest: dicts keep insertion order
        return Resource(phase=PHASES[job.outcome], message=message)

    async def _failure_message(self, meta: SlurmJobMeta, job: JobInfo, headline: str) -> str:
        parts = [f"{headline}, exit code {job.exit_code}"]
        error = task_error(meta.output_prefix)
        if error:
            parts.append(f"error: {error}")
        if job.stderr_path:
            tail = await self._call(meta.target, "tail", job.stderr_path, STDERR_TAIL_LINES)
            if tail.strip():
                parts.append(f"last lines of {job.stderr_path}:\n{tail.rstrip()}")
        return "\n".join(parts)

    async def delete(self, resource_meta: SlurmJobMeta, **kwargs: Any) -> None:
        """Cancel the job (a job that already ended is fine)."""
        await self._call(resource_meta.target, "cancel", resource_meta.job_id)


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
        """Submit the job and follow it to its end, printing its summary (or raising its error)."""
        ctx = FlyteContextManager.current_context()
        # flytekit serialises the template before submitting it and insists on an image; a Slurm job runs
        # in the environment its set-up lines activate, so flytekit's default image name only fills the field.
        settings = ctx.serialization_settings or SerializationSettings(ImageConfig.auto_default_image())
        try:
            with FlyteContextManager.with_context(ctx.with_serialization_settings(settings)):
                outputs = super().execute(**kwargs)
        except FlyteUserException as exc:
            job_id = self.resource_meta.job_id if self.resource_meta else ""
            outcome, _ = CONNECTOR.last.pop(job_id, (None, ""))
            if outcome is Outcome.RETRYABLE:  # preempted, node lost: Flyte's retries apply
                raise FlyteRecoverableException(str(exc)) from exc
            raise
        print(CONNECTOR.last.pop(self.resource_meta.job_id)[1], flush=True)
        return outputs


CONNECTOR = SlurmTrainConnector()
ConnectorRegistry.register(CONNECTOR)
