"""Batched payloads: many messages in one SEND/MESSAGE (Pulsar protocol, "Batch messages").

After decompression a batch payload is ``num_messages_in_batch`` repetitions of

    [SINGLE_METADATA_SIZE u32][SingleMessageMetadata][payload of payload_size bytes]

A payload is a batch when its MessageMetadata *has* ``num_messages_in_batch``
(the clients' own test: ``hasNumMessagesInBatch``), even when the count is 1.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from proxy.errors import BatchError, MetadataDecodeError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import decode_message

_U32 = struct.Struct(">I")
#: A batch larger than this is refused; Pulsar's batches are bounded by max_message_size.
MAX_BATCH_MESSAGES: Final = 1_000_000


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One message of a batch: its SingleMessageMetadata and its payload bytes."""

    metadata: api.SingleMessageMetadata
    payload: bytes


def is_batch(metadata: api.MessageMetadata) -> bool:
    return bool(metadata.HasField("num_messages_in_batch"))


def split_batch(metadata: api.MessageMetadata, uncompressed_payload: bytes) -> list[BatchEntry]:
    """The messages of a batch payload (already decompressed), in order."""
    count = metadata.num_messages_in_batch
    if not 0 < count <= MAX_BATCH_MESSAGES:
        raise BatchError(f"implausible num_messages_in_batch {count}")
    data = uncompressed_payload
    pos, end = 0, len(data)
    entries: list[BatchEntry] = []
    for index in range(count):
        if end - pos < 4:
            raise BatchError(f"batch ends before message {index} of {count}")
        meta_size = _U32.unpack_from(data, pos)[0]
        pos += 4
        if meta_size > end - pos:
            raise BatchError(f"metadata of message {index} runs past the end of the batch")
        try:
            single = decode_message(api.SingleMessageMetadata, data[pos:pos + meta_size],
                                    "SingleMessageMetadata")
        except MetadataDecodeError as exc:
            raise BatchError(f"message {index} of the batch: {exc}") from None
        pos += meta_size
        size = single.payload_size
        if not 0 <= size <= end - pos:
            raise BatchError(f"payload of message {index} runs past the end of the batch")
        entries.append(BatchEntry(single, data[pos:pos + size]))
        pos += size
    if pos != end:
        raise BatchError(f"{end - pos} stray bytes after the last message of the batch")
    return entries


def build_batch(entries: Iterable[tuple[api.SingleMessageMetadata, bytes] | BatchEntry]) -> bytes:
    """Serialise messages into a (not yet compressed) batch payload; payload_size is set here."""
    parts: list[bytes] = []
    for entry in entries:
        single, payload = (entry.metadata, entry.payload) if isinstance(entry, BatchEntry) else entry
        meta = api.SingleMessageMetadata()
        meta.CopyFrom(single)
        meta.payload_size = len(payload)
        raw = meta.SerializeToString()
        parts += (_U32.pack(len(raw)), raw, payload)
    return b"".join(parts)
