"""Frames of the Pulsar binary protocol: an incremental decoder and the encoders.

Wire layout (Pulsar binary protocol, "Framing"):

    simple:  [TOTAL_SIZE u32][CMD_SIZE u32][BaseCommand]
    payload: [TOTAL_SIZE u32][CMD_SIZE u32][BaseCommand]
             ([0x0e02][BEM_SIZE u32][BrokerEntryMetadata])?
             [0x0e01][CRC32C u32][METADATA_SIZE u32][MessageMetadata][payload]

TOTAL_SIZE counts everything after itself.  The CRC32C covers everything after the
checksum field (metadata size, metadata and payload).  A :class:`Frame` keeps its
original bytes, so a frame nobody changes is forwarded byte-for-byte; its command
type is read from the first bytes of the BaseCommand without a full decode, and
the BaseCommand and the payload section are decoded only when asked for.

The decoder follows h2's ``FrameBuffer``: check the header is complete, then the
body, validate the lengths, and leave partial data for the next ``feed``.  Once
it has raised, the stream is unusable and every later call raises the same error.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final, TypeVar

import crc32c as _crc32c
from google.protobuf.message import DecodeError, EncodeError, Message

from proxy.errors import (
    BadMagic,
    ChecksumMismatch,
    CommandDecodeError,
    CommandEncodeError,
    FrameTooLarge,
    MalformedFrame,
    MetadataDecodeError,
    ProtocolError,
    UnknownCommand,
)
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import PAYLOAD_TYPES, SUB_FIELDS, TYPE_NAMES, sub_command, type_name, wrap

MAGIC_CHECKSUM: Final = 0x0E01
MAGIC_BROKER_ENTRY_METADATA: Final = 0x0E02
#: Pulsar's default maxMessageSize (5 MiB).
DEFAULT_MAX_MESSAGE_SIZE: Final = 5 * 1024 * 1024
#: Room for the command and metadata around a maximal payload (Commands.MESSAGE_SIZE_FRAME_PADDING).
FRAME_PADDING: Final = 10 * 1024
#: Largest whole frame (with its 4-byte size prefix) accepted before CONNECTED.
DEFAULT_MAX_FRAME_BYTES: Final = DEFAULT_MAX_MESSAGE_SIZE + FRAME_PADDING

M = TypeVar("M", bound=Message)

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_HEADER = struct.Struct(">II")
_HEADER_SIZE: Final = 8
_PAYLOAD_TYPES: Final = frozenset(int(t) for t in PAYLOAD_TYPES)


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC32C (Castagnoli) as Pulsar computes it over a payload section."""
    return int(_crc32c.crc32c(data))


class PayloadSection:
    """The part of a SEND or MESSAGE frame after the command.

    Offsets index into the frame's raw bytes, so nothing is copied until asked for.
    """

    __slots__ = ("_raw", "broker_entry_metadata_raw", "checksum", "checksum_start",
                 "metadata_start", "metadata_end", "_metadata")

    def __init__(self, raw: bytes, broker_entry_metadata_raw: bytes | None, checksum: int,
                 checksum_start: int, metadata_start: int, metadata_end: int) -> None:
        self._raw = raw
        self.broker_entry_metadata_raw = broker_entry_metadata_raw
        self.checksum = checksum
        self.checksum_start = checksum_start
        self.metadata_start = metadata_start
        self.metadata_end = metadata_end
        self._metadata: api.MessageMetadata | None = None

    @property
    def metadata_raw(self) -> bytes:
        return self._raw[self.metadata_start:self.metadata_end]

    @property
    def metadata(self) -> api.MessageMetadata:
        """The decoded MessageMetadata (decoded once, on first use)."""
        if self._metadata is None:
            self._metadata = decode_message(api.MessageMetadata, self.metadata_raw, "MessageMetadata")
        return self._metadata

    @property
    def payload(self) -> bytes:
        """The message payload as sent: possibly compressed, possibly a batch or a chunk."""
        return self._raw[self.metadata_end:]

    @property
    def broker_entry_metadata(self) -> api.BrokerEntryMetadata | None:
        if self.broker_entry_metadata_raw is None:
            return None
        return decode_message(api.BrokerEntryMetadata, self.broker_entry_metadata_raw,
                              "BrokerEntryMetadata")

    def computed_checksum(self) -> int:
        return crc32c(memoryview(self._raw)[self.checksum_start:])

    def checksum_ok(self) -> bool:
        return self.computed_checksum() == self.checksum

    def verify_checksum(self) -> None:
        """Raise :class:`ChecksumMismatch` unless the CRC32C in the frame is right."""
        actual = self.computed_checksum()
        if actual != self.checksum:
            raise ChecksumMismatch(self.checksum, actual)


