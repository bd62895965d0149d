"""Messages as applications see them, decoded from a SEND or MESSAGE payload section.

The order of work is the clients': a chunk must first be reassembled (see
:mod:`proxy.protocol.chunks`); then the payload is decompressed with the
metadata's ``compression`` and ``uncompressed_size``; then, when the metadata has
``num_messages_in_batch``, split into the batch's single messages.  Encrypted
payloads cannot be opened here: they are returned whole, flagged ``encrypted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.errors import ChunkError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import batch, chunks, compression


@dataclass(frozen=True, slots=True)
class Message:
    """One application message (one entry of a batch, or a whole non-batched message)."""

    payload: bytes
    producer_name: str
    sequence_id: int
    publish_time: int
    key: str | None = None
    ordering_key: bytes | None = None
    properties: dict[str, str] = field(default_factory=dict)
    event_time: int = 0
    batch_index: int = -1
    batch_size: int = 0
    null_value: bool = False
    encrypted: bool = False
    compacted_out: bool = False

    @property
    def size(self) -> int:
        return len(self.payload)


def _props(kvs: object) -> dict[str, str]:
    return {kv.key: kv.value for kv in kvs}  # type: ignore[attr-defined]


def decode_messages(metadata: api.MessageMetadata, payload: bytes) -> list[Message]:
    """The application messages in one (not chunked) payload, decompressed and batch-split."""
    if chunks.is_chunk(metadata):
        raise ChunkError("a chunk must be reassembled (ChunkAssembler) before it is decoded")
    base_key = metadata.partition_key if metadata.HasField("partition_key") else None
    if metadata.encryption_keys:
        return [Message(payload, metadata.producer_name, metadata.sequence_id, metadata.publish_time,
                        key=base_key, properties=_props(metadata.properties), encrypted=True)]
    data = compression.decompress(metadata.compression, payload, metadata.uncompressed_size)
    if not batch.is_batch(metadata):
        return [Message(
            data, metadata.producer_name, metadata.sequence_id, metadata.publish_time,
            key=base_key,
            ordering_key=metadata.ordering_key if metadata.HasField("ordering_key") else None,
            properties=_props(metadata.properties), event_time=metadata.event_time,
            null_value=metadata.null_value,
        )]
    entries = batch.split_batch(metadata, data)
    messages = []
    for index, entry in enumerate(entries):
        single = entry.metadata
        messages.append(Message(
            entry.payload, metadata.producer_name,
            single.sequence_id if single.HasField("sequence_id") else metadata.sequence_id + index,
            metadata.publish_time,
            key=single.partition_key if single.HasField("partition_key") else None,
            ordering_key=single.ordering_key if single.HasField("ordering_key") else None,
            properties=_props(single.properties), event_time=single.event_time,
            batch_index=index, batch_size=len(entries), null_value=single.null_value,
            compacted_out=single.compacted_out,
        ))
    return messages


def encode_payload(messages: list[tuple[bytes, api.SingleMessageMetadata]], metadata: api.MessageMetadata,
                   compression_type: int, *, batched: bool) -> bytes:
    """Build a SEND payload from messages and fill in ``metadata``'s size and compression fields.

    With ``batched`` the messages form a batch (``num_messages_in_batch`` is set, even
    for one message); otherwise exactly one message is sent as is.
    """
    if batched:
        raw = batch.build_batch((single, payload) for payload, single in messages)
        metadata.num_messages_in_batch = len(messages)
    else:
        if len(messages) != 1:
            raise ValueError("a non-batched payload holds exactly one message")
        raw = messages[0][0]
    metadata.uncompressed_size = len(raw)
    if compression_type != compression.NONE:
        metadata.compression = compression_type
    return compression.compress(compression_type, raw)
