"""The first step of ``analyze``: one split of a segment decoded into narrow rows, on its executor.

Every frame record of the split is decoded where it was read; no frame's bytes leave
the executor except those of control frames (below).  The work is split by what a
frame's rows depend on:

- **The data path** (SEND, SEND_RECEIPT, SEND_ERROR, MESSAGE, FLOW, and ACKs without a
  ``request_id``) is decoded here completely: its ``frames`` row, and for a SEND its
  ``messages`` rows (decompressed, batches split, chunked messages reassembled when
  all their chunks are in the split) and ``replication`` rows.  Their topic is the one
  thing that depends on the connection's earlier history (which producer or consumer
  the id belonged to), so each row names the id and the point of the connection's
  history — the *epoch*, the first data frame after the last control frame — and the
  second step answers with the topic (:data:`~proxy.analytics.tables.RESOLUTION`).
- **Control frames** (everything else: CONNECT, LOOKUP, PRODUCER, SUBSCRIBE, SUCCESS,
  ERROR, CLOSE_*, PING, ACKs with a ``request_id`` ...; none carries a payload, a few
  per connection) go to the second step, keyed by connection, which runs them through
  the same :class:`~proxy.protocol.session.SessionTracker` as ``show`` and the live
  tracer.
- **SEND ids** (producer, sequence id, time, the receipt's error) go to the second
  step too, which pairs each SEND with its receipt exactly as the tracker does, across
  splits.  Likewise the metadata (not the payload) of chunks whose message spans
  splits, frames that do not decode, and each connection's last capture time.

Frames are handled as :func:`proxy.analytics.reference.connection_tables` handles them
(the tests compare the two row for row): the same decoding order, the same errors,
the same partial results when a frame fails half-way.  Output goes into Arrow record
batches of at most :data:`BATCH_ROWS` rows.
"""

from __future__ import annotations

import gc
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from google.protobuf.message import DecodeError

from proxy.analytics import tables as tb
from proxy.analytics.segments import SegmentBytes, SkippedRange, Split, SplitReader
from proxy.errors import BatchError, MalformedFrame, ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import recording_pb2 as rpb
from proxy.protocol import chunks, compression, markers
from proxy.protocol.batch import MAX_BATCH_MESSAGES
from proxy.protocol.commands import SUB_FIELDS, TYPE_NAMES
from proxy.protocol.frame import PayloadSection, decode_command, escape_text, section_at
from proxy.protocol.validation import MAGIC_CHECKSUM, MIN_COMMAND_SIZE, check_frame, peek_command

if TYPE_CHECKING:
    import pyarrow as pa

#: Rows per Arrow record batch (a 256 MiB segment must not become one batch).
BATCH_ROWS: Final = 32_768

_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_HEADER = struct.Struct(">II")
#: command types that fit in the type field's one byte (``peek_command``'s quick case)
_KNOWN_TYPES: Final = frozenset(kind for kind in TYPE_NAMES if kind < 0x80)
_T = api.BaseCommand
SEND, SEND_RECEIPT, SEND_ERROR = int(_T.SEND), int(_T.SEND_RECEIPT), int(_T.SEND_ERROR)
MESSAGE, FLOW, ACK = int(_T.MESSAGE), int(_T.FLOW), int(_T.ACK)
_SEND_TYPES: Final = frozenset({SEND, SEND_RECEIPT, SEND_ERROR})
_DIRECTIONS: Final = {rpb.TO_BROKER: "to_broker", rpb.TO_CLIENT: "to_client"}
_ORIGINS: Final = {rpb.CLIENT: "client", rpb.BROKER: "broker", rpb.PROXY: "proxy"}
_ID_FIELDS: Final = ("request_id", "producer_id", "consumer_id", "sequence_id")
#: data-path frame type -> its sub-command field and which of the id columns it has
_DATA_PATH: Final[dict[int, tuple[str, tuple[bool, ...]]]] = {
    kind: (SUB_FIELDS[kind], tuple(name in getattr(api.BaseCommand(), SUB_FIELDS[kind]).DESCRIPTOR.fields_by_name
                                   for name in _ID_FIELDS))
    for kind in (SEND, SEND_RECEIPT, SEND_ERROR, MESSAGE, FLOW, ACK)
}


