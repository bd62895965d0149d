"""The bulk path's walks take exactly the SENDs and receipts the regular expressions before them took, read alike.

:mod:`proxy.telemetry.bulk_forms` replaced three patterns the bulk path matched over each
SEND's and receipt's BaseCommand (:data:`SEND_COMMAND`; :data:`COMMON_RECEIPT_COMMAND`, tried
first, else :data:`RECEIPT_COMMAND`), kept here as the oracle, with the checks the callers
made of their groups: the sub-command's one-byte length is the rest of the command's, and a
receipt's message id is as long as its SIZE byte says.  For commands drawn near the forms and
damaged (truncated, flipped, extended, lengths off, varints padded, overlong, unterminated,
zero-ended, random bytes), inside other bytes, at any start and end (the bounds a pattern's
``pos`` and ``endpos`` have, beyond the buffer too), as bytes and as a memoryview (short, and
long: then the command is copied out of it): the walk takes a command exactly when the oracle
does, with the same key and producer id bytes, and num_messages' value (1 when there is none).
"""

from __future__ import annotations

import re

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.telemetry.bulk import varint_value
from proxy.telemetry.bulk_forms import receipt_key, send_command

from .scripted import padded_varint

#: a varint telemetry keys on: minimal (so its bytes name one value), at most 9 bytes (< 2**63)
_KEY = rb"(?:[\x00-\x7f]|[\x80-\xff]{1,8}[\x01-\x7f])"
#: any varint protobuf reads as a 64-bit value: at most 10 bytes, the tenth 0 or 1
_VARINT = rb"(?:[\x80-\xff]{0,8}[\x00-\x7f]|[\x80-\xff]{9}[\x00\x01])"
#: a varint of up to 9 bytes (_VARINT's first form)
_SHORT_VARINT = rb"[\x80-\xff]{0,8}[\x00-\x7f]"
#: num_messages as the per-frame path accepts it (< 2**31): minimal here, at most 4 bytes (< 2**28)
_COUNT = rb"(?:[\x00-\x7f]|[\x80-\xff]{1,3}[\x01-\x7f])"

#: a SEND's BaseCommand: groups (key, producer id, num_messages or None)
SEND_COMMAND = re.compile(rb"\x08\x06\x32[\x00-\x7f](\x08(" + _KEY + rb")\x10" + _KEY + rb")(?:\x18(" + _COUNT
                          + rb"))?")
#: a SEND_RECEIPT's BaseCommand: groups (key, message id length or None, message id or None); MessageIdData as the
#: per-frame path takes it (ledgerId, entryId, then partition, batch_index, batch_size; the last two tried last, so
#: that a ``20`` after the message id is first read as highest_sequence_id)
RECEIPT_COMMAND = re.compile(
    rb"\x08\x07\x3a[\x00-\x7f](\x08" + _KEY + rb"\x10" + _KEY + rb")(?:\x1a([\x00-\x7f])(\x08" + _VARINT
    + rb"\x10" + _VARINT + rb"(?:\x18" + _VARINT + rb")?(?:\x20" + _VARINT + rb")??(?:\x30" + _VARINT
    + rb")??))?(?:\x20" + _VARINT + rb")?")
#: the receipt brokers send, tried first (it was cheaper for the engine): a subset of RECEIPT_COMMAND, same groups
COMMON_RECEIPT_COMMAND = re.compile(
    rb"\x08\x07\x3a[\x00-\x7f](\x08" + _KEY + rb"\x10" + _KEY + rb")\x1a([\x00-\x7f])(\x08" + _SHORT_VARINT
    + rb"\x10" + _SHORT_VARINT + rb")(?:\x20" + _SHORT_VARINT + rb")?")


def _length_fits(buf: bytes | memoryview, match: re.Match[bytes]) -> bool:
    """The sub-command's one-byte length is the rest of the matched command's (what the callers checked)."""
    return buf[match.start() + 3] == match.end() - match.start() - 4


def oracle_send(buf: bytes | memoryview, start: int, end: int) -> tuple[bytes, bytes, int] | None:
    """What the bulk path took of a SEND before the walk: (key, producer id, number of messages) or None."""
    found = SEND_COMMAND.fullmatch(buf, start, end)
    if found is None or not _length_fits(buf, found):
        return None
    key, producer, count = found.group(1, 2, 3)
    return key, producer, 1 if count is None else varint_value(count)


def oracle_receipt(buf: bytes | memoryview, start: int, end: int) -> bytes | None:
    """What the bulk path took of a receipt before the walk: its key, or None."""
    found = COMMON_RECEIPT_COMMAND.fullmatch(buf, start, end) or RECEIPT_COMMAND.fullmatch(buf, start, end)
    if found is None or not _length_fits(buf, found):
        return None
    key, id_size, message_id = found.group(1, 2, 3)
    return key if id_size is None or id_size[0] == len(message_id) else None


