"""``python -m replay PACKAGE.tgz [--input NAME=VALUE ...]``: replay a `pyflyte package` archive node by
node, the way a Flyte cluster runs it."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from flyteidl.core import literals_pb2

from replay import literals
from replay.graph import ExecutionAborted, NodeFailed, Replay
from replay.package import PackageError, read_package
from replay.store import INPUTS, Execution, Store
from traincore.exitcodes import INTERRUPTED_EXIT_CODE
from traincore.files import path_argument

DEFAULT_PLAN = "workflows.pipeline.training_pipeline"
EPILOG = """\
Each task runs from its serialised container args in a fresh process (one per worker replica of a
PyTorchJob) with a Flyte pod's environment; pod directories, logs and the exact command of every pod
(pods/<pod>/pod.json: args, env, cwd) stay under --workdir, so one pod can be rerun by hand or inside an
image. Exit status: 0 on success, 1 when a node fails or a multi-pod world does not form, 2 on bad usage
(or an --abort-after node that never ran), 3 when --abort-after stopped the execution.

examples:
  pyflyte --pkgs workflows package --image IMG --copy all -o pkg.tgz   # fast registration
  python -m replay pkg.tgz --input max_steps=20 --input nproc_per_node=1
  python -m replay pkg.tgz --workdir /tmp/r --input backend=kubernetes --input nnodes=2 \\
      --input nproc_per_node=1 --input max_steps=20 --abort-after n2-0-dn0
  python -m replay pkg.tgz --workdir /tmp/r2 --store /tmp/r/store --recover EXECUTION  # the rest of it
"""


ENTRY_POINTS = ("pyflyte-fast-execute", "pyflyte-execute")  # what every task's container args start with


def package_archive(text: str) -> Path:
    """argparse's ``type`` for PKG: an existing tar archive, checked before the workdir is made."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give the archive file `pyflyte package` "
                                          "wrote (its -o/--output)")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} does not exist: make it with `pyflyte --pkgs workflows "
                                          f"package --image IMG --copy all -o {text}`")
    if not tarfile.is_tarfile(path):
        raise argparse.ArgumentTypeError(f"{text} is not a tar archive: give the .tgz `pyflyte package` "
                                          "wrote, or make it again")
    return path


def workdir_path(text: str) -> Path:
    """argparse's ``type`` for --workdir: a directory, or a path one can be made at."""
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." or "/" at worst
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a directory: name a new or existing "
                                          "directory")
    try:  # a real probe: access() says yes to root where the filesystem still refuses
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{existing} cannot be written ({exc.strerror}): name a directory "
                                          "you can write, or one to be made in such a directory") from exc
    return path


def summary_path(text: str) -> Path:
    """argparse's ``type`` for --summary-json: a file that can be written once the replay ends (checked
    now, so a long replay does not end on a typo)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: name a file, e.g. {path / 'summary.json'}")
    # Its directory is made when the replay writes it (often inside --workdir, made by the replay too).
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a directory: name a file in a directory")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be written (permissions): name a writable file")
    return path


def _number(text: str) -> float:
    """``text`` as a float; nan (refused as nan is) when it is not a number."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def positive_seconds(text: str) -> float:
    """argparse's ``type`` for --node-timeout: finite seconds > 0."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0: give e.g. 600")
    return value


def _delay(text: str) -> float:
    """argparse's ``type`` for --reschedule-after: finite seconds >= 0 (0, the default: at once)."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0: give e.g. 30")
    return value


