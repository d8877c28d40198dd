"""Metric sinks: which files each configuration writes, and where a W&B key may and may not go."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from traincore.config.schema import ConfigError, TelemetryConfig
from traincore.telemetry.sinks import (
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    build_sinks,
)
from traincore.telemetry.wandb_access import resolve_wandb_key, wandb_key_problem

SECRET = "local-0123456789abcdef0123456789abcdef01234567"  # a well-formed key of a local W&B server


@pytest.fixture(autouse=True)
def _isolated_wandb(monkeypatch, tmp_path):
    """No ambient W&B key, and W&B's home directories inside the test's tmp_path."""
    for name in ("WANDB_API_KEY", "WANDB_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def log_train_and_eval(output: Path, **overrides) -> None:
    """Open the configured sinks, log steps 1-2 and one eval at step 2, then close them."""
    cfg = TelemetryConfig(**{"tensorboard": False, **overrides})
    sinks = build_sinks(cfg, output, run_config={"model": {"name": "mlp"}})
    try:
        for step, loss in ((1, 1.0), (2, 2.0)):
            for sink in sinks:
                sink.log(step, {"loss": loss, "lr": 1e-3}, kind="train")
        for sink in sinks:
            sink.log(2, {"accuracy": 1.0}, kind="eval")
    finally:
        for sink in sinks:
            sink.close()


def test_only_jsonl_when_tensorboard_and_wandb_are_off(tmp_path):
    log_train_and_eval(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"], r.get("loss")) for r in records] == [
        (1, "train", 1.0), (2, "train", 2.0), (2, "eval", None)]


def test_jsonl_rejects_reserved_metric_names(tmp_path):
    sink = JsonlSink(tmp_path)
    with pytest.raises(ValueError, match=r"\['step'\] are reserved"):
        sink.log(1, {"step": 3.0})
    sink.close()
    assert not (tmp_path / "metrics.jsonl").exists()  # opened at the first record, and none was written


def test_wandb_offline_writes_a_run_and_never_the_key(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    output = tmp_path / "out"
    log_train_and_eval(output, wandb_mode="offline")
    runs = list((output / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert SECRET not in caplog.text
    for path in output.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_wandb_run_takes_its_name_tags_and_entity_from_the_config(tmp_path):
    cfg = TelemetryConfig(tensorboard=False, wandb_mode="offline", wandb_run_name="lr-sweep-7",
                          wandb_entity="vision-team", wandb_tags=["digits", "baseline"])
    (sink,) = [sink for sink in build_sinks(cfg, tmp_path, run_config={}) if isinstance(sink, WandbSink)]
    try:
        sink.log(1, {"loss": 1.0})
        run = sink._run  # the wandb Run our sink started: what W&B was given
        assert (run.name, tuple(run.tags)) == ("lr-sweep-7", ("digits", "baseline"))
        assert run.entity == "vision-team"
    finally:
        sink.close()
    with pytest.raises(ValueError, match="telemetry.wandb_tags=.* is invalid: expected a list of 1-64"):
        TelemetryConfig(wandb_tags=["x" * 65])


def test_wandb_key_file_must_be_readable(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="WANDB_API_KEY_FILE=.*missing.* cannot be read"):
        resolve_wandb_key("online")
    assert resolve_wandb_key("offline") is None and resolve_wandb_key("disabled") is None


# Keys of every shape wandb's own check (wandb.sdk.lib.wbauth.validation.check_api_key) tells apart.
KEYS = ["0123456789abcdef0123456789abcdef01234567", "local-0123456789abcdef0123456789abcdef01234567",
        "0123456789abcdef0123456789abcdef0123456", "local-0123456789abcdef", "not-a-real-key",
        '"0123456789abcdef0123456789abcdef01234567"', "0123456789abcdef0123456789 abcdef01234567",
        "WANDB_API_KEY=0123456789abcdef0123456789abcdef01234567", "aaa.bbb.ccc", "aaa.bbb", "x" * 80,
        "on-prem-" + "a" * 40, "é" * 40]


@pytest.mark.parametrize("key", KEYS)
def test_the_key_shape_rule_is_wandbs_own(key):
    """Our offline check accepts exactly the keys the installed wandb accepts (so it fails when a wandb
    upgrade changes the rule)."""
    from wandb.sdk.lib.wbauth.validation import check_api_key

    assert (wandb_key_problem(key) is None) == (check_api_key(key) is None), key


@pytest.mark.parametrize("source", ["env", "file"])
@pytest.mark.parametrize("key", ["not-a-real-key", "0123456789abcdef0123456789abcdef 01234567"])
def test_a_malformed_key_is_refused_without_showing_it(tmp_path, monkeypatch, source, key):
    if source == "env":
        monkeypatch.setenv("WANDB_API_KEY", key)
    else:
        (tmp_path / "secret").write_text(key + "\n")
        monkeypatch.setenv("WANDB_API_KEY_FILE", str(tmp_path / "secret"))
    with pytest.raises(ValueError) as info:
        resolve_wandb_key("online")
    message = str(info.value)
    assert "is malformed" in message and "https://wandb.ai/authorize" in message
    assert ("in WANDB_API_KEY " if source == "env" else "WANDB_API_KEY_FILE=") in message
    assert key not in message and key.split("-", 1)[-1] not in message


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished += 1


def test_wandb_online_key_from_secret_file_reaches_wandb_only(tmp_path, monkeypatch, caplog):
    import wandb

    caplog.set_level(logging.DEBUG)
    (tmp_path / "secret").write_text(SECRET + "\n")
    monkeypatch.setenv("WANDB_API_KEY_FILE", str(tmp_path / "secret"))
    calls, run = [], FakeRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or run)
    output = tmp_path / "out"
    log_train_and_eval(output, wandb_mode="online")
    assert calls[0]["settings"].api_key == SECRET and calls[0]["mode"] == "online"
    assert calls[0]["dir"] == str(output) and SECRET not in json.dumps(calls[0]["config"])
    assert run.logged[1][0] == 2 and run.logged[1][1]["train/loss"] == 2.0
    assert run.logged[2] == (2, {"eval/accuracy": 1.0}) and run.finished == 1
    assert os.environ.get("WANDB_API_KEY") is None
    assert SECRET not in caplog.text and SECRET not in (output / "metrics.jsonl").read_text()


def test_no_sink_writes_anything_before_the_run_knows_where_it_starts(tmp_path, monkeypatch):
    """Built and closed without a record or a resumed_at (a resume that failed): no file, no W&B run."""
    import wandb

    started = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: started.append(kwargs) or FakeRun())
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 9, "time": 0, "kind": "train"}\n{"step": 1')
    before = (tmp_path / "metrics.jsonl").stat()
    for sink in build_sinks(TelemetryConfig(tensorboard=True, wandb_mode="online"), tmp_path, run_config={}):
        sink.close()
    assert started == [] and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    after = (tmp_path / "metrics.jsonl").stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size,
                                                                before.st_mtime_ns)


def test_wandb_starts_its_run_at_resumed_at(tmp_path, monkeypatch):
    import wandb

    run = FakeRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    sink = WandbSink(tmp_path, TelemetryConfig(wandb_mode="online"), run_config={})
    assert sink._run is None
    sink.resumed_at(3)
    assert sink._run is run
    sink.log(4, {"loss": 1.0})
    sink.close()
    sink.close()
    assert run.logged == [(4, {"train/loss": 1.0})] and run.finished == 1


def test_failed_wandb_start_closes_the_sinks_already_open(tmp_path, monkeypatch):
    closed = []
    for sink_class in (JsonlSink, TensorBoardSink):
        close = sink_class.close
        monkeypatch.setattr(sink_class, "close", lambda self, close=close: closed.append(type(self).__name__)
                            or close(self))
    cfg = TelemetryConfig(tensorboard=True, wandb_mode="online")
    with pytest.raises(ValueError, match="needs a W&B API key"):
        build_sinks(cfg, tmp_path, run_config={})
    assert closed == ["JsonlSink", "TensorBoardSink"]


def jsonl_steps(path: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["kind"]) for r in map(json.loads, path.read_text().splitlines())]


def test_jsonl_resume_drops_later_steps_and_a_torn_line_atomically(tmp_path, monkeypatch):
    first = JsonlSink(tmp_path)
    for step in range(1, 8):
        first.log(step, {"loss": float(step)})
    first.log(5, {"accuracy": 0.5}, kind="eval")
    first.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines) + '{"step": 8, "time": 1.0, "ki')  # a crash mid-write
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: renamed.append((Path(src).name, Path(dst).name))
                        or replace(src, dst))
    second = JsonlSink(tmp_path)
    second.resumed_at(5)
    second.log(6, {"loss": 60.0})
    second.close()
    [(written, target)] = renamed  # written aside, then renamed over it
    assert written.startswith(".metrics.jsonl.") and written.endswith(".tmp") and target == "metrics.jsonl"
    assert path.read_text().splitlines(keepends=True)[:6] == lines[:5] + [lines[7]]  # kept lines untouched
    assert jsonl_steps(path) == [(1, "train"), (2, "train"), (3, "train"), (4, "train"), (5, "train"),
                                 (5, "eval"), (6, "train")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_jsonl_resume_with_nothing_to_drop_leaves_the_file_alone(tmp_path):
    first = JsonlSink(tmp_path)
    first.log(1, {"loss": 1.0})
    first.close()
    before = (tmp_path / "metrics.jsonl").stat()
    second = JsonlSink(tmp_path)
    second.resumed_at(1)
    second.close()
    after = (tmp_path / "metrics.jsonl").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    fresh = JsonlSink(tmp_path)
    fresh.resumed_at(0)  # a fresh start in the same directory: nothing of the earlier run remains
    fresh.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_jsonl_resume_ends_a_last_line_cut_before_its_newline(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "kind": "train"}\n'
                                            '{"step": 2, "time": 2.0, "kind": "train"}')
    sink = JsonlSink(tmp_path)
    sink.resumed_at(2)
    sink.log(3, {"loss": 3.0})
    sink.close()
    assert jsonl_steps(tmp_path / "metrics.jsonl") == [(1, "train"), (2, "train"), (3, "train")]


def tensorboard_points(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(directory))
    events.Reload()
    if tag not in events.Tags()["tensors"]:  # not written yet (the writer's thread writes the queue)
        return []
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]


@pytest.mark.parametrize("resume", [True, False])
def test_tensorboard_resume_purges_the_killed_attempts_later_steps(tmp_path, resume):
    killed = TensorBoardSink(tmp_path)
    killed.resumed_at(0)  # as the Trainer starts a fresh run (the first session start is no restart)
    for step in range(1, 8):  # a checkpoint at step 4, killed after step 7
        killed.log(step, {"loss": float(step)})
    killed.close()
    time.sleep(1.01 - time.time() % 1)  # event files sort by the second they are opened in
    resumed = TensorBoardSink(tmp_path)
    if resume:
        resumed.resumed_at(4)
    for step in range(5, 9):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    points = tensorboard_points(tmp_path / "tensorboard", "train/loss")
    if resume:
        assert points == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0), (7, 70.0), (8, 80.0)]
    else:  # what the resume prevents: steps 5-7 twice
        assert [step for step, _ in points].count(5) == 2


def test_tensorboard_opens_its_event_file_at_the_first_point(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.resumed_at(3)
    assert not (tmp_path / "tensorboard").exists()
    sink.log(4, {"loss": 1.0})
    sink.close()
    sink.close()
    assert tensorboard_points(tmp_path / "tensorboard", "train/loss") == [(4, 1.0)]


def test_tensorboard_scalars_of_every_kind_read_back(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.resumed_at(0)
    for step in (1, 2, 3):
        sink.log(step, {"loss": 1.0 / step, "lr": 0.5, "samples_per_s": 1e4 * step})
    sink.log(1, {"imports_s": 2.5}, kind="startup")
    sink.log(3, {"accuracy": 0.75}, kind="eval")
    sink.close()
    directory = tmp_path / "tensorboard"
    assert tensorboard_points(directory, "train/loss") == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert tensorboard_points(directory, "train/samples_per_s") == [(1, 1e4), (2, 2e4), (3, 3e4)]
    assert tensorboard_points(directory, "startup/imports_s") == [(1, 2.5)]
    assert tensorboard_points(directory, "eval/accuracy") == [(3, 0.75)]


def test_build_sinks_hands_the_queue_and_flush_settings_to_the_writer(tmp_path):
    cfg = TelemetryConfig(tensorboard=True, tb_max_queue=7, tb_flush_secs=3)
    jsonl, tensorboard = build_sinks(cfg, tmp_path, run_config={})
    tensorboard.log(1, {"loss": 1.0})
    writer = tensorboard._writer
    assert (writer.max_queue, writer.flush_secs) == (7, 3)
    for sink in (jsonl, tensorboard):
        sink.close()
    assert tensorboard_points(tmp_path / "tensorboard", "train/loss") == [(1, 1.0)]


@pytest.mark.parametrize("field", ["tb_max_queue", "tb_flush_secs"])
@pytest.mark.parametrize("value", [0, -1])
def test_tensorboard_queue_and_flush_settings_must_be_positive(field, value):
    with pytest.raises(ConfigError, match=rf"telemetry\.{field}={value} is invalid: must be an integer >= 1"):
        TelemetryConfig(**{field: value})


# Loaded by the first log and not before: at import they would add about half a second to start-up.
TENSORBOARD_MODULES = ("tensorboard", "torch.utils.tensorboard", "boto3")

IMPORTS_CHECK = textwrap.dedent("""
    import json, sys
    import traincore.run.trainer
    from traincore.config.schema import TelemetryConfig
    from traincore.telemetry.sinks import build_sinks
    loaded = lambda: [name for name in {modules!r} if name in sys.modules]
    sinks = build_sinks(TelemetryConfig(tensorboard=True), {output!r}, {{}})
    built = loaded()
    for sink in sinks:
        sink.log(1, {{"loss": 1.0}})
        sink.close()
    print(json.dumps({{"built": built, "logged": loaded()}}))
