"""The hot commands' sub-command fields in their plain forms, recognised without a parse (compiled).

Pulsar binary protocol, "Framing": a canonical BaseCommand is ``08 TYPE`` then exactly the
sub-command field.  The data path's commands -- SEND, SEND_RECEIPT, MESSAGE, FLOW, PING,
PONG -- come from their writers in one plain form each: the fields the clients and brokers
write, in field order, each at most once, every varint short enough that its value fits the
field's type (uint64 and int64: at most 9 bytes, < 2**63; uint32 and int32: at most 4 bytes,
< 2**28), bools 0 or 1, a MessageIdData exactly ``{ledgerId, entryId}``.  Every field of one
of these forms is a valid command by PulsarApi.proto, so :func:`plainly_valid` saying so
spares the relay's one-frame lane the parse (:mod:`proxy.protocol.validation` says what valid
is; tests/protocol/test_plain_commands.py holds this walk to its parser).  Anything else,
valid or not, is left to the parser.

A walk of the bytes, compiled with mypyc (scripts/setup.sh; :mod:`proxy.compiled`): it runs on
every small relayed read, where a regular expression of the same forms cost ~6 % of the relay.
"""

from __future__ import annotations

from typing import Final

#: the sub-command fields' tags (field number = type, wire type 2): one byte, or two for PING/PONG
_SEND: Final = 6 << 3 | 2
_SEND_RECEIPT: Final = 7 << 3 | 2
_MESSAGE: Final = 9 << 3 | 2
_FLOW: Final = 11 << 3 | 2
#: PING (18) and PONG (19): 0x92 0x01 and 0x9a 0x01
_PING_LOW: Final = (18 << 3 | 2) & 0x7F | 0x80
_PONG_LOW: Final = (19 << 3 | 2) & 0x7F | 0x80

#: the longest varints whose value fits a field: 64-bit (< 2**63) and 32-bit (< 2**28)
_LONG: Final = 9
_SHORT: Final = 4


def _varint(buf: bytes, at: int, end: int, longest: int) -> int:
    """The position after a varint of at most ``longest`` bytes at ``buf[at]`` (before ``end``), or -1."""
    if at < 0:
        return -1
    stop = at + longest if at + longest < end else end
    while at < stop:
        if buf[at] < 0x80:
            return at + 1
        at += 1
    return -1


def _field(buf: bytes, at: int, end: int, tag: int, longest: int) -> int:
    """A varint field with its one-byte ``tag`` at ``buf[at]``: the position after it, or -1."""
    if at < 0 or at >= end or buf[at] != tag:
        return -1
    return _varint(buf, at + 1, end, longest)


def _optional(buf: bytes, at: int, end: int, tag: int, longest: int) -> int:
    """:func:`_field` if ``buf[at]`` is its tag, else ``at`` (the field is absent)."""
    if at < 0 or at >= end or buf[at] != tag:
        return at
    return _varint(buf, at + 1, end, longest)


def _optional_bool(buf: bytes, at: int, end: int, tag: int) -> int:
    """An optional bool field written as 0 or 1."""
    if at < 0 or at >= end or buf[at] != tag:
        return at
    if at + 1 < end and buf[at + 1] <= 1:
        return at + 2
    return -1


def _message_id(buf: bytes, at: int, end: int) -> int:
    """A MessageIdData ``{ledgerId, entryId}`` at ``buf[at]`` (its one-byte length, then exactly those two)."""
    if at < 0 or at >= end:
        return -1
    stop = at + 1 + buf[at]
    if buf[at] > 20 or stop > end or at + 1 >= stop or buf[at + 1] != 0x08:
        return -1
    at = _varint(buf, at + 2, stop, _LONG)
    if at < 0 or at >= stop or buf[at] != 0x10:
        return -1
    return stop if _varint(buf, at + 1, stop, _LONG) == stop else -1


