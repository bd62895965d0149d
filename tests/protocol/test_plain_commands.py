"""plainly_valid, the parse-free check of the hot commands' plain forms, never accepts what the parser refuses.

The relay's one-frame lane skips protobuf for a sub-command field :func:`plainly_valid`
accepts; for anything else it asks the parser, as before.  So what must hold is: an accept
implies the parser's, and a frame's verdict (handed out, or the error word for word) is
the same as :func:`check_frame`'s, which never takes the shortcut.  The walk is also held
to :data:`PLAIN_FORMS`, the forms written as a regular expression (what the relay ran
before the walk): it accepts exactly what that matches.  The fields are drawn near the
plain forms, and damaged: truncated, flipped bytes, over-long and unterminated varints,
missing required fields, unknown fields, wrong wire types, fields out of order or twice,
nested lengths off by one, random bytes.
"""

from __future__ import annotations

import re
import struct

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.core.scanner import FrameScanner
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.protocol.validation import SUB_TAGS, CommandBatch, check_frame, check_sub_body, plainly_valid

HOT_TYPES = [api.BaseCommand.SEND, api.BaseCommand.SEND_RECEIPT, api.BaseCommand.MESSAGE, api.BaseCommand.FLOW,
             api.BaseCommand.PING, api.BaseCommand.PONG, api.BaseCommand.ACK]
PAYLOAD = b"\x0e\x01\x00\x00\x00\x00\x00\x00\x00\x02\x08\x01xyz"  # checksum magic, a CRC, metadata size 2, ...


def _plain_forms() -> re.Pattern[bytes]:
    """The plain forms as a regular expression: fields in order, varints of 9 (64-bit) or 4 (32-bit) bytes at most,
    bools 0 or 1, a MessageIdData of exactly ledgerId and entryId; a sub-command field's length is not checked."""
    v64, v32, bool_ = rb"[\x80-\xff]{0,8}[\x00-\x7f]", rb"[\x80-\xff]{0,3}[\x00-\x7f]", rb"[\x00\x01]"

    def of_size(size: int) -> bytes:
        return rb"[\x80-\xff]{%d}[\x00-\x7f]" % (size - 1)

    message_id = b"(?:" + b"|".join(re.escape(bytes([2 + ledger + entry, 0x08])) + of_size(ledger) + b"\x10"
                                    + of_size(entry) for ledger in range(1, 10) for entry in range(1, 10)) + b")"

    def plain(type_: int, *fields: tuple[int, bytes, bool]) -> bytes:
        out = re.escape(SUB_TAGS[type_]) + (rb"[\x00-\x7f]" if fields else b"\x00")
        for tag, value, required in fields:
            out += b"(?:" + re.escape(bytes([tag])) + value + (b")" if required else b")?")
        return out

    t = api.BaseCommand
    return re.compile(b"|".join([
        plain(t.SEND, (0x08, v64, True), (0x10, v64, True), (0x18, v32, False), (0x20, v64, False),
              (0x28, v64, False), (0x30, v64, False), (0x38, bool_, False), (0x40, bool_, False)),
        plain(t.SEND_RECEIPT, (0x08, v64, True), (0x10, v64, True), (0x1A, message_id, False), (0x20, v64, False)),
        plain(t.MESSAGE, (0x08, v64, True), (0x12, message_id, True), (0x18, v32, False), (0x28, v64, False)),
        plain(t.FLOW, (0x08, v64, True), (0x10, v32, True)),
        plain(t.PING),
        plain(t.PONG),
    ]))


PLAIN_FORMS = _plain_forms()


