"""The average of the weights: one lerp per step towards the live weights, buffers copied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from traincore.config import ConfigError, preset
from traincore.run.ema import EMA


def test_the_average_moves_one_minus_decay_of_the_way_and_copies_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = EMA(model, decay=0.75)
    start = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ema.model.parameters(), start, strict=True))
    assert not any(p.requires_grad for p in ema.model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(4.0)
    model(torch.randn(5, 3))  # BatchNorm's running statistics move
    ema.update()
    for averaged, before in zip(ema.model.parameters(), start, strict=True):
        torch.testing.assert_close(averaged, before + 1.0)  # a quarter of the way to the live weights
    assert torch.equal(ema.model[1].running_mean, model[1].running_mean)
    restored = EMA(model, decay=0.75)
    restored.load_state_dict(ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.model.parameters(), ema.model.parameters(),
                                                  strict=True))


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5])
def test_a_decay_outside_the_open_interval_is_refused(decay):
    with pytest.raises(ConfigError, match=rf"optim.ema_decay={decay} is invalid: must be in \(0, 1\), e.g. "
                                          "0.999, or 0 to turn the average off"):
        preset("debug").with_overrides({"optim.ema_decay": decay})
