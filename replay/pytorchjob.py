"""The PyTorchJob Flyte creates for a multi-node ``pytorch`` task, and the worker pods the operator starts.

Flyte side, followed from flyteorg/flyte (flyteplugins, read at commits 007d2e67 and 060e1319, the code
behind flyte backend v1.16):
- go/tasks/plugins/k8s/kfoperators/pytorch/pytorch.go, BuildResource: task type version 1 reads
  ``kubeflow.DistributedPyTorchTrainingTask`` from the template's custom; worker replica spec from
  common.ToReplicaSpecWithOverrides; ParseElasticConfig -> elasticPolicy {minReplicas, maxReplicas,
  rdzvBackend, nProcPerNode, maxRestarts}; with an elastic policy the Master replica is deleted.
- go/tasks/plugins/k8s/kfoperators/common/common_operator.go: the primary container is renamed
  ``pytorch``; restartPolicy from ParseRestartPolicy (unset = Never); runPolicy from ParseRunPolicy
  (cleanPodPolicy always set, backoffLimit / activeDeadlineSeconds / ttlSecondsAfterFinished when non-zero).
- go/tasks/pluginmachinery/flytek8s: the container gets the rendered args, the template env plus the
  execution env (see replay.pod.flyte_env), requests and limits (an unset limit takes the request), the
  shared-memory volume from extended resources, and for a GPU accelerator a required node affinity plus a
  toleration on the GpuDeviceNodeLabel (pod_helper.go, ApplyGPUNodeSelectors).

Operator side, followed from kubeflow/training-operator v1.9.0, pkg/controller.v1/pytorch/elastic.go and
envvar.go: every container gets PYTHONUNBUFFERED (set to "0" in that source; any non-empty value makes
Python unbuffered), then the elastic env PET_RDZV_ENDPOINT=<job>-worker-0:<port> (port of the container
port named pytorchjob-port, defaulted to 23456), PET_RDZV_BACKEND, PET_NNODES ("min:max"),
PET_MAX_RESTARTS, PET_NPROC_PER_NODE, and PET_RDZV_ID / PET_RDZV_CONF / PET_STANDALONE when set.
"""

from __future__ import annotations

import copy
import re
import socket

from flyteidl.core import tasks_pb2
from google.protobuf.json_format import MessageToDict

from replay.pod import PodSpec

DEFAULT_PORT, PORT_NAME, CONTAINER = 23456, "pytorchjob-port", "pytorch"
_RESOURCE_NAMES = {tasks_pb2.Resources.CPU: "cpu", tasks_pb2.Resources.MEMORY: "memory",
                   tasks_pb2.Resources.GPU: "nvidia.com/gpu", tasks_pb2.Resources.EPHEMERAL_STORAGE:
                   "ephemeral-storage"}
_CLEAN_POD = {"CLEANPOD_POLICY_NONE": "None", "CLEANPOD_POLICY_ALL": "All",
              "CLEANPOD_POLICY_RUNNING": "Running"}
_RESTART = {"RESTART_POLICY_NEVER": "Never", "RESTART_POLICY_ON_FAILURE": "OnFailure",
            "RESTART_POLICY_ALWAYS": "Always"}
ACCELERATOR_LABEL = "k8s.amazonaws.com/accelerator"  # flytek8s default GpuDeviceNodeLabel


def job_name(generated_name: str) -> str:
    """A DNS-1123 name, as Flyte derives the object name from the task execution's generated name."""
    return re.sub(r"[^a-z0-9-]", "-", generated_name.lower()).strip("-")[:63]


def _resources(container: tasks_pb2.Container) -> dict:
    requests = {_RESOURCE_NAMES[e.name]: e.value for e in container.resources.requests}
    limits = {_RESOURCE_NAMES[e.name]: e.value for e in container.resources.limits}
    limits = {**requests, **limits}  # flytek8s: an unset limit takes the request
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _pod_spec(template: tasks_pb2.TaskTemplate, args: list[str], env: dict[str, str]) -> dict:
    """The worker pod spec: one ``pytorch`` container plus the /dev/shm volume and GPU placement."""
    container = {"name": CONTAINER, "image": template.container.image, "args": list(args),
                 "env": [{"name": k, "value": v} for k, v in env.items()],
                 "resources": _resources(template.container)}
    pod: dict = {"containers": [container], "restartPolicy": "Never"}
    shm = template.extended_resources.shared_memory
    if template.extended_resources.HasField("shared_memory"):
        empty_dir = {"medium": "Memory", **({"sizeLimit": shm.size_limit} if shm.size_limit else {})}
        pod["volumes"] = [{"name": shm.mount_name, "emptyDir": empty_dir}]
        container["volumeMounts"] = [{"name": shm.mount_name, "mountPath": shm.mount_path}]
    device = template.extended_resources.gpu_accelerator.device
    if device and "nvidia.com/gpu" in container["resources"].get("limits", {}):  # ApplyGPUNodeSelectors
        term = {"matchExpressions": [{"key": ACCELERATOR_LABEL, "operator": "In", "values": [device]}]}
        pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}}
        pod["tolerations"] = [{"key": ACCELERATOR_LABEL, "operator": "Equal", "value": device,
                               "effect": "NoSchedule"}]
    return pod


