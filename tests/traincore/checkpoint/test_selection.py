"""Selecting a checkpoint by the validation metrics its commit marker records."""

from __future__ import annotations

import json

import pytest

from traincore.checkpoint import CheckpointError, CorruptCheckpointError, read_marker, select_step, step_dir
from traincore.checkpoint.commit import write_marker
from traincore.checkpoint.layout import MARKER, STATE_FILE
from traincore.checkpoint.prune import prune


def _step(root, step, metrics=None):
    directory = step_dir(root, step)
    directory.mkdir(parents=True)
    (directory / STATE_FILE).write_bytes(b"state")
    write_marker(directory, step, "sync", 1, {}, metrics)
    return directory


def test_best_is_the_earliest_step_no_later_one_improved_on_and_latest_is_the_newest(tmp_path):
    _step(tmp_path, 10, {"val_accuracy": 0.8, "val_loss": 0.5})
    _step(tmp_path, 20, {"val_accuracy": 0.9, "val_loss": 0.4})
    _step(tmp_path, 25)  # saved on the clock: not validated, no candidate for best
    _step(tmp_path, 30, {"val_accuracy": 0.9, "val_loss": 0.3})
    assert select_step(tmp_path, "best") == (20, "the best val_accuracy (0.9000) of the checkpoints that "
                                                 "record it")
    assert select_step(tmp_path, "best", "val_loss")[0] == 30
    assert select_step(tmp_path, "latest") == (30, "the latest")
    # Pruning to one step keeps the newest and the best.
    prune(tmp_path, keep_last=1, keep_best="val_accuracy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000020", "step-000030"]


def test_without_validated_steps_best_is_the_latest_and_says_why(tmp_path):
    _step(tmp_path, 5)
    _step(tmp_path, 7)
    assert select_step(tmp_path, "best") == (7, "the latest: no checkpoint records val_accuracy (validated "
                                                "steps do, train.eval_every)")
    with pytest.raises(CheckpointError, match="select='newest' is not one of best, latest"):
        select_step(tmp_path, "newest")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        select_step(tmp_path / "empty", "best")


def test_a_marker_with_damaged_metrics_is_corrupt_and_no_candidate(tmp_path):
    good, bad = _step(tmp_path, 1, {"val_accuracy": 0.7}), _step(tmp_path, 2, {"val_accuracy": 0.9})
    marker = json.loads((bad / MARKER).read_text())
    marker["metrics"] = {"val_accuracy": "high"}
    (bad / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CorruptCheckpointError, match="metrics has val_accuracy='high', not one of "
                                                     "val_accuracy, val_loss with a number"):
        read_marker(bad)
    assert read_marker(good)["metrics"] == {"val_accuracy": 0.7}
    assert select_step(tmp_path, "best")[0] == 1