def python_bin_dir(text: str) -> Path:
    """argparse's ``type`` for --python-bin: the pods' PATH must find flytekit's entry points there."""
    path = Path(text)
    if not path.is_dir():
        hint = f", e.g. its directory {path.parent}" if path.is_file() else ""
        raise argparse.ArgumentTypeError(f"{text} is not a directory: give the directory holding "
                                          f"{' and '.join(ENTRY_POINTS)}{hint}")
    missing = [name for name in ENTRY_POINTS if not os.access(path / name, os.X_OK)]
    if missing:
        raise argparse.ArgumentTypeError(f"{text} lacks {' and '.join(missing)}: give the bin directory of "
                                          "an environment with flytekit installed")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    description = __doc__.split(":", 1)[1].strip().replace("\n", " ")
    parser = argparse.ArgumentParser(prog="python -m replay", description=description, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", type=package_archive, metavar="PKG",
                        help="a `pyflyte package` archive, fast-registered (--copy all) or not")
    parser.add_argument("--input", "-i", action="append", default=[], metavar="NAME=VALUE",
                        help="override a launch-plan input (int, float, str or bool inputs, or Optional of "
                        "one); repeatable, and the last value given for a NAME wins")
    parser.add_argument("--launch-plan",
                        help=f"launch plan to run (default: {DEFAULT_PLAN}; with --recover, the one it ran)")
    parser.add_argument("--workdir", type=workdir_path,
                        help="where pods, logs and the store go (default: a new temporary directory)")
    parser.add_argument("--store", type=path_argument, help="object store root: a directory or "
                        "s3://bucket/prefix (default: WORKDIR/store); for s3 set FLYTE_AWS_ENDPOINT and the "
                        "FLYTE_AWS_* credentials")
    parser.add_argument("--project", default="flytesnacks", help="project to register into (%(default)s)")
    parser.add_argument("--domain", default="development", help="domain to register into (%(default)s)")
    parser.add_argument("--version", default="replay", help="version given to every registered entity")
    parser.add_argument("--python-bin", type=python_bin_dir, default=Path(sys.executable).parent,
                        help="directory put first on the pods' PATH, standing in for the image's; it must "
                        "hold pyflyte-fast-execute and pyflyte-execute (default: this interpreter's)")
    parser.add_argument("--node-timeout", type=positive_seconds, default=1800,
                        help="seconds before a node's pods are killed (default 1800)")
    parser.add_argument("--reschedule-after", type=_delay, default=0.0, metavar="S",
                        help="seconds before a lost pod of an elastic job (SIGKILLed; its workers "
                        "restart on failure) is made again, as it waits to be scheduled (%(default)s)")
    parser.add_argument("--abort-after", metavar="NODE",
                        help="stop the execution once node NODE (its id as the node wall times print it, "
                        "e.g. n3-0-dn2 inside a dynamic node) succeeded, as a user aborts one on a cluster; "
                        "the summary lists the nodes that ran, and the store keeps what they wrote")
    parser.add_argument("--recover", metavar="EXECUTION",
                        help="a new execution that reuses every node the execution EXECUTION (its name, as "
                        "the replay printed it) of the same --store ran to success, and runs the others, on "
                        "that execution's inputs and launch plan: Flyte's recover, e.g. after an abort or a "
                        "failed node")
    parser.add_argument("--echo", action="store_true", help="stream every pod's output, prefixed by its name")
    parser.add_argument("--summary-json", type=summary_path,
                        help="write node wall times and outputs here as JSON")
    return parser.parse_args(argv)


