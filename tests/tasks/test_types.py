"""The Flyte type of traincore's Config: flytekit's own, built once, and only for Config."""

from __future__ import annotations

from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import DataclassTransformer, TypeEngine

from tasks.types import ConfigTransformer, Topology
from traincore.config import Config
from traincore.presets import preset


def test_config_keeps_flytekit_dataclass_type_and_round_trips():
    transformer = TypeEngine.get_transformer(Config)
    assert isinstance(transformer, ConfigTransformer)
    literal_type = TypeEngine.to_literal_type(Config)
    assert literal_type == DataclassTransformer().get_literal_type(Config)
    assert TypeEngine.to_literal_type(Config) is literal_type  # built once
    ctx = FlyteContextManager.current_context()
    config = preset("digits").with_overrides({"train": {"max_steps": 7}})
    literal = TypeEngine.to_literal(ctx, config, Config, literal_type)
    assert literal == DataclassTransformer().to_literal(ctx, config, Config, literal_type)
    assert TypeEngine.to_python_value(ctx, literal, Config) == config


def test_other_dataclasses_keep_the_default_transformer():
    assert not isinstance(TypeEngine.get_transformer(Topology), ConfigTransformer)
    assert TypeEngine.to_literal_type(Topology) == DataclassTransformer().get_literal_type(Topology)
