"""The state registry: members the checkpointer has never heard of round-trip, and a resume keeps totals."""

from __future__ import annotations

import logging

import pytest
import torch

from traincore.checkpoint import Checkpointer
from traincore.config.presets import debug
from traincore.config.schema import CheckpointConfig
from traincore.run.state import StateRegistry
from traincore.run.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class EMAOfLoss:
    """A component the checkpointer does not know: a scalar, a tensor and a nested dict of state."""

    def __init__(self) -> None:
        self.value, self.history, self.meta = 0.0, torch.zeros(4), {"decay": 0.9}

    def state_dict(self) -> dict:
        return {"value": self.value, "history": self.history, "meta": dict(self.meta)}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.history, self.meta = state["value"], state["history"].clone(), dict(state["meta"])


@pytest.mark.parametrize("mode", ["sync", "dcp", "async"])
def test_a_new_member_round_trips_without_any_checkpointer_change(tmp_path, mode):
    saved, registry = EMAOfLoss(), StateRegistry()
    saved.value, saved.history, saved.meta = 1.5, torch.arange(4.0), {"decay": 0.99}
    registry.register("ema", saved)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode=mode), registry)
    checkpointer.save(7)
    checkpointer.close()

    restored, other = EMAOfLoss(), StateRegistry()
    other.register("ema", restored)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(mode=mode), other)
    assert checkpointer.load() == 7
    checkpointer.close()
    assert restored.value == 1.5 and restored.meta == {"decay": 0.99}
    assert torch.equal(restored.history, torch.arange(4.0))


def test_a_member_the_checkpoint_lacks_keeps_its_state(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="traincore.run.state")
    registry = StateRegistry()
    registry.register("ema", EMAOfLoss())
    Checkpointer(tmp_path, CheckpointConfig(), registry).save(1)
    newer, added = StateRegistry(), EMAOfLoss()
    newer.register("ema", EMAOfLoss())
    added.value = 3.0
    newer.register("added_later", added)
    assert Checkpointer(tmp_path, CheckpointConfig(), newer).load() == 1
    assert added.value == 3.0 and "holds no added_later state" in caplog.text


def test_names_are_unique():
    registry = StateRegistry()
    registry.register("rng", EMAOfLoss(), per_rank=True)
    with pytest.raises(AssertionError, match="registered twice"):
        registry.register("rng", EMAOfLoss())


def test_telemetry_totals_survive_a_resume_of_the_trainer(synthetic_dir, tmp_path):
    cfg = debug().with_overrides({"train.max_steps": 10, "checkpoint.every": 5, "loader.batch_size": 16,
                                  "telemetry.tensorboard": False})
    first = Trainer(cfg, synthetic_dir, tmp_path / "run")
    first_summary = first.train()
    resumed = Trainer(cfg.with_overrides({"train.max_steps": 20}), synthetic_dir, tmp_path / "run")
    summary = resumed.train()
    assert summary.resumed_from == 10 and summary.steps == 20
    assert resumed.telemetry.summary()["steps"] == 20  # both attempts' steps, not only the last one's
    assert summary.wall_s > first_summary.wall_s