def build_job(template: tasks_pb2.TaskTemplate, name: str, namespace: str, args: list[str],
              env: dict[str, str]) -> dict:
    """The PyTorchJob (kubeflow.org/v1) Flyte's pytorch plugin posts for ``template``, workers only."""
    if template.type != "pytorch" or template.task_type_version != 1:
        raise ValueError(f"{template.id.name}: not a v1 pytorch task (type {template.type!r})")
    custom = MessageToDict(template.custom)
    workers, elastic = custom.get("workerReplicas", {}), custom.get("elasticConfig")
    common = workers.get("common", workers)  # the deprecated flat fields when no common spec is set
    replicas = int(common.get("replicas", 0))
    if replicas <= 0:
        raise ValueError("number of workers must be greater than 0")
    pod = _pod_spec(template, args, env)
    if common.get("image"):
        pod["containers"][0]["image"] = common["image"]
    restart = _RESTART[common.get("restartPolicy", "RESTART_POLICY_NEVER")]
    worker = {"replicas": replicas, "restartPolicy": restart, "template": {"spec": pod}}
    spec: dict = {"pytorchReplicaSpecs": {"Worker": worker},
                  "runPolicy": _run_policy(custom.get("runPolicy"))}
    if elastic is None:  # not replayed: without an elastic policy Flyte also creates a Master replica
        raise ValueError(f"{template.id.name}: only elastic PyTorchJobs are replayed")
    spec["elasticPolicy"] = {"minReplicas": int(elastic.get("minReplicas", 0)),
                             "maxReplicas": int(elastic.get("maxReplicas", 0)),
                             "rdzvBackend": elastic.get("rdzvBackend", ""),
                             "nProcPerNode": int(elastic.get("nprocPerNode", 0)),
                             "maxRestarts": int(elastic.get("maxRestarts", 0))}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def _run_policy(policy: dict | None) -> dict:
    policy = policy or {}
    out: dict = {"cleanPodPolicy": _CLEAN_POD[policy.get("cleanPodPolicy", "CLEANPOD_POLICY_NONE")]}
    for key in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished"):  # only when non-zero
        if int(policy.get(key, 0)):
            out[key] = int(policy[key])
    return out


def operator_pods(job: dict) -> list[PodSpec]:
    """The worker pods the training operator creates: the manifest's container plus the operator's env."""
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    elastic, name = job["spec"]["elasticPolicy"], job["metadata"]["name"]
    container = worker["template"]["spec"]["containers"][0]
    port = next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == PORT_NAME),
                DEFAULT_PORT)  # the operator's defaulting adds pytorchjob-port 23456 when missing
    host, port = elastic.get("rdzvHost", f"{name}-worker-0"), elastic.get("rdzvPort", port)
    added = {"PYTHONUNBUFFERED": "0",
             "PET_RDZV_ENDPOINT": f"{host}:{port}",
             "PET_RDZV_BACKEND": elastic.get("rdzvBackend") or "c10d",
             "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
             "PET_MAX_RESTARTS": str(elastic["maxRestarts"]),
             "PET_NPROC_PER_NODE": str(elastic["nProcPerNode"])}
    if "rdzvId" in elastic:
        added["PET_RDZV_ID"] = elastic["rdzvId"]
    if elastic.get("rdzvConf"):
        added["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])
    if elastic.get("standalone"):
        added["PET_STANDALONE"] = ""
    env = {e["name"]: e["value"] for e in container.get("env", [])} | added
    command = list(container.get("command", []))
    return [PodSpec(f"{name}-worker-{i}", command + list(container["args"]), copy.deepcopy(env))
            for i in range(worker["replicas"])]


def loopback(pods: list[PodSpec], job: dict) -> list[PodSpec]:
    """The pods with the rendezvous host ``<job>-worker-0`` (a Service on a cluster) as 127.0.0.1 and a
    free port: every other byte of command, args and env is the manifest's."""
    host = f"{job['metadata']['name']}-worker-0"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for pod in pods:
        endpoint_host = pod.env["PET_RDZV_ENDPOINT"].rsplit(":", 1)[0]
        if endpoint_host != host:
            raise ValueError(f"rendezvous endpoint {pod.env['PET_RDZV_ENDPOINT']} is not on {host}")
        pod.env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{port}"
    return pods
