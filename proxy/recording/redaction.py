"""What a recording keeps of a frame: auth data redacted, payload bytes optionally left out.

Redaction covers every field of the Pulsar protocol that carries credentials, found
in the schema itself rather than listed by hand: wherever a command holds a field
named in :data:`SECRET_FIELDS` (``auth_data``, ``original_auth_data``), at any depth
(PulsarApi.proto, "Authentication") — today CONNECT ``auth_data`` and
``original_auth_data``, AUTH_CHALLENGE ``challenge.auth_data``, AUTH_RESPONSE
``response.auth_data``, and the ``original_auth_data`` a Pulsar proxy passes on in
LOOKUP and PARTITIONED_METADATA.  Fields whose names look like authentication but
carry none (the method's name, the role a proxy authenticated) are kept, each for the
reason :data:`NOT_SECRET` gives; a test walks the schema and fails on any field of
either kind that is in neither list.

A frame holding a secret is re-encoded with the value replaced by
:data:`REDACTED_MARKER` padded with ``*`` to the secret's length, so the frame keeps
its wire size (and the pcap export its byte counts); the record keeps a ``redacted``
flag so nobody mistakes the marker for the real bytes.  Only the command types that
can hold a secret are decoded at all, so the cost for ordinary traffic is one set lookup.

Payload stripping keeps a SEND or MESSAGE frame up to the end of its
MessageMetadata and records the original size: readers zero-fill the rest, so
sizes, commands and metadata stay true while message contents are not stored.
"""

from __future__ import annotations

from typing import Any, Final

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import PAYLOAD_TYPES, SUB_FIELDS
from proxy.protocol.frame import encode_command, frame_from_bytes, peek_type

REDACTED_MARKER: Final = "REDACTED"

#: names of the fields that carry credentials, wherever in the protocol they appear
SECRET_FIELDS: Final = frozenset({"auth_data", "original_auth_data"})
#: fields named like authentication that carry no secret, and why they are recorded
NOT_SECRET: Final[dict[str, str]] = {
    "auth_method": "which method was used (a deprecated enum), not a credential",
    "auth_method_name": "the method's name (e.g. 'token', 'tls'), not a credential",
    "original_auth_method": "the method a client used with the Pulsar proxy in front, not a credential",
    "original_principal": "the role a Pulsar proxy authenticated: who, not a credential",
    "supports_auth_refresh": "a capability flag",
    "authoritative": "whether a lookup answer is final",
}

_PAYLOAD_TYPES: Final = frozenset(int(t) for t in PAYLOAD_TYPES)
_HEADER_SIZE: Final = 8

Path = tuple[str, ...]


def _secret_paths(descriptor: Descriptor | Any, seen: frozenset[str] = frozenset()) -> list[Path]:
    """Paths (field names from ``descriptor``) to every secret field below it."""
    paths: list[Path] = []
    for field in descriptor.fields:
        if field.name in SECRET_FIELDS and field.type in (FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING):
            paths.append((field.name,))
        elif field.message_type is not None and field.message_type.full_name not in seen:
            inner = _secret_paths(field.message_type, seen | {descriptor.full_name})
            paths.extend((field.name, *path) for path in inner)
    return paths


#: command type -> the paths to its secret fields, from the BaseCommand's sub-command
SECRET_PATHS: Final[dict[int, tuple[Path, ...]]] = {
    number: tuple(paths) for number, name in SUB_FIELDS.items()
    if (paths := _secret_paths(api.BaseCommand.DESCRIPTOR.fields_by_name[name].message_type))
}


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


def _mask_path(message: Message, path: Path) -> bool:
    """Mask the secret at ``path`` below ``message`` (in every element of repeated messages)."""
    name, rest = path[0], path[1:]
    field = message.DESCRIPTOR.fields_by_name[name]
    if rest:
        children = getattr(message, name) if field.is_repeated else (
            [getattr(message, name)] if message.HasField(name) else [])
        masked = False
        for child in children:  # every one, not only up to the first secret
            masked = _mask_path(child, rest) or masked
        return masked
    value = getattr(message, name)
    if not value:
        return False
    if isinstance(value, str):
        setattr(message, name, mask(value.encode()).decode("ascii"))
    else:
        setattr(message, name, mask(bytes(value)))
    return True


def redact(raw: bytes) -> tuple[bytes, bool]:
    """The frame with its auth data replaced by the marker, and whether anything was replaced.

    Frames that carry no auth data, and frames that cannot be decoded, come back
    unchanged (an undecodable frame is recorded as it was seen).
    """
    paths = SECRET_PATHS.get(frame_type_of(raw))  # type: ignore[arg-type]
    if paths is None:
        return raw, False
    try:
        cmd = frame_from_bytes(raw, max_frame_bytes=len(raw), strict=False).command
    except ProtocolError:
        return raw, False
    sub = getattr(cmd, SUB_FIELDS[cmd.type])
    changed = False
    for path in paths:
        changed = _mask_path(sub, path) or changed
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


__all__ = ["NOT_SECRET", "REDACTED_MARKER", "SECRET_FIELDS", "SECRET_PATHS", "frame_type_of", "mask", "payload_offset",
           "redact", "strip_payload", "zero_fill"]
