"""Spans as OTLP protobuf bytes, written field by field (the traces request of OTLP/HTTP).

The SDK's OTLP encoder builds a protobuf message object per span, per attribute and per
attribute value, then serializes the tree: at 100 % sampling that was ~30 µs a span on
the exporter's thread, twice what building the span cost the relay's, and every
microsecond of it is taken from the relays (the GIL, 2 cores).  Here a batch is written
straight into bytes, in the wire format of ``opentelemetry/proto/collector/trace/v1``
``ExportTraceServiceRequest``:

- ``ExportTraceServiceRequest.resource_spans`` (1) → ``ResourceSpans``: ``resource`` (1),
  ``scope_spans`` (2), ``schema_url`` (3); ``ScopeSpans``: ``scope`` (1), ``spans`` (2),
  ``schema_url`` (3) — the resource and the scope are few and serialized once each by the
  SDK's own encoder (:func:`_envelope`, cached);
- ``Span``: ``trace_id`` (1), ``span_id`` (2), ``trace_state`` (3), ``parent_span_id`` (4),
  ``name`` (5), ``kind`` (6), ``start_time_unix_nano`` (7, fixed64), ``end_time_unix_nano``
  (8, fixed64), ``attributes`` (9), ``dropped_attributes_count`` (10), ``events`` (11),
  ``dropped_events_count`` (12), ``links`` (13), ``dropped_links_count`` (14), ``status``
  (15), ``flags`` (16, fixed32); ``Span.Event``: ``time_unix_nano`` (1), ``name`` (2),
  ``attributes`` (3), ``dropped_attributes_count`` (4); ``Span.Link``: ``trace_id`` (1),
  ``span_id`` (2), ``trace_state`` (3), ``attributes`` (4), ``dropped_attributes_count`` (5),
  ``flags`` (6, fixed32); ``Status``: ``message`` (2), ``code`` (3);
- ``KeyValue``: ``key`` (1), ``value`` (2); ``AnyValue``: ``string_value`` (1),
  ``bool_value`` (2), ``int_value`` (3), ``double_value`` (4), ``array_value`` (5:
  ``ArrayValue.values`` (1)), ``bytes_value`` (7); any other value (a mapping) goes
  through the SDK's encoder.

Fields at their default (0, empty) are left out, as proto3 serializers do, so a request
parses to the message the SDK's encoder builds (a test compares the two).  An attribute
whose string or bool value was seen before is copied from a bounded cache: most of a
request span's attributes (system, command, addresses, topic, producer name) repeat.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

from opentelemetry.exporter.otlp.proto.common._internal import (
    _encode_instrumentation_scope,
    _encode_key_value,
    _encode_resource,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.semconv.attributes.http_attributes import HTTP_RESPONSE_STATUS_CODE
from opentelemetry.trace import SpanContext, SpanKind, Status

from proxy.recording.segment import varint

#: encoded ``KeyValue`` fields of string and bool attributes, by (field tag, key, value); cleared when full
MAX_CACHED_ATTRIBUTES: Final = 65_536

_FIXED64: Final = struct.Struct("<Q").pack
_FIXED32: Final = struct.Struct("<I").pack
_DOUBLE: Final = struct.Struct("<d").pack
#: ``Span.kind``: SpanKind's value + 1 (SPAN_KIND_INTERNAL is 1 ... SPAN_KIND_CONSUMER 5)
_KIND: Final = {kind: bytes((0x30, kind.value + 1)) for kind in SpanKind}
#: ``Span.flags`` / ``Link.flags``: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, and with
#: SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK for a remote context
_FLAGS_LOCAL: Final = b"\x85\x01" + _FIXED32(0x100)
_FLAGS_REMOTE: Final = b"\x85\x01" + _FIXED32(0x300)
_LINK_FLAGS_LOCAL: Final = b"\x35" + _FIXED32(0x100)
_LINK_FLAGS_REMOTE: Final = b"\x35" + _FIXED32(0x300)
_VARINTS: Final = tuple(bytes((n,)) for n in range(128))


def _varint(value: int) -> bytes:
    if value < 128:
        return _VARINTS[value] if value >= 0 else _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    if value < 16384:
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    return varint(value)


def _field(tag: int, body: bytes) -> bytes:
    """A length-delimited field: its tag byte (field numbers below 16), length and body."""
    return bytes((tag,)) + _varint(len(body)) + body


def _any_value(value: object) -> bytes | None:
    """An ``AnyValue``'s body, or None for a value only the SDK's encoder takes (a mapping)."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        values = bytearray()
        for item in value:
            body = _any_value(item)
            if body is None:
                return None
            values += _field(0x0A, body)
        return _field(0x2A, bytes(values))
    return None


