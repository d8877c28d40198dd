"""`python -m replay` and `python -m replay.retry`: their refusals of bad usage, on a tiny fake package:
nothing runs, nothing is created."""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flyteidl.core import identifier_pb2, interface_pb2, literals_pb2, tasks_pb2, types_pb2
from flyteidl.core import workflow_pb2 as core_workflow_pb2
from replay_helpers import ROOT  # noqa: I001  (a module beside this file; puts the checkout on sys.path)

from replay import cli, literals, retry

BIN = Path(sys.executable).parent
WORKFLOW = cli.DEFAULT_PLAN  # the fake workflow, and its launch plan, replayed without --launch-plan
STRING, NONE = types_pb2.LiteralType(simple=types_pb2.STRING), types_pb2.LiteralType(simple=types_pb2.NONE)
STRING.structure.tag, NONE.structure.tag = "str", "none"  # as flytekit tags a union's variants
OPTIONAL_STR = types_pb2.LiteralType(union_type=types_pb2.UnionType(variants=[STRING, NONE]))


def _parameter(literal_type: types_pb2.LiteralType, default: literals_pb2.Scalar) -> interface_pb2.Parameter:
    return interface_pb2.Parameter(var=interface_pb2.Variable(type=literal_type),
                                   default=literals_pb2.Literal(scalar=default))


def _plan(name: str, fixed_threshold: bool) -> launch_plan_pb2.LaunchPlan:
    """The workflow's launch plan, or (``fixed_threshold``) a scheduled one that fixes ``threshold``."""
    none = literals_pb2.Scalar(none_type=literals_pb2.Void())
    parameters = {
        "threshold": _parameter(types_pb2.LiteralType(simple=types_pb2.FLOAT),
                                literals_pb2.Scalar(primitive=literals_pb2.Primitive(float_value=0.95))),
        "warm_start": _parameter(types_pb2.LiteralType(simple=types_pb2.BOOLEAN),
                                 literals_pb2.Scalar(primitive=literals_pb2.Primitive(boolean=False))),
        "champion": _parameter(OPTIONAL_STR, none),
        "nproc_per_node": _parameter(types_pb2.LiteralType(simple=types_pb2.INTEGER),
                                     literals_pb2.Scalar(primitive=literals_pb2.Primitive(integer=2)))}
    plan = launch_plan_pb2.LaunchPlan(id=identifier_pb2.Identifier(name=name))
    plan.spec.workflow_id.name = WORKFLOW
    if fixed_threshold:
        plan.spec.fixed_inputs.literals["threshold"].CopyFrom(parameters.pop("threshold").default)
    for key, parameter in parameters.items():
        plan.spec.default_inputs.parameters[key].CopyFrom(parameter)
    return plan


def _fake_package(path: Path) -> Path:
    """A non-fast `pyflyte package` archive of one task and a workflow without nodes, with its default launch
    plan and a ``scheduled`` one."""
    task = tasks_pb2.TaskTemplate(id=identifier_pb2.Identifier(name="t"),
                                  container=tasks_pb2.Container(args=["pyflyte-execute"]))
    workflow = core_workflow_pb2.WorkflowTemplate(id=identifier_pb2.Identifier(name=WORKFLOW))
    members = {"0_t_1.pb": task_pb2.TaskSpec(template=task), "1_wf_2.pb": workflow_pb2.WorkflowSpec(
        template=workflow), "2_wf_3.pb": _plan(WORKFLOW, False), "3_scheduled_3.pb": _plan("scheduled", True)}
    with tarfile.open(path, "w:gz") as tar:
        for name, message in members.items():
            data = message.SerializeToString()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    return _fake_package(tmp_path_factory.mktemp("fake") / "pkg.tgz")