@st.composite
def varints(draw: st.DrawFn) -> bytes:
    """Varints of every length the forms tell apart: mostly minimal, else padded (zero-ended), of 10 or 11 bytes,
    unterminated, of values up to 2**64."""
    if draw(st.integers(0, 3)):
        return padded_varint(draw(st.one_of(st.integers(0, 200), st.integers(0, 2**28), st.integers(0, 2**62))))
    value = draw(st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1),
                           st.sampled_from([2**28 - 1, 2**28, 2**31, 2**63 - 1, 2**63, 2**64 - 1])))
    out = padded_varint(value, draw(st.sampled_from([0, 0, 1, 2, 8])))
    shape = draw(st.sampled_from(["as is"] * 3 + ["unterminated", "ten", "eleven"]))
    if shape == "unterminated":
        return out[:-1] + bytes([out[-1] | 0x80])
    if shape in ("ten", "eleven"):  # 9 or 10 continuation bytes, then a last byte of 0 to 3
        return b"\xff" * (9 if shape == "ten" else 10) + bytes([draw(st.integers(0, 3))])
    return out


#: a message id's fields after ledgerId and entryId, as its writers give them: partition, batch_index, batch_size
SHAPES = st.sampled_from([(), (0x18,), (0x20,), (0x30,), (0x18, 0x20), (0x20, 0x30), (0x18, 0x20, 0x30)])


@st.composite
def commands(draw: st.DrawFn) -> bytes:
    """A SEND's or a receipt's BaseCommand near the forms, perhaps damaged."""
    receipt = draw(st.booleans())
    tags = [0x08, 0x10, 0x18, 0x20, 0x28, 0x30, 0x1A, 0x38]
    body = bytearray(b"\x08" + draw(varints()) + b"\x10" + draw(varints()))
    if receipt:
        if draw(st.booleans()):  # a message id: its fields, in order or not, its size right or off
            fields = b"\x08" + draw(varints()) + b"\x10" + draw(varints())
            for tag in draw(st.one_of(SHAPES, st.lists(st.sampled_from([0x18, 0x20, 0x30, 0x28]), max_size=4))):
                fields += bytes([tag]) + draw(varints())
            size = len(fields) + draw(st.sampled_from([0] * 12 + [-2, -1, 1, 2]))
            body += b"\x1a" + bytes([size & 0xFF]) + fields
        for tag in draw(st.one_of(st.sampled_from([(), (0x20,)]), st.lists(st.sampled_from([0x20, 0x30, 0x18]),
                                                                             max_size=3))):
            body += bytes([tag]) + draw(varints())
    else:
        for tag in draw(st.one_of(st.sampled_from([(), (0x18,)]), st.lists(st.sampled_from([0x18, 0x20, 0x10]),
                                                                             max_size=2))):
            body += bytes([tag]) + draw(varints())
    damage = draw(st.sampled_from(["none"] * 12 + ["truncate", "flip", "append", "random"]))
    if damage == "random":
        body = bytearray(draw(st.binary(max_size=30)))
    elif damage == "truncate" and body:
        del body[draw(st.integers(0, len(body) - 1)):]
    elif damage == "flip" and body:
        body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
    elif damage == "append":
        body += bytes([draw(st.sampled_from(tags))]) + draw(st.binary(max_size=3))
    length = len(body) + draw(st.sampled_from([0] * 12 + [-1, 1, 0x80]))
    return b"\x08" + (b"\x07\x3a" if receipt else b"\x06\x32") + bytes([length & 0xFF]) + bytes(body)


