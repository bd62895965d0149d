"""Messages on their way out: one user message, and the SEND frames built from them.

Pulsar protocol, "Producer" and "Batch messages": a non-batched message travels as
one SEND whose MessageMetadata carries the message's key, properties, event time
and sequence id; a batch travels as one SEND whose metadata carries the *first*
sequence id and ``num_messages_in_batch``, whose payload is the (compressed)
sequence of ``[size][SingleMessageMetadata][payload]`` records, and whose command
carries ``highest_sequence_id`` = the last message's sequence id.  Compression
covers the whole batch and ``uncompressed_size`` says how large it inflates.
Sans-IO: this module only builds bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.batch import build_batch
from proxy.protocol.compression import compress
from proxy.protocol.frame import encode_payload_command

R = TypeVar("R")


@dataclass(slots=True)
class OutgoingMessage(Generic[R]):
    """One message a user asked to send; ``receipt`` is whatever the I/O layer completes."""

    payload: bytes
    receipt: R
    key: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    event_time: int = 0
    ordering_key: bytes | None = None
    sequence_id: int = -1
    #: deduplication sequence id given by the user (replaces the generated one)
    user_sequence_id: int | None = None

    @property
    def size(self) -> int:
        return len(self.payload)


def _fill_common(meta: api.MessageMetadata | api.SingleMessageMetadata, msg: OutgoingMessage[R]) -> None:
    if msg.key is not None:
        meta.partition_key = msg.key
    for name, value in msg.properties.items():
        meta.properties.add(key=name, value=value)
    if msg.event_time:
        meta.event_time = msg.event_time
    if msg.ordering_key is not None:
        meta.ordering_key = msg.ordering_key


def single_metadata(msg: OutgoingMessage[R], producer_name: str, publish_time_ms: int,
                    compression: int, uncompressed_size: int) -> api.MessageMetadata:
    """The MessageMetadata of a message sent on its own (not in a batch)."""
    meta = api.MessageMetadata(producer_name=producer_name, sequence_id=msg.sequence_id,
                               publish_time=publish_time_ms)
    _fill_common(meta, msg)
    if compression:
        meta.compression = compression
        meta.uncompressed_size = uncompressed_size
    return meta


def send_command(producer_id: int, sequence_id: int, num_messages: int, *,
                 highest_sequence_id: int | None = None, is_chunk: bool = False) -> api.CommandSend:
    cmd = api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=num_messages)
    if highest_sequence_id is not None:
        cmd.highest_sequence_id = highest_sequence_id
    if is_chunk:
        cmd.is_chunk = True
    return cmd


def encode_single(producer_id: int, producer_name: str, msg: OutgoingMessage[R], compression: int,
                  publish_time_ms: int) -> bytes:
    """The SEND frame of one non-batched, non-chunked message."""
    body = compress(compression, msg.payload)
    meta = single_metadata(msg, producer_name, publish_time_ms, compression, len(msg.payload))
    return encode_payload_command(send_command(producer_id, msg.sequence_id, 1), meta, body)


def encode_batch(producer_id: int, producer_name: str, messages: Sequence[OutgoingMessage[R]],
                 compression: int, publish_time_ms: int) -> bytes:
    """The SEND frame of a batch (messages already carry their sequence ids, in order)."""
    records = []
    for msg in messages:
        single = api.SingleMessageMetadata(sequence_id=msg.sequence_id)
        _fill_common(single, msg)
        records.append((single, msg.payload))
    plain = build_batch(records)
    body = compress(compression, plain)
    first, last = messages[0].sequence_id, messages[-1].sequence_id
    meta = api.MessageMetadata(producer_name=producer_name, sequence_id=first, publish_time=publish_time_ms,
                               num_messages_in_batch=len(messages))
    if compression:
        meta.compression = compression
        meta.uncompressed_size = len(plain)
    cmd = send_command(producer_id, first, len(messages), highest_sequence_id=last)
    return encode_payload_command(cmd, meta, body)
