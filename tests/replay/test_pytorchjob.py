"""The PyTorchJob the replay derives from a 2-node train task: valid against the operator's CRD, and the
worker pods started from it carry the operator's elastic env with nothing else changed."""

from __future__ import annotations

import importlib.util
import os

import pytest
from flyteidl.core import tasks_pb2
from replay_helpers import ROOT  # noqa: I001  (a module beside this file)

from replay import pytorchjob
from replay.pod import flyte_env, render_args
from replay.store import Execution, Store

CRD = (ROOT.parent / "shared" / "reference" / "kubeflow-training-operator-v1.9.0"
       / "kubeflow.org_pytorchjobs.yaml")


def _beside_the_task_tests(name: str):
    """A helper module of tests/tasks/, loaded by path (test folders are not packages)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "tasks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


crd_schema = _beside_the_task_tests("crd_schema")
dynamic_compile = _beside_the_task_tests("dynamic_compile")


def two_node_train_task(nproc: int = 2, gpus: int = 2, min_nnodes: int = 0,
                        max_restarts: int = 0) -> tasks_pb2.TaskTemplate:
    """The train task the registered @dynamic emits for a 2-node Kubernetes launch (``min_nnodes`` 1: the
    range 1:2), as the cluster gets it."""
    from tasks.types import Topology

    topology = Topology(backend="kubernetes", nnodes=2, min_nnodes=min_nnodes, nproc_per_node=nproc,
                        gpus_per_node=gpus, accelerator="nvidia-l4" if gpus else "",
                        max_restarts=max_restarts)
    return dynamic_compile.compile_train(topology).to_flyte_idl()


def manifest(template: tasks_pb2.TaskTemplate, tmp_path) -> dict:
    execution = Execution("flytesnacks", "development", "fabc", "workflows.pipeline.training_pipeline", "v1")
    paths = Store(str(tmp_path)).node_paths(execution, "n2-0-dn0")
    args = render_args(template.container.args, paths, code_location=None)
    name = pytorchjob.job_name(f"{execution.name}-n2-0-dn0-0")
    return pytorchjob.build_job(template, name, "flytesnacks-development", args,
                                flyte_env(template, execution, attempt=0))


@pytest.fixture(scope="module")
def schema() -> dict:
    if not CRD.is_file():
        missing = f"CRD schema not found at {CRD} (shared/ beside the clone)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}: CI must validate against it")
        pytest.skip(missing)
    return crd_schema.load_crd_schema(CRD)


def test_two_node_job_conforms_to_the_training_operator_crd(schema, tmp_path):
    job = manifest(two_node_train_task(), tmp_path)
    assert crd_schema.schema_errors(job, schema) == []
    spec = job["spec"]
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}  # Flyte drops the Master of an elastic job
    assert spec["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 2, "rdzvBackend": "c10d",
                                     "nProcPerNode": 2, "maxRestarts": 0}
    assert spec["runPolicy"] == {"cleanPodPolicy": "All"}
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert (worker["replicas"], worker["restartPolicy"]) == (2, "Never")
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "flyte-shared-memory", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert not any("{{" in arg for arg in container["args"])  # every propeller template was filled in
    assert pod["tolerations"][0]["value"] == "nvidia-l4"
    # The validator is live: Flyte's spelling of a field is not the CRD's, and the server would prune it.
    job["spec"]["elasticPolicy"]["nprocPerNode"] = 2
    assert len(crd_schema.schema_errors(job, schema)) == 1


def test_a_node_range_is_the_jobs_elastic_policy_and_its_pods_range(schema, tmp_path):
    job = manifest(two_node_train_task(nproc=1, gpus=0, min_nnodes=1, max_restarts=1), tmp_path)
    assert crd_schema.schema_errors(job, schema) == []
    spec = job["spec"]
    assert spec["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 2, "rdzvBackend": "c10d",
                                     "nProcPerNode": 1, "maxRestarts": 1}
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2  # the most; the operator starts them all
    # A lost node's pod is made again instead of failing the job; a failing container restarts at most
    # max_restarts times
    assert (worker["restartPolicy"], spec["runPolicy"]["backoffLimit"]) == ("OnFailure", 1)
    fixed = manifest(two_node_train_task(nproc=1, gpus=0, max_restarts=1), tmp_path)["spec"]
    assert fixed["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "Never"
    pods = pytorchjob.operator_pods(job)
    assert {pod.env["PET_NNODES"] for pod in pods} == {"1:2"}
    container = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a returning pod's agent finds the store


def test_worker_pods_are_the_manifest_plus_the_operators_elastic_env(tmp_path):
    job = manifest(two_node_train_task(nproc=1, gpus=0), tmp_path)
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    pods = pytorchjob.operator_pods(job)
    assert [p.name for p in pods] == [f"{job['metadata']['name']}-worker-{i}" for i in (0, 1)]
    declared = {e["name"]: e["value"] for e in container["env"]}
    for pod in pods:
        assert pod.args == container["args"]
        assert {k: pod.env[k] for k in declared} == declared
        assert {k: v for k, v in pod.env.items() if k not in declared} == {
            "PYTHONUNBUFFERED": "0", "PET_RDZV_ENDPOINT": f"{job['metadata']['name']}-worker-0:23456",
            "PET_RDZV_BACKEND": "c10d", "PET_NNODES": "2:2", "PET_MAX_RESTARTS": "0",
            "PET_NPROC_PER_NODE": "1"}
    local = pytorchjob.loopback(pytorchjob.operator_pods(job), job)
    endpoints = {p.env["PET_RDZV_ENDPOINT"] for p in local}
    assert len(endpoints) == 1 and endpoints.pop().startswith("127.0.0.1:")
    assert [p.args for p in local] == [p.args for p in pods]
