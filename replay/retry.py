"""Rerun one node of a replayed execution as a later attempt, and restart single pods, as a cluster would.

``python -m replay.retry PACKAGE --store S --execution NAME --node ID --attempt N``: propeller's retry of
a node. The node's inputs.pb (written by attempt 0) is read back and the node's task runs again with
FLYTE_ATTEMPT_NUMBER=N, attempt N's output and raw-data prefixes, the previous attempt's checkpoint prefix
and new pods named ``<execution>-<node>-N`` (for a PyTorchJob: a new job, every worker pod new). A node of
a dynamic node (``n2-0-dn0``) takes its task from the parent's futures.pb.

``start_pod`` / ``kill_pod``: one pod's process from the ``pod.json`` a replay leaves (command, args, env,
cwd), as the training operator recreates a failed worker pod, and SIGKILL of its process group, as a lost
node ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from flyteidl.core import dynamic_job_pb2, literals_pb2

from replay import literals
from replay.cli import (
    DEFAULT_PLAN,
    REFUSALS,
    interrupted,
    package_archive,
    positive_seconds,
    python_bin_dir,
    refusable_workdir,
    summary_path,
    workdir_path,
    write_summary,
)
from replay.graph import NodeFailed, Replay
from replay.package import read_package
from replay.pod import pinned_to, platform_env
from replay.store import FUTURES, Execution, Store
from traincore.files import path_argument


class NodeNotFound(Exception):
    """The node to retry is not in the workflow, or its first attempt left no inputs in the store."""


RETRY_REFUSALS = (*REFUSALS, NodeNotFound)
"""What the retry reports as one ``error:`` line, exit 2."""


def node_task(package, workflow, store: Store, execution: Execution, node_id: str):
    """The task template of ``node_id``: from the workflow, or from its dynamic parent's futures.pb."""
    parent, sep, inner = node_id.partition("-0-")
    if not sep:
        (node,) = [n for n in workflow.nodes if n.id == node_id] or [None]
        if node is None:
            raise NodeNotFound(f"no node {node_id!r} in workflow {workflow.id.name}")
        return package.tasks[node.task_node.reference_id.name]
    futures = f"{store.node_paths(execution, parent).output_prefix}/{FUTURES}"
    spec = dynamic_job_pb2.DynamicJobSpec.FromString(store.read(futures))
    nodes = {n.id: n for n in spec.nodes}
    if inner not in nodes:
        raise NodeNotFound(f"no node {inner!r} in the dynamic spec of {parent!r}: {sorted(nodes)}")
    return {t.id.name: t for t in spec.tasks}[nodes[inner].task_node.reference_id.name]


def rerun_node(args: argparse.Namespace) -> dict:
    """Run attempt ``args.attempt`` of ``args.node`` with the inputs its first attempt received."""
    store = Store(args.store)
    with refusable_workdir(args.workdir, RETRY_REFUSALS) as workdir:
        package = read_package(args.package, workdir / "package-retry")
        workflow = package.workflows[package.launch_plan(args.launch_plan).spec.workflow_id.name]
        for task in package.tasks.values():  # as registered (see replay.cli)
            task.id.project, task.id.domain, task.id.version = args.project, args.domain, args.version
        execution = Execution(args.project, args.domain, args.execution, workflow.id.name, args.version)
        template = node_task(package, workflow, store, execution, args.node)
        inputs_path = store.node_paths(execution, args.node).inputs
        if not store.exists(inputs_path):
            raise NodeNotFound(f"{inputs_path} does not exist: --store, --execution and --node must name a "
                             "node whose first attempt ran (the replay's summary lists its execution and "
                             "nodes)")
    code = store.join("fast", args.version, package.code_tarball.name) if package.fast else None
    inputs = literals_pb2.LiteralMap.FromString(store.read(inputs_path))
    replay = Replay(store, execution, workdir, args.python_bin.resolve(), code, args.node_timeout,
                    args.echo, attempt=args.attempt)
    outputs = replay.run_task(args.node, template, inputs)
    return {"execution": execution.name, "workdir": str(workdir), "attempt": args.attempt,
            "nodes": [vars(t) for t in replay.timings],
            "outputs": {k: literals.to_python(v) for k, v in outputs.literals.items()}}


def _attempt(text: str) -> int:
    """argparse's ``type`` for --attempt: a retry is attempt 1 or later (attempt 0 is the replay's own)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an attempt number >= 1: attempt 0 is the one the "
                                          "replay ran; give e.g. 1")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The retry's flags, each checked as ``python -m replay`` checks its own before any pod starts."""
    parser = argparse.ArgumentParser(prog="python -m replay.retry", description=__doc__.split("\n\n")[1])
    parser.add_argument("package", type=package_archive, help="the `pyflyte package` archive the execution "
                        "replayed")
    parser.add_argument("--store", type=path_argument, required=True,
                        help="the execution's object store root (as --store)")
    parser.add_argument("--execution", required=True, help="the execution's name (replay summary)")
    parser.add_argument("--node", required=True, help="node id, e.g. n2-0-dn0 for the dynamic train node")
    parser.add_argument("--attempt", type=_attempt, default=1, help="attempt number, 0-based (default 1)")
    parser.add_argument("--workdir", type=workdir_path, required=True,
                        help="where the new pods' directories go")
    parser.add_argument("--launch-plan", default=DEFAULT_PLAN)
    parser.add_argument("--project", default="flytesnacks")
    parser.add_argument("--domain", default="development")
    parser.add_argument("--version", default="replay")
    parser.add_argument("--python-bin", type=python_bin_dir, default=Path(sys.executable).parent)
    parser.add_argument("--node-timeout", type=positive_seconds, default=1800)
    parser.add_argument("--echo", action="store_true")
    parser.add_argument("--summary-json", type=summary_path)
    parser.add_argument("--input", action="append", default=[], help=argparse.SUPPRESS)  # inputs are fixed
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.input:
        print("replay.retry: a retry reuses the node's inputs; --input is not accepted", file=sys.stderr)
        return 2
    try:
        summary = rerun_node(args)
    except RETRY_REFUSALS as exc:
        print(f"replay.retry: error: {exc}", file=sys.stderr)
        return 2
    except NodeFailed as exc:
        print(f"replay.retry: FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("replay.retry")
    print("replay.retry: outputs " + json.dumps(summary["outputs"], default=str)[:2000], flush=True)
    if args.summary_json:
        write_summary(args.summary_json, summary)
    return 0


def start_pod(pod_dir: Path, log_name: str = "log.txt",
              env: dict[str, str] | None = None) -> subprocess.Popen:
    """A new process for the pod in ``pod_dir`` from its pod.json (args, env, cwd and cores as first
    started, the platform's store settings from this environment, plus ``env``), in its own session (so its
    process group is the pod); output appended to ``log_name``. The same cores: a pod at another thread
    count would round differently, and a restarted job would no longer end bitwise as the first did."""
    started = json.loads((pod_dir / "pod.json").read_text())
    platform = {k: v for k, v in platform_env().items() if k in started.get("platform_env", ())}
    with (pod_dir / log_name).open("ab") as log:
        return subprocess.Popen(started["args"], cwd=started["cwd"],
                                env={**platform, **started["env"], **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=pinned_to(started.get("cpus")))


def kill_pod(process: subprocess.Popen) -> int:
    """SIGKILL the pod's whole process group (agent and workers), as losing its node would; its exit code."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return process.wait()


if __name__ == "__main__":
    sys.exit(main())
