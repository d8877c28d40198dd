"""The harness's own mechanics, without Flyte tasks: templates, pods, the world check, node order."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgpack
import pytest
import replay_helpers  # noqa: F401, I001  (a module beside this file; puts the checkout on sys.path)
from flyteidl.core import identifier_pb2, interface_pb2, literals_pb2, tasks_pb2, types_pb2, workflow_pb2
from google.protobuf.struct_pb2 import Struct

from replay.cli import report
from replay.graph import ExecutionAborted, NodeFailed, Replay, check_world, dependency_order, rank0_writer
from replay.package import REMOTE_PACKAGE_PATH
from replay.pod import PodResult, PodSpec, render_args, run_pods
from replay.retry import start_pod
from replay.store import Execution, Store

EXECUTION = Execution("p", "d", "fexec", "wf", "v1")
BIN = Path(sys.executable).parent


def test_templates_are_filled_in_as_propeller_does(tmp_path):
    store = Store(str(tmp_path))
    args = ["pyflyte-fast-execute", "--additional-distribution", REMOTE_PACKAGE_PATH, "--", "--inputs",
            "{{.input}}", "--output-prefix", "{{ .OutputPrefix }}", "--raw-output-data-prefix",
            "{{$rawOutputDataPrefix}}", "--checkpoint-path", "{{.checkpointOutputPrefix}}",
            "--prev-checkpoint", "{{.prevCheckpointPrefix}}", "--", "task-key", "{{.unknown}}"]
    first = render_args(args, store.node_paths(EXECUTION, "n1"), "s3://b/fast.tar.gz")
    paths = store.node_paths(EXECUTION, "n1")
    assert first[2] == "s3://b/fast.tar.gz"
    assert first[5] == paths.inputs == f"{paths.output_prefix.rsplit('/', 1)[0]}/inputs.pb"
    assert (first[7], first[9], first[11]) == (paths.output_prefix, paths.raw_output_prefix,
                                               paths.checkpoint_prefix)
    assert first[13] == '""' and first[-1] == "{{.unknown}}"  # unknown templates stay, as in propeller
    retry = store.node_paths(EXECUTION, "n1", attempt=1)
    assert render_args(args, retry, "x")[13] == paths.checkpoint_prefix  # the previous attempt's checkpoints
    with pytest.raises(ValueError, match="no code tarball"):
        render_args(args, paths, None)


def test_a_failed_pod_stops_the_others_as_the_job_fails(tmp_path):
    python = sys.executable
    specs = [PodSpec("fails", [python, "-c", "import sys; sys.exit(3)"]),
             PodSpec("waits", [python, "-c", "import time; time.sleep(60)"])]
    started = time.monotonic()
    results = {r.name: r.returncode for r in run_pods(specs, tmp_path, BIN, timeout_s=120)}
    assert results["fails"] == 3 and results["waits"] < 0  # killed, not left to run
    assert time.monotonic() - started < 30


def test_a_lost_pod_of_a_job_that_restarts_on_failure_is_made_again_after_its_scheduling(tmp_path):
    """The first run of the pod SIGKILLs itself (its node lost); the operator's new pod starts 1 s later,
    under the same name, and the job ends when it does. A pod that fails otherwise still ends the job."""
    marker = tmp_path / "lost-once"
    code = (f"import os, pathlib, signal, time; m = pathlib.Path({str(marker)!r})\n"
            "if not m.exists(): m.touch(); os.kill(os.getpid(), signal.SIGKILL)\n"
            "print('second life', flush=True)")
    specs = [PodSpec("worker-0", [sys.executable, "-c", "import time; time.sleep(2)"]),
             PodSpec("worker-1", [sys.executable, "-c", code])]
    started = time.monotonic()
    results = run_pods(specs, tmp_path, BIN, timeout_s=60, recreate_after_s=1.0)
    assert [r.returncode for r in results] == [0, 0] and time.monotonic() - started >= 1.0
    pod = tmp_path / "pods" / "worker-1"
    assert "second life" in (pod / "log.txt").read_text() and (pod / "log-lost-0.txt").is_file()
    failing = [PodSpec("fails", [sys.executable, "-c", "import sys; sys.exit(3)"])]
    assert [r.returncode for r in run_pods(failing, tmp_path, BIN, 60, recreate_after_s=1.0)] == [3]


def test_pods_get_their_own_home_tmp_and_cwd_outside_the_source_tree(tmp_path):
    code = ("import os; print(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], "
            "os.environ.get('PYTHONPATH'), os.environ['X'])")
    spec = PodSpec("env", [sys.executable, "-c", code], {"X": "1"})
    (result,) = run_pods([spec], tmp_path, BIN, timeout_s=60)
    cwd, home, tmp, pythonpath, x = result.log.read_text().split()
    pod = tmp_path / "pods" / "env"
    assert (cwd, home, tmp) == (str(pod / "work"), str(pod / "home"), str(pod / "tmp"))
    assert (pythonpath, x) == ("None", "1")  # nothing of the harness's environment, the container's env


def test_the_pods_of_a_job_run_on_their_own_cores_and_a_pod_alone_on_all(tmp_path):
    code = "import os; print(*sorted(os.sched_getaffinity(0)))"
    cores = sorted(os.sched_getaffinity(0))
    specs = [PodSpec(f"worker-{i}", [sys.executable, "-c", code]) for i in range(2)]
    together = [sorted(map(int, r.log.read_text().split())) for r in run_pods(specs, tmp_path, BIN, 60)]
    if len(cores) >= 2:
        assert not set(together[0]) & set(together[1]) and sorted(together[0] + together[1]) == cores
    for pod, seen in zip(specs, together, strict=True):
        assert json.loads((tmp_path / "pods" / pod.name / "pod.json").read_text())["cpus"] == seen
    # A pod restarted from its pod.json (as the operator recreates it) runs on the same cores.
    assert start_pod(tmp_path / "pods" / "worker-1", "again.txt").wait() == 0
    assert sorted(map(int, (tmp_path / "pods" / "worker-1" / "again.txt").read_text().split())) == together[1]
    (alone,) = run_pods([PodSpec("alone", [sys.executable, "-c", code])], tmp_path, BIN, 60)
    assert sorted(map(int, alone.log.read_text().split())) == cores


def _pytorch_template(replicas: int, nproc: int) -> tasks_pb2.TaskTemplate:
    custom = Struct()
    custom.update({"workerReplicas": {"replicas": replicas}, "elasticConfig": {"nprocPerNode": nproc}})
    return tasks_pb2.TaskTemplate(type="pytorch", custom=custom)


def _outputs(world: int) -> literals_pb2.LiteralMap:
    value = msgpack.packb({"summary": {"steps": 3, "world_size": world}})
    scalar = literals_pb2.Scalar(binary=literals_pb2.Binary(value=value, tag="msgpack"))
    return literals_pb2.LiteralMap(literals={"o0": literals_pb2.Literal(scalar=scalar)})


def test_world_size_must_span_every_pod():
    check_world("n", _pytorch_template(2, 2), _outputs(4))
    with pytest.raises(NodeFailed, match="did not form one world"):
        check_world("n", _pytorch_template(2, 2), _outputs(2))  # each pod trained on its own


def test_exactly_one_pod_of_a_job_may_keep_its_outputs(tmp_path):
    def pod(name: str, log: str) -> PodResult:
        (tmp_path / name).write_text(log)
        return PodResult(name, 0, 1.0, tmp_path / name)

    ignored = "WARNING User-scoped IgnoreOutputs received! Outputs.pb will not be uploaded."
    assert rank0_writer("n", [pod("w0", ignored), pod("w1", "train: done")]) == "w1"
    with pytest.raises(NodeFailed, match="2 pod"):  # both wrote outputs.pb: two rank-0s, two worlds
        rank0_writer("n", [pod("a", "train: done"), pod("b", "train: done")])
    with pytest.raises(NodeFailed, match="0 pod"):
        rank0_writer("n", [pod("c", ignored), pod("d", ignored)])


def test_nodes_run_after_the_nodes_they_are_bound_to():
    def node(node_id, upstream=(), bound=()):
        inputs = [literals_pb2.Binding(var=f"x{i}", binding=literals_pb2.BindingData(promise=_ref(b)))
                  for i, b in enumerate(bound)]
        return workflow_pb2.Node(id=node_id, upstream_node_ids=list(upstream), inputs=inputs)

    nodes = [node("n2", bound=["n1"]), node("n1", upstream=["n0"]), node("n0", bound=[""])]
    assert [n.id for n in dependency_order(nodes)] == ["n0", "n1", "n2"]
    with pytest.raises(ValueError, match="cycle"):
        dependency_order([node("a", upstream=["b"]), node("b", bound=["a"])])


def _ref(node_id: str) -> types_pb2.OutputReference:
    return types_pb2.OutputReference(node_id=node_id, var="o0")


def test_pods_that_never_finish_are_killed_at_the_node_timeout(tmp_path):
    specs = [PodSpec(f"waits-{i}", [sys.executable, "-c", "import time; time.sleep(60)"]) for i in (0, 1)]
    results = run_pods(specs, tmp_path, BIN, timeout_s=1)
    assert all(r.timed_out and r.returncode < 0 for r in results)


def binding(var: str, node_id: str, output: str) -> literals_pb2.Binding:
    ref = types_pb2.OutputReference(node_id=node_id, var=output)
    return literals_pb2.Binding(var=var, binding=literals_pb2.BindingData(promise=ref))


def integer(value: int) -> literals_pb2.Literal:
    primitive = literals_pb2.Primitive(integer=value)
    return literals_pb2.Literal(scalar=literals_pb2.Scalar(primitive=primitive))


@dataclass
class Doubling(Replay):
    """Every task doubles its input x, without a pod: the binding is what is under test."""

    ran: list[str] = field(default_factory=list)  # the task nodes run, in order

    def run_task(self, node_id, template, inputs):
        self.ran.append(node_id)
        return literals_pb2.LiteralMap(literals={"o0": integer(2 * inputs.literals["x"].scalar.primitive
                                                               .integer)})


def run_calling_workflow(replay: Replay) -> dict:
    """A workflow of a task node n0 and a node n1 that calls a workflow of two task nodes, on a=3."""
    task = workflow_pb2.TaskNode(reference_id=identifier_pb2.Identifier(name="double"))
    replay.workflows["inner"] = workflow_pb2.WorkflowTemplate(
        id=identifier_pb2.Identifier(name="inner"),
        nodes=[workflow_pb2.Node(id="n0", task_node=task, inputs=[binding("x", "", "y")]),
               workflow_pb2.Node(id="n1", task_node=task, inputs=[binding("x", "n0", "o0")])],
        outputs=[binding("z", "n1", "o0")])
    reference = workflow_pb2.WorkflowNode(sub_workflow_ref=identifier_pb2.Identifier(name="inner"))
    call = workflow_pb2.Node(id="n1", inputs=[binding("y", "n0", "o0")], workflow_node=reference)
    outer = [workflow_pb2.Node(id="n0", task_node=task, inputs=[binding("x", "", "a")]), call]
    return replay.run_nodes(outer, {"double": tasks_pb2.TaskTemplate()},
                            {"": literals_pb2.LiteralMap(literals={"a": integer(3)})})


def test_a_sub_workflow_runs_its_nodes_on_the_nodes_inputs_and_gives_its_own_outputs(tmp_path):
    """A workflow called inside another (retrain_and_promote calls training_pipeline): its nodes run under
    the calling node's id, on that node's bound inputs, and its output bindings become the node's outputs."""
    replay = Doubling(Store(str(tmp_path)), EXECUTION, tmp_path, BIN)
    outputs = run_calling_workflow(replay)
    assert replay.ran == ["n0", "n1-0-n0", "n1-0-n1"]
    assert outputs["n1"].literals["z"].scalar.primitive.integer == 24  # 3 -> 6 -> 12 -> 24
    assert replay.node_outputs["n1"] == outputs["n1"]


