"""What the cluster receives: `pyflyte package` of every entity, and the train task a launch produces.

One node -> a plain pod with shared memory; several -> an elastic PyTorchJob (its manifest is checked against
the training operator's CRD in tests/replay/test_pytorchjob.py).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from dynamic_compile import IMAGE, compile_dynamic, compile_train  # noqa: I001  (a module beside this file)
from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flytekit.models.task import Resources
from flytekit.tools.module_loader import load_object_from_module
from google.protobuf.json_format import MessageToDict

from tasks.types import NodeResources, Topology
from traincore.data import NODE_CACHE_ENV

ROOT = Path(__file__).resolve().parents[2]
ResourceName = Resources.ResourceName
SHM = {"mountPath": "/dev/shm", "mountName": "flyte-shared-memory"}


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> dict[str, object]:
    """Every serialised entity of `pyflyte --pkgs workflows package`, by kind and name."""
    out = tmp_path_factory.mktemp("package") / "flyte-package.tgz"
    subprocess.run([str(Path(sys.executable).parent / "pyflyte"), "--pkgs", "workflows", "package",
                    "--image", IMAGE, "--output", str(out), "--force"],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    entities: dict[str, object] = {}
    with tarfile.open(out) as archive:
        for member in archive.getmembers():
            data = archive.extractfile(member).read()
            kind = {"1.pb": task_pb2.TaskSpec, "2.pb": workflow_pb2.WorkflowSpec,
                    "3.pb": launch_plan_pb2.LaunchPlan}[member.name.rsplit("_", 1)[1]]
            entity = kind.FromString(data)
            name = entity.template.id.name if kind is not launch_plan_pb2.LaunchPlan else entity.id.name
            entities[f"{kind.__name__}:{name}"] = entity
    return entities


def test_package_holds_every_task_workflow_and_launch_plan(package):
    expected = {f"TaskSpec:{name}" for name in (
        "tasks.plan.plan_run", "tasks.stage.stage_dataset", "tasks.train.train-local-1x2",
        "tasks.export.export_model", "tasks.evaluate.evaluate_model", "tasks.promote.promotion_gate",
        "tasks.promote.warm_start_overrides", "tasks.tuning.plan_search", "tasks.tuning.rung_record",
        "tasks.tuning.finish_search", "tasks.tuning.search_report",
        "workflows.tuning.run_rung",
        "workflows.pipeline.train_on_backend")}
    expected |= {"WorkflowSpec:workflows.pipeline.training_pipeline",
                 "WorkflowSpec:workflows.schedules.retrain_and_promote",
                 "WorkflowSpec:workflows.tuning.tune_pipeline",
                 "LaunchPlan:scheduled_retraining", "LaunchPlan:scheduled_gpu_retraining",
                 "LaunchPlan:workflows.pipeline.training_pipeline"}
    assert expected <= set(package)


def test_packaged_train_task_is_a_plain_pod_with_shared_memory(package):
    template = package["TaskSpec:tasks.train.train-local-1x2"].template
    assert template.type == "python-task" and not MessageToDict(template.custom)
    assert MessageToDict(template.extended_resources)["sharedMemory"] == SHM
    assert not template.k8s_pod.ListFields()  # no deprecated pod-template volume for /dev/shm
    args = list(template.container.args)
    assert args[args.index("--resolver") + 1] == "tasks.launch.train_task_resolver"
    assert template.metadata.retries.retries == 3 and template.container.image == IMAGE


def test_packaged_staging_is_cached_by_format_version(package):
    from traincore.data.manifest import FORMAT_VERSION

    metadata = package["TaskSpec:tasks.stage.stage_dataset"].template.metadata
    assert metadata.discoverable and metadata.discovery_version == f"staging-format-{FORMAT_VERSION}"


def test_the_resources_input_sizes_each_train_node_and_its_stream_cache():
    sized = NodeResources(cpu="16", mem="120Gi", ephemeral_storage="202Gi")
    default = Topology(backend="kubernetes", nnodes=2, nproc_per_node=4)
    template = compile_train(Topology(backend="kubernetes", nnodes=2, nproc_per_node=4, resources=sized))
    requests = {entry.name: entry.value for entry in template.container.resources.requests}
    assert requests == {ResourceName.CPU: "16", ResourceName.MEMORY: "120Gi",
                        ResourceName.EPHEMERAL_STORAGE: "202Gi"}
    assert template.container.env[NODE_CACHE_ENV] == str(200 << 30)
    assert template.id.name != compile_train(default).id.name  # another template, another task ID


def test_multi_node_launch_becomes_an_elastic_pytorch_job_with_the_requested_gpus():
    topology = Topology(backend="kubernetes", nnodes=2, nproc_per_node=4, gpus_per_node=4,
                        accelerator="nvidia-tesla-a100", rdzv_timeout_s=1200)
    template = compile_train(topology)
    assert template.type == "pytorch"
    assert template.custom["elasticConfig"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2,
                                                "nprocPerNode": 4}
    assert template.custom["workerReplicas"] == {"replicas": 2}
    assert template.custom["runPolicy"] == {"cleanPodPolicy": "CLEANPOD_POLICY_ALL"}
    requests = {entry.name: entry.value for entry in template.container.resources.requests}
    # The node's disk: the stream cache (8 GiB by default) and 2 GiB more; the cache is told its size.
    assert requests == {ResourceName.CPU: "8", ResourceName.MEMORY: "24Gi", ResourceName.GPU: "4",
                        ResourceName.EPHEMERAL_STORAGE: "10Gi"}
    assert template.container.env[NODE_CACHE_ENV] == str(8 << 30)
    assert template.extended_resources.gpu_accelerator.device == "nvidia-tesla-a100"
    assert MessageToDict(template.extended_resources)["sharedMemory"] == SHM
    # The pod rebuilds exactly this task from its command line.
    args = template.container.args
    resolver = load_object_from_module(args[args.index("--resolver") + 1])
    rebuilt = resolver.load_task(args[args.index("--") + 1:])
    assert (rebuilt.min_nodes, rebuilt.task_config.nproc_per_node) == (2, 4)
    assert rebuilt.task_config.rdzv_configs["read_timeout"] == 1200


def test_single_node_launch_stays_a_plain_pod():
    template = compile_train(Topology(backend="kubernetes", nproc_per_node=3))
    assert template.type == "python-task" and not template.custom
    assert not template.extended_resources.gpu_accelerator.device


def test_preemptible_capacity_puts_the_train_node_on_preemptible_capacity():
    topology = Topology(backend="kubernetes", nnodes=2, nproc_per_node=1)
    (asked,) = [node for node in compile_dynamic(topology, capacity="preemptible").nodes
                if node.task_node and node.task_node.reference_id.name.startswith("tasks.train.")]
    assert asked.metadata.interruptible is True
    (default,) = compile_dynamic(topology).nodes
    assert not default.metadata.interruptible