def _varint(value: int, padding: int = 0, unterminated: bool = False) -> bytes:
    """``value`` as a varint, ``padding`` needless groups longer; cut off before its last byte if ``unterminated``."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out += bytes([value | 0x80]) + b"\x80" * (padding - 1) + b"\x00" if padding else bytes([value])
    return bytes(out[:-1]) if unterminated else bytes(out)


values = st.one_of(st.integers(0, 3), st.integers(0, 2**35), st.integers(0, 2**64 - 1), st.integers(2**63, 2**70))
#: mostly well formed: minimal, sometimes padded (up to 11 bytes), now and then cut off
varints = st.builds(_varint, values, st.sampled_from([0] * 12 + [1, 2, 5]), st.sampled_from([False] * 30 + [True]))

#: per type, the fields of its message in field order: (number, kind, required); kind "id" is MessageIdData
SCHEMAS: dict[int, list[tuple[int, str, bool]]] = {
    api.BaseCommand.SEND: [(1, "u64", True), (2, "u64", True), (3, "u32", False), (4, "u64", False),
                           (5, "u64", False), (6, "u64", False), (7, "bool", False), (8, "bool", False),
                           (9, "id", False)],
    api.BaseCommand.SEND_RECEIPT: [(1, "u64", True), (2, "u64", True), (3, "id", False), (4, "u64", False)],
    api.BaseCommand.MESSAGE: [(1, "u64", True), (2, "id", True), (3, "u32", False), (4, "u64", False),
                              (5, "u64", False)],
    api.BaseCommand.FLOW: [(1, "u64", True), (2, "u32", True)],
    api.BaseCommand.PING: [],
    api.BaseCommand.PONG: [],
    api.BaseCommand.ACK: [(1, "u64", True), (2, "u32", True), (3, "id", True)],
}
MESSAGE_ID = [(1, "u64", True), (2, "u64", True), (3, "u32", False), (4, "u32", False)]


@st.composite
def fields(draw: st.DrawFn, schema: list[tuple[int, str, bool]], depth: int = 0) -> bytes:
    """A message of ``schema``: its required fields and some optional ones in order, every part maybe damaged."""
    # (a message id's optional fields, which no plain form has, now and then)
    chosen = [field for field in schema if field[2] or not draw(st.integers(0, 3 if depth else 2))]
    damage = draw(st.sampled_from(["none"] * 8 + ["drop", "drop", "twice", "swap", "unknown"]))
    required = [index for index, field in enumerate(chosen) if field[2]]
    if damage == "drop" and required:
        del chosen[draw(st.sampled_from(required))]
    elif damage == "twice" and chosen:
        chosen.insert(0, chosen[-1])
    elif damage == "swap" and len(chosen) > 1:
        chosen[0], chosen[-1] = chosen[-1], chosen[0]
    elif damage == "unknown":
        chosen.insert(draw(st.integers(0, len(chosen))), (draw(st.integers(1, 20)), "u64", False))
    out = b""
    for number, kind, _ in chosen:
        wire_type = 2 if kind == "id" else 0
        if not draw(st.integers(0, 15)):
            wire_type = draw(st.sampled_from([0, 1, 2, 3, 5, 7]))
        out += _varint(number << 3 | wire_type)
        if wire_type == 2:
            nested = draw(fields(MESSAGE_ID, depth + 1)) if depth == 0 else draw(st.binary(max_size=3))
            out += _varint(max(0, len(nested) + draw(st.sampled_from([0] * 3 + [-1, 1])))) + nested
        elif kind == "bool" and wire_type == 0 and draw(st.integers(0, 3)):
            out += draw(st.sampled_from([b"\x00", b"\x01", b"\x02"]))
        elif kind == "u32" and wire_type == 0 and draw(st.integers(0, 3)):
            out += _varint(draw(st.integers(0, 2**33)))
        elif wire_type in (0, 2, 3, 7):
            out += draw(varints)
        else:
            out += draw(st.binary(max_size=8))
    return out


@st.composite
def sub_command_fields(draw: st.DrawFn) -> tuple[int, bytes]:
    """A hot type and its sub-command field (tag, one-byte length, body), the body maybe damaged."""
    type_ = draw(st.sampled_from(HOT_TYPES))
    body = draw(fields(SCHEMAS[type_]))
    damage = draw(st.sampled_from(["none"] * 6 + ["truncate", "flip", "append", "random"]))
    if damage == "random":
        body = draw(st.binary(max_size=24))
    elif damage == "truncate" and body:
        body = body[:draw(st.integers(0, len(body) - 1))]
    elif damage == "flip" and body:
        at = draw(st.integers(0, len(body) - 1))
        body = body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1:]
    elif damage == "append":
        body += draw(st.binary(min_size=1, max_size=4))
    body = body[:127]
    return type_, SUB_TAGS[type_] + bytes([len(body)]) + body


def _frame(type_: int, sub: bytes) -> bytes:
    command = b"\x08" + bytes([type_]) + sub
    payload = PAYLOAD if type_ in (api.BaseCommand.SEND, api.BaseCommand.MESSAGE) else b""
    return struct.pack(">II", 4 + len(command) + len(payload), len(command)) + command + payload


def _verdict(check: object) -> tuple[str, str]:
    try:
        check()  # type: ignore[operator]
    except ProtocolError as exc:
        return type(exc).__name__, str(exc)
    return "passed", ""


@settings(max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
@given(sub_command_fields())
def test_a_plain_form_match_implies_the_parser_accepts_and_every_frame_gets_the_verdict_it_got_before(
        drawn: tuple[int, bytes]) -> None:
    type_, sub = drawn
    body = sub[len(SUB_TAGS[type_]) + 1:]
    parser = _verdict(lambda: check_sub_body(body, type_))
    plain = plainly_valid(sub, 0, len(sub))
    assert plain == (PLAIN_FORMS.fullmatch(sub) is not None), sub.hex()
    framed = b"\x08" + bytes([type_]) + sub + b"\x00"  # (where the lane finds it: inside a frame, at 10)
    assert plainly_valid(b"\x00" * 8 + framed, 10, 8 + len(framed) - 1) == plain
    if plain:
        event("plain")
        assert parser == ("passed", ""), sub.hex()
        assert _verdict(lambda: CommandBatch().verify_one(sub)) == ("passed", "")
    else:
        event(f"not plain, parser: {parser[0]}")
    frame = _frame(type_, sub)
    # the scanner's one-frame lane (with the shortcut) against check_frame (the parser, always)
    verdict = _verdict(lambda: check_frame(frame, 0, len(frame), 1 << 20))
    assert _verdict(lambda: FrameScanner().feed(frame)) == verdict
    assert _verdict(lambda: FrameScanner().feed(memoryview(frame))) == verdict  # (no shortcut for a view)


def test_the_plain_forms_writers_use_are_matched() -> None:
    """SEND, SEND_RECEIPT (with and without a message id), MESSAGE, FLOW, PING and PONG as clients and brokers
    write them take the shortcut (its point), from the smallest values to the largest each form allows."""
    message_ids = [api.MessageIdData(ledgerId=ledger, entryId=entry)
                   for ledger in (0, 1, 127, 128, 123456, 2**63 - 1) for entry in (0, 300, 2**40, 2**63 - 1)]
    commands = [api.CommandPing(), api.CommandPong(), api.CommandFlow(consumer_id=2**63 - 1, messagePermits=1000)]
    for ids in ((0, 0), (1, 1), (2**63 - 1, 2**63 - 1)):
        commands += [api.CommandSend(producer_id=ids[0], sequence_id=ids[1]),
                     api.CommandSend(producer_id=ids[0], sequence_id=ids[1], num_messages=10, txnid_least_bits=7,
                                     txnid_most_bits=2**50, highest_sequence_id=ids[1], is_chunk=True, marker=False),
                     api.CommandSendReceipt(producer_id=ids[0], sequence_id=ids[1])]
        commands += [api.CommandSendReceipt(producer_id=ids[0], sequence_id=ids[1], message_id=message_id,
                                            highest_sequence_id=ids[1]) for message_id in message_ids]
        commands += [api.CommandMessage(consumer_id=ids[0], message_id=message_id, redelivery_count=3)
                     for message_id in message_ids]
    for command in commands:
        if isinstance(command, (api.CommandSend, api.CommandMessage)):
            frame = encode_payload_command(command, api.MessageMetadata(producer_name="p", sequence_id=1,
                                                                        publish_time=1), b"x")
        else:
            frame = encode_command(command)
        cmd_end = 8 + struct.unpack_from(">I", frame, 4)[0]
        assert plainly_valid(frame, 10, cmd_end), (type(command).__name__, frame[10:cmd_end].hex())
        assert FrameScanner().feed(frame) == [frame]


def test_damaged_plain_forms_are_not_matched() -> None:
    """Each damage the parser refuses (or may) leaves the shortcut: the parser then decides, as before."""
    send = bytes.fromhex("3204" "0801" "1001")
    assert plainly_valid(send, 0, len(send))
    for damaged in ["3202" "0801",                              # no sequence_id (required)
                    "3204" "1001" "0801",                       # fields out of order
                    "3206" "0801" "1001" "1001",                # sequence_id twice
                    "3204" "0a01" "1001",                       # producer_id with wire type 2
                    "320e" "08ffffffffffffffffff01" "1001",     # a ten-byte varint
                    "3204" "0881" "1001",                       # a varint cut off by the next tag
                    "3206" "0801" "1001" "3802",                # is_chunk 2
                    "3206" "0801" "1001" "5001"]:               # an unknown field
        fields = bytes.fromhex(damaged)
        assert not plainly_valid(fields, 0, len(fields)), damaged
    receipt = bytes.fromhex("3a0c" "0801" "1001" "1a04" "0801" "1001" "2001")
    assert plainly_valid(receipt, 0, len(receipt))
    for length in (0x03, 0x05):  # the message id's length one short, one long
        fields = receipt[:7] + bytes([length]) + receipt[8:]
        assert not plainly_valid(fields, 0, len(fields))
    for fields in (send[:1] + b"\x05" + send[2:], send[:1] + b"\x03" + send[2:-1],  # a length that is not the end's
                   bytes.fromhex("9201" "01" "00"), bytes.fromhex("9201"), b""):  # a PING with a body, cut off, none
        assert not plainly_valid(fields, 0, len(fields)), fields.hex()
