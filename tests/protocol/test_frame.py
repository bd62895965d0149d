"""The frame codec: sizes, magic numbers, checksums, split points and limits."""

from __future__ import annotations

import struct

import pytest

from proxy.errors import (
    BadMagic,
    ChecksumMismatch,
    CommandDecodeError,
    CommandEncodeError,
    FrameTooLarge,
    MalformedFrame,
    ProtocolError,
    UnknownCommand,
)
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import type_name, type_value, wrap
from proxy.protocol.frame import (
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_PADDING,
    FrameDecoder,
    crc32c,
    encode_command,
    encode_payload_command,
    frame_from_bytes,
    reencode,
)


def _send(payload: bytes = b"hello", **metadata_fields: object) -> bytes:
    metadata = api.MessageMetadata(producer_name="p-1", sequence_id=7, publish_time=1_700_000_000_000,
                                   **metadata_fields)
    return encode_payload_command(api.CommandSend(producer_id=3, sequence_id=7, num_messages=1), metadata, payload)


def test_simple_frame_layout_is_total_size_cmd_size_command() -> None:
    raw = encode_command(api.CommandPing())
    total, cmd_size = struct.unpack_from(">II", raw)
    assert total == len(raw) - 4
    assert cmd_size == len(raw) - 8
    assert api.BaseCommand.FromString(raw[8:]).type == api.BaseCommand.PING


def test_payload_frame_checksum_covers_everything_after_the_checksum_field() -> None:
    raw = _send(b"payload-bytes")
    frame = frame_from_bytes(raw)
    section = frame.payload
    assert section is not None
    assert raw[8 + frame.cmd_size:8 + frame.cmd_size + 2] == b"\x0e\x01"
    assert section.checksum == crc32c(raw[8 + frame.cmd_size + 6:])
    section.verify_checksum()
    assert section.payload == b"payload-bytes"
    assert section.metadata.sequence_id == 7


def test_a_flipped_payload_bit_is_a_checksum_mismatch() -> None:
    raw = bytearray(_send(b"payload-bytes"))
    raw[-1] ^= 0x01
    frame = frame_from_bytes(bytes(raw))
    assert frame.payload is not None
    assert not frame.payload.checksum_ok()
    with pytest.raises(ChecksumMismatch):
        frame.payload.verify_checksum()


def test_broker_entry_metadata_precedes_the_checksum_section() -> None:
    bem = api.BrokerEntryMetadata(broker_timestamp=123, index=9)
    metadata = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=2)
    raw = encode_payload_command(api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(ledgerId=1, entryId=2)),
                                 metadata, b"x", broker_entry_metadata=bem)
    frame = frame_from_bytes(raw)
    assert frame.payload is not None
    assert frame.payload.broker_entry_metadata == bem
    frame.payload.verify_checksum()
    assert reencode(frame) == raw


def test_command_type_is_read_without_decoding_the_command() -> None:
    frame = frame_from_bytes(encode_command(api.CommandFlow(consumer_id=1, messagePermits=1000)))
    assert frame.type == api.BaseCommand.FLOW
    assert frame._command is None  # nothing decoded yet
    assert frame.command.flow.messagePermits == 1000


def test_many_frames_in_one_chunk_and_one_frame_in_many_chunks() -> None:
    stream = b"".join([encode_command(api.CommandPing()), _send(b"a" * 1000), encode_command(api.CommandPong())])
    decoder = FrameDecoder()
    assert [f.type_name for f in decoder.receive(stream)] == ["PING", "SEND", "PONG"]
    decoder = FrameDecoder()
    got = []
    for i in range(len(stream)):
        got += decoder.receive(stream[i:i + 1])
    assert [f.raw for f in got] == [f.raw for f in FrameDecoder().receive(stream)]
    assert decoder.buffered == 0


def test_frame_over_the_limit_is_refused_before_its_body_arrives() -> None:
    decoder = FrameDecoder()
    with pytest.raises(FrameTooLarge):
        decoder.receive(struct.pack(">I", DEFAULT_MAX_FRAME_BYTES))
    # the decoder stays broken: a stream that lied once cannot be trusted again
    with pytest.raises(FrameTooLarge):
        decoder.receive(b"")