def plainly_valid(buf: bytes, start: int, end: int) -> bool:
    """Whether ``buf[start:end]``, a sub-command field (tag, one-byte length, body), is one of the plain forms.

    True means the command passes every check of :func:`~proxy.protocol.validation.check_command`;
    False says nothing (parse it).  The length is checked too: it must be ``end``'s.
    """
    if end - start < 3 or end - start > 0x81:
        return False
    tag = buf[start]
    if tag in (_PING_LOW, _PONG_LOW):
        return end - start == 3 and buf[start + 1] == 0x01 and buf[start + 2] == 0
    at = start + 2
    if buf[start + 1] != end - at:
        return False
    if tag == _SEND:
        at = _field(buf, at, end, 0x08, _LONG)  # producer_id
        at = _field(buf, at, end, 0x10, _LONG)  # sequence_id
        at = _optional(buf, at, end, 0x18, _SHORT)  # num_messages
        at = _optional(buf, at, end, 0x20, _LONG)  # txnid_least_bits
        at = _optional(buf, at, end, 0x28, _LONG)  # txnid_most_bits
        at = _optional(buf, at, end, 0x30, _LONG)  # highest_sequence_id
        at = _optional_bool(buf, at, end, 0x38)  # is_chunk
        at = _optional_bool(buf, at, end, 0x40)  # marker
    elif tag == _SEND_RECEIPT:
        at = _field(buf, at, end, 0x08, _LONG)  # producer_id
        at = _field(buf, at, end, 0x10, _LONG)  # sequence_id
        if 0 <= at < end and buf[at] == 0x1A:  # message_id
            at = _message_id(buf, at + 1, end)
        at = _optional(buf, at, end, 0x20, _LONG)  # highest_sequence_id
    elif tag == _MESSAGE:
        at = _field(buf, at, end, 0x08, _LONG)  # consumer_id
        if 0 <= at < end and buf[at] == 0x12:  # message_id (required)
            at = _message_id(buf, at + 1, end)
        else:
            return False
        at = _optional(buf, at, end, 0x18, _SHORT)  # redelivery_count
        at = _optional(buf, at, end, 0x28, _LONG)  # consumer_epoch
    elif tag == _FLOW:
        at = _field(buf, at, end, 0x08, _LONG)  # consumer_id
        at = _field(buf, at, end, 0x10, _SHORT)  # messagePermits
    else:
        return False
    return at == end


#: what :func:`row_mask` keeps of a byte: all of it, or only its continuation bit (a varint's payload)
_FIXED: Final = 0xFF
_FREE: Final = 0x80


def _free_varints(buf: bytes, at: int, end: int, mask: bytearray, start: int, bools: bool) -> None:
    """Mark the payload bits of the varints in the plainly valid fields ``buf[at:end]`` free in ``mask``
    (indexed from ``start``); a MessageIdData's fields too; with ``bools``, tags 0x38 and 0x40 are SEND's bools."""
    while at < end:
        tag = buf[at]
        at += 1
        if tag & 7 == 2:  # a MessageIdData: its length stays fixed, its two varints are free
            stop = at + 1 + buf[at]
            _free_varints(buf, at + 1, stop, mask, start, False)
            at = stop
            continue
        first = at
        while buf[at] >= 0x80:
            at += 1
        at += 1
        if not (bools and (tag == 0x38 or tag == 0x40)):
            while first < at:
                mask[first - start] = _FREE
                first += 1


def row_mask(buf: bytes, start: int, end: int) -> bytes | None:
    """For a field :func:`plainly_valid` accepts, what of each byte another field must share to be accepted too.

    ``None`` when it is not plainly valid.  Otherwise one byte per byte of the field: 0xFF where
    the walk reads the value (tags, lengths, bools), 0x80 in a varint of a number, where the walk
    reads only the continuation bit.  A field of the same size that agrees with this one on
    every bit the mask keeps takes every branch of the walk this one takes: the positions the
    walk compares are the fixed bytes (an absent optional field's tag position is the next
    field's tag), and how far a varint reaches, and whether it is at most 9 or 4 bytes long,
    depends on continuation bits only.  So it is plainly valid too, and valid by check_command
    (the forms hold no enum, whose value would matter; a number of at most 9 or 4 bytes always
    fits its field).
    """
    if not plainly_valid(buf, start, end):
        return None
    mask = bytearray(end - start)
    for index in range(end - start):
        mask[index] = _FIXED
    tag = buf[start]
    if tag != _PING_LOW and tag != _PONG_LOW:
        _free_varints(buf, start + 2, end, mask, start, tag == _SEND)
    return bytes(mask)


__all__ = ["plainly_valid", "row_mask"]