def server_error_name(code: int) -> str:
    """A ServerError value's name, as the session machine writes it."""
    try:
        return str(api.ServerError.Name(code))
    except ValueError:
        return f"UNKNOWN({code})"


def _command(data: bytes) -> api.BaseCommand:
    """:func:`proxy.protocol.frame.decode_command`, one call shorter (it runs once per frame)."""
    try:
        cmd = _BASE_COMMAND(data)
    except (DecodeError, RuntimeError, ValueError):
        return decode_command(data)  # raises the CommandDecodeError
    if not cmd.IsInitialized():  # (``type`` is required: a command without one is not initialized)
        return decode_command(data)
    return cmd


_BASE_COMMAND: Final = api.BaseCommand.FromString
_METADATA: Final = api.MessageMetadata.FromString


def _metadata(section: PayloadSection) -> api.MessageMetadata:
    """``section.metadata``, one parse and no more when it decodes (it runs once per SEND and MESSAGE)."""
    try:
        metadata = _METADATA(section.metadata_raw)
    except (DecodeError, RuntimeError, ValueError):
        return section.metadata  # raises the MetadataDecodeError
    return metadata if metadata.IsInitialized() else section.metadata


def parse_frame(raw: bytes, max_frame_bytes: int) -> tuple[int, int, Any]:
    """``(type, command size, payload section or None)`` of exactly one frame.

    The checks are :func:`proxy.protocol.validation.check_frame`'s, lenient on the
    command as recordings are read (:func:`~proxy.protocol.validation.peek_command`),
    so a damaged frame gets the problem text :func:`proxy.protocol.frame.frame_from_bytes`
    gives the one-process reader.
    """
    size = len(raw)
    if 10 <= size <= max_frame_bytes and raw[8] == 0x08:
        # The common case, checked here in a few steps: a whole frame, its type in one byte, no broker entry
        # metadata.  Anything else (and every failure) goes the long way, for check_frame's own answer.
        total, cmd_size = _HEADER.unpack_from(raw)
        frame_type = raw[9]
        cmd_end = 8 + cmd_size
        if total + 4 == size and MIN_COMMAND_SIZE <= cmd_size <= total - 4 and frame_type in _KNOWN_TYPES:
            if frame_type != SEND and frame_type != MESSAGE:
                if cmd_end == size:
                    return frame_type, cmd_size, None
            elif size - cmd_end >= 10 and _U16.unpack_from(raw, cmd_end)[0] == MAGIC_CHECKSUM:
                checksum, metadata_size = _HEADER.unpack_from(raw, cmd_end + 2)
                if metadata_size <= size - cmd_end - 10:
                    return frame_type, cmd_size, PayloadSection(raw, None, checksum, cmd_end + 6, cmd_end + 10,
                                                                cmd_end + 10 + metadata_size)
    head = check_frame(raw, 0, len(raw), max_frame_bytes, peek_command)
    if isinstance(head, int) or head.frame_size != len(raw):
        raise MalformedFrame("data is not exactly one frame")
    return head.type, head.cmd_size, None if head.layout is None else section_at(raw, head.layout)


def property_count(properties: Any) -> int:
    """How many properties a message has, counted as its decoded dict counts them (a repeated key once)."""
    return len(properties) if len(properties) < 2 else len({kv.key for kv in properties})


#: The columns of a ``messages`` row that differ between the messages of one payload, in the order
#: :func:`message_values` gives them; the others (:data:`MESSAGE_SHARED`) are the payload's.
MESSAGE_OWN: Final = ("sequence_id", "size", "key", "properties_count", "batch_index", "event_time_ms")
MESSAGE_SHARED: Final = ("conn_id", "ts_ns", "producer_name", "publish_time_ms", "compression", "epoch", "ref_kind",
                         "ref_id")


