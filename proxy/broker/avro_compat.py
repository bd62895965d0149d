"""Avro schema resolution: can data written with one schema be read with another?

Pulsar's broker checks a new AVRO or JSON schema (a JSON schema carries an Avro
definition) against the topic's latest one with Avro's resolution rules (the Avro
specification, "Schema Resolution"): a producer's both ways (strategy FULL, the 4.0.7
standalone's default), a consumer's one way (BACKWARD: the consumer reads what the latest
schema wrote).  This module is a compact implementation of those rules as Avro's
resolving grammar applies them, with its leniencies, measured on the real broker:

- records match whatever their names (also inside unions); a reader field missing from
  the writer needs a default; a writer field the reader lacks is skipped;
- enums and fixed types must have the same full name (a fixed type the same size); enum
  symbols are not checked (a symbol either side lacks fails only when read);
- promotions: int to long, float, double; long to float, double; float to double;
  string to bytes and back;
- a writer union: every branch must resolve; a reader union: some branch must take the
  writer's type (same type and name first, then any record, then a promotion).

:func:`can_read` answers None when the reader resolves the writer, else why not.

Before any of that the broker validates a definition it is to store
(``StructSchemaDataValidator``): Avro must parse it (an AVRO one must not be a union); a
JSON one Avro cannot parse may still be a JSON Schema document (an object with a known
``type``).  :func:`invalid_definition` answers with the broker's words.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

PRIMITIVES: Final = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
NAMED: Final = frozenset({"record", "error", "enum", "fixed"})
#: (writer type, reader type) pairs a reader promotes
PROMOTIONS: Final = frozenset({("int", "long"), ("int", "float"), ("int", "double"), ("long", "float"),
                               ("long", "double"), ("float", "double"), ("string", "bytes"), ("bytes", "string")})


class SchemaParseError(ValueError):
    """The text is not an Avro schema definition (Avro's ``SchemaParseException``, in its words)."""


class DuplicateField(SchemaParseError):
    """A record names a field twice (Avro's ``AvroRuntimeException``, not a parse error, in Pulsar's eyes)."""


@dataclass(eq=False)
class AvroType:
    """One node of a parsed schema; named types are shared by every reference to them."""

    kind: str
    name: str = ""
    size: int = 0
    items: AvroType | None = None
    branches: list[AvroType] = field(default_factory=list)
    fields: list[AvroField] = field(default_factory=list)


@dataclass(eq=False)
class AvroField:
    name: str
    type: AvroType
    has_default: bool
    aliases: tuple[str, ...] = ()


def parse(text: str | bytes) -> AvroType:
    """Parse an Avro schema definition (JSON text); :class:`SchemaParseError` if it is not one."""
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaParseError(f"not JSON: {exc}") from exc
    return _Parser().node(document, "")


class _Parser:
    def __init__(self) -> None:
        self.names: dict[str, AvroType] = {}

    def node(self, document: Any, namespace: str) -> AvroType:
        if isinstance(document, str):
            return self.reference(document, namespace)
        if isinstance(document, list):
            return AvroType("union", branches=[self.node(branch, namespace) for branch in document])
        if not isinstance(document, dict):
            raise SchemaParseError(f"not a schema: {document!r}")
        kind = document.get("type")
        if isinstance(kind, (dict, list)):
            return self.node(kind, namespace)
        if not isinstance(kind, str):
            raise SchemaParseError(f"No type: {_compact(document)}")
        if kind in PRIMITIVES:
            return AvroType(kind)
        if kind == "array":
            return AvroType("array", items=self.node(document.get("items"), namespace))
        if kind == "map":
            return AvroType("map", items=self.node(document.get("values"), namespace))
        if kind not in NAMED:
            return self.reference(kind, namespace)
        full_name, namespace = _full_name(document, namespace)
        named = AvroType("record" if kind == "error" else kind, name=full_name, size=_size(document))
        self.names[full_name] = named
        if named.kind == "record":
            entries = document.get("fields")
            if not isinstance(entries, list):
                raise SchemaParseError(f"Record has no fields: {_compact(document)}")
            for entry in entries:
                if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                    raise SchemaParseError(f"No field name: {_compact(entry)}")
                kind_of = entry.get("type")
                if isinstance(kind_of, str) and kind_of not in PRIMITIVES and not self.known(kind_of, namespace):
                    raise SchemaParseError(f"{_compact(kind_of)} is not a defined name. The type of the "
                                           f"{_compact(entry['name'])} field must be a defined name or a "
                                           '{"type": ...} expression.')
                named.fields.append(AvroField(entry["name"], self.node(kind_of, namespace),
                                              "default" in entry, tuple(entry.get("aliases") or ())))
            _refuse_duplicates(named)
        return named

    def known(self, name: str, namespace: str) -> bool:
        return any(candidate in self.names for candidate in _candidates(name, namespace))

    def reference(self, name: str, namespace: str) -> AvroType:
        if name in PRIMITIVES:
            return AvroType(name)
        for candidate in _candidates(name, namespace):
            if candidate in self.names:
                return self.names[candidate]
        raise SchemaParseError(f"Undefined name: {_compact(name)}")


def _refuse_duplicates(record: AvroType) -> None:
    first: dict[str, int] = {}
    for position, entry in enumerate(record.fields):
        if entry.name in first:
            earlier = first[entry.name]
            raise DuplicateField(f"Duplicate field {entry.name} in record {record.name}: "
                                 f"{_field_label(record, position)} and {_field_label(record, earlier)}.")
        first[entry.name] = position


def _field_label(record: AvroType, position: int) -> str:
    """A field as Avro's ``Field.toString`` shows it."""
    entry = record.fields[position]
    return f"{entry.name} type:{entry.type.kind.upper()} pos:{position}"


def _candidates(name: str, namespace: str) -> tuple[str, str]:
    return (f"{namespace}.{name}" if namespace and "." not in name else name, name)


def _compact(value: Any) -> str:
    """JSON as Avro's messages quote it (Jackson's compact form)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _full_name(document: dict[str, Any], namespace: str) -> tuple[str, str]:
    name = document.get("name")
    if not isinstance(name, str) or not name:
        raise SchemaParseError(f"a named type without a name: {document!r}")
    if "." in name:
        return name, name.rpartition(".")[0]
    own = document.get("namespace")
    namespace = own if isinstance(own, str) else namespace
    return (f"{namespace}.{name}" if namespace else name), namespace


def _size(document: dict[str, Any]) -> int:
    size = document.get("size", 0)
    return size if isinstance(size, int) else 0


def can_read(reader: AvroType, writer: AvroType) -> str | None:
    """None if data written with ``writer`` reads with ``reader``, else the first reason it does not."""
    return _resolve(writer, reader, set())


def _resolve(writer: AvroType, reader: AvroType, seen: set[tuple[int, int]]) -> str | None:
    pair = (id(writer), id(reader))
    if pair in seen:  # a recursive type already being resolved
        return None
    seen.add(pair)
    if writer.kind == "union":
        for branch in writer.branches:
            problem = _resolve(branch, reader, seen)
            if problem is not None:
                return problem
        return None
    if reader.kind == "union":
        chosen = _best_branch(reader, writer)
        if chosen is None:
            return f"found {_label(writer)}, expecting union"
        return _resolve(writer, chosen, seen)
    if writer.kind != reader.kind:
        if (writer.kind, reader.kind) in PROMOTIONS:
            return None
        return f"found {_label(writer)}, expecting {_label(reader)}"
    if writer.kind in ("enum", "fixed"):
        if writer.name != reader.name:
            return f"found {_label(writer)}, expecting {_label(reader)}"
        if writer.size != reader.size:
            return f"fixed {writer.name}: size {writer.size}, expecting {reader.size}"
        return None
    if writer.kind in ("array", "map"):
        assert writer.items is not None and reader.items is not None
        return _resolve(writer.items, reader.items, seen)
    if writer.kind == "record":
        written = {f.name: f for f in writer.fields}
        for wanted in reader.fields:
            source = next((written[name] for name in (wanted.name, *wanted.aliases) if name in written), None)
            if source is None:
                if not wanted.has_default:
                    return f"{reader.name}: field {wanted.name} has no default value"
                continue
            problem = _resolve(source.type, wanted.type, seen)
            if problem is not None:
                return problem
    return None


def _best_branch(union: AvroType, writer: AvroType) -> AvroType | None:
    branches = union.branches
    for branch in branches:
        if branch.kind == writer.kind and branch.name == writer.name:
            return branch
    if writer.kind == "record":
        return next((branch for branch in branches if branch.kind == "record"), None)
    return next((branch for branch in branches if (writer.kind, branch.kind) in PROMOTIONS), None)


def _label(node: AvroType) -> str:
    return f"{node.kind} {node.name}" if node.name else node.kind


def invalid_definition(type_name: str, text: str | bytes) -> str | None:
    """Why Pulsar's broker refuses to store this AVRO or JSON definition (its IncompatibleSchema message), or None.

    Measured on the 4.0.7 standalone; a JSON definition whose ``type`` Jackson does not know (``record`` with
    an undefined field type, no fields, a bad name) is never answered there, and accepted here.
    """
    prefix = f"Invalid schema definition data for {type_name} schema caused by "
    try:
        parsed = parse(text)
    except DuplicateField as exc:
        return f"{prefix}org.apache.avro.AvroRuntimeException: {exc}"
    except SchemaParseError as exc:
        if type_name != "JSON":
            return f"{prefix}org.apache.avro.SchemaParseException: {exc}"
        return _json_schema_problem(text, prefix)
    if type_name == "AVRO" and parsed.kind == "union":
        return "Avro schema typed [UNION] is not supported"
    return None


def _json_schema_problem(text: str | bytes, prefix: str) -> str | None:
    """Jackson's complaint reading the text as a JSON Schema document, or None (read, or never answered)."""
    decoded = text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray, memoryview)) else text
    try:
        document = json.loads(decoded)
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("type"), str):
        return None
    # Jackson gives up where the value it read ends: the closing brace of an object, else the first token
    lines = decoded.rstrip().splitlines() or [""]
    line, column = (len(lines), len(lines[-1])) if isinstance(document, dict) else (1, 1)
    return (f"{prefix}com.fasterxml.jackson.databind.exc.InvalidTypeIdException: Could not resolve subtype of "
            "[simple type, class com.fasterxml.jackson.module.jsonSchema.JsonSchema]: missing type id property "
            "'type'\n at [Source: REDACTED (`StreamReadFeature.INCLUDE_SOURCE_IN_LOCATION` disabled); "
            f"line: {line}, column: {column}]")
