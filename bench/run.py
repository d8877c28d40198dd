"""Run every benchmark and write bench/results/latest.json and latest.md: `make bench`.

    python bench/run.py [--results bench/results] [--scratch runs/bench] [--only NAME ...] [--tiny] [--merge]

Each benchmark script runs as its own process with ``--json PATH`` and writes
``{"benchmark": name, "results": [rows], "ratios": {name: value}}`` (optionally ``"targets": {name:
text}``, ``"tables": {title: [rows]}`` for further tables, ``"notes": [line]`` listed below them). A
script that is missing, fails or writes no JSON becomes one error line in the tables; the other
benchmarks still run. The results carry the machine they were measured on. ``--merge`` keeps the tables of
the benchmarks not run this time from the existing latest.json, each marked with the run it came from (to
re-measure one benchmark, e.g. ``--only sharded --merge``, without re-running the others). A --results or
--scratch that cannot be written, or with --merge a damaged latest.json, is refused before any benchmark runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.tables import markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ERROR_CHARS = 400  # of a failed benchmark's error line in latest.md (latest.json has all of it)
BENCHMARKS = ("loader", "checkpoint", "sharded", "object_store", "step", "startup", "end_to_end",
              "preemption", "validation", "staging", "streaming")
# The targets, for benchmarks whose JSON states none: (benchmark, ratio) -> target, and (benchmark,
# None) -> the target of every ratio of that benchmark.
TARGETS = {("checkpoint", "async_blocking_over_copy"): "<= 0.1", ("step", None): "<= 1.05",
           ("startup", "1 process"): "<= 1.5", ("startup", "2 processes"): "<= 1.5"}
TINY_ARGS = {  # seconds-long sizes for a smoke run; scripts without such options get none
    "loader": ["--images", "200", "--size", "16", "--naive-samples", "64", "--rounds", "1"],
    "end_to_end": ["--tiny"],
    # ~20 MB of state; ranks forked from the script's process, which has torch imported: fresh interpreters
    # for every pair of ranks would be most of a smoke run's CPU time
    "sharded": ["--params", "1.7M", "--width", "512", "--repeats", "2", "--steps", "2",
                "--start-method", "fork"],
    "object_store": ["--params", "1.7M", "--width", "512", "--repeats", "2", "--start-method", "fork"],
    "preemption": ["--steps", "20", "--rounds", "1"],
    "validation": ["--steps", "8", "--eval-every", "4", "--repeats", "1"],
    "staging": ["--samples", "600", "--size", "8", "--partitions", "1", "2", "--repeats", "1"],
    "streaming": ["--samples", "3000", "--small-samples", "300", "--size", "16", "--batches", "10",
                  "--cache-mb", "1"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked before any benchmark runs (a full run is 20 minutes): --results and --scratch
    are made writable directories, and with --merge ``previous`` is the report in --results/latest.json (None
    when there is none yet)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"),
                        help="where latest.json and latest.md go")
    parser.add_argument("--scratch", default=str(ROOT / "runs" / "bench"),
                        help="generated data, run directories and per-benchmark JSON (not committed)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--tiny", action="store_true", help="smoke-test sizes where a benchmark has them")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other benchmarks' tables of the existing latest.json (with their run)")
    args = parser.parse_args(argv)
    for flag, path in (("--results", args.results), ("--scratch", args.scratch)):
        problem = _directory_problem(Path(path))
        if problem:
            parser.error(f"{flag} {path} {problem}")
    for name in ("latest.json", "latest.md"):
        if (Path(args.results) / name).is_dir():
            parser.error(f"--results {args.results} holds a directory {name}, where the table is written: "
                         "remove it or name another --results")
    args.previous = None
    if args.merge:
        latest = Path(args.results) / "latest.json"
        try:
            args.previous = read_previous(latest)
        except ValueError as exc:
            parser.error(f"--merge: {exc}: repair or remove it, or run without --merge")
        if args.previous is None:
            print(f"warning: --merge: {latest} does not exist, so nothing is merged: it will hold only the "
                  "benchmarks of this run", file=sys.stderr, flush=True)
    return args


def _directory_problem(path: Path) -> str | None:
    """Why ``path`` cannot hold the runner's files (it is created when missing), None when it can."""
    if path.exists() and not path.is_dir():
        return "is a file, not a directory: name a directory (it is created when missing)"
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        return (f"is not a directory that can be written ({exc.strerror or exc}): name a directory you can "
                "write to or create")
    return None


