"""Which train task a launch gets, and how a pod or a Slurm job rebuilds the task that trains.

Why a task per Topology and a resolver: flytekit fixes an Elastic task's type ("python-task" for one node,
"pytorch" for a PyTorchJob) and its node range when the task object is built, and a pod rebuilds its task
from code; ``with_overrides(task_config=...)`` changes neither (it serialises a one-node "python-task"
with a multi-node custom). So :func:`train_task_for` builds one task per topology and backend, and the
command that runs it carries the task key for :data:`train_task_resolver` to rebuild it. A command runs
where training runs, a pod or a Slurm job's node, so the resolver rebuilds the elastic train task: on
Slurm, the task a launch gets is only submitted (tasks/slurm/connector.py).
"""

from __future__ import annotations

import functools
import json

from flytekit.core.base_task import TaskResolverMixin

from tasks.backends import SLURM_BACKEND
from tasks.slurm.connector import SlurmTrainTask
from tasks.train import ElasticTrainTask, task_key
from tasks.types import Topology
from traincore.config import Config

TrainTask = ElasticTrainTask | SlurmTrainTask
TASK_CLASSES: dict[str, type[TrainTask]] = {
    "local": ElasticTrainTask, "kubernetes": ElasticTrainTask, SLURM_BACKEND: SlurmTrainTask}


class TrainTaskResolver(TaskResolverMixin):
    """Rebuilds a topology's train task in a pod or a Slurm job from the arguments its command carries."""

    @property
    def location(self) -> str:
        return f"{__name__}.train_task_resolver"

    def name(self) -> str:
        return "TrainTaskResolver"

    def loader_args(self, settings, t: TrainTask) -> list[str]:
        return ["task-key", task_key(t.topology, t.wandb_secret)]

    def load_task(self, loader_args: list[str]) -> ElasticTrainTask:
        """The elastic train task of the key's topology, whatever its backend: the Slurm task's command runs
        on the job's nodes, where it trains as the elastic task does."""
        return _task_from_key(loader_args[1], ElasticTrainTask)

    def get_all_tasks(self) -> list[TrainTask]:
        return [train_task]


train_task_resolver = TrainTaskResolver()


def train_task_for(topology: Topology, config: Config) -> TrainTask:
    """The train task for ``topology.backend`` (checked by plan_run) and the run's W&B mode."""
    assert topology.backend in TASK_CLASSES, f"plan_run admits only known backends, got {topology.backend!r}"
    return _task_from_key(task_key(topology, config.telemetry.wandb_mode == "online"),
                          TASK_CLASSES[topology.backend])


@functools.cache
def _task_from_key(key: str, task_class: type[TrainTask]) -> TrainTask:
    """One task object per key and class: on the elastic backends, the task a launch gets is the one its
    command rebuilds."""
    spec = json.loads(key)
    task = task_class(Topology.from_dict(spec["topology"]), spec["wandb_secret"])
    # Set after construction: inside a @dynamic, flytekit would replace a resolver passed to __init__ with
    # the compilation context's default one, which rebuilds the module's default topology instead.
    task.set_resolver(train_task_resolver)
    return task


# The registered default (one node, two processes): `pyflyte package` serialises it, and it can be run alone.
train_task = train_task_for(Topology(), Config())
