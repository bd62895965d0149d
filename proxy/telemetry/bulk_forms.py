"""The SEND and SEND_RECEIPT commands telemetry accounts in bulk, recognised and read by a walk (compiled).

Pulsar binary protocol, "Framing": a canonical BaseCommand is ``08 TYPE`` then exactly the
sub-command field, here with a one-byte length.  :mod:`proxy.telemetry.bulk` files a SEND
under its key, the bytes ``08 <producer_id> 10 <sequence_id>``, and a receipt finds it by
the same bytes, so only the forms whose keys name their ids one way are taken:

- a SEND (PulsarApi.proto ``CommandSend``): ``08 06 32 LEN 08 <pid> 10 <seq> [18 <num_messages>]``,
  nothing else, the ids minimal varints of at most 9 bytes (< 2**63), num_messages a minimal
  varint of at most 4 (< 2**28: the per-frame path takes it below 2**31);
- a receipt (``CommandSendReceipt``): ``08 07 3a LEN 08 <pid> 10 <seq>``, then perhaps the
  message id ``1a SIZE`` {ledgerId, entryId, then perhaps partition (``18``), batch_index
  (``20``) and batch_size (``30``)}, then perhaps highest_sequence_id (``20``), every varint
  one protobuf reads as 64 bits (at most 10 bytes, the tenth 0 or 1).  A ``20`` that ends the
  command is read as highest_sequence_id, and SIZE must then be the message id's length
  without it (so ``1a 06 08 L 10 E 20 B`` with nothing after is not taken: the per-frame path
  reads it);

and LEN must be the sub-command's length up to ``end``.  Everything else goes the per-frame
way.  tests/telemetry/test_bulk_forms.py holds the walks to the regular expressions the bulk
path matched before them (what they take, and what they read).

Compiled with mypyc (scripts/setup.sh; :mod:`proxy.compiled`): the walks run once for every
SEND and receipt the relay passes while metrics or traces are on, where the expressions and
their groups were ~45 % of telemetry's extra time on the relay thread.

:func:`take_sends` and :func:`take_receipts` walk a run's frames and do what the bulk path
(:mod:`proxy.telemetry.observer`) does with each it takes, up to the first it does not take: the loop
in Python, a dozen lines a frame, was most of what metrics cost per message on the relay thread with the
official client, and the trace-context check of each SEND (:func:`plain_metadata_bytes`) most of what
traces at 1 % added to it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

#: the BaseCommand's type field (``08``) and the sub-command fields' tags (wire type 2)
_TYPE: Final = 0x08
_SEND: Final = 6
_SEND_FIELD: Final = 6 << 3 | 2
_RECEIPT: Final = 7
_RECEIPT_FIELD: Final = 7 << 3 | 2

#: the fields' tags (wire type 0, but the message id's: 2)
_FIRST: Final = 1 << 3  # producer_id; in the message id, ledgerId
_SECOND: Final = 2 << 3  # sequence_id; entryId
_THIRD: Final = 3 << 3  # num_messages; partition
_MESSAGE_ID: Final = 3 << 3 | 2
_FOURTH: Final = 4 << 3  # highest_sequence_id; batch_index
_SIXTH: Final = 6 << 3  # batch_size

#: the longest key varint (minimal, < 2**63), count varint (minimal, < 2**28) and 64-bit varint
_KEY_BYTES: Final = 9
_COUNT_BYTES: Final = 4
_VARINT_BYTES: Final = 10

#: a command whose LEN is its length is at most 4 + 127 bytes long (the forms: 92 at most)
_LONGEST: Final = 4 + 0x7F
#: a command's bytes copied out of a view, by their count (~2x cheaper than a slice of the view and its bytes)
_COPIES: Final = [struct.Struct(f"{size}s").unpack_from for size in range(_LONGEST + 1)]
#: a view this long at most is copied whole (~4x cheaper than the command's bytes out of it), into a bytes that
#: pymalloc's pools still give (requests of up to 512 bytes): a receipt, or a SEND of a small message
_SMALL_VIEW: Final = 448


def _key_end(buf: bytes, at: int, end: int) -> int:
    """The position after a minimal varint of at most 9 bytes at ``buf[at]`` (before ``end``), or -1."""
    stop = at + _KEY_BYTES if at + _KEY_BYTES < end else end
    pos = at
    while pos < stop:
        byte = buf[pos]
        if byte < 0x80:
            return -1 if byte == 0 and pos > at else pos + 1
        pos += 1
    return -1


def _varint_end(buf: bytes, at: int, end: int) -> int:
    """The position after a varint protobuf reads as 64 bits (at most 10 bytes, the tenth 0 or 1), or -1."""
    stop = at + _VARINT_BYTES if at + _VARINT_BYTES < end else end
    pos = at
    while pos < stop:
        byte = buf[pos]
        if byte < 0x80:
            return -1 if byte > 1 and pos - at == _VARINT_BYTES - 1 else pos + 1
        pos += 1
    return -1


def _producer_end(buf: bytes, start: int, end: int, sub_field: int) -> int:
    """Where the producer id ends in a command ``08 TYPE <sub_field> LEN 08 <pid> 10`` from ``buf[start]``, its LEN
    reaching ``end``; -1 when it is not one."""
    # (LEN is below 0x80, a one-byte varint, if it is the length: the longest of the forms is 92 bytes)
    if end - start < 8 or buf[start] != _TYPE or buf[start + 2] != sub_field or buf[start + 3] != end - start - 4 or (
            buf[start + 4] != _FIRST):
        return -1
    at = _key_end(buf, start + 5, end)
    return at if 0 <= at < end and buf[at] == _SECOND else -1


def _send(buf: bytes, start: int, end: int) -> tuple[bytes, bytes, int] | None:
    if start < 0:
        start = 0
    if end > len(buf):
        end = len(buf)
    if end - start < 8 or buf[start + 1] != _SEND:
        return None
    producer_end = _producer_end(buf, start, end, _SEND_FIELD)
    at = _key_end(buf, producer_end + 1, end) if producer_end >= 0 else -1
    if at < 0:
        return None
    key, producer = buf[start + 4:at], buf[start + 5:producer_end]
    if at == end:
        return key, producer, 1
    if buf[at] != _THIRD:
        return None
    # num_messages, read as it is walked
    first = at + 1
    stop = first + _COUNT_BYTES if first + _COUNT_BYTES < end else end
    value = shift = 0
    pos = first
    while pos < stop:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (key, producer, value) if pos + 1 == end and (byte or pos == first) else None
        shift += 7
        pos += 1
    return None


def _receipt(buf: bytes, start: int, end: int) -> bytes | None:
    if start < 0:
        start = 0
    if end > len(buf):
        end = len(buf)
    if end - start < 8 or buf[start + 1] != _RECEIPT:
        return None
    producer_end = _producer_end(buf, start, end, _RECEIPT_FIELD)
    at = _key_end(buf, producer_end + 1, end) if producer_end >= 0 else -1
    if at < 0:
        return None
    key = buf[start + 4:at]
    if at == end:
        return key
    if buf[at] == _FOURTH:  # highest_sequence_id, no message id
        return key if _varint_end(buf, at + 1, end) == end else None
    # (SIZE is below 0x80 if it is the message id's length: the whole command is shorter)
    if buf[at] != _MESSAGE_ID or at + 2 >= end or buf[at + 2] != _FIRST:
        return None
    id_size, id_start = buf[at + 1], at + 2
    at = _varint_end(buf, id_start + 1, end)
    if at < 0 or at >= end or buf[at] != _SECOND:
        return None
    at = _varint_end(buf, at + 1, end)
    if 0 <= at < end and buf[at] == _THIRD:
        at = _varint_end(buf, at + 1, end)
    if at < 0:
        return None
    # then batch_index, batch_size (each perhaps) and highest_sequence_id (perhaps): the tags 20 30 20, some left
    # out; a 20 that ends the command is highest_sequence_id, the fields before it the message id's
    allowed = (_FOURTH, _SIXTH, _FOURTH)
    next_tag = 0
    id_end = end
    while at < end:
        tag = buf[at]
        while next_tag < 3 and allowed[next_tag] != tag:
            next_tag += 1
        if next_tag == 3:
            return None
        next_tag += 1
        id_end = at if tag == _FOURTH else end
        at = _varint_end(buf, at + 1, end)
        if at < 0:
            return None
    return key if id_end - id_start == id_size else None


def _window(view: memoryview, start: int, end: int) -> bytes:
    """``view[start:end]`` as bytes, with the bounds a regular expression's ``pos`` and ``endpos`` have; empty when
    it is too short or too long to be a command of the forms."""
    if start < 0:
        start = 0
    if end > len(view):
        end = len(view)
    size = end - start
    if size < 8 or size > _LONGEST:
        return b""
    copy: bytes = _COPIES[size](view, start)[0]
    return copy


def send_command(buf: bytes | memoryview, start: int, end: int) -> tuple[bytes, bytes, int] | None:
    """A SEND's BaseCommand in ``buf[start:end]``, if it is of the form taken in bulk: (its key, its producer id's
    varint, its number of messages: num_messages, or 1 when it has none); else None."""
    if isinstance(buf, bytes):
        return _send(buf, start, end)
    # a view (of a run the relay's ring holds): copied whole, else the command out of it
    if len(buf) <= _SMALL_VIEW:
        return _send(buf.tobytes(), start, end)
    window = _window(buf, start, end)
    return _send(window, 0, len(window))


def receipt_key(buf: bytes | memoryview, start: int, end: int) -> bytes | None:
    """A SEND_RECEIPT's BaseCommand in ``buf[start:end]``, if it is of the form taken in bulk: its key; else None."""
    if isinstance(buf, bytes):
        return _receipt(buf, start, end)
    if len(buf) <= _SMALL_VIEW:
        return _receipt(buf.tobytes(), start, end)
    window = _window(buf, start, end)
    return _receipt(window, 0, len(window))


