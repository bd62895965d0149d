"""What a recording keeps of a frame: auth data redacted, payload bytes optionally left out.

Redaction covers every field of the Pulsar protocol that carries credentials:
CONNECT ``auth_data`` and ``original_auth_data``, AUTH_CHALLENGE
``challenge.auth_data`` and AUTH_RESPONSE ``response.auth_data`` (PulsarApi.proto,
"Authentication").  A frame holding any of them is re-encoded with the value
replaced by :data:`REDACTED_MARKER` padded with ``*`` to the secret's length, so
the frame keeps its wire size (and the pcap export its byte counts); the record
keeps a ``redacted`` flag so nobody mistakes the marker for the real bytes.  Only these three command types
are decoded at all, so the cost for ordinary traffic is one dictionary lookup.

Payload stripping keeps a SEND or MESSAGE frame up to the end of its
MessageMetadata and records the original size: readers zero-fill the rest, so
sizes, commands and metadata stay true while message contents are not stored.
"""

from __future__ import annotations

from typing import Final

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import PAYLOAD_TYPES
from proxy.protocol.frame import encode_command, frame_from_bytes, peek_type

REDACTED_MARKER: Final = "REDACTED"

_AUTH_TYPES: Final = frozenset({api.BaseCommand.CONNECT, api.BaseCommand.AUTH_CHALLENGE,
                                api.BaseCommand.AUTH_RESPONSE})
_PAYLOAD_TYPES: Final = frozenset(int(t) for t in PAYLOAD_TYPES)
_HEADER_SIZE: Final = 8


def frame_type_of(raw: bytes) -> int | None:
    """The BaseCommand type of a whole frame's bytes, or None if they are not a frame."""
    if len(raw) < _HEADER_SIZE:
        return None
    cmd_size = int.from_bytes(raw[4:8], "big")
    if cmd_size == 0 or _HEADER_SIZE + cmd_size > len(raw):
        return None
    try:
        return peek_type(raw, _HEADER_SIZE, _HEADER_SIZE + cmd_size)
    except ProtocolError:
        return None


def mask(secret: bytes) -> bytes:
    """The marker in place of a secret, of the secret's length so that frame sizes stay true.

    ``REDACTED`` followed by ``*`` up to the length; a secret shorter than the
    marker becomes the marker's first letters.
    """
    marker = REDACTED_MARKER.encode()
    return (marker + b"*" * max(0, len(secret) - len(marker)))[:len(secret)]


def redact(raw: bytes) -> tuple[bytes, bool]:
    """The frame with its auth data replaced by the marker, and whether anything was replaced.

    Frames that carry no auth data, and frames that cannot be decoded, come back
    unchanged (an undecodable frame is recorded as it was seen).
    """
    if frame_type_of(raw) not in _AUTH_TYPES:
        return raw, False
    try:
        cmd = frame_from_bytes(raw, max_frame_bytes=len(raw)).command
    except ProtocolError:
        return raw, False
    changed = False
    if cmd.type == api.BaseCommand.CONNECT:
        connect = cmd.connect
        if connect.auth_data:
            connect.auth_data = mask(connect.auth_data)
            changed = True
        if connect.original_auth_data:
            connect.original_auth_data = mask(connect.original_auth_data.encode()).decode()
            changed = True
    else:
        holder = cmd.authChallenge.challenge if cmd.type == api.BaseCommand.AUTH_CHALLENGE \
            else cmd.authResponse.response
        if holder.auth_data:
            holder.auth_data = mask(holder.auth_data)
            changed = True
    if not changed:
        return raw, False
    return encode_command(cmd), True


def payload_offset(raw: bytes) -> int | None:
    """Where the message payload starts in a SEND or MESSAGE frame; None for other frames."""
    if frame_type_of(raw) not in _PAYLOAD_TYPES:
        return None
    try:
        frame = frame_from_bytes(raw, max_frame_bytes=len(raw))
    except ProtocolError:
        return None
    section = frame.payload
    return None if section is None else section.metadata_end


def strip_payload(raw: bytes) -> bytes | None:
    """The frame cut where its message payload starts, or None when there is nothing to cut."""
    offset = payload_offset(raw)
    if offset is None or offset >= len(raw):
        return None
    return raw[:offset]


def zero_fill(data: bytes, original_size: int) -> bytes:
    """A stripped frame grown back to its wire size with zero bytes for the payload."""
    if original_size <= len(data):
        return data
    return data + bytes(original_size - len(data))


__all__ = ["REDACTED_MARKER", "frame_type_of", "mask", "payload_offset", "redact", "strip_payload", "zero_fill"]
