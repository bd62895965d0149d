"""Replication markers (PulsarMarkers.proto): messages the brokers write for themselves.

A marker is a message whose MessageMetadata has ``marker_type`` set; its payload is
one of the PulsarMarkers messages.  Replicated subscriptions use four of them
(snapshot request, response, snapshot, update), transactions three more (commit
marker payloads are opaque to us).  Messages copied by geo-replication carry
``replicated_from`` (the source cluster) and ``replicate_to``.  :func:`marker_label`
names a marker in one line (type, snapshot or subscription, cluster@position).

:func:`marker_metadata` writes a marker's MessageMetadata as Pulsar's ``Markers``
does: producer name ``pulsar.marker``, sequence id 0, the publish time, the marker
type, and ``replicate_to`` when the marker is meant for one cluster only (a
snapshot response goes back to the cluster that asked; a completed snapshot stays
in its own cluster; requests and subscription updates go everywhere).
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

#: the producer name on every marker a broker writes (Pulsar's ``Markers.newMessage``)
MARKER_PRODUCER_NAME: Final = "pulsar.marker"
#: the prefix of replicator producer names (Pulsar's ``replicatorPrefix``)
REPLICATOR_PREFIX: Final = "pulsar.repl"
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


def marker_value(name: str) -> int:
    """The MarkerType value of a name (``REPLICATED_SUBSCRIPTION_SNAPSHOT``); KeyError when unknown."""
    for value, known in MARKER_NAMES.items():
        if known == name:
            return value
    raise KeyError(name)


def is_replicator(producer_name: str | None) -> bool:
    """Whether a producer name is a geo-replicator's (``pulsar.repl.<local>--><remote>``)."""
    return producer_name is not None and producer_name.startswith(REPLICATOR_PREFIX + ".")


def replicator_name(local_cluster: str, remote_cluster: str) -> str:
    """The producer name a replicator uses on the remote cluster, as Pulsar's GeoPersistentReplicator."""
    return f"{REPLICATOR_PREFIX}.{local_cluster}-->{remote_cluster}"


def marker_metadata(marker_type: int, publish_time_ms: int, replicate_to: str | None = None) -> api.MessageMetadata:
    """The MessageMetadata of a marker a broker writes into its own topic."""
    metadata = api.MessageMetadata(producer_name=MARKER_PRODUCER_NAME, sequence_id=0,
                                   publish_time=publish_time_ms, marker_type=marker_type)
    if replicate_to is not None:
        metadata.replicate_to.append(replicate_to)
    return metadata


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


def _at(message_id: markers.MarkersMessageIdData) -> str:
    return f"{message_id.ledger_id}:{message_id.entry_id}"


def marker_label(marker: Marker) -> str:
    """One line naming a marker's type, its snapshot or subscription, and each cluster with its position."""
    body = marker.body
    short = marker.name.removeprefix("REPLICATED_SUBSCRIPTION_")
    if isinstance(body, markers.ReplicatedSubscriptionsSnapshotRequest):
        return f"{short} {body.snapshot_id[:8]} from {body.source_cluster}"
    if isinstance(body, markers.ReplicatedSubscriptionsSnapshotResponse):
        return f"{short} {body.snapshot_id[:8]} {body.cluster.cluster}@{_at(body.cluster.message_id)}"
    if isinstance(body, markers.ReplicatedSubscriptionsSnapshot):
        clusters = " ".join(f"{c.cluster}@{_at(c.message_id)}" for c in body.clusters)
        return f"{short} {body.snapshot_id[:8]} local@{_at(body.local_message_id)} {clusters}".rstrip()
    if isinstance(body, markers.ReplicatedSubscriptionsUpdate):
        clusters = " ".join(f"{c.cluster}@{_at(c.message_id)}" for c in body.clusters)
        return f"{short} {body.subscription_name} {clusters}".rstrip()
    return short
