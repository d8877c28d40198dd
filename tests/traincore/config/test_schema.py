"""Config validation: bad values raise ConfigError naming the field; overrides and presets round-trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from traincore.config import presets
from traincore.config import schema as C
from traincore.config.schema import Config, ConfigError, DataConfig, LoaderConfig, parse_source


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
    ("digits:/tmp/x", "only 'imagefolder' and 'python' take"),
    ("python", "needs a location: write 'python:<module>:<callable>'"),
    ("python:my data:build", "is not '<module>:<callable>'"),
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
    # Once resolved in silence by the JSON's key order (the dotted key won, the lr ten times the other):
    ('{"optim.lr": 0.01, "optim": {"lr": 0.02}}', r"optim.lr is given twice \(as a dotted key and inside "
                                                  r"'optim'\): give it once"),
    ('{"optim": {"lr": 0.02}, "optim.lr": 0.01}', "optim.lr is given twice"),
])
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config().with_overrides(overrides)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_round_trip_through_json(name):
    cfg = presets.preset(name)
    assert Config().with_overrides(json.dumps(cfg.to_dict())) == cfg


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="presets are debug"):
        presets.preset("huge")


def test_deterministic_only_off_for_the_gpu_preset():
    assert presets.imagenet_like().train.deterministic is False  # slow cuDNN convolutions otherwise
    assert presets.digits().train.deterministic is True  # CPU runs keep bitwise resume
    assert C.TrainConfig().deterministic is True


def test_presets_live_outside_config():
    for name in ("debug", "digits", "imagenet_like", "PRESETS", "preset"):
        assert not hasattr(C, name), f"schema.{name} should live in traincore.config.presets only"


def test_profile_window():
    assert C.TrainConfig(profile_steps="3:7").profile_window() == (3, 7)
    assert C.TrainConfig().profile_window() is None


WRONG_TYPE = {"bool": "no", "int": "8", "float": "0.5", "str": 5, "dict": "{}", "list": "fc.*"}
EXPECTED = {"bool": "expected true or false", "int": "expected an integer", "float": "expected a number",
            "str": "expected a string", "dict": "expected a JSON object", "list": "expected a JSON list"}
FIELDS = [(section, spec.name, spec.type) for section, cls in C._SECTIONS.items()
          for spec in dataclasses.fields(cls)]


@pytest.mark.parametrize(("section", "name", "kind"), FIELDS, ids=[f"{s}.{n}" for s, n, _ in FIELDS])
def test_every_field_is_type_checked(section, name, kind):
    """A value of the wrong type fails validation with a ConfigError naming field, value and type, never a
    TypeError from a comparison, and is never silently accepted ("shuffle": "no" used to mean true)."""
    value = WRONG_TYPE[kind]
    with pytest.raises(ConfigError) as info:
        Config().with_overrides({section: {name: value}})
    message = str(info.value)
    assert message.startswith(f"{section}.{name}={value!r} is invalid: {EXPECTED[kind]}"), message
    assert f"got {type(value).__name__}" in message


@pytest.mark.parametrize(("overrides", "message"), [
    ({"loader.shuffle": "no"}, 'write e.g. {"loader.shuffle": false}'),
    ({"loader.shuffle": 1}, 'write e.g. {"loader.shuffle": true}'),
    ({"loader.batch_size": "32"}, 'write e.g. {"loader.batch_size": 32}'),
    ({"loader.batch_size": 32.0}, 'write e.g. {"loader.batch_size": 32}'),
    ({"optim.lr": "1e-3"}, 'write e.g. {"optim.lr": 0.001}'),
    ({"checkpoint.resume": 12}, 'write e.g. {"checkpoint.resume": "12"}'),
    ({"loader.batch_size": True}, "expected an integer (a JSON number without a fraction), got bool"),
    ({"data.channels": True}, "data.channels=True is invalid: expected an integer"),
    ({"model.name": None}, "model.name=None is invalid: expected a string, got NoneType"),
    ({"optim.weight_decay": [0.1]}, "optim.weight_decay=[0.1] is invalid: expected a number, got list"),
])
def test_wrong_types_say_how_to_write_the_value(overrides, message):
    with pytest.raises(ConfigError) as info:
        Config().with_overrides(overrides)
    assert message in str(info.value)


@pytest.mark.parametrize(("overrides", "message"), [
    ('{"optim": {"lr": NaN}}', "optim.lr=nan is invalid: expected a finite number"),
    ('{"optim": {"weight_decay": Infinity}}', "optim.weight_decay=inf is invalid: expected a finite number"),
    ({"train.seed": 2**64}, f"train.seed={2**64} is invalid: must be <= {2**63 - 1}"),
    ({"dist.init_timeout_s": 10**12}, "dist.init_timeout_s=1000000000000 is invalid: must be <= 2147483647"),
    ({"train.profile_steps": "²:³"}, "must look like 'START:END'"),  # digits to isdigit(), not to int()
    # a window past the last step once profiled nothing without a word:
    ({"train.max_steps": 30, "train.profile_steps": "30:40"},
     "train.profile_steps='30:40' is invalid: starts after the run's last step (29;"),
    ({"checkpoint.resume": "١٢"}, "checkpoint.resume='١٢' is invalid"),
    # 0-255 statistics once trained in silence on inputs normalised far off scale:
    ({"data.channels": 1, "data.mean": [50], "data.std": [1]}, "data.mean=[50] is invalid: expected a list "
                                                              "of numbers in [0, 1], one per channel, of "
                                                              "pixels scaled to [0, 1] (not 0-255)"),
    ({"data.channels": 1, "data.mean": [0.5], "data.std": [60]}, "data.std=[60] is invalid: expected a list "
                                                                "of numbers in (0, 1]"),
    ({"data.mean": [0.5], "data.std": [0.5]}, "data.mean=[0.5] is invalid: needs one value per channel: "
                                              "data.channels is 3 (set data.channels to the staged data's"),
])
def test_values_that_would_fail_later_are_refused_now(overrides, message):
    with pytest.raises(ConfigError) as info:
        Config().with_overrides(overrides)
    assert message in str(info.value)


def test_async_checkpoints_need_a_cpu_backend():
    with pytest.raises(ConfigError, match=r"checkpoint.mode='async' with dist.backend='nccl' is invalid: .*"
                                          r"set dist.backend to 'auto' or 'cpu:gloo,cuda:nccl'"):
        Config().with_overrides({"checkpoint.mode": "async", "dist.backend": "nccl"})
    for backend in ("auto", "gloo", "cpu:gloo,cuda:nccl"):
        Config().with_overrides({"checkpoint.mode": "async", "dist.backend": backend})
    Config().with_overrides({"checkpoint.mode": "dcp", "dist.backend": "nccl"})


@pytest.mark.parametrize("overrides", [
    {"loader": 8, "loader.batch_size": 3},  # used to be a TypeError, depending on the key order
    {"loader.batch_size": 3, "loader": 8},
])
def test_a_section_that_is_not_an_object_is_named_in_any_key_order(overrides):
    with pytest.raises(ConfigError, match="config section 'loader' must be an object of fields, got 8"):
        Config().with_overrides(overrides)


def test_sections_must_be_their_dataclasses():
    with pytest.raises(ConfigError, match=r"loader=\{'batch_size': 8\} is invalid: must be a LoaderConfig"):
        Config(loader={"batch_size": 8})
