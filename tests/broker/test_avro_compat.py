"""Avro schema resolution (proxy/broker/avro_compat.py): the specification's rules, with the leniencies of
Avro's resolving grammar that the real broker showed (FIDELITY.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.broker import avro_compat


def record(fields: list[dict[str, Any]], name: str = "R", **extra: Any) -> dict[str, Any]:
    return {"type": "record", "name": name, "fields": fields, **extra}


def readable(reader: Any, writer: Any) -> bool:
    return avro_compat.can_read(avro_compat.parse(json.dumps(reader)), avro_compat.parse(json.dumps(writer))) is None


INT_A = record([{"name": "a", "type": "int"}])


@pytest.mark.parametrize(("reader", "writer", "expected"), [
    (INT_A, INT_A, True),
    # a field the reader adds needs a default; one it drops is skipped
    (record([{"name": "a", "type": "int"}, {"name": "b", "type": "string", "default": "x"}]), INT_A, True),
    (record([{"name": "a", "type": "int"}, {"name": "b", "type": "string"}]), INT_A, False),
    (record([{"name": "b", "type": "string", "default": ""}]), INT_A, True),
    (INT_A, record([{"name": "b", "type": "string", "default": ""}]), False),
    # an optional field of the Python client's Record: a null union without a default
    (record([{"name": "a", "type": "int"}, {"name": "q", "type": ["null", "int"]}]), INT_A, False),
    # an alias names the writer's field
    (record([{"name": "z", "type": "int", "aliases": ["a"]}]), INT_A, True),
    # promotions, one way only
    (record([{"name": "a", "type": "long"}]), INT_A, True),
    (INT_A, record([{"name": "a", "type": "long"}]), False),
    ("double", "float", True), ("float", "long", True), ("int", "double", False),
    ("bytes", "string", True), ("string", "bytes", True), ("boolean", "int", False),
    # record names do not matter, enum and fixed names do, and a fixed type's size
    (record([{"name": "a", "type": "int"}], name="Other"), INT_A, True),
    ({"type": "enum", "name": "E", "symbols": ["A"]}, {"type": "enum", "name": "E", "symbols": ["A", "B"]}, True),
    ({"type": "enum", "name": "F", "symbols": ["A"]}, {"type": "enum", "name": "E", "symbols": ["A"]}, False),
    ({"type": "fixed", "name": "F", "size": 4}, {"type": "fixed", "name": "F", "size": 4}, True),
    ({"type": "fixed", "name": "F", "size": 8}, {"type": "fixed", "name": "F", "size": 4}, False),
    # unions: every writer branch must resolve; a reader union takes a matching or promoting branch
    (["null", "int", "string"], ["null", "int"], True),
    (["null", "int"], ["null", "int", "string"], False),
    (["null", "long"], "int", True),
    ("int", ["null", "int"], False),
    (["null", record([], name="M")], record([], name="N"), True),
    # containers and nested records
    ({"type": "array", "items": "long"}, {"type": "array", "items": "int"}, True),
    ({"type": "map", "values": "int"}, {"type": "map", "values": "long"}, False),
    (record([{"name": "n", "type": record([{"name": "x", "type": "long"}], name="N")}]),
     record([{"name": "n", "type": record([{"name": "x", "type": "int"}], name="N")}]), True),
    (record([{"name": "n", "type": record([{"name": "x", "type": "int"}, {"name": "y", "type": "int"}], name="N")}]),
     record([{"name": "n", "type": record([{"name": "x", "type": "int"}], name="N")}]), False),
])
def test_resolution_rules(reader: Any, writer: Any, expected: bool) -> None:
    assert readable(reader, writer) is expected


def test_a_recursive_record_resolves_and_references_use_the_namespace() -> None:
    linked = record([{"name": "v", "type": "int"}, {"name": "next", "type": ["null", "List"], "default": None}],
                    name="List", namespace="ns")
    longer = record([{"name": "v", "type": "long"}, {"name": "next", "type": ["null", "ns.List"], "default": None}],
                    name="List", namespace="ns")
    assert readable(longer, linked)
    assert not readable(linked, longer)


@pytest.mark.parametrize("text", ["not json", '{"foo": 1}', '"NoSuchType"', '{"type": "record", "fields": []}'])
def test_what_is_not_a_schema_is_a_parse_error(text: str) -> None:
    with pytest.raises(avro_compat.SchemaParseError):
        avro_compat.parse(text)


JACKSON = ("Invalid schema definition data for JSON schema caused by com.fasterxml.jackson.databind.exc."
           "InvalidTypeIdException: Could not resolve subtype of [simple type, class com.fasterxml.jackson.module."
           "jsonSchema.JsonSchema]: missing type id property 'type'\n at [Source: REDACTED "
           "(`StreamReadFeature.INCLUDE_SOURCE_IN_LOCATION` disabled); line: {line}, column: 1]")


#: the real 4.0.7 standalone's IncompatibleSchema messages for a first schema (definitions as the official Python
#: client sends them: json.dumps(..., indent=True)); None: stored
@pytest.mark.parametrize(("type_name", "definition", "message"), [
    ("JSON", {"foo": 1}, JACKSON.format(line=3)),
    ("JSON", "not json{", JACKSON.format(line=1)),
    ("AVRO", {"foo": 1}, "Invalid schema definition data for AVRO schema caused by "
                         'org.apache.avro.SchemaParseException: No type: {"foo":1}'),
    ("AVRO", record([{"name": "x", "type": "Nope"}]),
     "Invalid schema definition data for AVRO schema caused by org.apache.avro.SchemaParseException: \"Nope\" is "
     'not a defined name. The type of the "x" field must be a defined name or a {"type": ...} expression.'),
    ("AVRO", ["null", "string"], "Avro schema typed [UNION] is not supported"),
    ("JSON", record([{"name": "x", "type": "int"}, {"name": "x", "type": "int"}]),
     "Invalid schema definition data for JSON schema caused by org.apache.avro.AvroRuntimeException: "
     "Duplicate field x in record R: x type:INT pos:1 and x type:INT pos:0."),
    ("AVRO", {"type": "string"}, None),
    ("JSON", {"type": "string"}, None),
    ("JSON", ["null", "string"], None),
    ("JSON", {"type": "object", "properties": {"x": {"type": "integer"}}}, None),  # a JSON Schema document
    ("JSON", record([]), None),
    ("JSON", record([{"name": "x", "type": "int", "default": "s"}]), None),  # defaults are not validated
    # the real broker never answers these (an exception escapes its validator): stored here
    ("JSON", record([{"name": "x", "type": "Nope"}]), None),
    ("JSON", {"type": "record", "name": "R"}, None),
])
def test_a_definition_the_real_broker_refuses_to_store(type_name: str, definition: Any, message: str | None) -> None:
    assert avro_compat.invalid_definition(type_name, json.dumps(definition, indent=True)) == message