#: a SEND in the book (``bulk.BookEntry``): (received_ns, forwarded_ns, frame size, num_messages, topic)
Entry = tuple[int, int, int, int, "str | None"]
#: a producer's (whether its SENDs may go in the book, its topic): ``ConnectionTimeline.bulk_producer``
Producer = tuple[bool, "str | None"]
#: the payload section's magic (``0e01``, then a CRC32-C and the metadata's size)
_MAGIC_0: Final = 0x0E
_MAGIC_1: Final = 0x01


#: what a SEND that names trace context holds (``tracker.TRACEPARENT``)
TRACEPARENT: Final = b"traceparent"


def _frame_end(buf: bytes, pos: int, end_of_data: int) -> int:
    """Where the frame at ``pos`` ends (its TOTAL_SIZE + 4 on), or -1 when it is not whole in ``buf``."""
    if end_of_data - pos < 8:
        return -1
    end = pos + 4 + (buf[pos] << 24 | buf[pos + 1] << 16 | buf[pos + 2] << 8 | buf[pos + 3])
    return end if end <= end_of_data else -1


def _command_end(buf: bytes, pos: int) -> int:
    """Where the command of the frame at ``pos`` ends (its CMD_SIZE from ``pos + 8``), or -1 when it is longer than
    the forms can be (what :func:`send_command` and :func:`receipt_key` answer None for out of a run's view)."""
    size = buf[pos + 4] << 24 | buf[pos + 5] << 16 | buf[pos + 6] << 8 | buf[pos + 7]
    return pos + 8 + size if size <= _LONGEST else -1


