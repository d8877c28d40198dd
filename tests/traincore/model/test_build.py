"""traincore.model.build: the models build by name for the staged shape; vit_tiny's size rule and FLOP
count."""

from __future__ import annotations

import pytest
import torch

from traincore.config.schema import ConfigError, ModelConfig
from traincore.model.build import VIT_TINY, build_model, parameter_count
from traincore.telemetry.metrics import training_flops_per_sample


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 32, 32), (3, 16, 16)])
def test_vit_tiny_maps_images_to_class_logits(shape):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="vit_tiny"), 10, shape)
    logits = model(torch.randn(4, *shape))
    assert logits.shape == (4, 10)
    logits.sum().backward()  # every parameter takes part in training
    assert all(p.grad is not None for p in model.parameters())


def test_vit_tiny_is_small_enough_for_cpu_training():
    model = build_model(ModelConfig(name="vit_tiny"), 10, (3, 32, 32))
    assert model.hidden_dim == VIT_TINY["hidden_dim"] and model.patch_size == VIT_TINY["patch_size"]
    assert 100_000 < parameter_count(model) < 2_000_000


@pytest.mark.parametrize("name, size, patch", [("vit_tiny", 30, 4), ("vit_b_16", 40, 16)])
def test_vision_transformers_reject_sizes_the_patch_does_not_divide(name, size, patch):
    message = f"model {name} needs an image size divisible by {patch}, got {size}: stage with data.image_size"
    with pytest.raises(ValueError, match=f"{message}={size - size % patch}"):
        build_model(ModelConfig(name=name), 10, (3, size, size))


def test_unknown_model_names_list_vit_tiny():
    with pytest.raises(ConfigError, match="vit_tiny"):
        ModelConfig(name="vit_small")


def test_vit_tiny_flops_grow_with_the_token_count():
    """More patches cost more than linearly: the attention matrices grow with the square of the tokens."""
    model = build_model(ModelConfig(name="vit_tiny"), 10, (3, 32, 32))
    small = training_flops_per_sample(model, (3, 32, 32))
    tokens = (32 // VIT_TINY["patch_size"]) ** 2 + 1
    hidden, mlp, layers = VIT_TINY["hidden_dim"], VIT_TINY["mlp_dim"], VIT_TINY["num_layers"]
    # Lower bound: 3 x 2 FLOPs per multiply-accumulate of the projections and MLP of every token and layer.
    assert small > 6 * layers * tokens * (4 * hidden * hidden + 2 * hidden * mlp)
    large = training_flops_per_sample(build_model(ModelConfig(name="vit_tiny"), 10, (3, 64, 64)),
                                      (3, 64, 64))
    assert large > 4 * small
