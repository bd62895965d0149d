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
says it is uncompressed (then a byte search rules trace context out).
"""

from __future__ import annotations

from typing import Final

from proxy.errors import ProtocolError
from proxy.protocol.commands import T
from proxy.protocol.validation import check_payload

#: ``08 TYPE <tag of the sub-command>`` at offset 8 of a canonical SEND / SEND_RECEIPT frame
_SEND_HEAD: Final = bytes((0x08, T.SEND, (6 << 3) | 2))
_RECEIPT_HEAD: Final = bytes((0x08, T.SEND_RECEIPT, (7 << 3) | 2))
_U64_LIMIT: Final = 1 << 64
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


def plain_metadata(raw: bytes, cmd_end: int, frame_end: int = -1) -> bool | None:
    """Whether the payload after ``cmd_end`` says it is uncompressed: True, False, or None (could not tell).

    Reads MessageMetadata's ``compression`` (field 8, a varint; absent means NONE) by
    walking its fields; anything this walk cannot follow answers None.  The frame ends
    at ``frame_end`` (-1: with ``raw``), so a frame is read where it lies in a run.
    """
    if frame_end < 0:
        frame_end = len(raw)
    try:
        layout = check_payload(raw, cmd_end, frame_end, frame_end)
    except ProtocolError:
        return None
    if isinstance(layout, int):
        return None
    pos, end = layout.metadata_start, layout.metadata_end
    compression = 0
    while pos < end:
        # (one-byte varints, the common case, read inline: this runs for every SEND while tracing)
        tag = raw[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(raw, pos, end)
        if tag < 0 or tag >> 3 == 0:
            return None
        wire = tag & 7
        if wire == 0:
            if pos < end and raw[pos] < 0x80:
                value = raw[pos]
                pos += 1
            else:
                value, pos = _varint(raw, pos, end)
                if value < 0:
                    return None
            if tag >> 3 == 8:
                compression = value
        elif wire == 2:
            if pos < end and raw[pos] < 0x80:
                length = raw[pos]
                pos += 1
            else:
                length, pos = _varint(raw, pos, end)
            if length < 0 or pos + length > end:
                return None
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            return None
    if pos != end:
        return None
    return compression == 0