def _refused(capsys, *argv: str, main=cli.main) -> str:
    """The one error line ``python -m replay ARGV`` (or the ``main`` given, e.g. replay.retry's) ends on,
    asserting it exits 2 while parsing."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    return errors[0]


def test_the_fake_package_replays_and_writes_its_summary(package, tmp_path):
    """What every refusal below is measured against: the same arguments, fixed, run to the end."""
    summary = tmp_path / "s.json"
    assert cli.main([str(package), "--workdir", str(tmp_path / "w"), "--summary-json", str(summary)]) == 0
    assert summary.is_file()


@pytest.mark.parametrize("where", ["afile/s.json", "isdir"])
def test_a_summary_json_that_cannot_be_written_is_refused_before_anything_runs(package, tmp_path, capsys,
                                                                                where):
    (tmp_path / "isdir").mkdir()
    (tmp_path / "afile").write_text("")
    error = _refused(capsys, str(package), "--workdir", str(tmp_path / "w"), "--summary-json",
                     str(tmp_path / where))
    assert "--summary-json" in error and "name a file" in error
    assert not (tmp_path / "w").exists()


def test_an_abort_after_a_node_that_never_ran_is_an_error_naming_it(package, tmp_path, capsys):
    """The node ids of a dynamic node's children are known only once it ran: a wrong one is found at the
    end, when the execution ran through without it."""
    assert cli.main([str(package), "--workdir", str(tmp_path / "w"), "--abort-after", "n9"]) == 2
    assert "replay: error: --abort-after n9: no node of that id ran" in capsys.readouterr().err


def test_a_recovery_runs_the_execution_s_own_launch_and_refuses_other_inputs(package, tmp_path, capsys):
    """--recover EXECUTION reads the launch plan and inputs that execution recorded in the store; other
    inputs, another launch plan or a name the store does not hold are refused with one error line."""
    workdir, first, again = tmp_path / "w", tmp_path / "first.json", tmp_path / "again.json"
    argv = [str(package), "--workdir", str(workdir)]
    assert cli.main([*argv, "--launch-plan", "scheduled", "--input", "nproc_per_node=3",
                     "--summary-json", str(first)]) == 0
    name = json.loads(first.read_text())["execution"]
    assert cli.main([*argv, "--recover", name, "--summary-json", str(again)]) == 0
    recovered = json.loads(again.read_text())
    assert recovered["recovered_from"] == name and recovered["execution"] != name
    said = capsys.readouterr().out
    assert f"launch plan scheduled, execution {recovered['execution']}, recovering {name}" in said
    propeller = workdir / "store" / "metadata" / "propeller"
    inputs = {execution: literals_pb2.LiteralMap.FromString(
        (propeller / f"flytesnacks-development-{execution}" / "inputs.pb").read_bytes())
        for execution in (name, recovered["execution"])}
    assert inputs[name] == inputs[recovered["execution"]]
    assert inputs[name].literals["nproc_per_node"].scalar.primitive.integer == 3
    for extra, expected in ((["--input", "nproc_per_node=4"], "own inputs: drop --input"),
                            (["--launch-plan", WORKFLOW], f"ran launch plan scheduled, not {WORKFLOW}"),
                            (["--recover", "fnosuchexecution"], "no execution of that name in")):
        recover = [] if "--recover" in extra else ["--recover", name]
        assert cli.main([*argv, *recover, *extra]) == 2
        (error,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert expected in error, error


def test_a_summary_json_in_a_directory_yet_to_be_made_is_written_there(package, tmp_path):
    summary = tmp_path / "w" / "reports" / "s.json"  # inside the workdir the replay makes
    assert cli.main([str(package), "--workdir", str(tmp_path / "w"), "--summary-json", str(summary)]) == 0
    assert summary.is_file()


def test_an_s3_store_without_a_bucket_is_refused_not_made_a_local_folder(package, tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    error = _refused(capsys, str(package), "--workdir", str(tmp_path / "w"), "--store", "s3://")
    assert "--store" in error and "names no bucket: write s3://BUCKET/PATH" in error
    assert sorted(tmp_path.iterdir()) == []  # neither the workdir nor a folder "s3:"


@pytest.mark.parametrize("kind, expected", [("missing", "does not exist: make it with `pyflyte"),
                                            ("directory", "is a directory: give the archive file"),
                                            ("not-tar", "is not a tar archive: give the .tgz")])
def test_a_package_that_is_no_archive_is_refused_before_a_workdir_is_made(tmp_path, capsys, monkeypatch,
                                                                           kind, expected):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the default workdir would go
    (tmp_path / "tmp").mkdir()
    (tmp_path / "directory").mkdir()
    (tmp_path / "not-tar").write_text("not a tar file\n" * 100)
    for workdir in (["--workdir", str(tmp_path / "w")], []):
        error = _refused(capsys, str(tmp_path / kind), *workdir)
        assert f"argument PKG: {tmp_path / kind} {expected}" in error
    assert not (tmp_path / "w").exists() and list((tmp_path / "tmp").iterdir()) == []


def test_a_truncated_archive_is_refused_naming_it(package, tmp_path, capsys):
    big = tmp_path / "big.tgz"
    with tarfile.open(big, "w:gz") as tar:
        tar.add(package, "0_t_1.pb")
        data = bytes(range(256)) * 4096  # 1 MiB that gzip barely shrinks
        info = tarfile.TarInfo("1_blob_1.pb")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    truncated = tmp_path / "truncated.tgz"
    truncated.write_bytes(big.read_bytes()[:2048])
    assert cli.main([str(truncated), "--workdir", str(tmp_path / "w")]) == 2
    assert f"{truncated} is not a readable tar archive" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # found once unpacking began: the workdir made for it is gone


def test_a_workdir_that_is_a_file_is_refused(package, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for workdir in ("file", "file/sub"):
        error = _refused(capsys, str(package), "--workdir", str(tmp_path / workdir))
        assert f"argument --workdir: {tmp_path / 'file'} is a file, not a directory" in error


def test_a_workdir_where_no_directory_can_be_made_is_refused():
    # sysfs refuses a new directory even to root, for whom access() says every directory is writable
    with pytest.raises(argparse.ArgumentTypeError,
                       match="^/sys cannot be written .Operation not permitted.: name a directory you"):
        cli.workdir_path("/sys/replay-workdir")


@pytest.mark.parametrize("flag, value", [("--node-timeout", "0"), ("--node-timeout", "-5"),
                                         ("--node-timeout", "nan"), ("--node-timeout", "inf"),
                                         ("--node-timeout", "ten"), ("--reschedule-after", "-1"),
                                         ("--reschedule-after", "nan"), ("--reschedule-after", "inf")])
def test_durations_must_be_finite_and_positive(package, capsys, flag, value):
    error = _refused(capsys, str(package), f"{flag}={value}")
    assert f"argument {flag}: {value!r} is not a number of seconds" in error


def test_durations_that_are_finite_and_positive_are_taken(package):
    args = cli.parse_args([str(package), "--node-timeout", "1e3", "--reschedule-after", "0"])
    assert (args.node_timeout, args.reschedule_after) == (1000.0, 0.0)  # 0: a lost pod is made again at once


def test_python_bin_must_be_a_directory_holding_flytekits_entry_points(package, tmp_path, capsys):
    error = _refused(capsys, str(package), "--python-bin", sys.executable)
    assert f"is not a directory: give the directory holding pyflyte-fast-execute and pyflyte-execute, e.g. " \
           f"its directory {BIN}" in error
    (tmp_path / "pyflyte-execute").write_text("#!/bin/sh\n")
    (tmp_path / "pyflyte-execute").chmod(0o755)
    error = _refused(capsys, str(package), "--python-bin", str(tmp_path))
    assert f"argument --python-bin: {tmp_path} lacks pyflyte-fast-execute: give the bin directory" in error
    assert cli.parse_args([str(package), "--python-bin", str(BIN)]).python_bin == BIN


@pytest.mark.parametrize("given, expected", [
    ("warm_start=yes", "--input warm_start='yes': a bool input takes true or false (any case), or 1 or 0"),
    ("nproc_per_node=two", "--input nproc_per_node='two': invalid literal for int()"),
    ("threshold=0.5", "input(s) ['threshold'] are fixed by the launch plan scheduled and cannot be "
                      "overridden: replay its workflow's launch plan (--launch-plan "
                      f"{WORKFLOW}) to set them"),
    ("nope=1", "unknown input(s) ['nope']; the launch plan takes ['champion', 'nproc_per_node', ")])
def test_input_errors_say_what_the_input_takes(package, tmp_path, capsys, given, expected):
    argv = [str(package), "--workdir", str(tmp_path / "w"), "--launch-plan", "scheduled", "--input", given]
    assert cli.main(argv) == 2
    assert f"replay: error: {expected}" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_an_optional_input_takes_its_types_values_as_flytekit_reads_them():
    from flytekit import FlyteContext
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Literal

    inputs = literals.launch_inputs(_plan(WORKFLOW, False), {"champion": "/tmp/x", "warm_start": "TRUE"})
    champion = inputs.literals["champion"]
    assert literals.to_python(champion) == "/tmp/x" and literals.to_python(inputs.literals["warm_start"])
    read = TypeEngine.to_python_value(FlyteContext.current_context(), Literal.from_flyte_idl(champion),
                                      str | None)
    assert read == "/tmp/x"
    collection = types_pb2.LiteralType(collection_type=STRING)
    with pytest.raises(literals.InputError, match="its type .collection_type. cannot be given on the"):
        literals.input_literal("a", collection, "names")


def test_the_last_of_a_repeated_input_wins_and_make_replay_puts_the_users_last():
    assert cli._overrides(["nproc_per_node=2", "max_steps=5", "nproc_per_node=4"]) == {
        "nproc_per_node": "4", "max_steps": "5"}
    dry_run = subprocess.run(["make", "-n", "--no-print-directory", "replay", f"BIN={BIN}",
                              "REPLAY_INPUTS=--input nproc_per_node=4 --input nnodes=3"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    replays = [shlex.split(line) for line in dry_run.replace("\\\n", " ").splitlines() if "-m replay" in line]
    assert len(replays) == 2
    for words in replays:
        given = [words[i + 1] for i, word in enumerate(words) if word == "--input"]
        assert {"nproc_per_node": "4", "nnodes": "3"}.items() <= cli._overrides(given).items()


def test_a_retry_checks_its_flags_as_the_replay_does(package, tmp_path, capsys):
    required = ["--store", str(tmp_path / "store"), "--execution", "e", "--node", "n0"]
    workdir = ["--workdir", str(tmp_path / "w")]
    error = _refused(capsys, str(tmp_path), *required, *workdir, main=retry.main)
    assert f"argument package: {tmp_path} is a directory: give the archive file" in error
    for attempt in ("0", "-1", "one"):
        error = _refused(capsys, str(package), *required, *workdir, "--attempt", attempt, main=retry.main)
        assert f"argument --attempt: {attempt!r} is not an attempt number >= 1" in error
    error = _refused(capsys, str(package), *required, *workdir, "--node-timeout", "nan", main=retry.main)
    assert "argument --node-timeout: 'nan' is not a number of seconds > 0" in error
    error = _refused(capsys, str(package), *required, "--workdir", str(package / "w"), main=retry.main)
    assert f"argument --workdir: {package} is a file, not a directory" in error
    assert not (tmp_path / "w").exists()


def test_a_retry_of_a_node_the_workflow_lacks_names_it(package, tmp_path, capsys):
    argv = [str(package), "--store", str(tmp_path / "store"), "--execution", "e", "--node", "n9",
            "--workdir", str(tmp_path / "w")]
    assert retry.main(argv) == 2
    assert f"replay.retry: error: no node 'n9' in workflow {WORKFLOW}" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # made to unpack the package, and removed with the refusal


@pytest.mark.parametrize("main, work, prog", [(cli.main, "replay_package", "replay"),
                                              (retry.main, "rerun_node", "replay.retry")])
def test_ctrl_c_is_one_line_and_exit_130(package, tmp_path, capsys, monkeypatch, main, work, prog):
    """Ctrl-C on the replay (or its retry) was a traceback; run_pods' own clean-up stops the pods."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules[main.__module__], work, interrupted)
    argv = [str(package), "--workdir", str(tmp_path / "w")]
    if main is retry.main:
        argv += ["--store", str(tmp_path / "store"), "--execution", "e", "--node", "n0"]
    assert main(argv) == 130
    assert capsys.readouterr().err == (f"{prog}: interrupted: the running node's pods were stopped; the "
                                       "workdir keeps every pod's log\n")