def test_an_execution_aborted_after_a_node_runs_nothing_after_it(tmp_path):
    """--abort-after: the execution stops once the named node (here one inside a sub-workflow) succeeded;
    the nodes before it ran and their outputs stay."""
    replay = Doubling(Store(str(tmp_path)), EXECUTION, tmp_path, BIN, abort_after="n1-0-n0")
    with pytest.raises(ExecutionAborted, match="aborted after node n1-0-n0, as --abort-after asked"):
        run_calling_workflow(replay)
    assert replay.ran == ["n0", "n1-0-n0"]
    assert replay.node_outputs["n1-0-n0"].literals["o0"].scalar.primitive.integer == 12


ELEMENT = """
import os, sys
from flyteidl.core import literals_pb2
inputs = literals_pb2.LiteralMap.FromString(open(sys.argv[1], "rb").read())
index = int(os.environ[os.environ["BATCH_JOB_ARRAY_INDEX_VAR_NAME"]])
x = inputs.literals["x"].collection.literals[index].scalar.primitive.integer
k = inputs.literals["k"].scalar.primitive.integer
value = literals_pb2.Literal(scalar=literals_pb2.Scalar(primitive=literals_pb2.Primitive(integer=x * k)))
os.makedirs(sys.argv[2], exist_ok=True)
with open(os.path.join(sys.argv[2], "outputs.pb"), "wb") as out:
    out.write(literals_pb2.LiteralMap(literals={"o0": value}).SerializeToString())
"""