@st.composite
def placed(draw: st.DrawFn) -> tuple[bytes, int, int]:
    """A command inside other bytes, with the start and end it is looked at with: its own mostly, else any."""
    command = draw(commands())
    before, after = draw(st.binary(max_size=12)), draw(st.binary(max_size=4))
    buf = before + command + after
    start, end = len(before), len(before) + len(command)
    bounds = draw(st.sampled_from(["its own"] * 5 + ["any", "start before", "end after"]))
    if bounds == "any":
        start = draw(st.integers(-3, len(buf) + 3))
        end = draw(st.integers(-3, len(buf) + 3))
    elif bounds == "start before":
        start = draw(st.integers(-3, start))
    elif bounds == "end after":
        end = draw(st.integers(start, len(buf) + 8))
    return buf, start, end


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placed())
@example((b"\x08\x07\x3a\x0a\x08\x01\x10\x02\x1a\x06\x08\x03\x10\x04\x20\x05", 0, 16))  # a 20 ending it: not the id's
@example((b"\x08\x07\x3a\x0a\x08\x01\x10\x02\x1a\x04\x08\x03\x10\x04\x20\x05", 0, 16))  # ... but highest_sequence_id
@example((b"\x08\x06\x32\x06\x08\x10\x10\x01\x18\x00", 0, 10))  # a producer id of 0x10; num_messages 0
@example((b"\x08\x06\x32\x06\x08\x10\x10\x01\x18\x00", 0, 99))  # the end beyond the buffer
@example((b"\x08\x06\x32\x06\x08\x10\x10\x01\x18\x00", -2, 10))  # the start before it
def test_the_walks_take_what_the_patterns_took_and_read_the_same(drawn: tuple[bytes, int, int]) -> None:
    buf, start, end = drawn
    event("send taken" if oracle_send(buf, start, end) else "receipt taken" if oracle_receipt(buf, start, end)
          else "not taken")
    # (a view longer than the walks copy whole: the command is copied out of it; before or after the rest)
    for whole, shift in ((buf, 0), (bytes(460) + buf, 460), (buf + bytes(460), 0)):
        expected_send = oracle_send(whole, start + shift, end + shift)
        expected_receipt = oracle_receipt(whole, start + shift, end + shift)
        for view in (whole, memoryview(whole)):
            assert send_command(view, start + shift, end + shift) == expected_send, (buf.hex(), start, end, shift)
            assert receipt_key(view, start + shift, end + shift) == expected_receipt, (buf.hex(), start, end, shift)


def test_receipts_with_each_shape_of_message_id_are_read_as_the_patterns_read_them() -> None:
    """Every run of batch_index (20), batch_size (30) and highest_sequence_id (20) after the message id's first
    fields, with each SIZE byte: a last 20 is highest_sequence_id, so SIZE must leave it out."""
    ids = b"\x08\x81\x01\x10\x05"
    head = b"\x08\x03\x10\x04"
    taken = 0
    for third in (b"", b"\x18\x07"):
        for tags in ((), (0x20,), (0x30,), (0x20, 0x30), (0x20, 0x20), (0x30, 0x20), (0x20, 0x30, 0x20),
                     (0x30, 0x30), (0x20, 0x20, 0x20), (0x30, 0x20, 0x30), (0x20, 0x30, 0x20, 0x20)):
            rest = b"".join(bytes([tag, 0x7F]) for tag in tags)
            for size in range(len(head + third + rest) + 2):
                sub = ids + b"\x1a" + bytes([size]) + head + third + rest
                command = b"\x08\x07\x3a" + bytes([len(sub)]) + sub
                expected = oracle_receipt(command, 0, len(command))
                assert receipt_key(command, 0, len(command)) == expected, command.hex()
                taken += expected is not None
    assert taken == 2 * 7  # (the seven shapes the patterns take, each with the one SIZE that fits it)


def test_what_the_writers_encode_is_taken() -> None:
    """SENDs (with and without num_messages) and receipts (with and without a message id, batch index,
    highest_sequence_id) as protobuf encodes them, from frames as the relay passes them."""
    metadata = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1)
    for send, number in ((api.CommandSend(producer_id=3, sequence_id=2**40), 1),
                         (api.CommandSend(producer_id=2**62, sequence_id=0, num_messages=300), 300),
                         (api.CommandSend(producer_id=0, sequence_id=5, num_messages=0), 0)):
        frame = encode_payload_command(send, metadata, b"payload")
        cmd_end = 8 + int.from_bytes(frame[4:8], "big")
        found = send_command(frame, 8, cmd_end)
        assert found is not None and found[2] == number
        assert found == send_command(memoryview(frame), 8, cmd_end) == oracle_send(frame, 8, cmd_end)
    for receipt in (api.CommandSendReceipt(producer_id=3, sequence_id=9),
                    api.CommandSendReceipt(producer_id=3, sequence_id=9, highest_sequence_id=12,
                                           message_id=api.MessageIdData(ledgerId=2**63, entryId=0, batch_index=4)),
                    api.CommandSendReceipt(producer_id=3, sequence_id=9,
                                           message_id=api.MessageIdData(ledgerId=7, entryId=1, partition=2))):
        frame = encode_command(receipt)
        cmd_end = 8 + int.from_bytes(frame[4:8], "big")
        assert receipt_key(frame, 8, cmd_end) == b"\x08\x03\x10\x09" == oracle_receipt(frame, 8, cmd_end)


_RECEIPT_TAILS = [b"", b"\x20", b"\x18", b"\x28", b"\x30", b"\x00", b"\x01", b"\x05", b"\x7f", b"\x80", b"\xff",
                  b"\x80\x01", b"\xff" * 8 + b"\x7f", b"\xff" * 9 + b"\x01"]


