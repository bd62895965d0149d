"""Chunking of messages larger than the broker's max_message_size, sans-IO.

Pulsar protocol, "Chunking": a producer with batching off compresses a message,
and if the result exceeds what one SEND may carry it cuts it into chunks.  Every
chunk is its own SEND with the *same* sequence id and ``is_chunk``; its metadata
repeats the message's key, properties and compression and adds ``uuid``
(``<producer name>-<sequence id>``), ``chunk_id``, ``num_chunks_from_msg`` and
``total_chunk_msg_size`` (the compressed size).  As in the C++ client a chunk's
payload is at most ``max_message_size`` minus the size of its metadata.
"""

from __future__ import annotations

from typing import TypeVar

from proxy.client.outgoing import OutgoingMessage, send_command, single_metadata
from proxy.protocol.frame import encode_payload_command

R = TypeVar("R")


def chunk_bounds(total: int, chunk_size: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each chunk of a ``total``-byte body (one empty chunk for 0 bytes)."""
    if chunk_size < 1:
        raise ValueError("chunk size must be positive")
    if total == 0:
        return [(0, 0)]
    return [(start, min(start + chunk_size, total)) for start in range(0, total, chunk_size)]


def encode_chunks(producer_id: int, producer_name: str, msg: OutgoingMessage[R], compression: int,
                  compressed: bytes, publish_time_ms: int, max_message_size: int) -> list[bytes]:
    """The SEND frames of a message whose compressed body is too large for one frame."""
    template = single_metadata(msg, producer_name, publish_time_ms, compression, len(msg.payload))
    template.uuid = f"{producer_name}-{msg.sequence_id}"
    template.total_chunk_msg_size = len(compressed)
    # Size the metadata with the largest values its chunk fields will take.
    probe = type(template)()
    probe.CopyFrom(template)
    probe.num_chunks_from_msg = len(compressed)
    probe.chunk_id = len(compressed)
    chunk_size = max_message_size - probe.ByteSize()
    if chunk_size < 1:
        raise ValueError("max_message_size leaves no room for a chunk's payload")
    bounds = chunk_bounds(len(compressed), chunk_size)
    frames = []
    for chunk_id, (start, end) in enumerate(bounds):
        meta = type(template)()
        meta.CopyFrom(template)
        meta.num_chunks_from_msg = len(bounds)
        meta.chunk_id = chunk_id
        cmd = send_command(producer_id, msg.sequence_id, 1, is_chunk=True)
        frames.append(encode_payload_command(cmd, meta, compressed[start:end]))
    return frames
