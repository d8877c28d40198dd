"""The benchmark runner, the loader, validation, staging, streaming, end-to-end, sharded-checkpoint and
object-store benchmarks run at tiny sizes and write their tables (the last two in one run of the runner,
shared by their tests).

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


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bench/run.py --only sharded object_store --tiny``, once for the module: its results directory. One
    runner for both saves a start-up (torch's import, for the machine's record)."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run([sys.executable, "bench/run.py", "--only", "sharded", "object_store", "--tiny",
                           "--results", str(out / "results"), "--scratch", str(out / "scratch")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "results"


def tiny_result(results: Path, name: str) -> dict:
    """The entry of benchmark ``name`` in ``results``/latest.json, which must have run without an error."""
    bench = next(b for b in json.loads((results / "latest.json").read_text())["benchmarks"]
                 if b["benchmark"] == name)
    assert "error" not in bench, bench
    return bench


def run_tiny(tmp_path: Path, *names: str) -> dict:
    """``bench/run.py --only NAMES --tiny`` into ``tmp_path``: latest.json, parsed, and latest.md."""
    results = tmp_path / "results"
    done = subprocess.run([sys.executable, "bench/run.py", "--only", *names, "--tiny", "--results",
                           str(results), "--scratch", str(tmp_path / "scratch")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads((results / "latest.json").read_text()), "table": (results / "latest.md").read_text()}


def test_runner_writes_loader_validation_and_staging_tables(tmp_path):
    report = run_tiny(tmp_path, "loader", "validation", "staging")
    assert {"cpu", "cores", "ram_gib", "torch", "cuda_device", "git", "date"} <= set(report["machine"])
    by_name = {b["benchmark"]: b for b in report["benchmarks"]}
    assert "error" not in by_name["loader"], by_name
    loaders = [row["loader"] for row in by_name["loader"]["results"]]
    assert loaders == ["naive", "staged", "staged+cpu", "memcpy"]
    # 8 steps validated every 4 against at the end only: 2 validations and saves against 1.
    validation = by_name["validation"]
    assert "error" not in validation, validation
    assert [(row["case"], row["validations"], row["kept_checkpoints"]) for row in validation["results"]] == [
        ("end only", 1, 1), ("eval_every=4", 2, 2)]
    assert validation["ratios"]["eval_every=4/end only"] > 0
    # The same staging in one and in two partitions (the script refuses to report different manifests).
    staging = by_name["staging"]
    assert "error" not in staging, staging
    assert [row["partitions"] for row in staging["results"]] == [1, 2]
    assert staging["ratios"]["1 over 2 partitions (speed-up)"] > 0
    assert all(f"### {name}" in report["table"] for name in ("loader", "validation", "staging"))


def test_streaming_bench_reads_a_staging_served_as_a_slow_store(tmp_path):
    # Its own runner: two streamed training runs to a first step make it the longest of the tiny benches.
    (streaming,) = run_tiny(tmp_path, "streaming")["benchmarks"]
    assert streaming["benchmark"] == "streaming" and "error" not in streaming, streaming
    # Streamed from bench/slow_store.py (a local directory served as S3, with latency): every loader and
    # evaluation row read batches, two streamed runs reached a first step, the cache stayed within its limit.
    rates = {row["case"]: row.get("samples_per_s") or row.get("seconds") for row in streaming["results"]}
    assert len(rates) == 10 and all(value > 0 for value in rates.values()), rates
    assert 0 < streaming["ratios"]["cache peak disk over its limit"] <= 1.0
    assert streaming["ratios"]["time to first step, large over small"] > 0


def test_runner_writes_the_end_to_end_table(tmp_path):
    report = run_tiny(tmp_path, "end_to_end")
    (end_to_end,) = report["benchmarks"]
    assert "error" not in end_to_end, end_to_end
    rows = end_to_end["results"]
    assert [(row["model"], row["variant"]) for row in rows] == [
        ("vit_tiny", "naive"), ("vit_tiny", "torchrun"), ("vit_tiny", "pyflyte")]
    for row in rows:  # 4 steps, a save every 2: steps 2 and 4
        assert row["saves"] == 2 and row["stall_per_save_s"] > 0, row
        assert 0 < row["first_step_s"] <= row["to_n_steps_s"] <= row["command_s"], row
        assert row["peak_rss_gib"] > 0.1, row
        assert row["timed"], row  # every row says what its command does in the time measured
    assert set(end_to_end["ratios"]) == {"vit_tiny naive/torchrun", "vit_tiny pyflyte/torchrun",
                                         "vit_tiny pyflyte/torchrun to N steps"}
    pyflyte = next(row for row in rows if row["variant"] == "pyflyte")
    torchrun = next(row for row in rows if row["variant"] == "torchrun")
    # The pyflyte ratio is of the whole commands: the workflow (export and evaluation included) over torchrun.
    assert end_to_end["ratios"]["vit_tiny pyflyte/torchrun"] == pytest.approx(
        pyflyte["command_s"] / torchrun["command_s"])
    table = report["table"]
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


SAVE_COLUMNS = {"mode", "saves", "steps_between", "first_blocks_s", "blocks_s", "snapshot_wait_s",
                "next_step_s", "committed_s", "rank0_rss_increase_gib", "rank0_rss_peak_gib",
                "rank1_rss_increase_gib", "rank0_written_mb", "rank1_written_mb", "gathered_to_rank0_mb",
                "stall_vs_naive", "committed_vs_naive", "rss_increase_vs_naive"}
STEP_COLUMNS = {"parallelism", "step_s", "rank0_state_mb", "rank1_state_mb", "rank0_peak_rss_gib",
                "rank1_peak_rss_gib", "step_vs_ddp", "state_vs_ddp", "peak_rss_vs_ddp"}


def test_sharded_bench_shows_where_each_mode_writes(tiny_results):
    """About 20 MB of FSDP state on two ranks, through the runner: every column, naive writes everything
    from rank 0 after gathering rank 1's half, the DCP modes split the bytes, fsdp holds half of ddp."""
    results = tiny_results
    sharded = tiny_result(results, "sharded")
    state_mb = sharded["state_bytes"] / 1e6
    assert 15 < state_mb < 30
    rows = {row["mode"]: row for row in sharded["results"]}
    assert list(rows) == ["naive (sync)", "dcp", "async", "dcp, torch writer", "async, torch stager"]
    for row in rows.values():
        assert set(row) == SAVE_COLUMNS, row
        assert row["saves"] == 2 and row["rank0_rss_peak_gib"] > 0, row
    naive = rows.pop("naive (sync)")
    assert naive["rank1_written_mb"] == 0 and naive["rank0_written_mb"] >= state_mb
    assert naive["gathered_to_rank0_mb"] == pytest.approx(state_mb / 2, rel=0.01)
    assert naive["snapshot_wait_s"] is None and naive["steps_between"] == 0  # saves back to back
    for mode in ("async", "async, torch stager"):  # they train beside the copy
        assert rows[mode]["steps_between"] >= 1 and rows[mode]["snapshot_wait_s"] is not None, mode
    for mode, row in rows.items():  # every rank writes its own half; nothing is gathered
        assert row["gathered_to_rank0_mb"] == 0, mode
        assert row["rank1_written_mb"] == pytest.approx(state_mb / 2, rel=0.05), mode
        assert row["rank0_written_mb"] + row["rank1_written_mb"] >= state_mb, mode
    ddp, fsdp = sharded["tables"]["fsdp vs ddp"]
    assert (ddp["parallelism"], fsdp["parallelism"]) == ("ddp", "fsdp")
    assert set(ddp) == set(fsdp) == STEP_COLUMNS
    assert ddp["rank0_state_mb"] == ddp["rank1_state_mb"] == pytest.approx(state_mb, rel=0.01)
    assert fsdp["state_vs_ddp"] == pytest.approx(0.5, rel=0.01)
    assert sharded["ratios"]["fsdp/ddp rank-0 state bytes"] == fsdp["state_vs_ddp"]
    table = (results / "latest.md").read_text()
    assert "### sharded" in table and "#### fsdp vs ddp" in table and "| async, torch stager |" in table
    headers = [line for line in table.splitlines() if line.startswith("| mode |") or
               line.startswith("| parallelism |")]
    assert [set(h.strip("| ").split(" | ")) for h in headers] == [SAVE_COLUMNS, STEP_COLUMNS]
    assert "Disk, dd of" in table and "about 1/2 (1/N)" in table