class Frame:
    """One whole frame: its exact bytes, its command type, and lazy decoders."""

    __slots__ = ("raw", "type", "cmd_size", "_command", "_payload")

    def __init__(self, raw: bytes, type_: int, cmd_size: int) -> None:
        self.raw = raw
        self.type = type_
        self.cmd_size = cmd_size
        self._command: api.BaseCommand | None = None
        self._payload: PayloadSection | None = None

    def __repr__(self) -> str:
        return f"<Frame {self.type_name} {len(self.raw)} bytes>"

    @property
    def size(self) -> int:
        """The whole frame in bytes, including the 4-byte size prefix."""
        return len(self.raw)

    @property
    def type_name(self) -> str:
        return type_name(self.type)

    @property
    def command(self) -> api.BaseCommand:
        """The decoded BaseCommand (decoded once, on first use)."""
        if self._command is None:
            self._command = decode_command(self.raw[_HEADER_SIZE:_HEADER_SIZE + self.cmd_size])
        return self._command

    @property
    def sub(self) -> Message:
        """The sub-command for this frame's type, e.g. the CommandSend of a SEND."""
        return sub_command(self.command)

    @property
    def has_payload(self) -> bool:
        return len(self.raw) > _HEADER_SIZE + self.cmd_size

    @property
    def payload(self) -> PayloadSection | None:
        """The payload section of a SEND or MESSAGE frame; None for other frames."""
        if self._payload is None and self.has_payload:
            self._payload = parse_payload_section(self.raw, _HEADER_SIZE + self.cmd_size)
        return self._payload


def decode_message(cls: type[M], data: bytes, what: str) -> M:
    """Decode protobuf bytes into ``cls``; every failure becomes a MetadataDecodeError."""
    msg = cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MetadataDecodeError(f"undecodable {what}: {exc}") from None
    if not msg.IsInitialized():
        missing = ", ".join(msg.FindInitializationErrors())  # type: ignore[attr-defined]
        raise MetadataDecodeError(f"{what} lacks required fields: {missing}")
    return msg


def decode_command(data: bytes) -> api.BaseCommand:
    """Decode a BaseCommand; every failure becomes a ProtocolError."""
    cmd = api.BaseCommand()
    try:
        cmd.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise CommandDecodeError(f"undecodable command: {exc}") from None
    if not cmd.HasField("type"):
        raise CommandDecodeError("command has no (known) type")
    if not cmd.IsInitialized():
        missing = ", ".join(cmd.FindInitializationErrors())
        raise CommandDecodeError(f"{type_name(cmd.type)} lacks required fields: {missing}")
    return cmd


def peek_type(raw: bytes | bytearray, start: int, end: int) -> int:
    """The BaseCommand type of the command in ``raw[start:end]``, reading as little as possible.

    Every Pulsar implementation writes field 1 (``type``) first, as tag 0x08 and a
    one-byte varint; anything else falls back to a full decode.
    """
    if end - start >= 2 and raw[start] == 0x08 and raw[start + 1] < 0x80:
        value = raw[start + 1]
    else:
        value = decode_command(bytes(raw[start:end])).type
    if value not in TYPE_NAMES:
        raise UnknownCommand(value)
    return value


def parse_payload_section(raw: bytes, pos: int) -> PayloadSection:
    """Parse the sections after the command of a payload frame, validating every size."""
    end = len(raw)
    bem_raw: bytes | None = None
    if end - pos < 2:
        raise MalformedFrame("truncated payload section")
    magic = _U16.unpack_from(raw, pos)[0]
    if magic == MAGIC_BROKER_ENTRY_METADATA:
        if end - pos < 6:
            raise MalformedFrame("truncated broker entry metadata size")
        bem_size = _U32.unpack_from(raw, pos + 2)[0]
        bem_start = pos + 6
        if bem_size > end - bem_start:
            raise MalformedFrame("broker entry metadata runs past the end of the frame")
        bem_raw = raw[bem_start:bem_start + bem_size]
        pos = bem_start + bem_size
        if end - pos < 2:
            raise MalformedFrame("truncated payload section after broker entry metadata")
        magic = _U16.unpack_from(raw, pos)[0]
    if magic != MAGIC_CHECKSUM:
        raise BadMagic(f"bad magic {magic:#06x} in payload section (expected 0x0e01)")
    if end - pos < 10:
        raise MalformedFrame("truncated checksum or metadata size")
    checksum = _U32.unpack_from(raw, pos + 2)[0]
    checksum_start = pos + 6
    metadata_size = _U32.unpack_from(raw, checksum_start)[0]
    metadata_start = checksum_start + 4
    if metadata_size > end - metadata_start:
        raise MalformedFrame("message metadata runs past the end of the frame")
    return PayloadSection(raw, bem_raw, checksum, checksum_start, metadata_start,
                          metadata_start + metadata_size)