""")


def test_tensorboard_is_imported_at_the_first_log_not_with_the_modules_or_the_sink(tmp_path):
    code = IMPORTS_CHECK.format(modules=TENSORBOARD_MODULES, output=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert loaded["built"] == []
    assert "torch.utils.tensorboard" in loaded["logged"]  # the check above would see the writer's modules
    assert tensorboard_points(tmp_path / "tensorboard", "train/loss") == [(1, 1.0)]


FROZEN_HEAP_CHECK = textwrap.dedent("""
    import gc, json, sys
    from traincore.telemetry.sinks import TensorBoardSink
    sink = TensorBoardSink(sys.argv[1])
    gc.disable()
    gc.freeze()  # as the training loop does before its first step, and so before the first log
    sink.log(1, {"loss": 1.0})
    from torch.utils.tensorboard import SummaryWriter
    print(json.dumps({"writer_class_frozen": not any(o is SummaryWriter for o in gc.get_objects()),
                      "unfrozen": len(gc.get_objects())}))
    sink.close()
""")


def test_the_writers_modules_join_a_frozen_heap(tmp_path):
    # Left out, their objects would be walked by every collection the training loop schedules.
    done = subprocess.run([sys.executable, "-c", FROZEN_HEAP_CHECK, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["writer_class_frozen"] and found["unfrozen"] < 2000, found


UNCLOSED_WRITER = textwrap.dedent("""
    import sys, time
    from traincore.telemetry.sinks import TensorBoardSink
    sink = TensorBoardSink(sys.argv[1], flush_secs=3600)
    sink.resumed_at(0)
    for step in range(1, 6):
        sink.log(step, {"loss": float(step)})
    print("logged", flush=True)
    time.sleep(600)  # killed here: no close, no flush, no interpreter exit
""")


def test_a_killed_writers_file_holds_what_it_logged_without_waiting_for_a_flush(tmp_path):
    # What a relaunched run's purge relies on: the killed attempt's points up to its checkpoint are on disk.
    child = subprocess.Popen([sys.executable, "-c", UNCLOSED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "logged"
        deadline = time.monotonic() + 60
        while len(tensorboard_points(tmp_path / "tensorboard", "train/loss")) < 5:
            assert time.monotonic() < deadline, "the writer's thread never wrote the queued events"
            time.sleep(0.1)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    points = tensorboard_points(tmp_path / "tensorboard", "train/loss")
    assert points == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]
