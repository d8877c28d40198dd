"""The profiler window: a real torch.profiler trace for the configured steps, nothing outside them."""

from __future__ import annotations

import json
import logging
import re

import torch

from traincore.config.presets import debug
from traincore.run.trainer import Trainer
from traincore.telemetry.profiling import ProfilerWindow


def work() -> None:
    torch.randn(32, 32) @ torch.randn(32, 32)


def test_window_records_its_steps_into_a_chrome_trace(tmp_path):
    window = ProfilerWindow((2, 4), tmp_path, rank=1)
    for step in range(6):
        window.on_step(step)
        assert (window.profiler is not None) == (2 <= step < 4)
        work()
    window.close()
    trace = json.loads((tmp_path / "profile" / "trace-rank1.json").read_text())
    assert any("mm" in event.get("name", "") for event in trace["traceEvents"])


def test_no_window_records_nothing(tmp_path):
    window = ProfilerWindow(None, tmp_path, rank=0)
    for step in range(3):
        window.on_step(step)
        assert window.profiler is None
    window.close()
    assert not (tmp_path / "profile").exists()


def test_close_writes_a_window_the_run_did_not_finish(tmp_path):
    window = ProfilerWindow((1, 100), tmp_path, rank=0)
    window.on_step(0)
    window.on_step(1)
    work()
    window.close()
    window.close()  # idempotent
    assert (tmp_path / "profile" / "trace-rank0.json").is_file()


def test_trainer_writes_the_configured_window(synthetic_dir, tmp_path):
    cfg = debug().with_overrides({"train.max_steps": 5, "train.profile_steps": "2:4", "loader.batch_size": 16,
                                  "telemetry.tensorboard": False})
    Trainer(cfg, synthetic_dir, tmp_path / "run").train()
    trace = json.loads((tmp_path / "run" / "profile" / "trace-rank0.json").read_text())
    assert trace["traceEvents"]


def test_a_window_the_run_does_not_reach_is_named(synthetic_dir, tmp_path, caplog):
    # An epoch-bounded run learns its last step only from the data: the trainer says so, it does not refuse.
    cfg = debug().with_overrides({"train.max_steps": 0, "train.epochs": 1, "train.profile_steps": "900:910",
                                  "loader.batch_size": 16, "telemetry.tensorboard": False})
    with caplog.at_level(logging.WARNING, logger="traincore.run.trainer"):
        Trainer(cfg, synthetic_dir, tmp_path / "run").train()
    assert re.search(r"train.profile_steps 900:910: this run trains steps 0 to \d+, so nothing is profiled",
                     caplog.text)
    assert not (tmp_path / "run" / "profile").exists()