def plain_metadata_bytes(buf: bytes, cmd_end: int, frame_end: int) -> bool:
    """True when the payload after ``cmd_end`` has the common layout (no broker entry metadata) and its
    MessageMetadata holds neither byte ``compression``'s tag needs (00, 40): then
    ``data_path.searchable`` is True without a search or a parse.  False: ask it."""
    if frame_end - cmd_end < 10 or buf[cmd_end] != _MAGIC_0 or buf[cmd_end + 1] != _MAGIC_1:
        return False
    start = cmd_end + 10
    end = start + (buf[cmd_end + 6] << 24 | buf[cmd_end + 7] << 16 | buf[cmd_end + 8] << 8 | buf[cmd_end + 9])
    if end > frame_end:
        return False
    pos = start
    while pos < end:
        byte = buf[pos]
        if byte == 0 or byte == 0x40:
            return False
        pos += 1
    return True


def take_sends(buf: bytes, pos: int, entries: dict[bytes, Entry], other_keys: set[bytes],
               producers: dict[bytes, Producer], bulk_producer: Callable[[bytes], Producer],
               capacity: int, forgets: bool, forget_oldest: Callable[[], None], received_ns: int, forwarded_ns: int,
               searchable: Callable[[bytes, int, int], bool] | None, marked: bool,
               messages: dict[str | None, int]) -> tuple[int, int, int]:
    """Files the SENDs of ``buf`` from ``pos`` in the book (``entries``) as the bulk path takes them, up to the
    first frame it does not take (or the end of the whole frames): (where it stopped, the SENDs filed, the
    capacity left).

    ``producers`` caches ``bulk_producer``; ``forgets`` / ``capacity`` / ``forget_oldest``: the book's limits
    (``ConnectionTimeline.bulk_capacity``); ``searchable`` (None: traces are off) is ``data_path.searchable``
    (True: a byte search of the frame tells whether it carries trace context), asked only when
    :func:`plain_metadata_bytes` cannot tell; ``marked``: the run names ``traceparent`` somewhere (a frame that
    does is not taken).  Each SEND's messages are added to ``messages`` under its topic.
    """
    end_of_data = len(buf)
    frames = 0
    while capacity > 0:
        end = _frame_end(buf, pos, end_of_data)
        if end < 0:
            break
        cmd_end = _command_end(buf, pos)
        found = _send(buf, pos + 8, cmd_end) if cmd_end >= 0 else None
        if found is None:
            break
        key, producer, number = found
        known = producers.get(producer)
        if known is None:
            known = producers[producer] = bulk_producer(producer)
        in_bulk, topic = known
        if not in_bulk or (other_keys and key in other_keys):
            break
        if searchable is not None and end > cmd_end and (
                (marked and buf.find(TRACEPARENT, pos, end) >= 0)
                or not (plain_metadata_bytes(buf, cmd_end, end) or searchable(buf, cmd_end, end))):
            break
        entries[key] = (received_ns, forwarded_ns, end - pos, number, topic)
        if not forgets:
            capacity -= 1
        elif len(entries) > capacity:
            forget_oldest()
        frames += 1
        if number:
            messages[topic] = messages.get(topic, 0) + number
        pos = end
    return pos, frames, capacity


