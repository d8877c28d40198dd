"""Parameter groups by name: a learning-rate multiplier, or frozen; patterns that match nothing are refused
before training."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from traincore.artifacts.export import export
from traincore.config import ConfigError, preset
from traincore.model import build_model
from traincore.run import Trainer, preflight
from traincore.run.param_groups import check_param_groups

TINY = {"model": {"name": "small_cnn", "width": 8}, "optim": {"lr": 3e-3, "warmup_steps": 2},
        "loader": {"batch_size": 8}, "telemetry": {"log_every": 2}, "train": {"max_steps": 6}}


def test_a_frozen_stem_keeps_its_weights_and_the_head_trains_at_its_multiple(data_dir, tmp_path):
    groups = [{"pattern": "head.*", "lr_mult": 10}, {"pattern": "features.0.*", "freeze": True}]
    cfg = preset("debug").with_overrides(TINY).with_overrides({"optim.param_groups": groups})
    trainer = Trainer(cfg, data_dir, tmp_path / "run")
    optimizer = trainer.optimizer
    assert [group["initial_lr"] for group in optimizer.param_groups] == [3e-3, pytest.approx(3e-2)]
    named = dict(trainer.model.named_parameters())
    head = {id(p) for name, p in named.items() if name.startswith("head.")}
    assert {id(p) for p in optimizer.param_groups[1]["params"]} == head
    assert not any(p.requires_grad for name, p in named.items() if name.startswith("features.0."))
    trainer.train()
    start = dict(build_model(cfg.model, 4, (3, 12, 12), seed=cfg.train.seed).named_parameters())
    export(tmp_path / "run" / "checkpoints", tmp_path / "model" / "model.safetensors")
    trained = load_file(tmp_path / "model" / "model.safetensors")
    stem = [name for name in start if name.startswith("features.0.")]  # BatchNorm's statistics still move
    assert stem and all(torch.equal(trained[name], start[name]) for name in stem)
    assert not torch.equal(trained["head.2.weight"], start["head.2.weight"])


def test_patterns_that_match_nothing_or_freeze_everything_are_refused_before_training(data_dir, tmp_path):
    model = build_model(preset("debug").with_overrides(TINY).model, 4, (3, 12, 12))
    with pytest.raises(ValueError, match=r"param_groups\[1\] pattern 'fc.\*' matches no parameter of "
                                         r"the model \(its parameters: features.0.0.weight, .*'head.2.\*'"):
        check_param_groups(model, [{"pattern": "features.*", "lr_mult": 2},
                                   {"pattern": "fc.*", "lr_mult": 10}])
    with pytest.raises(ValueError, match="freeze every parameter of the model, so nothing would train"):
        check_param_groups(model, [{"pattern": "*", "freeze": True}])
    cfg = preset("debug").with_overrides(TINY).with_overrides({"optim.param_groups": [{"pattern": "fc.*",
                                                                                        "freeze": True}]})
    with pytest.raises(ValueError, match="pattern 'fc.\\*' matches no parameter"):
        preflight(cfg, data_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("group", "message"), [
    ({"pattern": "fc.*"}, "give either lr_mult (a frozen group has no learning rate) or freeze: true"),
    ({"pattern": "fc.*", "lr_mult": 2, "freeze": True}, "give either lr_mult"),
    ({"pattern": "fc.*", "lr_mult": 0}, "optim.param_groups[0].lr_mult=0 is invalid: must be a number > 0"),
    ({"pattern": "", "lr_mult": 2}, 'expected {"pattern": "fc.*", "lr_mult": 10}'),
    ({"pattern": "fc.*", "lr": 2}, 'expected {"pattern": "fc.*", "lr_mult": 10}'),
])
def test_bad_groups_are_named(group, message):
    with pytest.raises(ConfigError) as caught:
        preset("debug").with_overrides({"optim.param_groups": [group]})
    assert message in str(caught.value), caught.value