def read_previous(path: Path) -> dict | None:
    """The report in an earlier latest.json, None when there is none; ValueError saying what is wrong with
    it, so that --merge never silently drops the benchmarks it holds."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise ValueError(f"{path} cannot be read ({exc})") from exc
    try:
        report = json.loads(text)
    except ValueError as exc:
        conflict = next((number for number, line in enumerate(text.splitlines(), 1)
                         if line.startswith("<<<<<<<")), None)
        if conflict:
            raise ValueError(f"{path} has git conflict markers (line {conflict})") from exc
        raise ValueError(f"{path} is not valid JSON ({exc})") from exc
    problem = _report_problem(report)
    if problem:
        raise ValueError(f"{path} is not a report of bench/run.py: {problem}")
    return report


def _report_problem(report: object) -> str | None:
    """What in a parsed latest.json ``merged`` and ``markdown`` cannot use, None when nothing."""
    if not isinstance(report, dict) or not isinstance(report.get("benchmarks"), list):
        return "not an object with a 'benchmarks' list"
    if not isinstance(report.get("machine", {}), dict):
        return "its 'machine' is not an object"
    for index, entry in enumerate(report["benchmarks"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("benchmark"), str):
            return f"benchmarks[{index}] is not an object with a 'benchmark' name"
        where = f"benchmarks[{index}] ({entry['benchmark']})"
        run = entry.get("measured_in", {"command": "", "machine": {}})
        if not (isinstance(run, dict) and "command" in run and isinstance(run.get("machine"), dict)):
            return f"{where} has a 'measured_in' without its 'command' and 'machine'"
        if "error" in entry:
            if not isinstance(entry["error"], str):
                return f"{where} has an 'error' that is not text"
            continue
        results, tables = entry.get("results"), entry.get("tables", {})
        if not (_rows(results) and isinstance(tables, dict) and all(map(_rows, tables.values()))):
            return f"{where} has no 'error', and its 'results' or 'tables' are not lists of rows (objects)"
        if not isinstance(entry.get("ratios", {}), dict) or not isinstance(entry.get("notes", []), list):
            return f"{where} has 'ratios' that are not an object or 'notes' that are not a list"
    return None


def _rows(rows: object) -> bool:
    """Whether ``rows`` is what markdown_table takes: a list of objects."""
    return isinstance(rows, list) and all(isinstance(row, dict) for row in rows)


def machine_info() -> dict:
    """CPU model, cores, RAM, torch version, CUDA device, git revision, load average and date of this run."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_kib = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True)
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kib / 2**20, 1),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "git": git.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") or "unknown",
            "load_avg_1m_5m_15m": ", ".join(f"{load:.1f}" for load in os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def run_benchmark(name: str, script: Path, args: list[str], scratch: Path) -> dict:
    """Run one benchmark script with ``--json``: its JSON, or ``{"benchmark", "error"}`` naming the fault."""
    if not script.exists():
        return {"benchmark": name, "error": f"{os.path.relpath(script, ROOT)} does not exist"}
    out = scratch / f"{name}.json"
    out.unlink(missing_ok=True)
    errors = scratch / f"{name}.stderr.log"
    start = time.perf_counter()
    with open(errors, "w") as stderr:  # stdout stays live on the terminal
        code = subprocess.run([sys.executable, str(script), *args, "--json", str(out)], cwd=ROOT,
                              stderr=stderr).returncode
    seconds = time.perf_counter() - start
    if code or not out.exists():
        lines = [line for line in errors.read_text(errors="replace").splitlines() if line.strip()]
        lines = lines or ["no output on stderr"]
        why = f"exit code {code}" if code else "it wrote no --json file"
        return {"benchmark": name, "error": f"{os.path.relpath(script, ROOT)} failed ({why}): {lines[-1]} "
                                            f"(full output: {os.path.relpath(errors, ROOT)})"}
    try:
        result = json.loads(out.read_text())
        if not isinstance(result.get("results"), list):
            raise ValueError("no 'results' list")
    except ValueError as exc:
        return {"benchmark": name, "error": f"{os.path.relpath(script, ROOT)} wrote unusable JSON ({exc})"}
    return {**result, "benchmark": name, "seconds": round(seconds, 1)}


def markdown(machine: dict, results: list[dict], command: str) -> str:
    """The report: machine, then per benchmark its rows and its ratios against their targets."""
    lines = [f"Measured with `{command}` on {machine['date']}, git {machine['git']}.", "",
             markdown_table([machine]), ""]
    for result in results:
        lines.append(f"### {result['benchmark']}")
        lines.append("")
        if "measured_in" in result:
            command, machine = result["measured_in"]["command"], result["measured_in"]["machine"]
            lines += [f"From an earlier run: `{command}` on {machine.get('date')}, git {machine.get('git')}, "
                      f"load average {machine.get('load_avg_1m_5m_15m')}.", ""]
        if "error" in result:
            error = result["error"]
            shown = error if len(error) <= ERROR_CHARS else f"{error[:ERROR_CHARS]} ... (see latest.json)"
            lines += [f"**error**: {shown}", ""]
            continue
        lines += [markdown_table(result["results"]), ""]
        for title, rows in result.get("tables", {}).items():
            lines += [f"#### {title}", "", markdown_table(rows), ""]
        ratios = [{"ratio": name, "value": value, "target": target_of(result, name)}
                  for name, value in result.get("ratios", {}).items()]
        if ratios:
            lines += [markdown_table(ratios), ""]
        if result.get("notes"):
            lines += [*(f"- {note}" for note in result["notes"]), ""]
    return "\n".join(lines)


def target_of(result: dict, ratio: str) -> str:
    """The target a ratio is held to: the benchmark's own, else the issue's (TARGETS), else "(none)"."""
    name = result["benchmark"]
    own = result.get("targets", {}).get(ratio)
    return own or TARGETS.get((name, ratio)) or TARGETS.get((name, None)) or "(none)"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    scratch, out = Path(args.scratch).resolve(), Path(args.results)
    results = []
    for name in args.only:
        extra = TINY_ARGS.get(name, []) if args.tiny else []
        if name in ("loader", "end_to_end", "sharded"):
            extra = [*extra, "--dir", str(scratch)]
        if name == "streaming":  # its datasets are kept apart from the others', tiny ones too
            extra = [*extra, "--dir", str(scratch / ("streaming-tiny" if args.tiny else "streaming"))]
        print(f"== {name}", flush=True)
        results.append(run_benchmark(name, ROOT / "bench" / f"{name}.py", extra, scratch))
    machine = machine_info()
    command = " ".join(["python bench/run.py", *(sys.argv[1:] if argv is None else argv)])
    if args.merge:
        results = merged(args.previous, results)
    report = {"machine": machine, "command": command, "benchmarks": results}
    _publish(out / "latest.json", json.dumps(report, indent=2) + "\n")
    _publish(out / "latest.md", markdown(machine, results, command) + "\n")
    print(f"wrote {out / 'latest.json'} and {out / 'latest.md'}")


def merged(previous: dict | None, results: list[dict]) -> list[dict]:
    """``results`` plus the benchmarks they lack from ``previous`` (an earlier latest.json's report, checked
    by read_previous; None: there is none), each of those marked with the run it was measured in; in
    BENCHMARKS order."""
    if previous is None:
        return results
    earlier = {"command": previous.get("command", "unknown"), "machine": previous.get("machine", {})}
    ran = {result["benchmark"] for result in results}
    kept = [{**result, "measured_in": result.get("measured_in", earlier)}
            for result in previous["benchmarks"] if result["benchmark"] not in ran]
    order = {name: index for index, name in enumerate(BENCHMARKS)}
    return sorted([*kept, *results], key=lambda result: order.get(result["benchmark"], len(order)))


def _publish(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a reader never sees a half-written table."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


if __name__ == "__main__":
    main()
