"""Staging progress: log lines away from a terminal, a bar redrawn in place on one."""

from __future__ import annotations

import io
import logging

from traincore.config.schema import DataConfig
from traincore.data.progress import LINE_EVERY_S, ProgressMeter
from traincore.data.staging import stage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_away_from_a_terminal_a_line_every_interval_with_rate_and_time_left():
    lines, clock = [], Clock()
    meter = ProgressMeter(1000, lines.append, io.StringIO(), clock)
    clock.now = 1.0
    meter.advance(100)  # within the interval: nothing yet
    clock.now = LINE_EVERY_S
    meter.advance(150)
    clock.now = LINE_EVERY_S + 1
    meter.advance(750)  # the end is always shown
    assert lines == ["staging: 250 / 1,000 samples (25%), 25 samples/s, 30s left",
                     "staging: 1,000 / 1,000 samples (100%), 91 samples/s, done"]


def test_on_a_terminal_a_bar_redrawn_in_place():
    terminal, lines, clock = Terminal(), [], Clock()
    meter = ProgressMeter(4, lines.append, terminal, clock)
    for _ in range(4):
        clock.now += 1
        meter.advance(1)
    meter.close()
    frames = terminal.getvalue().split("\r")[1:]
    assert len(frames) == 4 and not lines
    assert frames[0].startswith("staging [#######.......................] 1 / 4 samples (25%)")
    assert frames[-1] == "staging [##############################] 4 / 4 samples (100%), 1 samples/s, done\n"


def test_every_source_reports_its_progress(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    stage(DataConfig(source="synthetic", image_size=8, synthetic_samples=64), tmp_path / "staged")
    assert "staging: 64 / 64 samples (100%)" in caplog.text
