"""Replication markers (PulsarMarkers.proto): messages the brokers write for themselves.

A marker is a message whose MessageMetadata has ``marker_type`` set; its payload is
one of the PulsarMarkers messages.  Replicated subscriptions use four of them
(snapshot request, response, snapshot, update), transactions three more (commit
marker payloads are opaque to us).  Messages copied by geo-replication carry
``replicated_from`` (the source cluster) and ``replicate_to``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from google.protobuf.message import Message

from proxy.errors import MarkerError, MetadataDecodeError
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import PulsarMarkers_pb2 as markers
from proxy.protocol.frame import decode_message

SNAPSHOT_REQUEST: Final = markers.REPLICATED_SUBSCRIPTION_SNAPSHOT_REQUEST
SNAPSHOT_RESPONSE: Final = markers.REPLICATED_SUBSCRIPTION_SNAPSHOT_RESPONSE
SNAPSHOT: Final = markers.REPLICATED_SUBSCRIPTION_SNAPSHOT
UPDATE: Final = markers.REPLICATED_SUBSCRIPTION_UPDATE

#: MarkerType value -> name
MARKER_NAMES: Final[dict[int, str]] = {v.number: v.name for v in markers.MarkerType.DESCRIPTOR.values}

_PAYLOAD_TYPES: Final[dict[int, type[Message]]] = {
    SNAPSHOT_REQUEST: markers.ReplicatedSubscriptionsSnapshotRequest,
    SNAPSHOT_RESPONSE: markers.ReplicatedSubscriptionsSnapshotResponse,
    SNAPSHOT: markers.ReplicatedSubscriptionsSnapshot,
    UPDATE: markers.ReplicatedSubscriptionsUpdate,
}


def marker_name(marker_type: int) -> str:
    return MARKER_NAMES.get(marker_type, f"UNKNOWN({marker_type})")


def is_marker(metadata: api.MessageMetadata) -> bool:
    return bool(metadata.HasField("marker_type"))


@dataclass(frozen=True, slots=True)
class Marker:
    """A decoded marker: its type, its name, and the decoded payload (None when opaque)."""

    marker_type: int
    name: str
    body: Message | None


def decode_marker(metadata: api.MessageMetadata, payload: bytes) -> Marker:
    """Decode the payload of a marker message (already decompressed)."""
    if not is_marker(metadata):
        raise MarkerError("message is not a marker (no marker_type)")
    kind = metadata.marker_type
    cls = _PAYLOAD_TYPES.get(kind)
    body: Message | None = None
    if cls is not None:
        try:
            body = decode_message(cls, payload, marker_name(kind))
        except MetadataDecodeError as exc:
            raise MarkerError(str(exc)) from None
    elif kind not in MARKER_NAMES:
        raise MarkerError(f"unknown marker type {kind}")
    return Marker(kind, marker_name(kind), body)


def encode_marker(body: Message) -> tuple[int, bytes]:
    """The marker type and payload bytes for a marker message body."""
    for kind, cls in _PAYLOAD_TYPES.items():
        if isinstance(body, cls):
            return kind, body.SerializeToString()
    raise TypeError(f"{type(body).__name__} is not a replication marker")


@dataclass(frozen=True, slots=True)
class Replication:
    """Geo-replication facts of a message, from its metadata."""

    replicated_from: str | None
    replicate_to: tuple[str, ...]


def replication_of(metadata: api.MessageMetadata) -> Replication:
    return Replication(
        metadata.replicated_from if metadata.HasField("replicated_from") else None,
        tuple(metadata.replicate_to),
    )
