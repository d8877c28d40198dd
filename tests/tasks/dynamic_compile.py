"""The @dynamic tasks compiled as a cluster would run them: the train task template the launching one emits,
the map task and publish step of the staging."""

from __future__ import annotations

from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.models.task import TaskTemplate
from flytekit.types.directory import FlyteDirectory

from tasks.stage import stage_dataset
from tasks.types import NodeResources, StagedDataset, Topology
from traincore.config import DataConfig
from traincore.config.presets import preset
from traincore.data import source_fingerprint
from workflows.pipeline import train_on_backend

IMAGE = "ghcr.io/example/flyte-torch-pipeline:test"


SETTINGS = SerializationSettings(image_config=ImageConfig(default_image=Image(name="default",
                                                                              fqn=IMAGE.split(":")[0],
                                                                              tag="test")),
                                 project="flytesnacks", domain="development", version="v1", env={})


def compile_dynamic(topology: Topology, capacity: str = "on-demand"):
    """Run the launching @dynamic as the cluster would: the DynamicJobSpec (nodes and task templates)."""
    dataset = StagedDataset(directory=FlyteDirectory("s3://bucket/staged"), source="digits",
                            classes=list("0123456789"), shape=[1, 32, 32],
                            counts={"train": 1437, "val": 180, "test": 180}, format_version=1,
                            source_fingerprint="digits:sha256:" + "0" * 32)
    inputs = {"config": preset("digits"), "dataset": dataset, "topology": topology,
              "checkpoint_uri": "s3://bucket/run", "capacity": capacity}
    return run_dynamic(train_on_backend, inputs)


def run_dynamic(task, inputs: dict):
    """``task`` (a @dynamic) run on ``inputs`` as in a pod: the DynamicJobSpec it emits."""
    task._wf = None  # flytekit compiles a dynamic once per process (a pod runs one); start afresh
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_serialization_settings(SETTINGS)) as ctx:
        state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(state)) as ctx:
            literals = TypeEngine.dict_to_literal_map(ctx, inputs, task.python_interface.inputs)
            return task.dispatch_execute(ctx, literals)


def compile_train(topology: Topology) -> TaskTemplate:
    """Run the launching @dynamic as the cluster would and return the train task it emits."""
    (template,) = [t for t in compile_dynamic(topology).tasks if t.id.name.startswith("tasks.train.")]
    return template


def compile_stage(data: DataConfig, partitions: int, resources: NodeResources | None = None):
    """Run the staging @dynamic as the cluster would: the DynamicJobSpec of its map task and publish step."""
    inputs = {"data": data, "source_fingerprint": source_fingerprint(data), "partitions": partitions,
              "resources": resources}
    return run_dynamic(stage_dataset, inputs)
