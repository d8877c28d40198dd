"""What the cluster receives: `pyflyte package` of every entity, and the train task a launch produces.

One node -> a plain pod with shared memory; several -> an elastic PyTorchJob, checked against the
Kubeflow training operator's CRD schema (../shared/reference beside the repository).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from crd_schema import load_crd_schema, schema_errors  # noqa: I001  (a module beside this file)
from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.models.task import Resources, TaskTemplate
from flytekit.tools.module_loader import load_object_from_module
from flytekit.types.directory import FlyteDirectory
from google.protobuf.json_format import MessageToDict

from tasks.types import StagedDataset, Topology
from traincore.presets import preset
from workflows.pipeline import train_on_backend

ROOT = Path(__file__).resolve().parents[2]
CRD = (ROOT.parent / "shared" / "reference" / "kubeflow-training-operator-v1.9.0"
       / "kubeflow.org_pytorchjobs.yaml")
IMAGE = "ghcr.io/example/flyte-torch-pipeline:test"
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
        "tasks.plan.plan_run", "tasks.stage.stage_dataset", "tasks.train.train-1x2",
        "tasks.export.export_model", "tasks.evaluate.evaluate_model", "tasks.promote.promotion_gate",
        "workflows.pipeline.train_on_backend")}
    expected |= {"WorkflowSpec:workflows.pipeline.training_pipeline",
                 "WorkflowSpec:workflows.schedules.retrain_and_promote",
                 "LaunchPlan:scheduled_retraining", "LaunchPlan:workflows.pipeline.training_pipeline"}
    assert expected <= set(package)


def test_packaged_train_task_is_a_plain_pod_with_shared_memory(package):
    template = package["TaskSpec:tasks.train.train-1x2"].template
    assert template.type == "python-task" and not MessageToDict(template.custom)
    assert MessageToDict(template.extended_resources)["sharedMemory"] == SHM
    assert not template.k8s_pod.ListFields()  # no deprecated pod-template volume for /dev/shm
    args = list(template.container.args)
    assert args[args.index("--resolver") + 1] == "tasks.train.elastic_task_resolver"
    assert template.metadata.retries.retries == 3 and template.container.image == IMAGE


def test_packaged_staging_is_cached_by_format_version(package):
    from traincore.data import FORMAT_VERSION

    metadata = package["TaskSpec:tasks.stage.stage_dataset"].template.metadata
    assert metadata.discoverable and metadata.discovery_version == f"staging-format-{FORMAT_VERSION}"


def compile_train(topology: Topology) -> TaskTemplate:
    """Run the launching @dynamic as the cluster would and return the train task it emits."""
    settings = SerializationSettings(image_config=ImageConfig(default_image=Image(name="default",
                                                                                  fqn=IMAGE.split(":")[0],
                                                                                  tag="test")),
                                     project="flytesnacks", domain="development", version="v1", env={})
    dataset = StagedDataset(directory=FlyteDirectory("s3://bucket/staged"), source="digits",
                            classes=list("0123456789"), shape=[1, 32, 32],
                            counts={"train": 1437, "val": 180, "test": 180}, format_version=1)
    inputs = {"config": preset("digits"), "dataset": dataset, "topology": topology, "checkpoint_uri": "s3://bucket/run"}
    train_on_backend._wf = None  # flytekit compiles a dynamic once per process (a pod runs one); start afresh
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_serialization_settings(settings)) as ctx:
        state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(state)) as ctx:
            literals = TypeEngine.dict_to_literal_map(ctx, inputs, train_on_backend.python_interface.inputs)
            spec = train_on_backend.dispatch_execute(ctx, literals)
    (template,) = [t for t in spec.tasks if t.id.name.startswith("tasks.train.")]
    return template


def pytorch_job(template: TaskTemplate) -> dict:
    """The PyTorchJob Flyte's kfoperators plugin builds from an elastic task template (workers only)."""
    custom, container = template.custom, template.container
    names = {ResourceName.CPU: "cpu", ResourceName.MEMORY: "memory", ResourceName.GPU: "nvidia.com/gpu"}
    resources = {
        kind: {names[entry.name]: entry.value for entry in entries}
        for kind, entries in (("requests", container.resources.requests),
                              ("limits", container.resources.limits))
        if entries}
    elastic = custom["elasticConfig"]
    pod = {"containers": [{"name": "pytorch", "image": container.image, "args": list(container.args),
                           "resources": resources,
                           "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}],
           "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}]}
    accelerator = template.extended_resources.gpu_accelerator.device
    if accelerator:
        pod["nodeSelector"] = {"k8s.amazonaws.com/accelerator": accelerator}
    clean = {"CLEANPOD_POLICY_NONE": "None", "CLEANPOD_POLICY_ALL": "All",
             "CLEANPOD_POLICY_RUNNING": "Running"}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "f-train"}, "spec": {
        "elasticPolicy": {"rdzvBackend": elastic["rdzvBackend"], "minReplicas": elastic["minReplicas"],
                          "maxReplicas": elastic["maxReplicas"], "nProcPerNode": elastic["nprocPerNode"],
                          "maxRestarts": elastic.get("maxRestarts", 0)},
        "runPolicy": {"cleanPodPolicy": clean[custom.get("runPolicy", {}).get("cleanPodPolicy",
                                                                              "CLEANPOD_POLICY_NONE")]},
        "pytorchReplicaSpecs": {"Worker": {"replicas": custom["workerReplicas"]["replicas"],
                                           "restartPolicy": "Never", "template": {"spec": pod}}}}}


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
    assert requests == {ResourceName.CPU: "8", ResourceName.MEMORY: "24Gi", ResourceName.GPU: "4"}
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


def test_pytorch_job_conforms_to_the_training_operator_crd():
    if not CRD.is_file():
        missing = f"CRD schema not found at {CRD} (shared/ beside the clone)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}: CI must validate against it")
        pytest.skip(missing)
    schema = load_crd_schema(CRD)
    job = pytorch_job(compile_train(Topology(backend="kubernetes", nnodes=3, nproc_per_node=2,
                                             gpus_per_node=2, accelerator="nvidia-l4", max_restarts=0)))
    assert schema_errors(job, schema) == []
    assert job["spec"]["elasticPolicy"]["nProcPerNode"] == 2
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"][
        "requests"]["nvidia.com/gpu"] == "2"
    broken = pytorch_job(compile_train(Topology(backend="kubernetes", nnodes=2)))
    broken["spec"]["elasticPolicy"]["nprocPerNode"] = 2  # Flyte's spelling, not the CRD's
    broken["spec"]["runPolicy"]["cleanPodPolicy"] = 1
    assert len(schema_errors(broken, schema)) == 2
