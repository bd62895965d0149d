"""The data path's few fields, read from a frame's bytes without decoding its command.

Telemetry pairs every SEND with its SEND_RECEIPT; decoding both commands with
protobuf and running them through the generic session machinery costs more than
the rest of its per-frame work.  :func:`send_fields` and :func:`receipt_fields`
read ``producer_id``, ``sequence_id`` and ``num_messages`` (PulsarApi.proto,
``CommandSend`` / ``CommandSendReceipt``) straight from the wire with a small
varint reader — but only for the canonical encoding of a command that protobuf
would decode with the same values and accept as complete.  Anything else (another
field layout, a nested message this reader does not check, an oversized varint)
answers None and the caller takes the full path, so the fast path never decides
differently from it.  :func:`plain_metadata` tells whether a payload's metadata
says it is uncompressed (then a byte search rules trace context out), reading it as
the full path does; :func:`searchable` answers the same question for the data path
without protobuf for metadata that cannot name a compression at all (the common case:
an unsampled request should cost next to nothing, and the parse was most of what a
SEND cost while tracing).
"""

from __future__ import annotations

import re
import struct
from typing import Final

from google.protobuf.message import DecodeError

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.validation import check_payload

#: ``08 TYPE <tag of the sub-command>`` at offset 8 of a canonical SEND / SEND_RECEIPT frame
_SEND_HEAD: Final = bytes((0x08, T.SEND, (6 << 3) | 2))
_RECEIPT_HEAD: Final = bytes((0x08, T.SEND_RECEIPT, (7 << 3) | 2))
_U64_LIMIT: Final = 1 << 64
#: the metadata size after the checksum
_SIZE: Final = struct.Struct(">I")
_I32_LIMIT: Final = 1 << 31
#: MessageIdData's required fields and its other varint fields (ack_set and first_chunk_message_id excluded)
_MESSAGE_ID_REQUIRED: Final = frozenset((1, 2))
_MESSAGE_ID_VARINTS: Final = frozenset((1, 2, 3, 4, 6))


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); value -1 when it is unterminated, longer than 10 bytes or beyond 64 bits."""
    value = shift = 0
    while pos < end and shift < 70:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value, pos) if value < _U64_LIMIT else (-1, pos)
        shift += 7
    return -1, pos


def _sub_command(raw: bytes, head: bytes) -> tuple[int, int] | None:
    """(start, end) of the sub-command of a frame whose BaseCommand is exactly ``head`` + that one field."""
    if raw[8:11] != head:
        return None
    cmd_end = 8 + int.from_bytes(raw[4:8], "big")
    length, start = _varint(raw, 11, cmd_end)
    if length < 0 or start + length != cmd_end:
        return None
    return start, cmd_end


def send_fields(raw: bytes) -> tuple[int, int, int] | None:
    """(producer_id, sequence_id, num_messages) of a whole SEND frame in canonical encoding, else None.

    Accepted: varint fields only (CommandSend's other fields are flags and ids that
    telemetry does not read); a length-delimited field (``message_id``) sends the
    frame down the full path.  ``num_messages`` is 1 when absent, as its default says.
    """
    span = _sub_command(raw, _SEND_HEAD)
    if span is None:
        return None
    pos, end = span
    producer_id = sequence_id = -1
    num_messages = 1
    while pos < end:
        tag, pos = _varint(raw, pos, end)
        if tag < 0 or tag & 7 != 0:
            return None
        value, pos = _varint(raw, pos, end)
        if value < 0:
            return None
        field = tag >> 3
        if field == 1:
            producer_id = value
        elif field == 2:
            sequence_id = value
        elif field == 3:
            num_messages = value
        elif field == 0:
            return None
    if producer_id < 0 or sequence_id < 0 or num_messages >= _I32_LIMIT:
        return None
    return producer_id, sequence_id, num_messages


def receipt_fields(raw: bytes) -> tuple[int, int] | None:
    """(producer_id, sequence_id) of a whole SEND_RECEIPT frame in canonical encoding, else None.

    Its ``message_id`` is checked as far as protobuf would (ledgerId and entryId
    present, varint fields only); anything more unusual goes down the full path.
    """
    span = _sub_command(raw, _RECEIPT_HEAD)
    if span is None:
        return None
    pos, end = span
    producer_id = sequence_id = -1
    while pos < end:
        tag, pos = _varint(raw, pos, end)
        if tag < 0:
            return None
        field, wire = tag >> 3, tag & 7
        if wire == 2 and field == 3:
            length, pos = _varint(raw, pos, end)
            if length < 0 or pos + length > end or not _plain_message_id(raw, pos, pos + length):
                return None
            pos += length
            continue
        if wire != 0 or field == 0:
            return None
        value, pos = _varint(raw, pos, end)
        if value < 0:
            return None
        if field == 1:
            producer_id = value
        elif field == 2:
            sequence_id = value
    if producer_id < 0 or sequence_id < 0:
        return None
    return producer_id, sequence_id


def _plain_message_id(raw: bytes, pos: int, end: int) -> bool:
    """True when ``raw[pos:end]`` is a MessageIdData of varint fields that has its required ones."""
    seen: set[int] = set()
    while pos < end:
        tag, pos = _varint(raw, pos, end)
        if tag < 0 or tag & 7 != 0 or (tag >> 3) not in _MESSAGE_ID_VARINTS:
            return False
        value, pos = _varint(raw, pos, end)
        if value < 0:
            return False
        seen.add(tag >> 3)
    return pos == end and seen >= _MESSAGE_ID_REQUIRED


def plain_metadata(raw: bytes | memoryview, cmd_end: int, frame_end: int = -1) -> bool | None:
    """Whether the payload after ``cmd_end`` says it is uncompressed: True, False, or None (could not tell).

    Reads MessageMetadata's ``compression`` as the full path does (protobuf's parser, in C:
    a walk of its fields in Python cost several times as much, for every SEND while
    tracing); a section or metadata it cannot read answers None.  The frame ends at
    ``frame_end`` (-1: with ``raw``), so a frame is read where it lies in a run.
    """
    if frame_end < 0:
        frame_end = len(raw)
    span = _metadata_span(raw, cmd_end, frame_end)
    return None if span is None else _parsed_plain(raw, *span)


#: bytes MessageMetadata's ``compression`` (field 8, a varint: tag 0x40) cannot be encoded without: its
#: tag in one byte (40), or padded (a varint padded with zero groups ends in 00; protobuf refuses tags
#: longer than 5 bytes or beyond 32 bits, so no other spelling reads as field 8).  A 00 elsewhere (a
#: field of value 0) only sends the metadata to the parser; one character class searches fastest
_COMPRESSION_TAG_MAY_BE_IN: Final = re.compile(rb"[\x00\x40]").search


def searchable(raw: bytes | memoryview, cmd_end: int, frame_end: int) -> bool:
    """True when a byte search of the frame for ``traceparent`` tells whether it carries trace context.

    The full path (``tracker._trace_contexts``) finds trace context that the search cannot
    see only in an entry of a compressed batch, when the metadata parses and names a
    compression.  Metadata with no byte sequence that could be ``compression``'s tag cannot
    (nor can metadata that does not parse: the full path finds nothing in it then): no
    protobuf parse for it.  Otherwise :func:`plain_metadata` decides (True: uncompressed).
    """
    span = _metadata_span(raw, cmd_end, frame_end)
    if span is None:
        return False
    start, end = span
    if _COMPRESSION_TAG_MAY_BE_IN(raw, start, end) is None:
        return True
    return _parsed_plain(raw, start, end) is True


def _metadata_span(raw: bytes | memoryview, cmd_end: int, frame_end: int) -> tuple[int, int] | None:
    """(start, end) of the MessageMetadata of the payload section from ``cmd_end``; None: not readable."""
    if frame_end - cmd_end >= 10 and raw[cmd_end] == 0x0E and raw[cmd_end + 1] == 0x01:
        start = cmd_end + 10  # the common layout: no broker entry metadata before the checksum
        end = start + _SIZE.unpack_from(raw, cmd_end + 6)[0]
        return None if end > frame_end else (start, end)
    try:
        layout = check_payload(raw, cmd_end, frame_end, frame_end)
    except ProtocolError:
        return None
    if isinstance(layout, int):
        return None
    return layout.metadata_start, layout.metadata_end


def _parsed_plain(raw: bytes | memoryview, start: int, end: int) -> bool | None:
    """Whether the MessageMetadata at ``raw[start:end]`` says uncompressed; None: protobuf cannot read it."""
    metadata = _metadata.take()
    try:
        metadata.ParseFromString(raw[start:end])
    except (DecodeError, RuntimeError, ValueError):
        return None
    return bool(metadata.compression == api.NONE)


class _ReusedMetadata:
    """The one MessageMetadata :func:`plain_metadata` parses into, again and again, a fresh one every
    ``RENEW`` parses (upb keeps each parse's fields in the message's arena until the message goes:
    ~15 bytes a parse).

    A message per SEND freed an arena per SEND, and protobuf's allocator calls ``malloc_trim(0)``
    every 10,000 frees: all of the heap's free pages given back and faulted in again, tens of times
    a second while tracing (and a parse into a message kept is ~2.5x faster).  Loop thread only.
    """

    RENEW: Final = 4096

    def __init__(self) -> None:
        self._message = api.MessageMetadata()
        self._left = self.RENEW

    def take(self) -> api.MessageMetadata:
        self._left -= 1
        if self._left < 0:
            self._message = api.MessageMetadata()
            self._left = self.RENEW - 1
        return self._message


_metadata = _ReusedMetadata()