class SpanEncoder:
    """Batches of finished spans as ``ExportTraceServiceRequest`` bytes; see the module docstring."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        self._attributes: dict[tuple[int, str, object], bytes] = {}
        self._envelopes: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        #: what the ids in ``_envelopes`` are of (kept alive, so that an id is not reused for another object)
        self._enveloped: list[object] = []

    def request(self, spans: Sequence[ReadableSpan]) -> bytes:
        """The serialized request of ``spans``: grouped by resource, then by instrumentation scope, in order."""
        # (by identity: a Resource's hash serializes its attributes, and a batch's spans share one)
        groups: dict[int, tuple[Resource, dict[int, tuple[InstrumentationScope | None, bytearray]]]] = {}
        for span in spans:
            resource = span.resource
            group = groups.get(id(resource))
            if group is None:
                group = groups[id(resource)] = (resource, {})
            scope = span.instrumentation_scope or None
            scoped = group[1].get(id(scope))
            if scoped is None:
                scoped = group[1][id(scope)] = (scope, bytearray())
            scoped[1].extend(_field(0x12, self.span(span)))
        out = bytearray()
        for resource, scopes in groups.values():
            resource_spans = bytearray(_field(0x0A, self._envelope(resource, None)[0]))
            for scope, encoded in scopes.values():
                scope_spans = _field(0x0A, self._envelope(resource, scope)[1]) + encoded
                if scope is not None and scope.schema_url:
                    scope_spans += _field(0x1A, scope.schema_url.encode())
                resource_spans += _field(0x12, bytes(scope_spans))
            if resource.schema_url:
                resource_spans += _field(0x1A, resource.schema_url.encode())
            out += _field(0x0A, bytes(resource_spans))
        return bytes(out)

    def _envelope(self, resource: Resource, scope: InstrumentationScope | None) -> tuple[bytes, bytes]:
        """The ``Resource`` and ``InstrumentationScope`` bodies (the SDK's encoding, once each: by identity, the
        objects are kept alive with it)."""
        key = (id(resource), id(scope))
        envelope = self._envelopes.get(key)
        if envelope is None:
            if len(self._envelopes) >= 64:
                self._envelopes.clear()
                self._enveloped.clear()
            self._enveloped += (resource, scope)
            envelope = self._envelopes[key] = (_encode_resource(resource).SerializeToString(),
                                               _encode_instrumentation_scope(scope).SerializeToString())  # type: ignore[arg-type]
        return envelope

    def span(self, span: ReadableSpan) -> bytes:
        """One ``Span`` message's body."""
        context = span.context
        assert context is not None  # (every span the SDK finishes has one)
        out = bytearray(_ids(context))
        trace_state = _trace_state(context)
        if trace_state:
            out += _field(0x1A, trace_state)
        parent = span.parent
        if parent is not None:
            out += b"\x22\x08" + parent.span_id.to_bytes(8, "big")
        if span.name:
            out += _field(0x2A, span.name.encode())
        out += _KIND[span.kind]
        if span.start_time:
            out += b"\x39" + _FIXED64(span.start_time)
        if span.end_time:
            out += b"\x41" + _FIXED64(span.end_time)
        if span.attributes:
            out += self._attributes_of(0x4A, span.attributes)
        if span.dropped_attributes:
            out += b"\x50" + _varint(span.dropped_attributes)
        for event in span.events:
            body = bytearray(b"\x09" + _FIXED64(event.timestamp) if event.timestamp else b"")
            if event.name:
                body += _field(0x12, event.name.encode())
            if event.attributes:
                body += self._attributes_of(0x1A, event.attributes)
            if event.dropped_attributes:
                body += b"\x20" + _varint(event.dropped_attributes)
            out += _field(0x5A, bytes(body))
        if span.dropped_events:
            out += b"\x60" + _varint(span.dropped_events)
        for link in span.links:
            linked = link.context
            body = bytearray(_ids(linked))
            if link.attributes:
                body += self._attributes_of(0x22, link.attributes)
            if link.dropped_attributes:
                body += b"\x28" + _varint(link.dropped_attributes)
            body += _LINK_FLAGS_REMOTE if linked.is_remote else _LINK_FLAGS_LOCAL
            out += _field(0x6A, bytes(body))
        if span.dropped_links:
            out += b"\x70" + _varint(span.dropped_links)
        out += b"\x7a" + _status(span.status)
        out += _FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL
        return bytes(out)

    def _attributes_of(self, tag: int, attributes: Mapping[str, Any]) -> bytes:
        """``attributes`` as repeated ``KeyValue`` fields numbered ``tag``."""
        out = bytearray()
        cache, keys = self._attributes, self._keys
        prefix = _VARINTS[tag]
        for key, value in attributes.items():
            kind = type(value)
            if (kind is int and value >= 0) or kind is float:
                # (inline: most of a request span's attributes that are not cached: ids, sizes, times)
                encoded_key = keys.get(key) or self._key(key)
                number = b"\x18" + _varint(value) if kind is int else b"\x21" + _DOUBLE(value)
                size = len(encoded_key) + len(number) + 2
                out += prefix
                out += _VARINTS[size] if size < 128 else _varint(size)
                out += encoded_key
                out += b"\x12"
                out += _VARINTS[len(number)]
                out += number
                continue
            cacheable = kind is str or kind is bool
            if cacheable:
                encoded = cache.get((tag, key, value))
                if encoded is not None:
                    out += encoded
                    continue
            body = _any_value(value)
            if body is None:
                kv = _encode_key_value(key, value).SerializeToString()
            else:
                kv = self._key(key) + _field(0x12, body)
            encoded = prefix + _varint(len(kv)) + kv
            if cacheable:
                if len(cache) >= MAX_CACHED_ATTRIBUTES:
                    cache.clear()
                cache[(tag, key, value)] = encoded
            out += encoded
        return bytes(out)

    def _key(self, key: str) -> bytes:
        encoded = self._keys.get(key)
        if encoded is None:
            if len(self._keys) >= MAX_CACHED_ATTRIBUTES:
                self._keys.clear()
            encoded = self._keys[key] = _field(0x0A, key.encode()) if key else b""
        return encoded


