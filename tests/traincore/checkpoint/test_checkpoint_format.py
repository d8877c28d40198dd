"""What a step directory holds: the tensor split, and checkpoints of the previous format still resuming."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from traincore.checkpoint import read_marker, step_dir
from traincore.checkpoint.format import flat_shapes, merge, read_checkpoint, split_tensors
from traincore.config.presets import debug
from traincore.run.trainer import Trainer

V2 = Path(__file__).parent / "fixtures" / "checkpoint-v2"
# The run that wrote the version-2 fixtures (see their README).
V2_RUN = {"model.width": 4, "train.max_steps": 8, "checkpoint.every": 4, "checkpoint.keep_last": 5,
          "telemetry.tensorboard": False, "loader.batch_size": 16}


def test_split_puts_dict_nested_tensors_aside_and_merge_restores_the_tree():
    tree = {"model": {"w": torch.ones(2, 3)}, "optimizer": {"state": {"w": {"exp_avg": torch.zeros(2, 3)}},
                                                            "param_groups": [{"lr": 0.1, "params": ["w"]}]},
            "rng": [torch.arange(3)], "step": 4}
    tensors, rest = split_tensors(tree)
    assert flat_shapes(tensors) == {"model.w": [2, 3], "optimizer.state.w.exp_avg": [2, 3]}
    assert rest["step"] == 4 and torch.equal(rest["rng"][0], torch.arange(3))  # tensors in lists stay
    merged = merge(rest, tensors)
    assert (merged.keys() == tree.keys()
            and merged["optimizer"]["param_groups"] == tree["optimizer"]["param_groups"])
    assert torch.equal(merged["optimizer"]["state"]["w"]["exp_avg"], torch.zeros(2, 3))


@pytest.mark.parametrize("mode", ["sync", "dcp"])
def test_a_version_2_checkpoint_loads_bitwise_and_trains_on_as_its_run_did(synthetic_dir, tmp_path, mode):
    assert read_marker(step_dir(V2 / mode, 4))["format_version"] == 2
    root = tmp_path / "checkpoints"
    shutil.copytree(step_dir(V2 / mode, 4), step_dir(root, 4))
    cfg = debug().with_overrides({**V2_RUN, "checkpoint.mode": mode})
    saved, _ = read_checkpoint(step_dir(V2 / mode, 4))
    with Trainer(cfg, synthetic_dir, tmp_path / "run", root) as trainer:  # loads step 4, trains nothing
        loaded = trainer.model.state_dict()
        assert trainer.resumed_from == 4 and saved.keys() == loaded.keys()
        for name in saved:
            assert torch.equal(saved[name], loaded[name]), name
    summary = Trainer(cfg, synthetic_dir, tmp_path / "run", root).train()
    assert summary.resumed_from == 4 and summary.steps == 8
    expected, extra = read_checkpoint(step_dir(V2 / mode, 8))  # the version-2 run's own step 8
    actual, _ = read_checkpoint(step_dir(root, 8))
    assert read_marker(step_dir(root, 8))["format_version"] == 3
    assert extra["meta"]["shape"] == [3, 8, 8] and expected.keys() == actual.keys()
    # The fixtures' steps 5-8 were computed on another machine, whose CPU kernels may round differently in
    # the last bit: the four steps trained here match them closely, not necessarily bitwise.
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