def test_merge_keeps_the_benchmarks_not_run_with_their_run(tmp_path):
    run = _runner()
    earlier = {"command": "python bench/run.py", "machine": {"date": "then", "git": "abc1234",
                                                             "load_avg_1m_5m_15m": "1.0, 1.0, 1.0"},
               "benchmarks": [{"benchmark": "loader", "results": [{"loader": "naive"}]},
                              {"benchmark": "sharded", "results": [{"mode": "old"}]}]}
    (tmp_path / "latest.json").write_text(json.dumps(earlier))
    fresh = [{"benchmark": "sharded", "results": [{"mode": "new"}]}]
    results = run.merged(run.read_previous(tmp_path / "latest.json"), fresh)
    assert [r["benchmark"] for r in results] == ["loader", "sharded"]  # in BENCHMARKS order
    assert results[1] == fresh[0] and results[0]["measured_in"]["command"] == "python bench/run.py"
    table = run.markdown(run.machine_info(), results, "python bench/run.py --only sharded --merge")
    assert "From an earlier run: `python bench/run.py` on then, git abc1234" in table
    assert run.read_previous(tmp_path / "absent.json") is None and run.merged(None, fresh) == fresh


def test_object_store_bench_saves_into_a_local_s3_server_and_compares(tiny_results):
    """Our dcp save and load beside boto3's upload_file and download_file of the same bytes."""
    bench = tiny_result(tiny_results, "object_store")
    rows = {row["case"]: row for row in bench["results"]}
    dcp = rows["dcp into the store (ours)"]
    plain = rows["boto3 upload_file of the shards' bytes"]
    assert dcp["bytes_mb"] >= plain["bytes_mb"] > 1  # the checkpoint holds the shards and a little more
    load, download = rows["dcp load from the store (ours)"], rows["boto3 download_file of the shards"]
    assert load["bytes_mb"] == download["bytes_mb"] == plain["bytes_mb"]
    assert all(row["seconds"] > 0 for row in rows.values())
    assert rows["async into the store (ours)"]["blocks_s"] > 0
    assert set(bench["ratios"]) == {"dcp bytes/s over boto3 upload_file bytes/s",
                                    "dcp load bytes/s over boto3 download_file bytes/s",
                                    "async blocking over one in-memory copy"}


def test_the_fork_gate_script_counts_its_launches_both_ways():
    # A few launches of two forked workers each way; how many hang is what the script is for, not asserted.
    done = subprocess.run([sys.executable, "bench/fork_gate.py", "--launches", "3", "--workers", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "launches of 2 forked workers hung" in line]
    assert [line.split(":")[0] for line in lines] == ["without the start gate", "with the start gate"], lines
    assert "with the start gate: 0 of 3 launches" in done.stdout, done.stdout
