"""The ``resources`` input: parsed and checked at launch, with the problem and the expected form named."""

from __future__ import annotations

import pytest

from tasks.plan import LaunchInputError, check_resources
from tasks.resources import gib, parse_resources, quantity
from tasks.types import NodeResources


def test_sections_and_keys_left_out_keep_their_defaults():
    parsed = parse_resources('{"train": {"cpu": "16", "ephemeral_storage": "200Gi"}}')
    assert parsed == {"train": NodeResources(cpu="16", ephemeral_storage="200Gi"), "stage": NodeResources()}
    assert parse_resources("") == {"train": NodeResources(), "stage": NodeResources()}


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not JSON"),
    ('{"trian": {}}', r"unknown section\(s\) \['trian'\]"),
    ('["train"]', "unknown section"),
    ('{"train": {"gpu": "1"}}', r"unknown key\(s\) \['gpu'\] \(GPUs are the gpus_per_node input\)"),
    ('{"stage": {"memory": "4Gi"}}', r"section 'stage' has unknown key\(s\) \['memory'\]"),
    ('{"train": {"cpu": 8}}', r"train.cpu=8 is not a positive Kubernetes quantity in quotes"),
    ('{"train": {"mem": "32 GB"}}', "train.mem='32 GB' is not a positive Kubernetes quantity"),
    ('{"stage": {"ephemeral_storage": "0"}}', "stage.ephemeral_storage='0' is not a positive"),
])
def test_a_bad_resources_input_is_named_with_the_expected_form(text, message):
    with pytest.raises(LaunchInputError, match=message) as caught:
        check_resources(text)
    assert str(caught.value).startswith(f"input resources={text!r}")


def test_quantities_are_read_as_kubernetes_reads_them():
    assert quantity("10Gi") == 10 * 2**30 and quantity("200G") == 200e9 and quantity("500m") == 0.5
    assert gib(10 * 2**30) == "10Gi" and gib(10 * 2**30 + 1) == "11Gi"
    with pytest.raises(ValueError, match="is not a quantity"):
        quantity("ten")