@settings(max_examples=2000, deadline=None)
@given(ids=st.tuples(st.integers(0, 2**63), st.integers(0, 2**63)), ledger=st.integers(0, 2**64 - 1),
       entry=st.integers(0, 2**64 - 1), size_shift=st.integers(-2, 2), tail=st.lists(st.sampled_from(_RECEIPT_TAILS),
                                                                                      max_size=6))
def test_the_common_receipt_pattern_reads_what_the_general_one_reads(ids: tuple[int, int], ledger: int, entry: int,
                                                                      size_shift: int, tail: list[bytes]) -> None:
    """Where the oracle's pattern for the receipts brokers send matches, the general receipt pattern matches with
    the same groups (the bulk path tried the common one first): message ids of any size byte, then anything."""
    message_id = b"\x08" + padded_varint(ledger) + b"\x10" + padded_varint(entry)
    sub = (b"\x08" + padded_varint(ids[0]) + b"\x10" + padded_varint(ids[1]) + b"\x1a"
           + bytes([max(len(message_id) + size_shift, 0) & 0x7F]) + message_id + b"".join(tail))
    command = b"\x08\x07\x3a" + bytes([len(sub) & 0x7F]) + sub
    common = COMMON_RECEIPT_COMMAND.fullmatch(command)
    general = RECEIPT_COMMAND.fullmatch(command)
    if common is not None:
        assert general is not None and general.group(1, 2, 3) == common.group(1, 2, 3)
    if general is not None and not tail and size_shift == 0 and max(ledger, entry) < 2**63:
        assert common is not None  # the common shape is taken by the common pattern


@st.composite
def payload_sends(draw: st.DrawFn) -> tuple[bytes, int]:
    """A SEND frame whose payload section holds metadata drawn near what clients write (a compression named or
    not, its tag plain or padded, a ``@`` or a 0 in a field, a damaged size, bytes protobuf cannot read, broker
    entry metadata first), and where its command ends."""
    metadata = api.MessageMetadata(producer_name=draw(st.sampled_from(["p", "standalone-0-7", "p@host"])),
                                   sequence_id=draw(st.integers(0, 2**40)), publish_time=draw(st.integers(0, 2**42)))
    if draw(st.booleans()):
        metadata.compression = draw(st.sampled_from([api.NONE, api.LZ4, api.ZLIB, api.ZSTD, api.SNAPPY]))
    if draw(st.booleans()):
        metadata.num_messages_in_batch = draw(st.integers(0, 5))
    spelt = metadata.SerializeToString() + draw(st.sampled_from([b"", b"\xc0\x00\x01", b"\x40\x00", b"\xff\xff"]))
    frame = bytearray(encode_payload_command(
        api.CommandSend(producer_id=1, sequence_id=2), spelt, b"payload",
        broker_entry_metadata=api.BrokerEntryMetadata(index=3) if draw(st.integers(0, 4)) == 0 else None))
    cmd_end = 8 + int.from_bytes(frame[4:8], "big")
    if draw(st.integers(0, 5)) == 0:  # the metadata's size damaged
        frame[cmd_end + 6:cmd_end + 10] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big")
    return bytes(frame), cmd_end


@settings(max_examples=1500, deadline=None)
@given(payload_sends())
def test_metadata_bytes_the_walk_takes_as_plain_are_what_searchable_takes(drawn: tuple[bytes, int]) -> None:
    """take_sends asks data_path.searchable only when plain_metadata_bytes cannot tell: it says True only for
    the common layout whose metadata holds neither byte ``compression``'s tag needs, where searchable says True."""
    from proxy.telemetry.bulk_forms import plain_metadata_bytes
    from proxy.telemetry.data_path import searchable

    raw, cmd_end = drawn
    plain = plain_metadata_bytes(raw, cmd_end, len(raw))
    event(f"plain {plain}")
    if plain:
        assert searchable(raw, cmd_end, len(raw))
    start = cmd_end + 10
    common = raw[cmd_end:cmd_end + 2] == b"\x0e\x01" and start + int.from_bytes(raw[cmd_end + 6:start], "big") <= len(
        raw)
    metadata = raw[start:start + int.from_bytes(raw[cmd_end + 6:start], "big")]
    assert plain == (common and 0 not in metadata and 0x40 not in metadata)


def test_the_walk_looks_for_the_trace_context_the_tracker_reads() -> None:
    from proxy.telemetry.bulk_forms import TRACEPARENT as WALKED
    from proxy.telemetry.tracker import TRACEPARENT

    assert TRACEPARENT.encode() == WALKED
