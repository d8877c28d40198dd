"""Start-up: phase marks from the process start, what a fresh interpreter imports, the startup record."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from traincore.telemetry.startup import StartupClock, process_start_time

# What a default run must not pay for at import: DCP (dcp/async checkpoints only), TensorBoard and W&B
# (their sinks only), torchvision (its models only).
HEAVY = ("torch.distributed.checkpoint", "tensorboard", "torch.utils.tensorboard", "wandb", "torchvision")


def run_python(code: str, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter; its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_process_start_time_counts_what_ran_before_the_first_call():
    # The interpreter sleeps before it asks: the start time must lie before the sleep, not at the call.
    out = run_python("import time\ntime.sleep(0.6)\nasked = time.time()\n"
                     "from traincore.telemetry.startup import process_start_time\n"
                     "print(asked - process_start_time())")
    assert 0.6 <= float(out) < 30


def test_process_start_time_is_stable_and_in_the_past():
    first, second = process_start_time(), process_start_time()
    assert abs(first - second) < 0.05
    assert first < time.time()


def test_phases_add_up_to_the_total_and_read_as_one_line():
    clock = StartupClock(origin=time.time() - 1.0)
    clock.mark("imports")
    time.sleep(0.05)
    clock.mark("process group")
    assert list(clock.phases) == ["imports", "process group"]
    assert clock.phases["imports"] >= 1.0 and clock.phases["process group"] >= 0.05
    assert clock.total == pytest.approx(sum(clock.phases.values()), abs=1e-6)
    record = clock.record()
    assert set(record) == {"imports_s", "process_group_s", "total_s", "origin"}
    assert record["origin"] == clock.origin
    line = clock.describe()
    assert line.startswith(f"start-up {clock.total:.1f} s to first step: imports 1.")
    assert "process group 0.0" in line


def test_a_clock_handed_to_a_worker_continues_from_the_launchers_last_mark():
    launcher = StartupClock(origin=time.time() - 1.0)
    launcher.mark("imports")
    state = launcher.state_dict()
    time.sleep(0.05)
    worker = StartupClock()  # built later, elsewhere: its own origin is replaced by the launcher's
    worker.load_state_dict(state)
    worker.mark("launch")
    assert list(worker.phases) == ["imports", "launch"] and worker.origin == launcher.origin
    assert worker.phases["imports"] == launcher.phases["imports"] and worker.phases["launch"] >= 0.05
    assert worker.total == pytest.approx(sum(worker.phases.values()), abs=1e-6)
    assert launcher.phases == {"imports": state["phases"]["imports"]}  # the launcher's own clock is untouched


def test_import_of_the_trainer_loads_no_heavy_optional_module():
    code = (f"import json, sys\nimport traincore.run.cli\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    loaded = json.loads(run_python(code))
    assert loaded == []


def test_preflight_of_our_own_model_does_not_import_sympy(synthetic_dir, tmp_path):
    # A forward on the meta device would (over a second): the launcher of forked workers only checks.
    code = f"""
import json, sys
from traincore.config.presets import debug
from traincore.run.preflight import preflight
preflight(debug(), {str(synthetic_dir)!r}, {str(tmp_path / "run")!r})
print(json.dumps([m for m in ("sympy", "torch._dynamo") if m in sys.modules]))
"""
    assert json.loads(run_python(code)) == []


@pytest.fixture(scope="module")
def sync_run(synthetic_dir, tmp_path_factory) -> dict:
    """A 4-step sync-mode run without TensorBoard in a fresh interpreter, as the CLI starts it: its output
    directory, its summary's start-up phases and which of HEAVY it had loaded when it finished."""
    output = tmp_path_factory.mktemp("sync-run") / "run"
    code = f"""
import json, sys
from traincore.config.presets import debug
from traincore.telemetry.startup import process_start_time
from traincore.run.trainer import Trainer
cfg = debug().with_overrides({{"train": {{"max_steps": 4}}, "checkpoint": {{"mode": "sync"}},
                              "telemetry": {{"tensorboard": False, "progress": "off"}}}})
summary = Trainer(cfg, {str(synthetic_dir)!r}, {str(output)!r}, started_at=process_start_time()).train()
print(json.dumps({{"startup": summary.startup_s, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    return {"output": output, **json.loads(run_python(code).splitlines()[-1])}


def test_a_sync_run_reports_its_start_up_phases(sync_run):
    phases = ["imports", "preflight", "dynamo import", "process group", "loader", "model", "telemetry",
              "checkpoint look-up", "first step"]
    assert list(sync_run["startup"]) == phases
    assert sync_run["startup"]["imports"] > 0.1  # at least the interpreter's start and `import torch`
    records = [json.loads(line) for line in (sync_run["output"] / "metrics.jsonl").read_text().splitlines()]
    startup = [record for record in records if record["kind"] == "startup"]
    assert len(startup) == 1 and startup[0]["step"] == 1
    assert startup[0]["total_s"] == pytest.approx(sum(sync_run["startup"].values()), abs=1e-3)
    assert startup[0]["first_step_s"] == pytest.approx(sync_run["startup"]["first step"], abs=1e-3)


def test_a_sync_run_without_tensorboard_loads_neither_tensorboard_nor_wandb_nor_torchvision(sync_run):
    assert [name for name in sync_run["loaded"] if name != "torch.distributed.checkpoint"] == []


def test_trainer_built_in_process_counts_from_its_construction(synthetic_dir, tmp_path):
    from traincore.config.presets import debug
    from traincore.run.trainer import Trainer

    cfg = debug().with_overrides({"train": {"max_steps": 2}, "telemetry": {"tensorboard": False,
                                                                           "progress": "off"}})
    summary = Trainer(cfg, synthetic_dir, tmp_path / "run").train()
    assert "imports" not in summary.startup_s  # this process's imports are not this run's start-up
    assert list(summary.startup_s)[-1] == "first step"
    assert sum(summary.startup_s.values()) < summary.wall_s + 60


def test_a_resumed_attempt_logs_its_own_startup_record(synthetic_dir, tmp_path):
    from traincore.config.presets import debug
    from traincore.run.trainer import Trainer

    cfg = debug().with_overrides({"train": {"max_steps": 2}, "telemetry": {"tensorboard": False,
                                                                           "progress": "off"}})
    Trainer(cfg, synthetic_dir, tmp_path / "run").train()
    Trainer(cfg.with_overrides({"train": {"max_steps": 4}}), synthetic_dir, tmp_path / "run").train()
    lines = (Path(tmp_path) / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if json.loads(line)["kind"] == "startup"] == [1, 3]