def message_values(metadata: api.MessageMetadata, payload: bytes, values: list[tuple[Any, ...]]) -> None:
    """The application messages of one whole (not chunked) payload, as ``decode_messages`` finds them.

    Appends one tuple of the :data:`MESSAGE_OWN` columns per message to ``values``
    (the rest of a ``messages`` row is the same for every message of the payload);
    raises what ``decode_messages`` raises (the caller drops what was added for the
    payload then).
    """
    base_key = metadata.partition_key if metadata.HasField("partition_key") else None
    if metadata.encryption_keys:
        values.append((metadata.sequence_id, len(payload), base_key, property_count(metadata.properties), -1, None))
        return
    kind = metadata.compression
    data = payload if kind == compression.NONE else compression.decompress(kind, payload, metadata.uncompressed_size)
    if not metadata.HasField("num_messages_in_batch"):
        values.append((metadata.sequence_id, len(data), base_key, property_count(metadata.properties), -1,
                       metadata.event_time or None))
        return
    count = metadata.num_messages_in_batch
    if not 0 < count <= MAX_BATCH_MESSAGES:
        raise BatchError(f"implausible num_messages_in_batch {count}")
    pos, end = 0, len(data)
    unpack, first_sequence, append = _U32.unpack_from, metadata.sequence_id, values.append
    for index in range(count):
        if end - pos < 4:
            raise BatchError(f"batch ends before message {index} of {count}")
        meta_size = unpack(data, pos)[0]
        pos += 4
        if meta_size > end - pos:
            raise BatchError(f"metadata of message {index} runs past the end of the batch")
        # this loop runs once per message: the common SingleMessageMetadata is read off the bytes
        # (:func:`single_message_fields`), anything else by protobuf (:func:`_single_message_values`)
        fields = single_message_fields(data, pos, pos + meta_size) if _READ_WIRE else _NOT_COMMON
        pos += meta_size
        own = common_message_values(fields, index, first_sequence) if fields[0] else \
            _single_message_values(data[pos - meta_size:pos], index, first_sequence)
        size: int = own[1]
        if not 0 <= size <= end - pos:
            raise BatchError(f"payload of message {index} runs past the end of the batch")
        append(own)
        pos += size
    if pos != end:
        raise BatchError(f"{end - pos} stray bytes after the last message of the batch")


def _single_message_values(meta: bytes, index: int, first_sequence: int) -> tuple[Any, ...]:
    """The :data:`MESSAGE_OWN` columns of message ``index`` of a batch, its SingleMessageMetadata parsed by protobuf.

    (``decode_message(SingleMessageMetadata, ...)`` inlined.)  A field's presence is
    asked for only when its value is the default (asking costs as much as reading it).
    """
    try:
        single = _SINGLE(meta)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise BatchError(f"message {index} of the batch: undecodable SingleMessageMetadata: {exc}") from None
    size = single.payload_size
    # Properties (field 1) are tagged 0x0a (or, over-long, 0x8a 0x80.. 0x00): bytes without either have none.
    property_total = 0 if meta.find(b"\n") < 0 and meta.find(b"\x8a") < 0 else len(single.properties)
    if (not size and not single.HasField("payload_size")) or (property_total and not single.IsInitialized()):
        missing = ", ".join(single.FindInitializationErrors())
        raise BatchError(f"message {index} of the batch: SingleMessageMetadata lacks required fields: {missing}")
    sequence_id = single.sequence_id
    if not sequence_id and not single.HasField("sequence_id"):
        sequence_id = first_sequence + index
    key = single.partition_key
    if not key and not single.HasField("partition_key"):
        key = None
    return (sequence_id, size, key, property_total if property_total < 2 else property_count(single.properties),
            index, single.event_time or None)


_SINGLE: Final = api.SingleMessageMetadata.FromString
#: ``(read, payload_size, partition_key, sequence_id, has sequence_id, event_time)``; see
#: :func:`single_message_fields`
SingleFields = tuple[bool, int, str | None, int, bool, int]
_NOT_COMMON: Final[SingleFields] = (False, 0, None, 0, False, 0)


def _is_compiled() -> bool:
    return not __file__.endswith(".py")


#: Whether :func:`message_values` reads common SingleMessageMetadata off the wire itself: compiled,
#: that is 3x faster than protobuf's parse and attribute reads; interpreted, slower than them.
_READ_WIRE: Final = _is_compiled()


def common_message_values(fields: SingleFields, index: int, first_sequence: int) -> tuple[Any, ...]:
    """The :data:`MESSAGE_OWN` columns of message ``index`` of a batch from :func:`single_message_fields`."""
    return fields[3] if fields[4] else first_sequence + index, fields[1], fields[2], 0, index, fields[5] or None


def single_message_fields(data: bytes, pos: int, end: int) -> SingleFields:
    """The fields ``messages`` rows need of the SingleMessageMetadata in ``data[pos:end]``, read off the wire.

    Only the common shape is read: fields 2 to 10 (properties are left to protobuf), each
    with its declared wire type, single-byte tags, varints
    of at most 9 bytes, UTF-8 partition keys, a ``payload_size`` present and in int32
    range.  For anything else (including every malformed input) the first element is
    False and protobuf decides (:func:`_single_message_values`), so both ways give the
    same values, as a property test checks.  As protobuf does, the last occurrence of a
    field wins.
    """
    payload_size = -1
    sequence_id = 0
    has_sequence = False
    key: str | None = None
    event_time = 0
    while pos < end:
        tag = data[pos]
        pos += 1
        if tag == 0x12 or tag == 0x3A:  # partition_key, ordering_key (not a column): length-delimited
            length, pos = _varint(data, pos, end, 28)
            if pos < 0 or length > end - pos:
                return _NOT_COMMON
            if tag == 0x12:
                try:
                    key = data[pos:pos + length].decode()
                except UnicodeDecodeError:
                    return _NOT_COMMON
            pos += length
            continue
        if tag & 7 != 0 or tag < 0x18 or tag > 0x50 or tag == 0x38:  # varints: fields 3 to 10, 7 is bytes
            return _NOT_COMMON
        value, pos = _varint(data, pos, end, 56)
        if pos < 0:
            return _NOT_COMMON
        if tag == 0x18:
            payload_size = value
        elif tag == 0x40:
            sequence_id = value
            has_sequence = True
        elif tag == 0x28:
            event_time = value
    if not 0 <= payload_size <= 0x7FFFFFFF:
        return _NOT_COMMON
    return True, payload_size, key, sequence_id, has_sequence, event_time


def _varint(data: bytes, pos: int, end: int, last_shift: int) -> tuple[int, int]:
    """``(value, position after it)`` of the varint at ``pos``; the position is -1 when it runs past ``end``
    or has more than ``last_shift // 7 + 1`` bytes."""
    value = 0
    shift = 0
    while pos < end and shift <= last_shift:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return 0, -1


def unread_batch_values(first_sequence: int, count: int) -> list[tuple[Any, ...]]:
    """:data:`MESSAGE_OWN` columns of the ``count`` messages of a payload that was not recorded."""
    return [(first_sequence + index, None, None, None, index if count > 1 else -1, None) for index in range(count)]


def replication_rows(ts_ns: int, metadata: api.MessageMetadata, payload: bytes | None
                     ) -> list[tuple[str, str | None, float | None, str | None, str | None]]:
    """``(kind, replicated_from, lag_ms, snapshot_id, source_cluster)`` per replication fact of a message.

    ``payload`` is None when it was not recorded (a marker is then not decoded).
    """
    rows: list[tuple[str, str | None, float | None, str | None, str | None]] = []
    if metadata.HasField("replicated_from"):
        rows.append(("replicated_message", metadata.replicated_from, ts_ns / 1e6 - metadata.publish_time, None, None))
    if metadata.HasField("marker_type") and payload is not None:
        data = compression.decompress(metadata.compression, payload, metadata.uncompressed_size)
        marker = markers.decode_marker(metadata, data)
        body = marker.body
        rows.append((marker.name, metadata.replicated_from or None,
                     None, getattr(body, "snapshot_id", None) if body is not None else None,
                     (getattr(body, "source_cluster", None) or None) if body is not None else None))
    return rows


def _rules(record: rpb.FrameRecord) -> str | None:
    """The names of the rules that fired on a frame, comma-separated (None for most frames: none fired)."""
    rules = record.rules
    return ",".join(rules) if rules else None


class ChunkAssembler(chunks.ChunkAssembler):
    """The protocol core's assembler, able to say whether a message is still being assembled."""

    def holds(self, key: tuple[str, str]) -> bool:
        return key in self._pending

    def forget(self, key: tuple[str, str]) -> None:
        """The message was started again and finished elsewhere (another split)."""
        self._pending.pop(key, None)


@dataclass(slots=True)
class _Connection:
    """What the split knows of one connection."""

    #: the epoch of the data frames now arriving (None right after a control frame)
    epoch: int | None = None
    refs: set[tuple[int, int, int]] = field(default_factory=set)
    last_ts: int = 0
    assembler: ChunkAssembler | None = None
    #: chunked messages restarted (chunk 0) in this split: key -> seq of the first restart
    chunk_keys: dict[tuple[str, str], int] = field(default_factory=dict)
    #: the edge rows of each locally started chunked message still incomplete
    chunk_rows: dict[tuple[str, str], list[tuple[Any, ...]]] = field(default_factory=dict)


class _Rows:
    """Row tuples for one table, turned into Arrow record batches every :data:`BATCH_ROWS` rows.

    Rows hold every column but ``recording``, which is the same for the whole split.
    """

    def __init__(self, columns: tb.Columns, recording: str) -> None:
        import pyarrow as pa

        self.schema = tb.arrow_schema(columns)
        #: the row tuples' columns, converted by Arrow in one go
        self.row_type = pa.struct(list(self.schema)[1:])
        self.recording = recording
        self.rows: list[tuple[Any, ...]] = []
        self.batches: list[pa.RecordBatch] = []

    def flush(self) -> None:
        if not self.rows:
            return
        self._add_batch(_columns(self.rows, self.row_type), len(self.rows))
        self.rows = []

    def _add_batch(self, arrays: list[pa.Array], count: int) -> None:
        import pyarrow as pa

        recording = pa.repeat(pa.scalar(self.recording, pa.string()), count)
        self.batches.append(pa.RecordBatch.from_arrays([recording, *arrays], schema=self.schema))

    def table(self) -> pa.Table:
        import pyarrow as pa

        self.flush()
        return pa.Table.from_batches(self.batches, schema=self.schema)


class _MessageRows(_Rows):
    """``messages`` rows, kept as each message's own columns and, once per payload, the shared ones.

    The messages of a batch share eight of a row's fourteen columns
    (:data:`MESSAGE_SHARED`): Arrow repeats them instead of Python carrying them in
    every message's tuple (:attr:`values` holds the :data:`MESSAGE_OWN` columns).
    """

    def __init__(self, recording: str) -> None:
        import pyarrow as pa

        super().__init__(tb.STAGED["messages"], recording)
        self.own_type = pa.struct([self.schema.field(name) for name in MESSAGE_OWN])
        self.shared_type = pa.struct([self.schema.field(name) for name in MESSAGE_SHARED])
        self.values: list[tuple[Any, ...]] = []
        #: per payload: its shared columns, and how many of :attr:`values` follow from it
        self.shared: list[tuple[Any, ...]] = []
        self.counts: list[int] = []

    def mark(self) -> tuple[int, int]:
        return len(self.values), len(self.shared)

    def add(self, shared: tuple[Any, ...], mark: tuple[int, int]) -> None:
        """The values added since ``mark`` were one payload's messages, with these shared columns."""
        count = len(self.values) - mark[0]
        if count:
            self.shared.append(shared)
            self.counts.append(count)

    def rollback(self, mark: tuple[int, int]) -> None:
        del self.values[mark[0]:]
        del self.shared[mark[1]:]
        del self.counts[mark[1]:]

    def flush(self) -> None:
        import numpy as np
        import pyarrow as pa

        if not self.values:
            return
        payload_of = pa.array(np.repeat(np.arange(len(self.counts), dtype=np.int64), self.counts))
        shared = [column.take(payload_of) for column in _columns(self.shared, self.shared_type)]
        by_name = dict(zip(MESSAGE_SHARED, shared, strict=True))
        by_name.update(zip(MESSAGE_OWN, _columns(self.values, self.own_type), strict=True))
        self._add_batch([by_name[name] for name in self.schema.names[1:]], len(self.values))
        self.values, self.shared, self.counts = [], [], []


def _columns(rows: list[tuple[Any, ...]], row_type: pa.StructType) -> list[pa.Array]:
    """Row tuples as Arrow columns of ``row_type``'s fields (C++ transposes them in one go)."""
    import pyarrow as pa

    try:
        return list(pa.RecordBatch.from_struct_array(pa.array(rows, type=row_type)).columns)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # text recorded as bytes that are not UTF-8
        columns = list(zip(*rows, strict=True))
        return [_array(values, row_type.field(index).type) for index, values in enumerate(columns)]


def _array(values: tuple[Any, ...], kind: pa.DataType) -> pa.Array:
    """One column; text that was recorded as bytes that are not UTF-8 comes out escaped (``x\\xff``).

    Protobuf gives such strings back as ``bytes``; frames that passed the wire's checks
    cannot hold them, so the column is looked at again only when Arrow refuses it.
    """
    import pyarrow as pa

    try:
        return pa.array(values, type=kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        if not pa.types.is_string(kind):
            raise
        return pa.array([escape_text(v) if isinstance(v, bytes) else v for v in values], type=kind)


@dataclass
class SplitOutput:
    """What one split decoded to."""

    split: Split
    recording: str
    #: frames, messages, replication: the large rows, topics still to resolve
    staged: dict[str, pa.Table]
    #: the rows for the second step
    edges: pa.Table
    skipped: list[SkippedRange]
    frames: int = 0
    bytes: int = 0


class SplitDecoder:
    """Decodes the frame records of one split; see the module docstring."""

    def __init__(self, split: Split, recording: str) -> None:
        self.split = split
        self.recording = recording
        self.frames = _Rows(tb.STAGED["frames"], recording)
        self.messages = _MessageRows(recording)
        self.replication = _Rows(tb.STAGED["replication"], recording)
        self.edges = _Rows(tb.EDGE, recording)
        self.connections: dict[int, _Connection] = {}
        self.frame_count = 0
        self._seq_base = split.segment_index << 40

    # -- the records ------------------------------------------------------------------------
    def frame_record(self, offset: int, record: rpb.FrameRecord) -> None:
        """Decode one frame record found at ``offset`` of the segment."""
        conn_id = record.conn_id
        connection = self.connections.get(conn_id)
        if connection is None:
            connection = self.connections[conn_id] = _Connection()
        ts_ns = record.ts_ns
        if ts_ns > connection.last_ts:
            connection.last_ts = ts_ns
        self.frame_count += 1
        direction = _DIRECTIONS.get(record.direction, "to_broker")
        stripped = record.payload_stripped
        data = record.data
        size = record.original_size if stripped and record.original_size else len(data)
        seq = self._seq_base | offset
        try:
            raw = data + bytes(size - len(data)) if stripped and size > len(data) else data
            frame_type, cmd_size, section = parse_frame(raw, max(size, 8))
            cmd = _command(raw[8:8 + cmd_size])
            path = _DATA_PATH.get(frame_type)
            if path is None or (frame_type == ACK and cmd.ack.HasField("request_id")):
                connection.epoch = None
                self.edges.rows.append((conn_id, seq, tb.EDGE_CONTROL, ts_ns, direction,
                                        _ORIGINS.get(record.origin, "proxy"), size, _rules(record),
                                        raw, frame_type, None, None, None, None, None, None, None, None, None, None))
                return
            self._data_frame(connection, conn_id, seq, ts_ns, direction, record, size, stripped, frame_type,
                             getattr(cmd, path[0]), path[1], section, len(raw))
        except (ProtocolError, ValueError) as exc:
            self.edges.rows.append((conn_id, seq, tb.EDGE_PROBLEM, ts_ns, direction, None, None, None,
                                    None, None, None, None, None, None, None, None, None, None,
                                    f"{type(exc).__name__}: {exc}", None))

    def _data_frame(self, connection: _Connection, conn_id: int, seq: int, ts_ns: int, direction: str,
                    record: rpb.FrameRecord, size: int, stripped: bool, frame_type: int, sub: Any,
                    has_ids: tuple[bool, ...], section: Any, frame_size: int) -> None:
        epoch = connection.epoch
        if epoch is None:
            epoch = connection.epoch = seq
        if frame_type in (MESSAGE, FLOW, ACK):
            ref_kind, ref_id = tb.REF_CONSUMER, sub.consumer_id
        else:
            ref_kind, ref_id = tb.REF_PRODUCER, sub.producer_id
        connection.refs.add((epoch, ref_kind, ref_id))
        num_messages = metadata = None
        if frame_type == SEND:
            num_messages = sub.num_messages if sub.HasField("num_messages") else 1
        elif frame_type == MESSAGE:
            metadata = _metadata(section)  # a MESSAGE whose metadata does not decode gets no frames row
            num_messages = metadata.num_messages_in_batch if metadata.HasField("num_messages_in_batch") else 1
        has_request, has_producer, has_consumer, has_sequence = has_ids
        self.frames.rows.append((
            conn_id, ts_ns, direction, _ORIGINS.get(record.origin, "proxy"), TYPE_NAMES[frame_type], size,
            sub.request_id if has_request and sub.HasField("request_id") else None,
            sub.producer_id if has_producer else None, sub.consumer_id if has_consumer else None,
            sub.sequence_id if has_sequence else None, num_messages,
            frame_size - section.metadata_end if section is not None else None,
            _rules(record), epoch, ref_kind, ref_id))
        if frame_type in _SEND_TYPES:
            error_code = error_message = None
            if frame_type == SEND_ERROR:
                error_code = server_error_name(sub.error)
                error_message = sub.message if sub.HasField("message") else None
            self.edges.rows.append((conn_id, seq, tb.EDGE_SEND, ts_ns, direction, None, None, None, None,
                                    frame_type, sub.producer_id, sub.sequence_id,
                                    sub.num_messages if frame_type == SEND else None, error_code, error_message,
                                    None, None, None, None, epoch))
        if len(self.frames.rows) >= BATCH_ROWS:
            self.frames.flush()
        if section is None or (frame_type != SEND and frame_type != MESSAGE):
            return
        messages_mark, replication_mark = self.messages.mark(), len(self.replication.rows)
        try:
            if metadata is None:
                metadata = _metadata(section)
            if frame_type == SEND:
                self._messages(connection, conn_id, seq, ts_ns, direction, metadata, section, stripped, epoch,
                               ref_id, frame_size)
            # nearly every message has neither: nothing for the replication table
            if metadata.HasField("replicated_from") or metadata.HasField("marker_type"):
                for kind, replicated_from, lag_ms, snapshot_id, source_cluster in replication_rows(
                        ts_ns, metadata, None if stripped else section.payload):
                    self.replication.rows.append((conn_id, ts_ns, direction, kind, replicated_from,
                                                  metadata.publish_time, lag_ms, snapshot_id, source_cluster, epoch,
                                                  ref_kind, ref_id))
        except (ProtocolError, ValueError):
            self.messages.rollback(messages_mark)
            del self.replication.rows[replication_mark:]
            raise
        if len(self.messages.values) >= BATCH_ROWS:
            self.messages.flush()
        if len(self.replication.rows) >= BATCH_ROWS:
            self.replication.flush()

    def _messages(self, connection: _Connection, conn_id: int, seq: int, ts_ns: int, direction: str,
                  metadata: api.MessageMetadata, section: Any, stripped: bool, epoch: int, producer_id: int,
                  frame_size: int) -> None:
        """The messages rows of a SEND, as the reference's ``_MessageDecoder.rows``."""
        if metadata.HasField("marker_type"):
            return
        messages = self.messages
        values, mark = messages.values, messages.mark()
        shared = (conn_id, ts_ns, metadata.producer_name, metadata.publish_time,
                  compression.compression_name(metadata.compression), epoch, tb.REF_PRODUCER, producer_id)
        if metadata.HasField("uuid") and metadata.num_chunks_from_msg > 1:
            if stripped:
                if metadata.chunk_id + 1 >= metadata.num_chunks_from_msg:
                    values.append((metadata.sequence_id, metadata.total_chunk_msg_size, None, None, -1, None))
            else:
                whole = self._chunk(connection, conn_id, seq, ts_ns, direction, metadata, section, producer_id,
                                    frame_size)
                if whole is not None:
                    message_values(whole.metadata, whole.payload, values)
        elif stripped:
            count = metadata.num_messages_in_batch if metadata.HasField("num_messages_in_batch") else 1
            values += unread_batch_values(metadata.sequence_id, count)
        else:
            message_values(metadata, section.payload, values)
        messages.add(shared, mark)

    def _chunk(self, connection: _Connection, conn_id: int, seq: int, ts_ns: int, direction: str,
               metadata: api.MessageMetadata,
               section: Any, producer_id: int, frame_size: int) -> chunks.AssembledMessage | None:
        """Assemble a chunk here when its message was started in this split, else hand it on."""
        key = (metadata.producer_name, metadata.uuid)
        edge = (conn_id, seq, tb.EDGE_CHUNK, ts_ns, direction, None, None, None, section.metadata_raw, SEND,
                producer_id, None, None, None, None, None, None, frame_size - section.metadata_end, None, None)
        if metadata.chunk_id != 0 and key not in connection.chunk_keys:
            self.edges.rows.append(edge)  # its message started before this split
            return None
        if connection.assembler is None:
            connection.assembler = ChunkAssembler()
        if metadata.chunk_id == 0:
            connection.chunk_keys.setdefault(key, seq)
            connection.chunk_rows[key] = []
        pending = connection.chunk_rows.setdefault(key, [])
        pending.append(edge)
        try:
            whole = connection.assembler.add(metadata, section.payload)
        finally:
            if not connection.assembler.holds(key):
                connection.chunk_rows.pop(key, None)
        return whole

    # -- the end ----------------------------------------------------------------------------
    def finish(self, skipped: list[SkippedRange]) -> SplitOutput:
        edges = self.edges.rows
        for conn_id, connection in self.connections.items():
            for epoch, ref_kind, ref_id in connection.refs:
                edges.append((conn_id, epoch, tb.EDGE_REF, None, None, None, None, None, None, None, None, None,
                              None, None, None, ref_kind, ref_id, None, None, None))
            for key, first_seq in connection.chunk_keys.items():
                pending = connection.chunk_rows.get(key)
                if pending and connection.assembler is not None and connection.assembler.holds(key):
                    edges.extend(pending)  # still incomplete at the split's end: the second step continues it
                else:
                    edges.append((conn_id, first_seq, tb.EDGE_CHUNK_RESET, None, None, None, None, None, None,
                                  None, None, None, None, None, None, None, None, None, key[0] + "\x00" + key[1], None))
            edges.append((conn_id, self._seq_base | self.split.start, tb.EDGE_LAST, connection.last_ts, None, None,
                          None, None, None, None, None, None, None, None, None, None, None, None, None, None))
        return SplitOutput(
            self.split, self.recording,
            {"frames": self.frames.table(), "messages": self.messages.table(),
             "replication": self.replication.table()},
            self.edges.table(), skipped, frames=self.frame_count)


def decode_split(split: Split, data: SegmentBytes, recording: str | None = None) -> SplitOutput:
    """Decode the records ``split`` owns in ``data`` (the whole segment's bytes)."""
    reader = SplitReader(data, split)
    decoder = SplitDecoder(split, recording or split.recording)
    frame_record = decoder.frame_record
    collecting = gc.isenabled()
    # The rows pile up as tuples (no cycles among them): without this, the collector walks them all,
    # and everything the process has imported, again and again as they grow (a sixth of the time).
    gc.disable()
    try:
        for offset, record in reader.records():
            if record.HasField("frame"):
                frame_record(offset, record.frame)
        output = decoder.finish(reader.skipped)
    finally:
        if collecting:
            gc.enable()
    output.bytes = split.end - split.start
    return output


__all__ = ["BATCH_ROWS", "MESSAGE_OWN", "MESSAGE_SHARED", "SplitDecoder", "SplitOutput", "decode_split",
           "message_values", "parse_frame", "replication_rows", "server_error_name", "unread_batch_values"]