def _ids(context: SpanContext) -> bytes:
    """The ``trace_id`` (1) and ``span_id`` (2) fields a ``Span`` and a ``Span.Link`` begin with."""
    return b"\x0a\x10" + context.trace_id.to_bytes(16, "big") + b"\x12\x08" + context.span_id.to_bytes(8, "big")


def _trace_state(context: SpanContext) -> bytes:
    state = context.trace_state
    if not state:
        return b""
    return ",".join(f"{key}={value}" for key, value in state.items()).encode()


def _status(status: Status) -> bytes:
    """A ``Status`` field's length and body."""
    body = b""
    if status.description:
        body = _field(0x12, status.description.encode())
    if status.status_code.value:
        body += b"\x18" + _varint(status.status_code.value)
    return _varint(len(body)) + body


class HttpSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter (its transport, retries, limits and metrics) with the batch encoded by
    :class:`SpanEncoder`.

    It reaches into the SDK exporter's parts (its HTTP client, size limit, self-metrics); an SDK whose exporter
    lacks one of them gets its own ``export`` unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.encoder = SpanEncoder()
        self._own_encoding = all(hasattr(self, name) for name in ("_client", "_metrics", "_max_request_size",
                                                                  "_shutdown"))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self._own_encoding or self._shutdown:
            return super().export(spans)
        try:
            data = self.encoder.request(spans)
        except Exception:  # a value this encoder does not know: the SDK's encoder decides (and logs)
            return super().export(spans)
        if 0 < self._max_request_size < len(data):
            return super().export(spans)  # (which drops the batch, logs and counts it as the SDK does)
        with self._metrics.export_operation(len(spans)) as result:
            exported = self._client.export(data)
            if not exported.success:
                result.error = exported.error
                result.error_attrs = (None if exported.status_code is None
                                      else {HTTP_RESPONSE_STATUS_CODE: exported.status_code})
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS
