"""What makes a frame valid: the one set of checks FrameDecoder and the relay's FrameScanner share.

Pulsar binary protocol, "Framing": ``[TOTAL_SIZE][CMD_SIZE][BaseCommand]`` and, for
SEND and MESSAGE, ``([0x0e02][size][BrokerEntryMetadata])? [0x0e01][CRC32C]
[METADATA_SIZE][MessageMetadata][payload]``.  :func:`check_frame` runs the checks in
a fixed order, each as soon as the bytes it reads have arrived, so a decoder that is
fed a frame in pieces rejects it at the same point, with the same error, as one that
gets it whole (and a hostile peer cannot hold a connection open with a header that
is already wrong):

1. TOTAL_SIZE (4 bytes): over the frame limit, or too small to hold a command;
2. CMD_SIZE (8 bytes): larger than the frame, or too small to hold a type;
3. the BaseCommand (``8 + CMD_SIZE`` bytes): :func:`check_command`;
4. extra bytes after a command without payload, or a payload command without them;
5. the payload section, field by field up to METADATA_SIZE (the metadata itself and
   the checksum are left to whoever reads them: the broker decides about those).

:func:`check_command` is what "undecodable command" means: a known type, the
sub-command of that type present, decodable as PulsarApi.proto says, with its
required fields, and every string in valid UTF-8 (a peer that sends invalid UTF-8
in a topic name is broken; its connection is closed like any other protocol error).
It decodes against the *strict twin* of the generated schema (the same messages,
built at import as protobuf edition 2023 with UTF-8 verification), so all of that
is checked in protobuf's C parser.  Commands in their canonical form — the type,
then exactly the sub-command field, as every Pulsar client and broker writes them —
are checked by parsing just the sub-command field; :class:`CommandBatch` lets the
relay collect many such fields and parse them in one call, and :func:`plainly_valid`
(:mod:`proxy.protocol.plain_forms`, compiled) accepts the hot commands' fields in the plain
form their writers give them without any parse at all.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Final, NamedTuple, NoReturn

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, EncodeError, Message

from proxy.errors import BadMagic, CommandDecodeError, FrameTooLarge, MalformedFrame, ProtocolError, UnknownCommand
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import PAYLOAD_TYPES, SUB_FIELDS, TYPE_NAMES, type_name
from proxy.protocol.plain_forms import plainly_valid, row_mask

MAGIC_CHECKSUM: Final = 0x0E01
MAGIC_BROKER_ENTRY_METADATA: Final = 0x0E02
HEADER_SIZE: Final = 8
#: the smallest BaseCommand: the type field's tag and a one-byte value
MIN_COMMAND_SIZE: Final = 2

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_PAYLOAD_TYPES: Final = frozenset(int(t) for t in PAYLOAD_TYPES)


# -- the strict twin of PulsarApi.proto --------------------------------------------------------
_STRICT_PACKAGE: Final = "pulsar_tap.strict"


def _strict_file() -> descriptor_pb2.FileDescriptorProto:
    """PulsarApi.proto as edition 2023: same messages, field numbers and defaults; strings verified.

    proto2 semantics are kept where they matter to a decoder (required fields stay
    required, enums stay closed); what changes is that the parser refuses a string
    field that is not UTF-8, which proto2 leaves to the reader.  ``SubCommands`` is
    added: BaseCommand's sub-command fields, repeated, so that many canonical commands'
    sub-command fields, concatenated, parse as one message.
    """
    source = descriptor_pb2.FileDescriptorProto()
    api.DESCRIPTOR.CopyToProto(source)
    twin = descriptor_pb2.FileDescriptorProto()
    twin.CopyFrom(source)
    twin.name = "pulsar_tap/strict/PulsarApi.proto"
    twin.package = _STRICT_PACKAGE
    twin.syntax = "editions"
    twin.edition = descriptor_pb2.EDITION_2023
    features = twin.options.features
    features.enum_type = descriptor_pb2.FeatureSet.CLOSED
    features.utf8_validation = descriptor_pb2.FeatureSet.VERIFY
    features.repeated_field_encoding = descriptor_pb2.FeatureSet.EXPANDED
    prefix = "." + source.package + "."

    def convert(message: descriptor_pb2.DescriptorProto) -> None:
        for field in message.field:
            if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REQUIRED:
                field.label = descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
                field.options.features.field_presence = descriptor_pb2.FeatureSet.LEGACY_REQUIRED
            if field.type_name.startswith(prefix):
                field.type_name = f".{_STRICT_PACKAGE}.{field.type_name[len(prefix):]}"
            if field.options.HasField("packed"):
                packed = field.options.packed
                field.options.ClearField("packed")
                field.options.features.repeated_field_encoding = (
                    descriptor_pb2.FeatureSet.PACKED if packed else descriptor_pb2.FeatureSet.EXPANDED)
        for nested in message.nested_type:
            convert(nested)

    for message in twin.message_type:
        convert(message)
    base = next(m for m in twin.message_type if m.name == "BaseCommand")
    batch = twin.message_type.add(name="SubCommands")
    for field in base.field:
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE:
            copy = batch.field.add()
            copy.CopyFrom(field)
            copy.label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    return twin


_STRICT_POOL = descriptor_pool.DescriptorPool()
_STRICT_POOL.Add(_strict_file())


@functools.cache
def strict_class(name: str) -> type[Message]:
    """The strict twin of the PulsarApi message ``name`` (e.g. ``"MessageMetadata"``)."""
    return message_factory.GetMessageClass(_STRICT_POOL.FindMessageTypeByName(f"{_STRICT_PACKAGE}.{name}"))


StrictBaseCommand = strict_class("BaseCommand")
SubCommands = strict_class("SubCommands")


def has_bad_text(message_name: str, data: bytes) -> bool:
    """Whether protobuf bytes that decode as ``message_name`` hold a string that is not UTF-8.

    Checked by the strict twin's C parser (the only thing it refuses that the
    generated message accepts), so the answer costs one parse, not a walk in Python.
    """
    try:
        strict_class(message_name)().ParseFromString(data)
    except DecodeError:
        return True
    return False


# -- commands ----------------------------------------------------------------------------------
def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: type -> the tag of its sub-command field (field number = type, wire type 2)
SUB_TAGS: Final[dict[int, bytes]] = {number: _varint(number << 3 | 2) for number in SUB_FIELDS}


def _read_varint(buf: bytes | bytearray | memoryview, pos: int, end: int) -> tuple[int, int] | None:
    """(value, position after it), or None when the varint is longer than 5 bytes or cut off."""
    value = shift = 0
    while pos < end and shift < 35:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
    return None


def _decode_problem(exc: DecodeError) -> str:
    """protobuf's reason without the name of the strict twin's message."""
    text = str(exc)
    _, sep, reason = text.partition("': ")
    return reason if sep and reason else "malformed protobuf"


def _missing_fields(message: Message) -> str:
    errors: list[str] = message.FindInitializationErrors()  # type: ignore[attr-defined]
    # "send[0].sequence_id" (SubCommands) and "send.sequence_id" (BaseCommand) both name "sequence_id"
    return ", ".join(error.split(".", 1)[1] if "." in error else error for error in errors)


#: type -> the strict twin of its sub-command message (e.g. CommandSend)
_STRICT_SUBS: Final[dict[int, type[Message]]] = {
    number: strict_class(api.BaseCommand.DESCRIPTOR.fields_by_name[name].message_type.name)
    for number, name in SUB_FIELDS.items()
}


def check_sub_body(body: bytes | bytearray | memoryview, type_: int) -> None:
    """Check a sub-command's bytes as the message of ``type_``: decodable, required fields, UTF-8."""
    sub = _STRICT_SUBS[type_]()
    try:
        sub.ParseFromString(body)  # type: ignore[arg-type]  # any buffer will do
    except DecodeError as exc:
        raise CommandDecodeError(f"undecodable {type_name(type_)}: {_decode_problem(exc)}") from None
    if not _has_required_fields(sub):
        raise CommandDecodeError(f"{type_name(type_)} lacks required fields: {_missing_fields(sub)}")


def _has_required_fields(message: Message) -> bool:
    """IsInitialized, at a fraction of its cost: protobuf's encoder checks required fields in C."""
    try:
        message.SerializeToString()
    except EncodeError:
        return False
    return True


def canonical_envelope(buf: bytes | bytearray | memoryview, start: int, end: int) -> int | None:
    """Where the sub-command's bytes start, if ``buf[start:end]`` is ``08 TYPE`` and exactly its field.

    Raises :class:`UnknownCommand` for a first type field of a value no version defines.
    """
    if end - start < 2 or buf[start] != 0x08 or buf[start + 1] >= 0x80:
        return None
    type_ = buf[start + 1]
    tag = SUB_TAGS.get(type_)
    if tag is None:
        raise UnknownCommand(type_)
    at = start + 2
    # the common form: a one-byte tag and a one-byte length
    if len(tag) == 1 and end - start >= 4 and buf[at] == tag[0] and buf[at + 1] == end - at - 2 < 0x80:
        return at + 2
    if buf[at:at + len(tag)] != tag:
        return None
    length = _read_varint(buf, at + len(tag), end)
    if length is None or length[1] + length[0] != end:
        return None
    return length[1]


def check_command(buf: bytes | bytearray | memoryview, start: int, end: int) -> int:
    """Validate the BaseCommand in ``buf[start:end]``; returns its type.

    Raises :class:`UnknownCommand` or :class:`CommandDecodeError` (see the module docstring).
    """
    at = canonical_envelope(buf, start, end)
    if at is not None:
        type_ = buf[start + 1]
        check_sub_body(buf[at:end], type_)
        return type_
    # Any other layout is legal protobuf (fields in another order, unknown fields): decode it all.
    cmd = StrictBaseCommand()
    try:
        cmd.ParseFromString(bytes(buf[start:end]))
    except DecodeError as exc:
        raise CommandDecodeError(f"undecodable command: {_decode_problem(exc)}") from None
    if not cmd.HasField("type"):
        raise CommandDecodeError("command has no (known) type")
    type_ = int(cmd.type)  # type: ignore[attr-defined]
    name = type_name(type_)
    field = SUB_FIELDS.get(type_)
    if field is None:
        raise UnknownCommand(type_)
    if not cmd.HasField(field):
        raise CommandDecodeError(f"{name} lacks its sub-command ({field})")
    if not cmd.IsInitialized():
        raise CommandDecodeError(f"{name} lacks required fields: {_missing_fields(cmd)}")
    return type_


def peek_command(buf: bytes | bytearray | memoryview, start: int, end: int) -> int:
    """The type of a command as lenient readers see it (recordings): the first type field, unchecked."""
    if end - start >= 2 and buf[start] == 0x08 and buf[start + 1] < 0x80:
        value = buf[start + 1]
    else:
        cmd = api.BaseCommand()
        try:
            cmd.ParseFromString(bytes(buf[start:end]))
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise CommandDecodeError(f"undecodable command: {exc}") from None
        if not cmd.HasField("type"):
            raise CommandDecodeError("command has no (known) type")
        value = cmd.type
    if value not in TYPE_NAMES:
        raise UnknownCommand(value)
    return value


CommandCheck = Callable[[bytes | bytearray | memoryview, int, int], int]


class CommandBatch:
    """Sub-command fields of canonical commands, put aside and checked in one parse.

    The relay's scanner adds the field of every frame it passes (``pending.append``;
    a row of frames of one size adds their fields joined, as one entry) and calls
    :meth:`verify` before it hands anything out; when the batch fails, the fields are
    checked one by one so the error is the first bad frame's, word for word what
    :func:`check_command` says about it.
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[bytes | bytearray | memoryview] = []

    def verify(self) -> None:
        pending = self.pending
        if not pending:
            return
        self.pending = []
        # A new message each time: a upb message parsed into again keeps every arena block
        # it ever had (a reused one grew the proxy ~12 MiB a minute at 2 000 messages/s).
        batch = SubCommands()
        try:
            batch.ParseFromString(b"".join(pending))
            if _has_required_fields(batch):
                return
        except DecodeError:
            pass
        _raise_first_error(pending)

    def verify_one(self, fields: bytes | memoryview) -> None:
        """:meth:`verify` of ``fields`` put aside alone (the batch must be empty): one frame's, at less cost."""
        batch = SubCommands()
        try:
            batch.ParseFromString(fields)  # type: ignore[arg-type]  # any buffer will do
            batch.SerializeToString()  # (_has_required_fields, inline)
            return
        except (DecodeError, EncodeError):
            pass
        _raise_first_error([fields])

    def clear(self) -> None:
        self.pending = []


def _raise_first_error(pending: list[bytes | bytearray | memoryview]) -> NoReturn:
    """The batch of ``pending`` failed: raise the error of its first bad field, as check_command words it."""
    for fields in pending:  # canonical fields, one or a row of them: their tags and lengths were checked
        pos = 0
        while pos < len(fields):
            tag = _read_varint(fields, pos, len(fields))
            length = _read_varint(fields, tag[1], len(fields)) if tag is not None else None
            if tag is None or length is None:
                raise CommandDecodeError("undecodable command")
            pos = length[1] + length[0]
            check_sub_body(fields[length[1]:pos], tag[0] >> 3)
    raise CommandDecodeError("undecodable command")  # the batch failed, so one field above did


# -- frames ------------------------------------------------------------------------------------
class PayloadLayout(NamedTuple):
    """Offsets (from the frame's start) of a payload section's parts."""

    bem_start: int          # -1 without broker entry metadata
    bem_end: int
    checksum_at: int        # the CRC32C field; it covers everything after itself
    metadata_start: int
    metadata_end: int


class FrameHead(NamedTuple):
    """A frame whose every check passed; the rest of its bytes need no look."""

    frame_size: int         # with the 4-byte size prefix
    cmd_size: int
    type: int
    layout: PayloadLayout | None


def check_total(total: int, limit: int) -> None:
    """Step 1: TOTAL_SIZE against the limit and the smallest possible frame."""
    if total + 4 > limit:
        raise FrameTooLarge(total + 4, limit)
    if total < 4 + MIN_COMMAND_SIZE:
        raise MalformedFrame(f"total size {total} leaves no room for a command")


def check_sizes(total: int, cmd_size: int) -> None:
    """Step 2: CMD_SIZE within the frame and large enough for a type."""
    if cmd_size > total - 4:
        raise MalformedFrame(f"command size {cmd_size} exceeds total size {total}")
    if cmd_size < MIN_COMMAND_SIZE:
        raise MalformedFrame(f"command of {cmd_size} bytes cannot hold a type")


def check_payload(buf: bytes | bytearray | memoryview, pos: int, frame_end: int,
                  end: int) -> PayloadLayout | int:
    """Step 5: the payload section starting at ``pos`` of a frame ending at ``frame_end``.

    Only ``buf[:end]`` has arrived.  Returns the absolute layout, or the offset the
    bytes must reach before the next check can run.
    """
    bem_start = bem_end = -1
    if frame_end - pos < 2:
        raise MalformedFrame("truncated payload section")
    if end < pos + 2:
        return pos + 2
    magic = _U16.unpack_from(buf, pos)[0]
    if magic == MAGIC_BROKER_ENTRY_METADATA:
        if frame_end - pos < 6:
            raise MalformedFrame("truncated broker entry metadata size")
        if end < pos + 6:
            return pos + 6
        bem_size = _U32.unpack_from(buf, pos + 2)[0]
        bem_start = pos + 6
        if bem_size > frame_end - bem_start:
            raise MalformedFrame("broker entry metadata runs past the end of the frame")
        pos = bem_end = bem_start + bem_size
        if frame_end - pos < 2:
            raise MalformedFrame("truncated payload section after broker entry metadata")
        if end < pos + 2:
            return pos + 2
        magic = _U16.unpack_from(buf, pos)[0]
    if magic != MAGIC_CHECKSUM:
        raise BadMagic(f"bad magic {magic:#06x} in payload section (expected 0x0e01)")
    if frame_end - pos < 10:
        raise MalformedFrame("truncated checksum or metadata size")
    if end < pos + 10:
        return pos + 10
    metadata_size = _U32.unpack_from(buf, pos + 6)[0]
    metadata_start = pos + 10
    if metadata_size > frame_end - metadata_start:
        raise MalformedFrame("message metadata runs past the end of the frame")
    return PayloadLayout(bem_start, bem_end, pos + 2, metadata_start, metadata_start + metadata_size)


def check_frame(buf: bytes | bytearray | memoryview, pos: int, end: int, limit: int,
                command_check: CommandCheck = check_command) -> FrameHead | int:
    """Every check of the frame starting at ``buf[pos]``, with bytes up to ``end`` arrived.

    Returns the frame's head once every check has passed (the rest of the frame may
    still be on its way), or the absolute offset the bytes must reach before the next
    check can run.  Raises the first check's error otherwise.
    """
    if end - pos < 4:
        return pos + 4
    total: int = _U32.unpack_from(buf, pos)[0]
    check_total(total, limit)
    if end - pos < HEADER_SIZE:
        return pos + HEADER_SIZE
    cmd_size: int = _U32.unpack_from(buf, pos + 4)[0]
    check_sizes(total, cmd_size)
    cmd_end = pos + HEADER_SIZE + cmd_size
    if end < cmd_end:
        return cmd_end
    type_: int = command_check(buf, pos + HEADER_SIZE, cmd_end)
    frame_end = pos + 4 + total
    if type_ not in _PAYLOAD_TYPES:
        if frame_end > cmd_end:
            raise MalformedFrame(f"{type_name(type_)} carries {frame_end - cmd_end} unexpected bytes after its command")
        return FrameHead(total + 4, cmd_size, type_, None)
    if frame_end == cmd_end:
        raise MalformedFrame(f"{type_name(type_)} has no payload section")
    layout = check_payload(buf, cmd_end, frame_end, end)
    if isinstance(layout, int):
        return layout
    if not pos:
        return FrameHead(total + 4, cmd_size, type_, layout)
    bem_start, bem_end, checksum_at, metadata_start, metadata_end = layout
    return FrameHead(total + 4, cmd_size, type_, PayloadLayout(
        bem_start - pos if bem_start >= 0 else -1, bem_end - pos if bem_end >= 0 else -1, checksum_at - pos,
        metadata_start - pos, metadata_end - pos))


def closed_mid_frame(received: int, frame_size: int | None) -> MalformedFrame:
    """The error for a peer that closed with ``received`` bytes of an unfinished frame."""
    if frame_size is None:
        return MalformedFrame(f"connection closed mid-frame ({received} bytes of a frame header)")
    return MalformedFrame(f"connection closed mid-frame ({received} of {frame_size} bytes received)")


def frame_size_of(buf: bytes | bytearray | memoryview, pos: int, end: int) -> int | None:
    """The whole size of the frame starting at ``buf[pos]``, if its size prefix has arrived."""
    return _U32.unpack_from(buf, pos)[0] + 4 if end - pos >= 4 else None


__all__ = [
    "HEADER_SIZE", "MAGIC_BROKER_ENTRY_METADATA", "MAGIC_CHECKSUM", "MIN_COMMAND_SIZE", "SUB_TAGS", "CommandBatch",
    "CommandCheck", "FrameHead", "PayloadLayout", "ProtocolError", "StrictBaseCommand", "SubCommands",
    "canonical_envelope", "check_command", "check_frame", "check_payload", "check_sizes", "check_sub_body",
    "check_total", "closed_mid_frame", "frame_size_of", "has_bad_text", "peek_command", "plainly_valid", "row_mask",
    "strict_class",
]