class FrameDecoder:
    """Incremental decoder: ``feed`` it bytes split anywhere, take whole frames out.

    ``max_frame_bytes`` bounds a whole frame including its size prefix; call
    :meth:`set_max_message_size` when CONNECTED announces the broker's limit.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._pos = 0
        self._error: ProtocolError | None = None

    def set_max_message_size(self, max_message_size: int) -> None:
        """Adopt a broker's ``max_message_size`` (CONNECTED) as the frame limit."""
        self.max_frame_bytes = max_message_size + FRAME_PADDING

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is not None:
            raise self._error
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> Frame | None:
        """The next whole frame, or None when more bytes are needed."""
        if self._error is not None:
            raise self._error
        try:
            return self._next_frame()
        except ProtocolError as exc:
            self._error = exc
            raise

    def _next_frame(self) -> Frame | None:
        buf, pos = self._buf, self._pos
        available = len(buf) - pos
        if available < 4:
            return None
        total_size = _U32.unpack_from(buf, pos)[0]
        frame_size = total_size + 4
        if frame_size > self.max_frame_bytes:
            raise FrameTooLarge(frame_size, self.max_frame_bytes)
        if total_size < 4:
            raise MalformedFrame(f"total size {total_size} leaves no room for the command size")
        if available < 8:
            return None
        cmd_size = _U32.unpack_from(buf, pos + 4)[0]
        if cmd_size > total_size - 4:
            raise MalformedFrame(f"command size {cmd_size} exceeds total size {total_size}")
        if cmd_size == 0:
            raise MalformedFrame("empty command")
        if available < frame_size:
            return None
        with memoryview(buf) as view:  # one copy, not a bytearray slice and then bytes()
            raw = bytes(view[pos:pos + frame_size])
        self._pos = pos + frame_size
        frame_type = peek_type(raw, _HEADER_SIZE, _HEADER_SIZE + cmd_size)
        if frame_size > _HEADER_SIZE + cmd_size:
            if frame_type not in _PAYLOAD_TYPES:
                raise MalformedFrame(f"{type_name(frame_type)} carries {frame_size - 8 - cmd_size} "
                                     "unexpected bytes after its command")
            frame = Frame(raw, frame_type, cmd_size)
            frame._payload = parse_payload_section(raw, _HEADER_SIZE + cmd_size)
            return frame
        if frame_type in _PAYLOAD_TYPES:
            raise MalformedFrame(f"{type_name(frame_type)} has no payload section")
        return Frame(raw, frame_type, cmd_size)

    def frames(self) -> Iterator[Frame]:
        """Every whole frame buffered so far."""
        while (frame := self.next_frame()) is not None:
            yield frame

    def receive(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Feed ``data`` and return every frame it completes."""
        self.feed(data)
        return list(self.frames())

    def close(self) -> None:
        """The peer closed the stream: leftover bytes mean it stopped mid-frame."""
        if self._error is None and self.buffered:
            self._error = MalformedFrame(f"connection closed mid-frame ({self.buffered} bytes pending)")
            raise self._error


def _command_bytes(cmd: api.BaseCommand | Message) -> bytes:
    if not isinstance(cmd, api.BaseCommand):
        cmd = wrap(cmd)
    try:
        data: bytes = cmd.SerializeToString()
    except EncodeError as exc:
        raise CommandEncodeError(str(exc)) from None
    return data


def encode_command(cmd: api.BaseCommand | Message) -> bytes:
    """A simple frame for a BaseCommand, or for a sub-command (wrapped on the fly)."""
    body = _command_bytes(cmd)
    return _HEADER.pack(len(body) + 4, len(body)) + body


def encode_payload_command(cmd: api.BaseCommand | Message, metadata: api.MessageMetadata | bytes,
                           payload: bytes, *,
                           broker_entry_metadata: api.BrokerEntryMetadata | bytes | None = None) -> bytes:
    """A payload frame (SEND or MESSAGE) with a freshly computed CRC32C."""
    body = _command_bytes(cmd)
    meta = metadata if isinstance(metadata, bytes) else metadata.SerializeToString()
    checked = _U32.pack(len(meta)) + meta + payload
    parts = [b"", body]
    if broker_entry_metadata is not None:
        bem = (broker_entry_metadata if isinstance(broker_entry_metadata, bytes)
               else broker_entry_metadata.SerializeToString())
        parts.append(_U16.pack(MAGIC_BROKER_ENTRY_METADATA) + _U32.pack(len(bem)) + bem)
    parts.append(_U16.pack(MAGIC_CHECKSUM) + _U32.pack(crc32c(checked)))
    parts.append(checked)
    total = sum(len(p) for p in parts) + 4
    parts[0] = _HEADER.pack(total, len(body))
    return b"".join(parts)


def reencode(frame: Frame) -> bytes:
    """Encode a frame again from its decoded parts (the command may have been changed)."""
    section = frame.payload
    if section is None:
        return encode_command(frame.command)
    return encode_payload_command(frame.command, section.metadata_raw, section.payload,
                                  broker_entry_metadata=section.broker_entry_metadata_raw)


def frame_from_bytes(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Decode exactly one whole frame from ``data``."""
    decoder = FrameDecoder(max_frame_bytes)
    decoder.feed(data)
    frame = decoder.next_frame()
    if frame is None or decoder.buffered:
        raise MalformedFrame("data is not exactly one frame")
    return frame


__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "DEFAULT_MAX_MESSAGE_SIZE", "FRAME_PADDING", "MAGIC_BROKER_ENTRY_METADATA",
    "MAGIC_CHECKSUM", "SUB_FIELDS", "Frame", "FrameDecoder", "PayloadSection", "crc32c", "decode_command",
    "encode_command", "encode_payload_command", "frame_from_bytes", "parse_payload_section", "peek_type",
    "reencode",
]