def _overrides(pairs: list[str]) -> dict[str, str]:
    """``--input`` values by name; the last of a repeated name wins (`make replay` relies on it)."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise literals.InputError(f"--input {pair!r}: expected NAME=VALUE")
        out[name] = value
    return out


class NotRecoverable(Exception):
    """--recover names no execution of the store, or asks for other inputs or another launch plan."""


REFUSALS = (PackageError, literals.InputError, NotRecoverable)
"""What the replay reports as one ``error:`` line, exit 2: the package or an input is not usable."""


@contextlib.contextmanager
def refusable_workdir(given: Path | None, refusals: tuple[type[Exception], ...] = REFUSALS) -> Iterator[Path]:
    """``given`` (or a new temporary directory), made for the checks that need the package unpacked; one
    that the block made is removed again when the block ends in one of ``refusals``, so that a refused
    replay leaves nothing behind."""
    workdir = (given or Path(tempfile.mkdtemp(prefix="replay-"))).resolve()
    made = given is None or not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        yield workdir
    except refusals:
        if made:
            shutil.rmtree(workdir, ignore_errors=True)
        raise


LAUNCH_RECORD = "launch.json"  # beside the execution's inputs.pb: the launch plan it ran


def recovered_launch(args: argparse.Namespace, store: Store) -> tuple[str, literals_pb2.LiteralMap]:
    """The launch plan and inputs of the execution --recover names, as this replay recorded them when it
    ran there: Flyte's recover runs an execution's own inputs, so --input and another --launch-plan are
    refused."""
    earlier = store.execution_prefix(Execution(args.project, args.domain, args.recover, "", args.version))
    if not store.exists(f"{earlier}/{LAUNCH_RECORD}"):
        raise NotRecoverable(f"--recover {args.recover}: no execution of that name in {store.root}: give the "
                             "name a replay printed (`execution f...`) and the --store it used (by default "
                             "WORKDIR/store)")
    plan = json.loads(store.read(f"{earlier}/{LAUNCH_RECORD}"))["launch_plan"]
    if args.input:
        raise NotRecoverable(f"--recover {args.recover} runs that execution's own inputs: drop --input "
                             f"{' '.join(args.input)}, or launch a new execution without --recover")
    if args.launch_plan not in (None, plan):
        raise NotRecoverable(f"--recover {args.recover}: that execution ran launch plan {plan}, not "
                             f"{args.launch_plan}: drop --launch-plan")
    return plan, literals_pb2.LiteralMap.FromString(store.read(f"{earlier}/{INPUTS}"))


def replay_package(args: argparse.Namespace) -> dict:
    """Replay the launch plan; returns the summary (node timings and decoded outputs)."""
    with refusable_workdir(args.workdir) as workdir:  # the inputs are checked against the launch plan
        package = read_package(args.package, workdir / "package")
        store = Store(args.store or str(workdir / "store"))
        if args.recover:
            plan_name, inputs = recovered_launch(args, store)
            plan = package.launch_plan(plan_name)
        else:
            plan = package.launch_plan(args.launch_plan or DEFAULT_PLAN)
            inputs = literals.launch_inputs(plan, _overrides(args.input))
        workflow = package.workflows[plan.spec.workflow_id.name]
    for template in package.tasks.values():  # what `flytectl register files` does to every entity
        template.id.project, template.id.domain, template.id.version = args.project, args.domain, args.version
    name = "f" + uuid.uuid4().hex[:19]  # Flyte's execution names: 20 characters, starting with a letter
    execution = Execution(args.project, args.domain, name, workflow.id.name, args.version)
    recover = Execution(args.project, args.domain, args.recover, workflow.id.name, args.version) \
        if args.recover else None
    # What a recovery of this execution reads back: its inputs and launch plan, as propeller keeps them.
    store.write(f"{store.execution_prefix(execution)}/{INPUTS}", inputs.SerializeToString())
    store.write(f"{store.execution_prefix(execution)}/{LAUNCH_RECORD}",
                json.dumps({"launch_plan": plan.id.name}).encode())
    code = None
    if package.fast:  # flytectl uploads the code tarball and writes its location into the task args
        code = store.join("fast", args.version, package.code_tarball.name)
        store.write(code, package.code_tarball.read_bytes())
    recovering = f", recovering {recover.name}" if recover else ""
    print(f"replay: {args.package.name} ({'fast' if package.fast else 'non-fast'} registration), launch plan "
          f"{plan.id.name}, execution {execution.name}{recovering}, workdir {workdir}", flush=True)
    replay = Replay(store, execution, workdir, args.python_bin.resolve(), code, args.node_timeout, args.echo,
                    reschedule_s=args.reschedule_after, workflows=package.workflows,
                    abort_after=args.abort_after, recover=recover)
    started = time.monotonic()
    aborted, final = None, {}
    try:
        outputs = replay.run_nodes(workflow.nodes, package.tasks, {literals.START_NODE: inputs})
        final = literals.bind_inputs(workflow.outputs, outputs).literals
    except ExecutionAborted as exc:  # no workflow outputs: the summary keeps the nodes that ran
        aborted = str(exc)
    return {"execution": execution.name, "recovered_from": args.recover, "workdir": str(workdir),
            "fast": package.fast,
            "total_s": time.monotonic() - started, "aborted": aborted,
            "nodes": [vars(t) for t in replay.timings],
            "outputs": {k: literals.to_python(v) for k, v in final.items()},
            "node_outputs": {node: {k: literals.to_python(v) for k, v in out.literals.items()}
                             for node, out in replay.node_outputs.items()}}


def report(summary: dict) -> None:
    """Each node's wall time and the workflow's outputs (accuracy first)."""
    print("replay: node wall times")
    for node in summary["nodes"]:
        if node["recovered_from"]:
            print(f"  {node['node_id']:<10} {node['task']:<45} recovered from {node['recovered_from']}")
            continue
        writer = f"  (outputs.pb from {node['writer']}, global rank 0)" if node["writer"] else ""
        print(f"  {node['node_id']:<10} {node['task']:<45} {node['pods']} pod(s) {node['wall_s']:7.1f} s"
              + writer)
    print(f"  {'total':<65} {summary['total_s']:7.1f} s")
    for name, value in summary["outputs"].items():
        accuracy = literals.find_values(value, "accuracy")
        if accuracy:
            print(f"replay: output {name}: accuracy {accuracy[0]:.4f}")
    print("replay: outputs " + json.dumps(summary["outputs"], default=str)[:2000], flush=True)


def write_summary(path: Path, summary: dict) -> None:
    """``summary`` as JSON at ``path`` (--summary-json), its directory made if the replay has not."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str))


def interrupted(prog: str) -> int:
    """Ctrl-C: one line and exit code 130. The pods run in sessions of their own, out of the terminal's
    reach, and the replay stopped the running ones (replay.pod.run_pods); each pod's log stays."""
    print(f"{prog}: interrupted: the running node's pods were stopped; the workdir keeps every pod's log",
          file=sys.stderr)
    return INTERRUPTED_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = replay_package(args)
    except (*REFUSALS, FileNotFoundError) as exc:
        print(f"replay: error: {exc}", file=sys.stderr)
        return 2
    except NotImplementedError as exc:
        print(f"replay: error: the package uses what the replay does not support: {exc}", file=sys.stderr)
        return 2
    except NodeFailed as exc:
        print(f"replay: FAILED: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("replay")
    report(summary)
    if args.summary_json:
        write_summary(args.summary_json, summary)
    if summary["aborted"]:
        print(f"replay: ABORTED: {summary['aborted']}; the nodes after it did not run", file=sys.stderr)
        return 3
    if args.abort_after:
        print(f"replay: error: --abort-after {args.abort_after}: no node of that id ran (the execution ran "
              "to its end); give one of the node ids above", file=sys.stderr)
        return 2
    return 0
