"""Literals as propeller handles them: launch inputs, binding resolution, and plain values for display."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
from flyteidl.admin import launch_plan_pb2
from flyteidl.core import literals_pb2, types_pb2
from google.protobuf.json_format import MessageToDict

SimpleType = types_pb2.SimpleType
START_NODE = ""  # flytekit binds workflow inputs to node id "" (propeller's start-node)


class InputError(ValueError):
    """A launch input is unknown, missing or does not parse as its declared type."""


COMMAND_LINE_TYPES = "int, float, str and bool inputs, or Optional of one"


def primitive_literal(text: str, simple: int, name: str) -> literals_pb2.Literal:
    """``text`` as a literal of the simple type ``simple`` (integer, float, string or boolean)."""
    try:
        if simple == SimpleType.INTEGER:
            primitive = literals_pb2.Primitive(integer=int(text))
        elif simple == SimpleType.FLOAT:
            primitive = literals_pb2.Primitive(float_value=float(text))
        elif simple == SimpleType.STRING:
            primitive = literals_pb2.Primitive(string_value=text)
        elif simple == SimpleType.BOOLEAN:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError("a bool input takes true or false (any case), or 1 or 0")
            primitive = literals_pb2.Primitive(boolean=text.lower() in ("true", "1"))
        else:
            raise ValueError(f"its type ({SimpleType.Name(simple)}) cannot be given on the command line, "
                             f"only {COMMAND_LINE_TYPES}")
    except ValueError as exc:
        raise InputError(f"--input {name}={text!r}: {exc}") from exc
    return literals_pb2.Literal(scalar=literals_pb2.Scalar(primitive=primitive))


def input_literal(text: str, declared: types_pb2.LiteralType, name: str) -> literals_pb2.Literal:
    """``text`` as a literal of the declared type: a simple type, or Optional[X] of a simple X, which takes
    X's values and becomes the union literal flytekit makes for it (the value and the variant it matched)."""
    if declared.HasField("simple"):
        return primitive_literal(text, declared.simple, name)
    variants = [v for v in declared.union_type.variants if not _is_none(v)]
    if len(variants) != 1 or not variants[0].HasField("simple"):
        kind = declared.WhichOneof("type")
        raise InputError(f"--input {name}={text!r}: its type ({kind}) cannot be given on the command line, "
                         f"only {COMMAND_LINE_TYPES}; leave it out for the launch plan's value")
    value = primitive_literal(text, variants[0].simple, name)
    union = literals_pb2.Union(value=value, type=variants[0])
    return literals_pb2.Literal(scalar=literals_pb2.Scalar(union=union))


def _is_none(literal_type: types_pb2.LiteralType) -> bool:
    return literal_type.HasField("simple") and literal_type.simple == SimpleType.NONE


def launch_inputs(plan: launch_plan_pb2.LaunchPlan, overrides: Mapping[str, str]) -> literals_pb2.LiteralMap:
    """The launch plan's fixed inputs and defaults, with ``overrides`` (name -> text) applied on top."""
    parameters = plan.spec.default_inputs.parameters
    fixed = plan.spec.fixed_inputs.literals
    _check_names(plan, overrides)
    inputs = literals_pb2.LiteralMap()
    for name, literal in fixed.items():
        inputs.literals[name].CopyFrom(literal)
    for name, parameter in parameters.items():
        if name in overrides:
            inputs.literals[name].CopyFrom(input_literal(overrides[name], parameter.var.type, name))
        elif parameter.HasField("default"):
            inputs.literals[name].CopyFrom(parameter.default)
        elif parameter.required:
            raise InputError(f"input {name!r} is required: give --input {name}=VALUE")
    return inputs


def _check_names(plan: launch_plan_pb2.LaunchPlan, overrides: Mapping[str, str]) -> None:
    """Refuse overrides of inputs the launch plan fixes or does not have."""
    parameters = plan.spec.default_inputs.parameters
    fixed = sorted(set(overrides) & set(plan.spec.fixed_inputs.literals))
    if fixed:
        raise InputError(f"input(s) {fixed} are fixed by the launch plan {plan.id.name} and cannot be "
                         f"overridden: replay its workflow's launch plan (--launch-plan "
                         f"{plan.spec.workflow_id.name}) to set them")
    unknown = sorted(set(overrides) - set(parameters))
    if unknown:
        raise InputError(f"unknown input(s) {unknown}; the launch plan takes {sorted(parameters)}")


def resolve(binding: literals_pb2.BindingData, outputs: Mapping[str, literals_pb2.LiteralMap]
            ) -> literals_pb2.Literal:
    """The literal a binding stands for, given every finished node's outputs (``START_NODE``: the inputs)."""
    kind = binding.WhichOneof("value")
    if kind == "scalar":
        return literals_pb2.Literal(scalar=binding.scalar)
    if kind == "collection":
        items = [resolve(b, outputs) for b in binding.collection.bindings]
        return literals_pb2.Literal(collection=literals_pb2.LiteralCollection(literals=items))
    if kind == "map":
        mapped = {k: resolve(b, outputs) for k, b in binding.map.bindings.items()}
        return literals_pb2.Literal(map=literals_pb2.LiteralMap(literals=mapped))
    if kind == "promise":
        ref = binding.promise
        if ref.attr_path:  # propeller resolves these inside msgpack/Struct values; this workflow needs none
            raise NotImplementedError(f"attribute paths in bindings are not replayed: {ref}")
        node = ref.node_id or START_NODE
        if node not in outputs or ref.var not in outputs[node].literals:
            raise KeyError(f"binding to {node or 'the workflow inputs'}.{ref.var}, which is not available")
        return outputs[node].literals[ref.var]
    raise NotImplementedError(f"binding kind {kind!r} is not replayed")


def bind_inputs(bindings, outputs: Mapping[str, literals_pb2.LiteralMap]) -> literals_pb2.LiteralMap:
    """A node's inputs.pb content from its ``inputs`` bindings (a repeated core.Binding)."""
    return literals_pb2.LiteralMap(literals={b.var: resolve(b.binding, outputs) for b in bindings})


def to_python(literal: literals_pb2.Literal) -> Any:
    """A plain value for display: primitives, msgpack or Struct dataclasses as dicts, blobs as URIs."""
    kind = literal.WhichOneof("value")
    if kind == "collection":
        return [to_python(item) for item in literal.collection.literals]
    if kind == "map":
        return {k: to_python(v) for k, v in literal.map.literals.items()}
    if kind != "scalar":
        return MessageToDict(literal)
    scalar = literal.scalar
    which = scalar.WhichOneof("value")
    if which == "primitive":
        return getattr(scalar.primitive, scalar.primitive.WhichOneof("value"))
    if which == "union":  # an Optional or Union value: the value of the variant it holds
        return to_python(scalar.union.value)
    if which == "binary" and scalar.binary.tag == "msgpack":
        return msgpack.unpackb(scalar.binary.value, strict_map_key=False)
    if which == "generic":
        return MessageToDict(scalar.generic)
    if which == "blob":
        return scalar.blob.uri
    return MessageToDict(scalar)


def find_values(value: Any, key: str) -> list[Any]:
    """Every value stored under ``key`` anywhere inside nested dicts and lists."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            found += [v] if k == key else []
            found += find_values(v, key)
    elif isinstance(value, list):
        for item in value:
            found += find_values(item, key)
    return found
