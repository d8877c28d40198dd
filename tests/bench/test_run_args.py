"""bench/run.py refuses a --results or --scratch it cannot write, and with --merge a latest.json it cannot
read, before any benchmark runs. The runner runs in-process with stand-in benchmarks: seconds, not minutes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORT = {"command": "python bench/run.py", "machine": {"date": "then", "git": "abc1234"},
          "benchmarks": [{"benchmark": "loader", "results": [{"loader": "naive"}], "ratios": {"x": 1.0}},
                         {"benchmark": "step", "error": "bench/step.py failed"}]}


@pytest.fixture
def run():
    """bench/run.py as a module whose benchmarks and machine record are stand-ins; ``ran``: the benchmarks
    it ran."""
    spec = importlib.util.spec_from_file_location("bench_run_args", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ran = []

    def benchmark(name: str, script: Path, args: list[str], scratch: Path) -> dict:
        module.ran.append(name)
        return {"benchmark": name, "results": [{"row": name}], "ratios": {}}

    module.run_benchmark = benchmark
    module.machine_info = lambda: {"date": "now", "git": "def5678"}  # not torch's import, for speed
    return module


def refused(run, capsys: pytest.CaptureFixture, *argv: str) -> str:
    """The one ``error:`` line of ``bench/run.py ARGV``, which must exit 2 before running a benchmark."""
    with pytest.raises(SystemExit) as exited:
        run.main(list(argv))
    assert exited.value.code == 2 and run.ran == []
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    return errors[0]


def test_a_results_path_naming_a_file_is_refused_before_any_benchmark(run, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    error = refused(run, capsys, "--only", "loader", "--tiny", "--scratch", str(tmp_path / "scratch"),
                    "--results", str(afile))
    assert f"error: --results {afile} is a file, not a directory: name a directory" in error


@pytest.mark.parametrize(("flag", "path", "problem"), [
    ("--results", "afile/results", "is not a directory that can be written (Not a directory)"),
    ("--scratch", "afile", "is a file, not a directory"),
    ("--scratch", "afile/scratch", "is not a directory that can be written (Not a directory)"),
])
def test_a_results_or_scratch_that_cannot_be_a_directory_is_refused(run, tmp_path, capsys, flag, path,
                                                                    problem):
    (tmp_path / "afile").write_text("")
    paths = {"--results": str(tmp_path / "results"), "--scratch": str(tmp_path / "scratch"),
             flag: str(tmp_path / path)}
    error = refused(run, capsys, "--only", "loader", *(item for pair in paths.items() for item in pair))
    assert f"error: {flag} {tmp_path / path} {problem}" in error and "name a directory" in error


def test_a_directory_where_latest_json_goes_is_refused(run, tmp_path, capsys):
    (tmp_path / "results" / "latest.json").mkdir(parents=True)
    error = refused(run, capsys, "--only", "loader", "--results", str(tmp_path / "results"), "--scratch",
                    str(tmp_path / "scratch"))
    assert "holds a directory latest.json" in error and "remove it or name another --results" in error


@pytest.mark.parametrize(("text", "problem"), [
    (json.dumps(REPORT)[:-30], "is not valid JSON"),
    (f"<<<<<<< HEAD\n{json.dumps(REPORT)}\n=======\n{json.dumps(REPORT)}\n>>>>>>> other\n",
     "has git conflict markers (line 1)"),
    ("[]", "is not a report of bench/run.py: not an object with a 'benchmarks' list"),
    (json.dumps({**REPORT, "benchmarks": ["loader"]}), "benchmarks[0] is not an object with a 'benchmark'"),
    (json.dumps({**REPORT, "benchmarks": [{"benchmark": "loader", "results": "naive"}]}),
     "benchmarks[0] (loader) has no 'error', and its 'results' or 'tables' are not lists of rows"),
    (json.dumps({**REPORT, "benchmarks": [{"benchmark": "loader", "error": "x", "measured_in": "then"}]}),
     "benchmarks[0] (loader) has a 'measured_in' without its 'command' and 'machine'"),
    (b"\xff\xfe{}", "cannot be read ('utf-8' codec can't decode"),
])
def test_merge_refuses_a_damaged_latest_json_before_any_benchmark(run, tmp_path, capsys, text, problem):
    latest = tmp_path / "results" / "latest.json"
    latest.parent.mkdir()
    (latest.write_bytes if isinstance(text, bytes) else latest.write_text)(text)
    error = refused(run, capsys, "--only", "sharded", "--merge", "--results", str(latest.parent), "--scratch",
                    str(tmp_path / "scratch"))
    assert f"error: --merge: {latest}" in error and problem in error
    assert error.endswith(": repair or remove it, or run without --merge")
    assert (latest.read_bytes() if isinstance(text, bytes) else latest.read_text()) == text  # untouched


def test_merge_without_a_latest_json_says_that_nothing_is_merged(run, tmp_path, capsys):
    results = tmp_path / "results"
    run.main(["--only", "loader", "--merge", "--results", str(results), "--scratch", str(tmp_path / "s")])
    assert (f"warning: --merge: {results / 'latest.json'} does not exist, so nothing is merged"
            in capsys.readouterr().err)
    assert [b["benchmark"] for b in json.loads((results / "latest.json").read_text())["benchmarks"]] == [
        "loader"]


def test_merge_reads_the_reports_the_runner_writes(run, tmp_path):
    """The checks accept what the runner writes, merged entries too, and the committed latest.json."""
    results = tmp_path / "results"
    (results).mkdir()
    (results / "latest.json").write_text(json.dumps(REPORT))
    for only in ("sharded", "loader"):
        run.main(["--only", only, "--merge", "--results", str(results), "--scratch", str(tmp_path / "s")])
    report = json.loads((results / "latest.json").read_text())
    assert [(b["benchmark"], "measured_in" in b) for b in report["benchmarks"]] == [
        ("loader", False), ("sharded", True), ("step", True)]
    assert report["benchmarks"][2]["measured_in"]["command"] == "python bench/run.py"
    assert run.ran == ["sharded", "loader"]
    assert run.read_previous(ROOT / "bench" / "results" / "latest.json") is not None