def test_an_array_node_runs_a_pod_per_element_and_gathers_their_outputs(tmp_path):
    """A map task as propeller's ArrayNode runs it: each pod reads the node's whole inputs (the mapped list
    and the bound scalar), picks its element by FLYTE_K8S_ARRAY_INDEX, writes its own outputs.pb; the
    node's output is the list of the elements' outputs, in element order."""
    integer_list = types_pb2.LiteralType(collection_type=types_pb2.LiteralType(simple=types_pb2.INTEGER))
    template = tasks_pb2.TaskTemplate(
        id=identifier_pb2.Identifier(name="times_k"),
        container=tasks_pb2.Container(args=[sys.executable, "-c", ELEMENT, "{{.input}}",
                                            "{{.outputPrefix}}"]),
        interface=interface_pb2.TypedInterface(outputs={"variables": {"o0": {"type": integer_list}}}))
    element = workflow_pb2.Node(id="n0", task_node=workflow_pb2.TaskNode(reference_id=template.id))
    array = workflow_pb2.Node(id="n0", array_node=workflow_pb2.ArrayNode(node=element, parallelism=2),
                              inputs=[binding("x", "", "xs"), binding("k", "", "k")])
    values = literals_pb2.LiteralCollection(literals=[integer(v) for v in (1, 2, 5)])
    xs = literals_pb2.Literal(collection=values)
    replay = Replay(Store(str(tmp_path / "store")), EXECUTION, tmp_path, BIN)
    outputs = replay.run_nodes([array], {"times_k": template},
                               {"": literals_pb2.LiteralMap(literals={"xs": xs, "k": integer(10)})})
    gathered = outputs["n0"].literals["o0"].collection.literals
    assert [literal.scalar.primitive.integer for literal in gathered] == [10, 20, 50]
    assert sorted(p.name for p in (tmp_path / "pods").iterdir()) == [f"fexec-n0-{i}-0" for i in range(3)]


