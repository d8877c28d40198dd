"""Walk a workflow as propeller does: nodes in dependency order, bindings resolved from earlier outputs,
dynamic nodes expanded from their futures.pb (DynamicJobSpec), pytorch tasks run as a PyTorchJob, array
nodes (map tasks) as one pod per element; an execution stopped after a node (an abort), and one that
recovers an earlier execution's nodes that succeeded instead of running them (Flyte's recover)."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from flyteidl.core import dynamic_job_pb2, errors_pb2, literals_pb2, tasks_pb2, workflow_pb2

from replay import literals, pytorchjob
from replay.pod import PodResult, PodSpec, flyte_env, render_args, run_pods
from replay.store import ERROR, FUTURES, OUTPUTS, Execution, NodePaths, Store

IGNORE_OUTPUTS = "IgnoreOutputs received"  # flytekit's entrypoint logs this when a pod must not write outputs
# The element index propeller gives each pod of an array node, and the variable naming it (flytepropeller
# pkg/controller/nodes/array/execution_context.go).
ARRAY_INDEX = {"BATCH_JOB_ARRAY_INDEX_VAR_NAME": "FLYTE_K8S_ARRAY_INDEX"}


class NodeFailed(RuntimeError):
    """A node's pod(s) failed, or its outputs break what the cluster guarantees."""


class ExecutionAborted(RuntimeError):
    """The execution was stopped after the node ``Replay.abort_after`` names, as a user aborts one on a
    cluster between two nodes: what the nodes before it wrote stays in the store."""


@dataclass
class NodeTiming:
    node_id: str
    task: str
    wall_s: float
    pods: int
    writer: str = ""  # the pod that wrote outputs.pb (multi-pod jobs)
    recovered_from: str = ""  # the execution whose outputs of this node were reused (no pod ran)