def test_connected_max_message_size_raises_the_limit() -> None:
    big = _send(b"x" * (6 * 1024 * 1024))
    with pytest.raises(FrameTooLarge):
        FrameDecoder().receive(big)
    decoder = FrameDecoder()
    decoder.set_max_message_size(8 * 1024 * 1024)
    assert decoder.max_frame_bytes == 8 * 1024 * 1024 + FRAME_PADDING
    assert len(decoder.receive(big)) == 1


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (struct.pack(">II", 2, 0), MalformedFrame),  # total size leaves no room for cmd size
        (struct.pack(">II", 10, 20) + b"\0" * 6, MalformedFrame),  # cmd_size > total_size
        (struct.pack(">II", 4, 0), MalformedFrame),  # empty command
        (struct.pack(">II", 6, 2) + b"\x08\x7f", UnknownCommand),
        (struct.pack(">II", 7, 3) + b"\xff\xff\xff", CommandDecodeError),
    ],
)
def test_inconsistent_sizes_and_bad_commands_are_protocol_errors(raw: bytes, error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        FrameDecoder().receive(raw)


def test_bad_magic_and_truncated_payload_sections_are_rejected() -> None:
    good = _send(b"abc")
    cmd_size = struct.unpack_from(">I", good, 4)[0]
    magic_at = 8 + cmd_size
    bad_magic = good[:magic_at] + b"\x0e\x09" + good[magic_at + 2:]
    with pytest.raises(BadMagic):
        FrameDecoder().receive(bad_magic)
    # metadata size larger than what is left of the frame
    meta_size_at = magic_at + 6
    lying = good[:meta_size_at] + struct.pack(">I", 10_000) + good[meta_size_at + 4:]
    with pytest.raises(MalformedFrame):
        FrameDecoder().receive(lying)
    # a SEND without any payload section
    with pytest.raises(MalformedFrame):
        FrameDecoder().receive(encode_command(api.CommandSend(producer_id=1, sequence_id=1)))
    # a PING with trailing bytes
    ping = encode_command(api.CommandPing())
    padded = struct.pack(">I", len(ping) - 4 + 3) + ping[4:] + b"\x0e\x01\x00"
    with pytest.raises(MalformedFrame):
        FrameDecoder().receive(padded)


def test_closing_mid_frame_is_reported() -> None:
    decoder = FrameDecoder()
    decoder.receive(_send()[:-3])
    with pytest.raises(MalformedFrame):
        decoder.close()


def test_missing_required_fields_are_decode_errors() -> None:
    """On the wire the frame is refused as it is read; read leniently (recordings), when decoded."""
    raw = encode_command(api.BaseCommand(type=api.BaseCommand.PRODUCER, producer=api.CommandProducer(
        topic="t", producer_id=1, request_id=2)))
    # strip the required request_id by hand-building the command
    cmd = api.BaseCommand(type=api.BaseCommand.PRODUCER)
    cmd.producer.topic = "t"
    body = cmd.SerializePartialToString()
    data = struct.pack(">II", len(body) + 4, len(body)) + body
    with pytest.raises(CommandDecodeError, match="PRODUCER lacks required fields: producer_id, request_id"):
        frame_from_bytes(data)
    frame = frame_from_bytes(data, strict=False)
    with pytest.raises(CommandDecodeError):
        _ = frame.command
    assert frame_from_bytes(raw).command.producer.request_id == 2


def test_every_command_type_encodes_and_decodes_through_wrap() -> None:
    for field in api.BaseCommand.DESCRIPTOR.fields:
        if field.name == "type":
            continue
        sub = getattr(api, field.message_type.name)()
        cmd = wrap(sub)
        assert cmd.type == field.number
        assert type_name(cmd.type) == api.BaseCommand.Type.Name(field.number)
        assert type_value(type_name(cmd.type)) == field.number
        if not cmd.IsInitialized():
            with pytest.raises(CommandEncodeError):
                encode_command(cmd)
            continue
        raw = encode_command(cmd) if cmd.type not in (api.BaseCommand.SEND, api.BaseCommand.MESSAGE) else None
        if raw is not None:
            frame = FrameDecoder().receive(raw)[0]
            assert frame.type == field.number
            assert frame.raw == raw

