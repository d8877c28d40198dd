"""Config validation: bad values raise ConfigError naming the field; overrides and presets round-trip."""

from __future__ import annotations

import json

import pytest

from traincore import config as C
from traincore import presets
from traincore.config import Config, ConfigError, DataConfig, LoaderConfig, parse_source


@pytest.mark.parametrize(("make", "field"), [
    (lambda: DataConfig(image_size=0), "data.image_size"),
    (lambda: DataConfig(image_size=5000), "data.image_size"),
    (lambda: DataConfig(channels=2), "data.channels"),
    (lambda: DataConfig(val_fraction=0.6, test_fraction=0.5), "data.val_fraction + data.test_fraction"),
    (lambda: DataConfig(decode_workers=-1), "data.decode_workers"),
    (lambda: DataConfig(synthetic_classes=1), "data.synthetic_classes"),
    (lambda: LoaderConfig(batch_size=0), "loader.batch_size"),
    (lambda: LoaderConfig(num_workers=-1), "loader.num_workers"),
    (lambda: LoaderConfig(prefetch_factor=0), "loader.prefetch_factor"),
    (lambda: LoaderConfig(batch_size=True), "loader.batch_size"),
    (lambda: C.TrainConfig(max_steps=0, epochs=0), "train.max_steps/train.epochs"),
    (lambda: C.TrainConfig(profile_steps="5:2"), "train.profile_steps"),
    (lambda: C.CheckpointConfig(mode="fast"), "checkpoint.mode"),
    (lambda: C.ModelConfig(name="resnet9000"), "model.name"),
])
def test_bad_values_name_the_field(make, field):
    with pytest.raises(ConfigError) as info:
        make()
    assert str(info.value).startswith(f"{field}=")


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError, match="loader.batch_size=0"):
        LoaderConfig(batch_size=0)


@pytest.mark.parametrize(("source", "message"), [
    ("mnist", "is unknown"),
    ("imagefolder", "needs a location"),
    ("digits:/tmp/x", "only 'imagefolder' takes"),
])
def test_bad_sources(source, message):
    with pytest.raises(ConfigError, match=message) as info:
        DataConfig(source=source)
    assert "data.source" in str(info.value)


def test_parse_source_keeps_uri():
    assert parse_source("imagefolder:s3://bucket/train") == ("imagefolder", "s3://bucket/train")
    assert parse_source("digits") == ("digits", "")


def test_overrides_nested_dotted_and_json():
    base = Config()
    nested = base.with_overrides({"loader": {"batch_size": 8}, "data.seed": 3})
    from_json = base.with_overrides('{"loader.batch_size": 8, "data": {"seed": 3}}')
    assert nested == from_json
    assert (nested.loader.batch_size, nested.data.seed) == (8, 3)
    assert base.loader.batch_size == LoaderConfig().batch_size  # the original is untouched


@pytest.mark.parametrize(("overrides", "message"), [
    ({"loaders": {"batch_size": 8}}, "unknown config section 'loaders'"),
    ({"loader": {"batchsize": 8}}, "unknown config field loader.batchsize"),
    ({"loader": 8}, "must be an object of fields"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"loader.batch_size": 0}, "loader.batch_size=0"),
])
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config().with_overrides(overrides)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_round_trip_through_json(name):
    cfg = presets.preset(name)
    assert Config.from_dict(json.loads(cfg.to_json())) == cfg


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="presets are debug"):
        presets.preset("huge")


def test_deterministic_only_off_for_the_gpu_preset():
    assert presets.imagenet_like().train.deterministic is False  # slow cuDNN convolutions otherwise
    assert presets.digits().train.deterministic is True  # CPU runs keep bitwise resume
    assert C.TrainConfig().deterministic is True


def test_presets_live_outside_config():
    for name in ("debug", "digits", "imagenet_like", "PRESETS", "preset"):
        assert not hasattr(C, name), f"traincore.config.{name} should live in traincore.presets only"


def test_profile_window():
    assert C.TrainConfig(profile_steps="3:7").profile_window() == (3, 7)
    assert C.TrainConfig().profile_window() is None
