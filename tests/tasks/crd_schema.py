"""A strict checker for the subset of OpenAPI v3 that Kubernetes CRD schemas use.

Stricter than the API server in one way on purpose: a field the schema does not know is an error here,
because the server would silently prune it and the setting would be lost.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

INT32 = (-(2**31), 2**31 - 1)
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float)}


def load_crd_schema(path: Path, version: str = "v1") -> dict:
    """The openAPIV3Schema of ``version`` in a CustomResourceDefinition YAML file."""
    crd = yaml.safe_load(path.read_text())
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{path} has no version {version}")


def schema_errors(value, schema: dict, where: str = "") -> list[str]:
    """Every way ``value`` breaks ``schema``, as 'path: problem' lines (empty when it conforms)."""
    if "anyOf" in schema or schema.get("x-kubernetes-int-or-string"):
        options = schema.get("anyOf") or [{"type": "integer"}, {"type": "string"}]
        base = {k: v for k, v in schema.items() if k not in ("anyOf", "x-kubernetes-int-or-string")}
        if all(schema_errors(value, base | option) for option in options):
            return [f"{where}: {value!r} matches none of {options}"]
        return []
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{where}: {value!r} is not an integer"]
        if schema.get("format") == "int32" and not INT32[0] <= value <= INT32[1]:
            return [f"{where}: {value} does not fit int32"]
        return []
    if kind in _TYPES and (not isinstance(value, _TYPES[kind])
                           or (kind == "number" and isinstance(value, bool))):
        return [f"{where}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} is not one of {schema['enum']}"]
    if kind == "string" and "pattern" in schema and not re.search(schema["pattern"], value):
        return [f"{where}: {value!r} does not match {schema['pattern']}"]
    if kind == "array":
        return [e for i, item in enumerate(value)
                for e in schema_errors(item, schema.get("items", {}), f"{where}[{i}]")]
    if kind == "object":
        return _object_errors(value, schema, where)
    return []


def _object_errors(value: dict, schema: dict, where: str) -> list[str]:
    errors = [f"{where}: required field {name!r} is missing"
              for name in schema.get("required", []) if name not in value]
    properties, extra = schema.get("properties"), schema.get("additionalProperties")
    for key, item in value.items():
        path = f"{where}.{key}"
        if properties is not None and key in properties:
            errors += schema_errors(item, properties[key], path)
        elif isinstance(extra, dict):
            errors += schema_errors(item, extra, path)
        elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            errors.append(f"{path}: unknown field (the API server would prune it)")
    return errors