@dataclass
class Replay:
    """One execution of one workflow against one store."""

    store: Store
    execution: Execution
    workdir: Path
    python_bin: Path
    code_location: str | None = None
    timeout_s: float = 1800
    echo: bool = False
    reschedule_s: float = 0.0  # until the operator's new pod for a lost one starts (restart policy OnFailure)
    attempt: int = 0  # FLYTE_ATTEMPT_NUMBER of every node run (a Flyte retry of one node: replay.retry)
    abort_after: str | None = None  # a node id (as in the timings): the execution stops once it succeeded
    recover: Execution | None = None  # an earlier execution of this launch: its succeeded nodes are reused
    workflows: dict[str, workflow_pb2.WorkflowTemplate] = field(default_factory=dict)  # sub-workflows
    timings: list[NodeTiming] = field(default_factory=list)
    node_outputs: dict[str, literals_pb2.LiteralMap] = field(default_factory=dict)

    def run_nodes(self, nodes, tasks: dict[str, tasks_pb2.TaskTemplate], outputs: dict,
                  prefix: str = "") -> dict[str, literals_pb2.LiteralMap]:
        """Run ``nodes`` in dependency order; ``outputs`` maps node id -> outputs and grows as they finish."""
        for node in dependency_order(nodes):
            outputs[node.id] = self.run_node(f"{prefix}{node.id}", node, tasks, outputs)
            if f"{prefix}{node.id}" == self.abort_after:
                raise ExecutionAborted(f"aborted after node {self.abort_after}, as --abort-after asked")
        return outputs

    def run_node(self, node_id: str, node, tasks: dict[str, tasks_pb2.TaskTemplate],
                 outputs: dict) -> literals_pb2.LiteralMap:
        """One node of any kind the replay runs, on its bound inputs: its outputs."""
        if node.WhichOneof("target") == "workflow_node":
            return self.run_subworkflow(node_id, node, tasks, outputs)
        if node.WhichOneof("target") == "array_node":
            return self.run_array(node_id, node, tasks, outputs)
        if node.WhichOneof("target") != "task_node":
            raise NotImplementedError(f"node {node.id}: only task, array and sub-workflow nodes are replayed")
        template = tasks[node.task_node.reference_id.name]
        if node.task_node.overrides.ListFields():  # propeller would merge these into the pod spec
            print(f"replay: warning: node {node.id} has task overrides, which are not replayed: "
                  f"{node.task_node.overrides}", flush=True)
        result = self.run_task(node_id, template, literals.bind_inputs(node.inputs, outputs))
        self.node_outputs[node_id] = result
        return result

    def run_subworkflow(self, node_id: str, node, tasks: dict[str, tasks_pb2.TaskTemplate],
                        outputs: dict) -> literals_pb2.LiteralMap:
        """A workflow called inside another (a sub-workflow of the same package): its nodes, named under
        ``node_id``, on the node's bound inputs; its outputs from its own bindings."""
        reference = node.workflow_node
        if reference.WhichOneof("reference") != "sub_workflow_ref":
            raise NotImplementedError(f"node {node_id}: a launch plan called as a node is not replayed")
        workflow = self.workflows[reference.sub_workflow_ref.name]
        inputs = literals.bind_inputs(node.inputs, outputs)
        inner = self.run_nodes(workflow.nodes, tasks, {literals.START_NODE: inputs}, prefix=f"{node_id}-0-")
        result = literals.bind_inputs(workflow.outputs, inner)
        self.node_outputs[node_id] = result
        return result

    def run_array(self, node_id: str, node, tasks: dict[str, tasks_pb2.TaskTemplate],
                  outputs: dict) -> literals_pb2.LiteralMap:
        """A map task as propeller's ArrayNode runs it: every element's pod side by side (up to the node's
        parallelism), each reading the node's whole inputs.pb and picking its element by the index in
        FLYTE_K8S_ARRAY_INDEX (as flytekit's pyflyte-map-execute does), each writing outputs.pb under
        ``<output prefix>/<index>``; the node's outputs are the elements' outputs gathered into lists."""
        array = node.array_node
        template = tasks[array.node.task_node.reference_id.name]
        recovered = self._recovered(node_id, template)
        if recovered is not None:
            self.node_outputs[node_id] = recovered
            return recovered
        inputs = literals.bind_inputs(node.inputs, outputs)
        mapped = [name for name, literal in inputs.literals.items()
                  if literal.HasField("collection") and name not in array.bound_inputs]
        size = len(inputs.literals[mapped[0]].collection.literals) if mapped else 0
        paths = self.store.node_paths(self.execution, node_id, self.attempt)
        self.store.write(paths.inputs, inputs.SerializeToString())
        env = flyte_env(template, self.execution, attempt=self.attempt)
        width = array.parallelism or size
        started = time.monotonic()
        for first in range(0, size, max(width, 1)):
            pods = [PodSpec(f"{self.execution.name}-{node_id}-{i}-{self.attempt}",
                            render_args(template.container.args, element_paths(paths, i), self.code_location),
                            {**env, **ARRAY_INDEX, "FLYTE_K8S_ARRAY_INDEX": str(i)})
                    for i in range(first, min(first + width, size))]
            self._run(node_id, pods)
        print(f"replay: node {node_id:<10} {template.id.name:<45} {size} pod(s) "
              f"{time.monotonic() - started:7.1f} s", flush=True)
        elements = []
        for i in range(size):
            element = element_paths(paths, i)
            self._raise_task_error(f"{node_id}[{i}]", element)
            elements.append(self._read_outputs(f"{node_id}[{i}]", template, element))
        self.timings.append(NodeTiming(node_id, template.id.name, time.monotonic() - started, size))
        gathered = literals_pb2.LiteralMap()
        for name in template.interface.outputs.variables:
            collection = gathered.literals[name].collection
            collection.literals.extend(element.literals[name] for element in elements)
        self.store.write(f"{paths.output_prefix}/{OUTPUTS}", gathered.SerializeToString())
        self.node_outputs[node_id] = gathered
        return gathered

    def run_task(self, node_id: str, template: tasks_pb2.TaskTemplate,
                 inputs: literals_pb2.LiteralMap) -> literals_pb2.LiteralMap:
        """One task node: write inputs.pb, start its pod(s), read back outputs.pb (or expand futures.pb)."""
        recovered = self._recovered(node_id, template)
        if recovered is not None:
            return recovered
        paths = self.store.node_paths(self.execution, node_id, self.attempt)
        self.store.write(paths.inputs, inputs.SerializeToString())
        args = render_args(template.container.args, paths, self.code_location)
        env = flyte_env(template, self.execution, attempt=self.attempt)
        started = time.monotonic()
        if template.type == "pytorch":
            results = self._run_pytorch_job(node_id, template, args, env)
        else:
            pod = PodSpec(f"{self.execution.name}-{node_id}-{self.attempt}", args, env)
            results = self._run(node_id, [pod])
        wall = time.monotonic() - started
        print(f"replay: node {node_id:<10} {template.id.name:<45} {len(results)} pod(s) {wall:7.1f} s",
              flush=True)
        self._raise_task_error(node_id, paths)  # the task's own error message beats any other verdict
        writer = rank0_writer(node_id, results) if template.type == "pytorch" else ""
        self.timings.append(NodeTiming(node_id, template.id.name, wall, len(results), writer))
        futures = f"{paths.output_prefix}/{FUTURES}"
        if self.store.exists(futures):
            spec = dynamic_job_pb2.DynamicJobSpec.FromString(self.store.read(futures))
            return self._run_dynamic(node_id, spec, paths)
        return self._read_outputs(node_id, template, paths)

    def _recovered(self, node_id: str, template: tasks_pb2.TaskTemplate) -> literals_pb2.LiteralMap | None:
        """Flyte's recovery (``recover``): a node that succeeded in the earlier execution is not run again;
        its inputs and outputs are copied to this execution's paths and the outputs, which name the earlier
        execution's data, are used as they are. A dynamic node's spec (futures.pb) is copied and its nodes
        recover one by one, so those that had not succeeded run now. None: the node runs."""
        found = self._succeeded_attempt(node_id) if self.recover else None
        if found is None:
            return None
        succeeded, written = found
        paths = self.store.node_paths(self.execution, node_id, self.attempt)
        self.store.copy(succeeded.inputs, paths.inputs)
        print(f"replay: node {node_id:<10} {template.id.name:<45} recovered from {self.recover.name}",
              flush=True)
        self.timings.append(NodeTiming(node_id, template.id.name, 0.0, 0, recovered_from=self.recover.name))
        data = self.store.read(f"{succeeded.output_prefix}/{written}")
        self.store.write(f"{paths.output_prefix}/{written}", data)
        if written == FUTURES:
            return self._run_dynamic(node_id, dynamic_job_pb2.DynamicJobSpec.FromString(data), paths)
        return literals_pb2.LiteralMap.FromString(data)

    def _succeeded_attempt(self, node_id: str) -> tuple[NodePaths, str] | None:
        """The earlier execution's attempt of ``node_id`` that succeeded, after any that failed (a retried
        node), and what it wrote: futures.pb (a dynamic node) or outputs.pb, with no error.pb. None if none
        did. A task without outputs leaves nothing that tells, and runs again."""
        for attempt in itertools.count():
            paths = self.store.node_paths(self.recover, node_id, attempt)
            if self.store.exists(f"{paths.output_prefix}/{ERROR}"):
                continue
            written = next((name for name in (FUTURES, OUTPUTS)
                            if self.store.exists(f"{paths.output_prefix}/{name}")), None)
            return None if written is None else (paths, written)

    def _run(self, node_id: str, pods: list[PodSpec], recreate: bool = False,
             first_serves: str | None = None) -> list[PodResult]:
        """``recreate``: a lost pod is made again, as the training operator does for workers whose restart
        policy is OnFailure; ``first_serves``: the rendezvous endpoint the first pod hosts
        (replay.pod.run_pods)."""
        results = run_pods(pods, self.workdir, self.python_bin, self.timeout_s, self.echo,
                           self.reschedule_s if recreate else None, first_serves)
        failed = [r for r in results if r.returncode != 0]
        if failed:
            tails = "\n".join(f"--- {r.name} (exit {r.returncode}, log {r.log}):\n{r.log_tail()}"
                              for r in failed)
            why = "failed"
            if any(r.timed_out for r in failed):
                why = (f"killed after {self.timeout_s:.0f} s (--node-timeout); the pods of a world that does "
                       "not form wait for the rendezvous timeout")
            raise NodeFailed(f"node {node_id}: {len(failed)} of {len(results)} pod(s) {why}\n{tails}")
        return results

    def _run_pytorch_job(self, node_id: str, template, args: list[str], env: dict) -> list[PodResult]:
        """The job's worker pods, started from the manifest the plugin would post (kept under jobs/)."""
        name = pytorchjob.job_name(f"{self.execution.name}-{node_id}-{self.attempt}")
        job = pytorchjob.build_job(template, name, f"{self.execution.project}-{self.execution.domain}",
                                   args, env)
        manifest = self.workdir / "jobs" / f"{name}.json"  # what would be posted to the API server
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps(job, indent=1))
        pods = pytorchjob.loopback(pytorchjob.operator_pods(job), job)
        # A job whose pods are made again (restart policy OnFailure: an elastic range) outlives a lost pod
        # only while worker-0, whose address the endpoint names, hosts the rendezvous store, as on a cluster.
        # Other jobs start their pods at once: which of them hosts the store matters to none of them.
        elastic = job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
        return self._run(node_id, pods, recreate=elastic,
                         first_serves=pods[0].env["PET_RDZV_ENDPOINT"] if elastic else None)

    def _raise_task_error(self, node_id: str, paths: NodePaths) -> None:
        """flytekit reports a task's exception in error.pb and exits 0; propeller fails the node on it."""
        error = f"{paths.output_prefix}/{ERROR}"
        if self.store.exists(error):
            document = errors_pb2.ErrorDocument.FromString(self.store.read(error))
            raise NodeFailed(f"node {node_id}: the task reported an error:\n{document.error.message}")

    def _read_outputs(self, node_id: str, template, paths: NodePaths) -> literals_pb2.LiteralMap:
        path = f"{paths.output_prefix}/{OUTPUTS}"
        if not self.store.exists(path):
            if not template.interface.outputs.variables:
                return literals_pb2.LiteralMap()
            raise NodeFailed(f"node {node_id}: no {OUTPUTS} under {paths.output_prefix}")
        outputs = literals_pb2.LiteralMap.FromString(self.store.read(path))
        if template.type == "pytorch":
            check_world(node_id, template, outputs)
        return outputs

    def _run_dynamic(self, node_id: str, spec: dynamic_job_pb2.DynamicJobSpec,
                     paths: NodePaths) -> literals_pb2.LiteralMap:
        """Run the DynamicJobSpec's nodes with its tasks, then the node's outputs from its bindings;
        propeller writes them to the dynamic node's output prefix."""
        tasks = {t.id.name: t for t in spec.tasks}
        inner = self.run_nodes(spec.nodes, tasks, {}, prefix=f"{node_id}-0-")
        outputs = literals.bind_inputs(spec.outputs, inner)
        self.store.write(f"{paths.output_prefix}/{OUTPUTS}", outputs.SerializeToString())
        return outputs


