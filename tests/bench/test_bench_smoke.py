"""The benchmark runner and the end-to-end benchmark run at tiny sizes and write their tables.

Speed is not asserted here: the benchmarks print their ratios; these tests only check that they run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _runner():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_writes_loader_and_end_to_end_tables(tmp_path):
    results = tmp_path / "results"
    done = subprocess.run([sys.executable, "bench/run.py", "--only", "loader", "end_to_end", "--tiny",
                           "--results", str(results), "--scratch", str(tmp_path / "scratch")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((results / "latest.json").read_text())
    assert {"cpu", "cores", "ram_gib", "torch", "cuda_device", "git", "date"} <= set(report["machine"])
    by_name = {b["benchmark"]: b for b in report["benchmarks"]}
    assert "error" not in by_name["loader"] and "error" not in by_name["end_to_end"], by_name
    loaders = [row["loader"] for row in by_name["loader"]["results"]]
    assert loaders == ["naive", "staged", "staged+cpu", "memcpy"]
    rows = by_name["end_to_end"]["results"]
    assert [(row["model"], row["variant"]) for row in rows] == [
        ("vit_tiny", "naive"), ("vit_tiny", "torchrun"), ("vit_tiny", "pyflyte")]
    for row in rows:  # 4 steps, a save every 2: steps 2 and 4
        assert row["saves"] == 2 and row["stall_per_save_s"] > 0, row
        assert 0 < row["first_step_s"] <= row["to_n_steps_s"] <= row["command_s"], row
        assert row["peak_rss_gib"] > 0.1, row
        assert row["timed"], row  # every row says what its command does in the time measured
    assert set(by_name["end_to_end"]["ratios"]) == {"vit_tiny naive/torchrun", "vit_tiny pyflyte/torchrun",
                                                    "vit_tiny pyflyte/torchrun to N steps"}
    pyflyte = next(row for row in rows if row["variant"] == "pyflyte")
    torchrun = next(row for row in rows if row["variant"] == "torchrun")
    # The pyflyte ratio is of the whole commands: the workflow (export and evaluation included) over torchrun.
    assert by_name["end_to_end"]["ratios"]["vit_tiny pyflyte/torchrun"] == pytest.approx(
        pyflyte["command_s"] / torchrun["command_s"])
    table = (results / "latest.md").read_text()
    assert "### end_to_end" in table and "| vit_tiny | pyflyte |" in table
    assert "| vit_tiny naive/torchrun |" in table and ">= 3" in table


def test_a_missing_or_failing_benchmark_becomes_an_error_line(tmp_path):
    run = _runner()
    missing = run.run_benchmark("step", tmp_path / "absent.py", [], tmp_path)
    assert missing == {"benchmark": "step", "error": f"{os.path.relpath(tmp_path / 'absent.py', ROOT)} "
                                                     "does not exist"}
    old = tmp_path / "old.py"  # a benchmark that has not gained --json yet
    old.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    failed = run.run_benchmark("startup", old, [], tmp_path)
    assert "failed (exit code 2)" in failed["error"] and "unrecognized arguments: --json" in failed["error"]
    silent = tmp_path / "silent.py"  # exits 0 but writes nothing
    silent.write_text("import sys\n")
    assert "wrote no --json file" in run.run_benchmark("checkpoint", silent, [], tmp_path)["error"]
    table = run.markdown(run.machine_info(), [missing, failed], "python bench/run.py")
    assert "### step\n\n**error**: " in table and "### startup\n\n**error**: " in table
