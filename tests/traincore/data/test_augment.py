"""Augmentation on the device: random resized crop and horizontal flip, seeded by the batch's place."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from traincore.checkpoint import complete_steps, read_checkpoint, step_dir
from traincore.config.presets import debug, digits, imagenet_like
from traincore.config.schema import ConfigError, LoaderConfig
from traincore.data.augment import Augmenter
from traincore.data.loader import StagedLoader, StagedSplit
from traincore.run.trainer import Trainer


def ramp(n: int = 6, size: int = 8) -> torch.Tensor:
    """Images whose pixel value is its column: a flip and a crop are visible in the values."""
    return torch.arange(size, dtype=torch.float32).expand(n, 3, size, size).clone()


def test_a_flip_mirrors_about_half_the_images_and_the_key_decides_which():
    flip = Augmenter(LoaderConfig(horizontal_flip=True))
    images = ramp(64)
    out = flip(images, (0, 0, 0, 0))
    mirrored = (out[:, 0, 0, 0] == 7).numpy()
    assert 16 < mirrored.sum() < 48 and torch.equal(out[mirrored], images[mirrored].flip(-1))
    assert torch.equal(out[~mirrored], images[~mirrored])
    assert torch.equal(flip(images, (0, 0, 0, 0)), out)  # the same key, the same flips
    assert not torch.equal(flip(images, (0, 0, 0, 64)), out)  # the next batch, others


def test_a_crop_keeps_the_size_and_zooms_into_part_of_the_image():
    crop = Augmenter(LoaderConfig(random_resized_crop=True, crop_scale=0.25))
    images = ramp(32)
    out = crop(images, (1, 0, 2, 32))
    assert out.shape == images.shape
    spans = (out[:, 0, 4, -1] - out[:, 0, 4, 0]).numpy()  # what remains of the 0..7 ramp across a row
    assert (spans < 7.0).all() and (spans > 7.0 * 0.25 - 1).all()
    whole = Augmenter(LoaderConfig(random_resized_crop=True, crop_scale=1.0))(images, (1, 0, 2, 32))
    torch.testing.assert_close(whole, images, atol=1e-4, rtol=0)  # the whole image: resized onto itself
    with pytest.raises(ConfigError, match=r"loader.crop_scale=0.0 is invalid: must be in \(0, 1\]"):
        LoaderConfig(crop_scale=0.0)


def test_the_loader_augments_training_batches_only_when_asked(synthetic_dir):
    split = StagedSplit(synthetic_dir, "train")
    plain = next(iter(StagedLoader(split, LoaderConfig(batch_size=16, num_workers=0), seed=3)))[0]
    cfg = LoaderConfig(batch_size=16, num_workers=0, horizontal_flip=True, random_resized_crop=True)
    first = next(iter(StagedLoader(split, cfg, seed=3)))[0]
    again = next(iter(StagedLoader(split, cfg, seed=3)))[0]
    assert first.shape == plain.shape and not torch.equal(first, plain) and torch.equal(first, again)
    assert imagenet_like().loader.random_resized_crop and imagenet_like().loader.horizontal_flip
    assert not digits().loader.random_resized_crop and not digits().loader.horizontal_flip


def test_a_run_with_augmentation_and_accumulation_resumes_bitwise(synthetic_dir, tmp_path):
    cfg = debug().with_overrides({"loader": {"random_resized_crop": True, "horizontal_flip": True,
                                             "batch_size": 8},
                                  "train": {"grad_accum_steps": 2, "max_steps": 9},
                                  "checkpoint": {"every": 3}, "telemetry": {"tensorboard": False}})
    Trainer(cfg, synthetic_dir, tmp_path / "whole").train()
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")  # killed after its step-6 checkpoint
    shutil.rmtree(step_dir(tmp_path / "resumed" / "checkpoints", 9))
    assert Trainer(cfg, synthetic_dir, tmp_path / "resumed").train().resumed_from == 6
    a, b = (read_checkpoint(step_dir(tmp_path / run / "checkpoints", 9))[0] for run in ("whole", "resumed"))
    assert all(torch.equal(a[name], b[name]) for name in a)
    plain = Trainer(cfg.with_overrides({"loader": {"random_resized_crop": False, "horizontal_flip": False}}),
                    synthetic_dir, tmp_path / "plain").train()
    c = read_checkpoint(step_dir(tmp_path / "plain" / "checkpoints", 9))[0]
    assert plain.steps == 9 and complete_steps(tmp_path / "plain" / "checkpoints")[-1] == 9
    assert not all(torch.equal(a[name], c[name]) for name in a)  # the augmentation changed the training
    np.testing.assert_equal(sorted(a), sorted(c))