ADD_ONE = """
import os, sys
from flyteidl.core import literals_pb2
inputs = literals_pb2.LiteralMap.FromString(open(sys.argv[1], "rb").read())
x = inputs.literals["x"].scalar.primitive.integer
value = literals_pb2.Literal(scalar=literals_pb2.Scalar(primitive=literals_pb2.Primitive(integer=x + 1)))
os.makedirs(sys.argv[2], exist_ok=True)
with open(os.path.join(sys.argv[2], "outputs.pb"), "wb") as out:
    out.write(literals_pb2.LiteralMap(literals={"o0": value}).SerializeToString())
with open(sys.argv[3], "a") as ran:
    ran.write(sys.argv[2].split("/")[-3] + "\\n")
"""


def test_a_recovered_execution_reuses_what_succeeded_and_runs_the_rest(tmp_path, capsys):
    """--recover: an execution aborted after n1 of n0 -> n1 -> n2, recovered as a new execution: n0 and n1
    are not run again (their inputs and outputs copied to the new execution's paths), n2 runs on n1's
    recovered output, and the workflow's result is the one an uninterrupted execution gives."""
    ran = tmp_path / "ran.txt"
    template = tasks_pb2.TaskTemplate(
        id=identifier_pb2.Identifier(name="add_one"),
        container=tasks_pb2.Container(args=[sys.executable, "-c", ADD_ONE, "{{.input}}", "{{.outputPrefix}}",
                                            str(ran)]))
    task = workflow_pb2.TaskNode(reference_id=template.id)
    nodes = [workflow_pb2.Node(id="n0", task_node=task, inputs=[binding("x", "", "a")]),
             workflow_pb2.Node(id="n1", task_node=task, inputs=[binding("x", "n0", "o0")]),
             workflow_pb2.Node(id="n2", task_node=task, inputs=[binding("x", "n1", "o0")])]
    store, start = Store(str(tmp_path / "store")), {"": literals_pb2.LiteralMap(literals={"a": integer(3)})}
    first = Replay(store, EXECUTION, tmp_path, BIN, abort_after="n1")
    with pytest.raises(ExecutionAborted):
        first.run_nodes(nodes, {"add_one": template}, dict(start))
    assert ran.read_text().split() == ["n0", "n1"]
    again = Replay(store, replace(EXECUTION, name="fagain"), tmp_path, BIN, recover=EXECUTION)
    outputs = again.run_nodes(nodes, {"add_one": template}, dict(start))
    assert ran.read_text().split() == ["n0", "n1", "n2"]  # only n2 ran again
    assert outputs["n2"].literals["o0"].scalar.primitive.integer == 6  # 3 -> 4 -> 5 -> 6
    assert [(t.node_id, t.pods, t.recovered_from) for t in again.timings] == [
        ("n0", 0, "fexec"), ("n1", 0, "fexec"), ("n2", 1, "")]
    recovered = store.node_paths(again.execution, "n1")
    assert store.read(f"{recovered.output_prefix}/outputs.pb") == outputs["n1"].SerializeToString()
    assert store.exists(recovered.inputs)
    capsys.readouterr()  # the nodes' own lines, then the summary's wall times
    report({"nodes": [vars(t) for t in again.timings], "total_s": 1.0, "outputs": {}})
    wall_times = capsys.readouterr().out.splitlines()
    assert "recovered from fexec" in wall_times[1] and "1 pod(s)" in wall_times[3], wall_times


def test_recovery_takes_the_attempt_that_succeeded_and_runs_a_node_that_only_failed(tmp_path):
    """A node retried after a failed attempt recovers from the attempt that succeeded; a node whose only
    attempt failed (error.pb), or that left nothing (its pods were stopped), is run again."""
    store = Store(str(tmp_path))
    for node_id, attempt, name in (("retried", 0, "error.pb"), ("retried", 1, "outputs.pb"),
                                   ("failed", 0, "error.pb"), ("dynamic", 0, "futures.pb")):
        store.write(f"{store.node_paths(EXECUTION, node_id, attempt).output_prefix}/{name}", b"")
    replay = Replay(store, replace(EXECUTION, name="fagain"), tmp_path, BIN, recover=EXECUTION)
    found = {node: replay._succeeded_attempt(node) for node in ("retried", "failed", "dynamic", "stopped")}
    assert found["retried"] == (store.node_paths(EXECUTION, "retried", 1), "outputs.pb")
    assert found["dynamic"] == (store.node_paths(EXECUTION, "dynamic", 0), "futures.pb")
    assert found["failed"] is None and found["stopped"] is None
