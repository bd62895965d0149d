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
from typing import Any, Final, TypeVar

import crc32c as _crc32c
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, EncodeError, Message

from proxy.errors import (
    ChecksumMismatch,
    CommandDecodeError,
    CommandEncodeError,
    MalformedFrame,
    MetadataDecodeError,
    ProtocolError,
)
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import SUB_FIELDS, sub_command, type_name, wrap
from proxy.protocol.validation import (
    MAGIC_BROKER_ENTRY_METADATA,
    MAGIC_CHECKSUM,
    CommandCheck,
    FrameHead,
    PayloadLayout,
    check_command,
    check_frame,
    check_payload,
    closed_mid_frame,
    frame_size_of,
    has_bad_text,
    peek_command,
)

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


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC32C (Castagnoli) as Pulsar computes it over a payload section."""
    return int(_crc32c.crc32c(data))


class PayloadSection:
    """The part of a SEND or MESSAGE frame after the command.

    Offsets index into the frame's raw bytes, so nothing is copied until asked for.
    """

    __slots__ = ("_raw", "broker_entry_metadata_raw", "checksum", "checksum_start",
                 "metadata_start", "metadata_end", "_metadata", "escape_bad_utf8")

    def __init__(self, raw: bytes, broker_entry_metadata_raw: bytes | None, checksum: int,
                 checksum_start: int, metadata_start: int, metadata_end: int) -> None:
        self._raw = raw
        self.broker_entry_metadata_raw = broker_entry_metadata_raw
        self.checksum = checksum
        self.checksum_start = checksum_start
        self.metadata_start = metadata_start
        self.metadata_end = metadata_end
        self._metadata: api.MessageMetadata | None = None
        #: set for frames read leniently (recordings): text that is not UTF-8 comes back escaped
        self.escape_bad_utf8 = False

    @property
    def metadata_raw(self) -> bytes:
        return self._raw[self.metadata_start:self.metadata_end]

    @property
    def metadata(self) -> api.MessageMetadata:
        """The decoded MessageMetadata (decoded once, on first use)."""
        if self._metadata is None:
            self._metadata = decode_message(api.MessageMetadata, self.metadata_raw, "MessageMetadata",
                                            escape_bad_utf8=self.escape_bad_utf8)
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
    """One whole frame: its exact bytes, its command type, and lazy decoders.

    ``checked`` says the command passed :func:`~proxy.protocol.validation.check_command`
    (every frame read from the wire); a frame read leniently from an old recording may
    hold strings that are not UTF-8, which :attr:`command` then shows escaped.
    ``verified``: whoever made the Frame ran that check on these very bytes (the relay's
    scanner, a strict decoder), so decoding need not look for required fields again.
    """

    __slots__ = ("raw", "type", "cmd_size", "checked", "verified", "draw", "_command", "_payload")

    def __init__(self, raw: bytes, type_: int, cmd_size: int, checked: bool = True, *,
                 verified: bool = False) -> None:
        self.raw = raw
        self.type = type_
        self.cmd_size = cmd_size
        self.checked = checked
        self.verified = verified
        #: set by a scanner whose sampler counted this frame: the sampler's note (see
        #: ``proxy.core.scanner.Sampler``); None for every other frame
        self.draw: object = None
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
            self._command = decode_command(self.raw[_HEADER_SIZE:_HEADER_SIZE + self.cmd_size],
                                           escape_bad_utf8=not self.checked, checked=self.verified)
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
            self._payload.escape_bad_utf8 = not self.checked
        return self._payload


def decode_message(cls: type[M], data: bytes, what: str, *, escape_bad_utf8: bool = False) -> M:
    """Decode protobuf bytes into ``cls``; every failure becomes a MetadataDecodeError.

    ``escape_bad_utf8`` (frames read from recordings): strings that are not UTF-8 come
    back with the bad bytes escaped (``\\xff``) rather than as bytes.  It costs a
    second parse, so the wire's hot paths (which check commands, not metadata) skip it.
    """
    msg = cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MetadataDecodeError(f"undecodable {what}: {exc}") from None
    if not msg.IsInitialized():
        missing = ", ".join(msg.FindInitializationErrors())  # type: ignore[attr-defined]
        raise MetadataDecodeError(f"{what} lacks required fields: {missing}")
    descriptor = msg.DESCRIPTOR
    if escape_bad_utf8 and _holds_strings(descriptor) and (
            descriptor.file is not api.DESCRIPTOR or has_bad_text(descriptor.name, data)):  # (markers: walked)
        _escape_bad_utf8(msg)
    return msg


def decode_command(data: bytes, *, escape_bad_utf8: bool = True, checked: bool = False) -> api.BaseCommand:
    """Decode a BaseCommand; every failure becomes a ProtocolError.

    ``escape_bad_utf8`` (for commands that did not pass the wire's checks, e.g. from
    an old recording): strings that are not UTF-8 are kept with their bad bytes escaped.
    ``checked``: the bytes passed :func:`~proxy.protocol.validation.check_command` (or the
    scanner's batch check) already, required fields included, so that costly walk
    (``IsInitialized``, most of a small command's decoding time) is not repeated.
    """
    cmd = api.BaseCommand()
    try:
        cmd.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise CommandDecodeError(f"undecodable command: {exc}") from None
    if not cmd.HasField("type"):
        raise CommandDecodeError("command has no (known) type")
    if not checked and not cmd.IsInitialized():
        missing = ", ".join(cmd.FindInitializationErrors())
        raise CommandDecodeError(f"{type_name(cmd.type)} lacks required fields: {missing}")
    if escape_bad_utf8 and cmd.type in _TYPES_WITH_STRINGS and has_bad_text("BaseCommand", data):
        _escape_bad_utf8(cmd)
    return cmd


_STRINGS: dict[str, bool] = {}


def _holds_strings(descriptor: Descriptor | Any) -> bool:
    """Can a message of this type hold a string, at any depth?"""
    known = _STRINGS.get(descriptor.full_name)
    if known is None:
        _STRINGS[descriptor.full_name] = False  # recursion guard
        known = any(field.type == FieldDescriptor.TYPE_STRING
                    or (field.message_type is not None and _holds_strings(field.message_type))
                    for field in descriptor.fields)
        _STRINGS[descriptor.full_name] = known
    return known


_TYPES_WITH_STRINGS: Final = frozenset(
    number for number, name in SUB_FIELDS.items()
    if _holds_strings(api.BaseCommand.DESCRIPTOR.fields_by_name[name].message_type))


def escape_text(value: bytes) -> str:
    """Bytes that should have been UTF-8, as text with the bad bytes escaped (``x\\xff``)."""
    return value.decode("utf-8", "backslashreplace")


def escape_bad_utf8(msg: Message) -> None:
    """Replace, in place and at any depth, string values that are not UTF-8 by their escaped text."""
    _escape_bad_utf8(msg)


def _escape_bad_utf8(msg: Message) -> None:
    for field, value in msg.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING:
            if field.is_repeated:
                for index, item in enumerate(value):
                    if isinstance(item, bytes):
                        value[index] = escape_text(item)
            elif isinstance(value, bytes):
                setattr(msg, field.name, escape_text(value))
        elif field.message_type is not None and _holds_strings(field.message_type):
            for sub in (value if field.is_repeated else (value,)):
                _escape_bad_utf8(sub)


def peek_type(raw: bytes | bytearray, start: int, end: int) -> int:
    """The BaseCommand type of the command in ``raw[start:end]``, as lenient readers see it.

    Reads the first type field (tag 0x08, one-byte varint) and decodes the command only
    when it does not open so; the wire's checks are :func:`check_command`.
    """
    return peek_command(raw, start, end)


def parse_payload_section(raw: bytes, pos: int) -> PayloadSection:
    """Parse the sections after the command of a whole payload frame, validating every size."""
    layout = check_payload(raw, pos, len(raw), len(raw))
    assert not isinstance(layout, int)  # the whole frame is here: nothing left to wait for
    return section_at(raw, layout)


def section_at(raw: bytes, layout: PayloadLayout) -> PayloadSection:
    """The payload section of the whole frame ``raw`` whose checks gave ``layout`` (offsets in ``raw``)."""
    bem_raw = raw[layout.bem_start:layout.bem_end] if layout.bem_start >= 0 else None
    checksum = _U32.unpack_from(raw, layout.checksum_at)[0]
    return PayloadSection(raw, bem_raw, checksum, layout.checksum_at + 4, layout.metadata_start,
                          layout.metadata_end)


class FrameDecoder:
    """Incremental decoder: ``feed`` it bytes split anywhere, take whole frames out.

    ``max_frame_bytes`` bounds a whole frame including its size prefix; call
    :meth:`set_max_message_size` when CONNECTED announces the broker's limit.  Each
    frame is checked by :func:`~proxy.protocol.validation.check_frame` as its bytes
    arrive; ``strict=False`` (recordings made before commands were checked) checks
    the framing and the type only.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, *, strict: bool = True) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.strict = strict
        self._command_check: CommandCheck = check_command if strict else peek_command
        self._buf = bytearray()
        self._pos = 0
        #: the current frame, once its checks have passed
        self._head: FrameHead | None = None
        #: bytes of the current frame needed before the next check can run
        self._need = 4
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
        head = self._head
        if head is None:
            if available < self._need:
                return None
            checked = check_frame(buf, pos, len(buf), self.max_frame_bytes, self._command_check)
            if isinstance(checked, int):
                self._need = checked - pos
                return None
            head = self._head = checked
        frame_size = head.frame_size
        if available < frame_size:
            return None
        with memoryview(buf) as view:  # one copy, not a bytearray slice and then bytes()
            raw = bytes(view[pos:pos + frame_size])
        self._pos = pos + frame_size
        self._head = None
        self._need = 4
        return Frame(raw, head.type, head.cmd_size, self.strict, verified=self.strict)

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
            self._error = closed_mid_frame(self.buffered, frame_size_of(self._buf, self._pos, len(self._buf)))
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


def encode_payload_section(metadata: api.MessageMetadata | bytes, payload: bytes) -> bytes:
    """A payload section as a broker stores it: ``[0x0e01][CRC32C][size][MessageMetadata][payload]``."""
    meta = metadata if isinstance(metadata, bytes) else metadata.SerializeToString()
    checked = _U32.pack(len(meta)) + meta + payload
    return _U16.pack(MAGIC_CHECKSUM) + _U32.pack(crc32c(checked)) + checked


def encode_payload_command(cmd: api.BaseCommand | Message, metadata: api.MessageMetadata | bytes,
                           payload: bytes, *,
                           broker_entry_metadata: api.BrokerEntryMetadata | bytes | None = None) -> bytes:
    """A payload frame (SEND or MESSAGE) with a freshly computed CRC32C."""
    body = _command_bytes(cmd)
    parts = [b"", body]
    if broker_entry_metadata is not None:
        bem = (broker_entry_metadata if isinstance(broker_entry_metadata, bytes)
               else broker_entry_metadata.SerializeToString())
        parts.append(_U16.pack(MAGIC_BROKER_ENTRY_METADATA) + _U32.pack(len(bem)) + bem)
    parts.append(encode_payload_section(metadata, payload))
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


def frame_from_bytes(data: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, *, strict: bool = True) -> Frame:
    """Decode exactly one whole frame from ``data`` (``strict``: see :class:`FrameDecoder`)."""
    decoder = FrameDecoder(max_frame_bytes, strict=strict)
    decoder.feed(data)
    frame = decoder.next_frame()
    if frame is None or decoder.buffered:
        raise MalformedFrame("data is not exactly one frame")
    return frame


__all__ = [
    "DEFAULT_MAX_FRAME_BYTES", "DEFAULT_MAX_MESSAGE_SIZE", "FRAME_PADDING", "MAGIC_BROKER_ENTRY_METADATA",
    "MAGIC_CHECKSUM", "SUB_FIELDS", "Frame", "FrameDecoder", "PayloadSection", "crc32c", "decode_command",
    "encode_command", "encode_payload_command", "encode_payload_section", "escape_bad_utf8", "escape_text",
    "frame_from_bytes", "parse_payload_section", "peek_type", "reencode", "section_at",
]