def element_paths(paths: NodePaths, index: int) -> NodePaths:
    """Where element ``index`` of an array node writes: its own output, raw-data and checkpoint prefixes
    under the node's; its inputs are the node's."""
    raw = f"{paths.raw_output_prefix}/{index}"
    return replace(paths, output_prefix=f"{paths.output_prefix}/{index}", raw_output_prefix=raw,
                   checkpoint_prefix=f"{raw}/_flytecheckpoints")


def rank0_writer(node_id: str, results: list[PodResult]) -> str:
    """The one pod that kept its outputs: every other pod of an elastic job ends in IgnoreOutputs."""
    writers = [r.name for r in results if IGNORE_OUTPUTS not in r.log.read_text(errors="replace")]
    if len(writers) != 1:
        raise NodeFailed(f"node {node_id}: {len(writers)} pod(s) kept their outputs ({writers}); exactly one "
                         "(the one holding global rank 0) may write outputs.pb")
    return writers[0]


def dependency_order(nodes) -> list:
    """Nodes sorted so that each comes after every node it depends on (upstream ids and bindings)."""
    by_id = {n.id: n for n in nodes}
    needs = {n.id: set(n.upstream_node_ids) | _bound_nodes(n) for n in nodes}
    ordered, done = [], set()
    while len(ordered) < len(nodes):
        ready = [i for i in by_id if i not in done and needs[i] & set(by_id) <= done]
        if not ready:
            raise ValueError(f"cycle among nodes {sorted(set(by_id) - done)}")
        for node_id in sorted(ready):
            ordered.append(by_id[node_id])
            done.add(node_id)
    return ordered


def _bound_nodes(node) -> set[str]:
    found: set[str] = set()

    def walk(binding) -> None:
        kind = binding.WhichOneof("value")
        if kind == "promise":
            found.add(binding.promise.node_id)
        elif kind == "collection":
            for b in binding.collection.bindings:
                walk(b)
        elif kind == "map":
            for b in binding.map.bindings.values():
                walk(b)

    for b in node.inputs:
        walk(b.binding)
    return found


def check_world(node_id: str, template, outputs: literals_pb2.LiteralMap) -> None:
    """A world_size the task reports must be replicas x processes per node: one world, not several."""
    custom = template.custom
    expected = (int(custom["workerReplicas"]["replicas"]) * int(custom["elasticConfig"]["nprocPerNode"]))
    for literal in outputs.literals.values():
        for world in literals.find_values(literals.to_python(literal), "world_size"):
            if world != expected:
                raise NodeFailed(f"node {node_id}: world_size {world} != {expected} (pods x nproc_per_node): "
                                 "the pods did not form one world")

