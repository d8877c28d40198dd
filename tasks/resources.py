"""What the tasks ask of their nodes, set at launch: the workflow input ``resources``.

    resources='{"train": {"cpu": "16", "mem": "120Gi", "ephemeral_storage": "200Gi"},
                "stage": {"cpu": "4", "mem": "8Gi"}}'

``train`` is per train node (pod or Slurm node: CPU and memory become sbatch's ``--cpus-per-task`` and
``--mem``), ``stage`` per staging partition pod. A value left out keeps its default: per node, 2 CPUs and
6 GiB per process and the node's stream cache plus 2 GiB of ephemeral storage for training; 2 CPUs, 4 GiB
and the partition's staged bytes plus a quarter for a partition. GPUs are the ``gpus_per_node`` input.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields

from tasks.types import NodeResources

SECTIONS = ("train", "stage")
CACHE_MARGIN = 2 << 30  # a node's ephemeral storage beyond its stream cache (logs, TensorBoard events)
# Kubernetes resource quantities: a decimal number with an optional SI or binary suffix.
_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$")
_FACTORS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "Ki": 2**10, "Mi": 2**20,
            "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def quantity(text: str) -> float:
    """The value of a Kubernetes quantity ("10Gi" -> 10737418240.0); ValueError for anything else."""
    match = _QUANTITY.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a quantity")
    return float(match.group(1)) * _FACTORS[match.group(3) or ""]


FORM = ('expected JSON such as \'{"train": {"cpu": "8", "mem": "32Gi", "ephemeral_storage": "100Gi"}}\' '
        f"with sections {', '.join(SECTIONS)} and keys {', '.join(f.name for f in fields(NodeResources))}")


def parse_resources(text: str) -> dict[str, NodeResources]:
    """The ``resources`` input as one NodeResources per section (all of them; absent ones at defaults);
    ValueError naming the first problem and the expected form."""
    try:
        raw = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not JSON ({exc.msg}): {FORM}") from None
    if not isinstance(raw, dict) or set(raw) - set(SECTIONS):
        unknown = sorted(set(raw) - set(SECTIONS)) if isinstance(raw, dict) else raw
        raise ValueError(f"has unknown section(s) {unknown}: {FORM}")
    return {section: _section(section, raw.get(section, {})) for section in SECTIONS}


def _section(section: str, values: object) -> NodeResources:
    known = {f.name for f in fields(NodeResources)}
    if not isinstance(values, dict) or set(values) - known:
        bad = sorted(set(values) - known) if isinstance(values, dict) else values
        gpus = isinstance(values, dict) and "gpu" in values
        hint = " (GPUs are the gpus_per_node input)" if gpus else ""
        raise ValueError(f"section {section!r} has unknown key(s) {bad}{hint}: {FORM}")
    for key, value in values.items():
        if not isinstance(value, str) or not _positive(value):
            raise ValueError(f"{section}.{key}={value!r} is not a positive Kubernetes quantity in quotes, "
                             'such as "8", "500m", "32Gi" or "200G"')
    return NodeResources(**values)


def _positive(value: str) -> bool:
    try:
        return quantity(value) > 0
    except ValueError:
        return False


def gib(value: float) -> str:
    """A byte count as a whole number of GiB, rounded up: a quantity Kubernetes and flytekit take."""
    return f"{-(-int(value) // 2**30)}Gi"