def take_receipts(buf: bytes, pos: int, entries: dict[bytes, Entry], other_keys: set[bytes], forwarded_ns: int,
                  latencies: dict[str | None, list[float]], draw: Callable[[], float] | None, rate: float,
                  sampled: list[tuple[bytes, Entry]]) -> tuple[int, int, int]:
    """Takes the receipts of ``buf`` from ``pos`` as the bulk path does, up to the first frame it does not take
    (or the end of the whole frames): (where it stopped, the receipts taken, the spans skipped).

    Each receipt of a SEND in the book takes it out; its latency (``forwarded_ns`` less the SEND's, in seconds,
    not below 0) is appended to ``latencies`` under its topic.  With ``draw`` (traces on) each is drawn for a span
    at ``rate`` (``rate`` >= 1: every one, nothing drawn), in order: a sampled one is appended to ``sampled``, the
    others counted as skipped.
    """
    end_of_data = len(buf)
    frames = skipped = 0
    every = rate >= 1.0
    sent_ns, seconds = -1, 0.0
    while True:
        end = _frame_end(buf, pos, end_of_data)
        if end < 0:
            break
        cmd_end = _command_end(buf, pos)
        key = _receipt(buf, pos + 8, cmd_end) if cmd_end >= 0 else None
        if key is None or (other_keys and key in other_keys and key not in entries):
            break
        frames += 1
        entry = entries.pop(key, None)
        if entry is not None:
            if entry[0] != sent_ns:
                sent_ns = entry[0]
                waited = forwarded_ns - sent_ns
                seconds = (waited if waited > 0 else 0) / 1e9
            topic = entry[4]
            found = latencies.get(topic)
            if found is None:
                latencies[topic] = [seconds]
            else:
                found.append(seconds)
            if draw is not None:
                if every or draw() < rate:
                    sampled.append((key, entry))
                else:
                    skipped += 1
        pos = end
    return pos, frames, skipped


__all__ = ["plain_metadata_bytes", "receipt_key", "send_command", "take_receipts", "take_sends"]
