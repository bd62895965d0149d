"""A recording decoded into a timeline: each frame's command, fields, topic and latency.

This is what ``pulsar-tap show`` prints and what its sequence diagram draws.
Each connection's frames go through its own
:class:`~proxy.protocol.session.SessionTracker` (lenient: a recording may start
mid-session or hold frames the proxy injected), which attributes id-only
commands (SEND, MESSAGE, ACK, FLOW, ...) to their topic and pairs responses with
their requests, so a response carries the latency since its request.

:meth:`TimelineEntry.to_json` renders the ``show --json`` object exactly as
SPEC.md fixes it: ``ts_ns``, ``conn``, ``direction``, ``origin``, ``command``,
``size``, ``fields`` (sub-command fields named as in PulsarApi.proto, enums as
names, bytes as base64) and, for SEND/MESSAGE, ``num_messages``,
``compression`` and ``payload_size``.  Geo-replication traffic adds
``replication``: ``replicated_from``, ``replicate_to``, ``publish_time`` and, for a
replication marker, ``marker`` (its MarkerType name), ``marker_fields`` (the decoded
PulsarMarkers message: snapshot id, clusters and their positions) and ``label``.
Nothing here does I/O.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import markers
from proxy.protocol.commands import sub_command, type_name
from proxy.protocol.session import Direction, RequestPair, SessionTracker
from proxy.recording.reader import RecordedFrame
from proxy.recording.redaction import frame_type_of

JsonValue = Any


def message_fields(msg: Message) -> dict[str, JsonValue]:
    """The set fields of a protobuf message as JSON values (enums by name, bytes in base64)."""
    out: dict[str, JsonValue] = {}
    for desc, value in msg.ListFields():
        if desc.is_repeated:
            out[desc.name] = [_field_value(desc, v) for v in value]
        else:
            out[desc.name] = _field_value(desc, value)
    return out


def _field_value(desc: FieldDescriptor, value: Any) -> JsonValue:
    if desc.type == FieldDescriptor.TYPE_MESSAGE:
        return message_fields(value)
    if desc.type == FieldDescriptor.TYPE_ENUM:
        enum_value = desc.enum_type.values_by_number.get(value) if desc.enum_type is not None else None
        return enum_value.name if enum_value is not None else value
    if desc.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    return value


@dataclass(slots=True)
class TimelineEntry:
    """One recorded frame, decoded."""

    frame: RecordedFrame
    command: str
    fields: dict[str, JsonValue]
    topic: str | None = None
    completed: RequestPair | None = None
    num_messages: int | None = None
    compression: str | None = None
    payload_size: int | None = None
    #: geo-replication facts of a SEND/MESSAGE (replicated_from, replicate_to, marker...), if any
    replication: dict[str, JsonValue] | None = None
    #: why the frame could not be decoded, if it could not
    error: str | None = None
    #: the producer's name, from the frame or from the PRODUCER/PRODUCER_SUCCESS of its producer id
    producer_name: str | None = None

    @property
    def is_payload(self) -> bool:
        return self.num_messages is not None

    @property
    def latency_ns(self) -> int | None:
        return None if self.completed is None else self.completed.latency_ns

    def to_json(self) -> dict[str, JsonValue]:
        """The ``show --json`` object of this frame (SPEC.md, "show --json")."""
        frame = self.frame
        obj: dict[str, JsonValue] = {
            "ts_ns": frame.ts_ns, "conn": frame.conn, "direction": frame.direction, "origin": frame.origin,
            "command": self.command, "size": frame.size, "fields": self.fields,
        }
        if self.is_payload:
            obj["num_messages"] = self.num_messages
            obj["compression"] = self.compression
            obj["payload_size"] = self.payload_size
        # Additions beyond the fixed keys, present only when they say something.
        if self.topic is not None:
            obj["topic"] = self.topic
        if self.completed is not None:
            obj["latency_us"] = round(self.completed.latency_ns / 1000, 3)
            obj["request"] = self.completed.request_command
            if self.completed.error_code is not None:
                obj["error_code"] = self.completed.error_code
        if self.replication is not None:
            obj["replication"] = self.replication
        if frame.rules:
            obj["rules"] = list(frame.rules)
        if frame.redacted:
            obj["redacted"] = True
        if frame.payload_stripped:
            obj["payload_stripped"] = True
        if self.error is not None:
            obj["error"] = self.error
        return obj


class TimelineBuilder:
    """Decodes frames in capture order, keeping one session tracker per connection."""

    def __init__(self) -> None:
        self.trackers: dict[int, SessionTracker] = {}

    def entry(self, recorded: RecordedFrame) -> TimelineEntry:
        tracker = self.trackers.get(recorded.conn)
        if tracker is None:
            tracker = self.trackers[recorded.conn] = SessionTracker(strict=False)
        try:
            frame = recorded.frame
            sub = sub_command(frame.command)
        except ProtocolError as exc:
            frame_type = frame_type_of(recorded.raw)
            command = type_name(frame_type) if frame_type is not None else "INVALID"
            return TimelineEntry(recorded, command, {}, error=str(exc))
        entry = TimelineEntry(recorded, frame.type_name, message_fields(sub))
        try:
            observation = tracker.observe(frame, Direction(recorded.direction), recorded.ts_ns)
        except ProtocolError as exc:
            entry.error = str(exc)
        else:
            entry.topic = observation.topic
            entry.completed = observation.completed
            if observation.producer is not None:
                entry.producer_name = observation.producer.producer_name
        if isinstance(entry.fields.get("producer_name"), str):
            entry.producer_name = entry.fields["producer_name"]
        if entry.topic is None and isinstance(entry.fields.get("topic"), str):
            entry.topic = entry.fields["topic"]
        section = frame.payload
        if section is not None:
            try:
                metadata = section.metadata
            except ProtocolError as exc:
                entry.error = str(exc)
                metadata = api.MessageMetadata()
            entry.num_messages = (metadata.num_messages_in_batch if metadata.HasField("num_messages_in_batch")
                                  else 1)
            if entry.producer_name is None and metadata.HasField("producer_name"):
                entry.producer_name = metadata.producer_name
            entry.compression = api.CompressionType.Name(metadata.compression)
            entry.payload_size = len(section.payload)
            entry.replication = replication_facts(metadata, None if recorded.payload_stripped else section.payload)
        return entry

    def entries(self, frames: Iterable[RecordedFrame]) -> Iterator[TimelineEntry]:
        for recorded in frames:
            yield self.entry(recorded)


def replication_facts(metadata: api.MessageMetadata, payload: bytes | None) -> dict[str, JsonValue] | None:
    """What a message says about geo-replication (None for an ordinary message).

    ``payload`` is None when the recording holds no payloads: a marker is then named but not decoded.
    """
    is_marker = markers.is_marker(metadata)
    if not (is_marker or metadata.HasField("replicated_from") or len(metadata.replicate_to)):
        return None
    facts: dict[str, JsonValue] = {"publish_time": metadata.publish_time}
    if metadata.HasField("replicated_from"):
        facts["replicated_from"] = metadata.replicated_from
    if len(metadata.replicate_to):
        facts["replicate_to"] = list(metadata.replicate_to)
    if is_marker:
        facts["marker"] = markers.marker_name(metadata.marker_type)
        if payload is not None:
            try:
                marker = markers.decode_marker(metadata, payload)
            except ProtocolError as exc:
                facts["marker_error"] = str(exc)
            else:
                facts["label"] = markers.marker_label(marker)
                if marker.body is not None:
                    facts["marker_fields"] = message_fields(marker.body)
    return facts


def build_timeline(frames: Iterable[RecordedFrame]) -> Iterator[TimelineEntry]:
    """The timeline of frames given in capture-time order."""
    return TimelineBuilder().entries(frames)


#: sub-command fields shown in a timeline line, in this order (the rest is for --json)
SUMMARY_FIELDS: tuple[str, ...] = (
    "request_id", "producer_id", "consumer_id", "sequence_id", "highest_sequence_id", "producer_name",
    "subscription", "subType", "consumer_name", "messagePermits", "message_id", "ack_type", "response",
    "brokerServiceUrl", "authoritative", "proxy_through_service_url", "partitions", "error", "message",
    "client_version", "server_version", "protocol_version", "proxy_to_broker_url", "auth_method_name",
    "max_message_size", "redelivery_count", "txnid_most_bits", "txnid_least_bits",
)


def summary_fields(fields: dict[str, JsonValue]) -> str:
    """The fields worth a glance, as ``key=value`` pairs; message ids as ``ledger:entry``."""
    parts: list[str] = []
    for key in SUMMARY_FIELDS:
        if key not in fields:
            continue
        value = fields[key]
        if key == "message_id":
            ids = value if isinstance(value, list) else [value]
            rendered = ",".join(f"{m.get('ledgerId', '?')}:{m.get('entryId', '?')}" for m in ids[:3])
            if len(ids) > 3:
                rendered += f",+{len(ids) - 3}"
            value = rendered
        elif isinstance(value, str) and len(value) > 60:
            value = value[:57] + "..."
        parts.append(f"{key}={value}")
    return " ".join(parts)


__all__ = ["SUMMARY_FIELDS", "TimelineBuilder", "TimelineEntry", "build_timeline", "message_fields",
           "replication_facts", "summary_fields"]
