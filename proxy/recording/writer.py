"""Writing a recording: queue items, record encoding, segment files and the index.

Everything the recorder does except waiting.  The Trio recorder
(:class:`proxy.server.recorder.Recorder`, the proxy's observer) puts a
:class:`FrameItem` per frame the proxy looked at, a :class:`RunItem` per stretch of
bytes it passed through unchanged, and a ``Record`` per connection opened or closed
on a bounded queue, and hands batches of them to the recording's writer process
(:mod:`proxy.recording.writer_process`), which calls :meth:`SegmentWriter.write`.
This module owns what happens then and the account kept meanwhile; it imports no trio
and never waits (its file writes are blocking, and are made in the writer process).

:func:`encode_batch` cuts runs into frames (per connection and direction, carrying a
frame that continues in the next run; a run that does not follow on from the one
before — one was dropped — loses the frame begun before the gap, and a connection's
end loses a frame begun and not finished: both counted as dropped here, while the
frames that begin in a dropped run were counted where it was dropped, so that every
frame the proxy passed is recorded or counted once),
redacts auth data, strips payloads when asked and frames the records
(:mod:`proxy.recording.segment`); :class:`SegmentFiles` appends them to the current
segment, rotating to a new one past ``max_segment_bytes``.  Every write goes straight
to the OS (unbuffered), so a killed proxy loses at most the batch being written;
the recorder has the segment fsynced and the index rewritten (write + rename) once a
second.  :class:`RecordingBook` keeps the recording's account — frames and bytes per
connection, frames dropped (queue full, or lost across a gap), protocol versions — and
builds the index from it.

Layout: ``DIR/<UTC start YYYYmmddTHHMMSSZ>-<pid>/`` holding ``segment-NNNNNN.ptap``
files and ``index.pb`` (recordings/FORMAT.md).
"""

from __future__ import annotations

import enum
import os
import pickle
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, Protocol, TypeAlias

import crc32c as _crc32c
import numpy

from proxy.core.rows import column, leading_same
from proxy.core.run_cutter import RunCutter, count_frame_starts
from proxy.errors import ProtocolError, RecordingError
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import frame_from_bytes
from proxy.recording import run_ring
from proxy.recording.redaction import SECRET_PATHS, frame_type_of, redact, strip_payload
from proxy.recording.segment import FORMAT_VERSION, SEGMENT_MAGIC, encode_frame_record, encode_record, varint

INDEX_NAME: Final = "index.pb"
SEGMENT_SUFFIX: Final = ".ptap"
DEFAULT_MAX_SEGMENT_BYTES: Final = 256 * 1024 * 1024
DEFAULT_QUEUE_SIZE: Final = 10_000
#: bytes of runs waiting for the writer (the size of the recorder's run ring); beyond this a run is
#: dropped (and its frames counted).  What the observer hub's queue (64 MiB of runs) and the
#: recorder's queue (64 MiB) held together when runs went through both.
DEFAULT_QUEUE_BYTES: Final = 128 * 1024 * 1024
#: bytes of runs a paced write (``SegmentWriter.write``) encodes and appends between two calls of its pace:
#: ~6 ms of the writer's CPU at 100 B frames, ~1.5 ms at 1 KiB (bench/writer.py)
PACE_BYTES: Final = 1024 * 1024

DIRECTIONS: Final[dict[str, int]] = {"to_broker": rpb.TO_BROKER, "to_client": rpb.TO_CLIENT}
ORIGINS: Final[dict[str, int]] = {"client": rpb.CLIENT, "broker": rpb.BROKER, "proxy": rpb.PROXY}
LOOKUP_MODES: Final[dict[str, int]] = {"rewrite": rpb.REWRITE, "proxy-through": rpb.PROXY_THROUGH,
                                       "proxy_through": rpb.PROXY_THROUGH}

Address = tuple[str, int] | str | None


@dataclass(frozen=True, slots=True)
class RecordConfig:
    """The ``record:`` section of proxy.yaml (``max_segment_mb`` given here in bytes)."""

    dir: Path
    redact: bool = True
    include_payloads: bool = True
    max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES
    #: frames waiting for the writer; beyond this they are dropped and counted
    queue_size: int = DEFAULT_QUEUE_SIZE
    #: bytes of passed-through runs waiting for the writer (the run ring's size); beyond this a run is
    #: dropped and counted
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    #: seconds between fsync + index rewrites
    flush_interval: float = 1.0


@dataclass(slots=True)
class RecorderStats:
    """Counters for /metrics."""

    frames_recorded: int = 0
    frames_dropped: int = 0
    bytes_written: int = 0
    segments: int = 0


def recording_dir_name(start_ns: int, pid: int) -> str:
    """``YYYYmmddTHHMMSSZ-<pid>`` for a recording started at ``start_ns`` (Unix epoch ns)."""
    stamp = datetime.fromtimestamp(start_ns / 1e9, tz=UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{pid}"


def segment_name(number: int) -> str:
    """The file name of a recording's ``number``-th segment (from 1)."""
    return f"segment-{number:06d}{SEGMENT_SUFFIX}"


def _enum_name(value: str | enum.Enum) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    return str(value).lower()


def _code(codes: dict[str, int], value: str | enum.Enum) -> int:
    """``codes[_enum_name(value)]``, looked up as given first: the relay passes its direction and origin as
    members of string enums, equal to their names, and ``Enum.value`` cost the relay ~0.4 us per run recorded."""
    code = codes.get(value) if isinstance(value, str) else None
    return code if code is not None else codes[_enum_name(value)]


def _address(addr: Address) -> rpb.Address | None:
    if addr is None:
        return None
    if isinstance(addr, str):
        host, sep, port = addr.rpartition(":")
        if not sep or not port.isdigit():
            raise RecordingError(f"address {addr!r} is not HOST:PORT")
        return rpb.Address(host=host.strip("[]"), port=int(port))
    return rpb.Address(host=str(addr[0]), port=int(addr[1]))


# Queue items: ("frame", FrameItem) or ("opened"/"closed", Record)
@dataclass(slots=True)
class FrameItem:
    conn_id: int
    direction: int
    origin: int
    ts_ns: int
    raw: bytes
    rules: tuple[str, ...]


@dataclass(slots=True)
class RunItem:
    """Bytes passed through unchanged: whole frames, perhaps cut at either end (see ``record_run``).

    The proxy's recorder keeps ``data`` in its run ring (``ring_offset``, see
    :mod:`proxy.recording.run_ring`): then only its place crosses to the writer process,
    where ``data`` is a view of the same shared memory.
    """

    conn_id: int
    direction: int
    ts_ns: int
    data: bytes | memoryview
    lead: int
    stream_pos: int
    #: where ``data`` lies in the run ring; -1 when it is not in one (it crosses as bytes)
    ring_offset: int = -1

    def __reduce__(self) -> tuple[Callable[..., RunItem], tuple[object, ...]]:
        if self.ring_offset >= 0:
            return _ring_run, (self.conn_id, self.direction, self.ts_ns, self.ring_offset, len(self.data), self.lead,
                               self.stream_pos)
        # the run's bytes out of band (see proxy.recording.writer_process)
        return RunItem, (self.conn_id, self.direction, self.ts_ns, pickle.PickleBuffer(self.data), self.lead,
                         self.stream_pos)


def _ring_run(conn_id: int, direction: int, ts_ns: int, offset: int, length: int, lead: int,
              stream_pos: int) -> RunItem:
    """A RunItem in the writer process, its bytes where the proxy put them in the ring."""
    return RunItem(conn_id, direction, ts_ns, run_ring.attached(offset, length), lead, stream_pos)


QueueItem: TypeAlias = FrameItem | RunItem | rpb.Record

_SIZE_PREFIX = struct.Struct(">I")
_RECORD_HEAD = struct.Struct(">II")
#: a frame's size prefix, as numpy reads it
_PREFIX: Final = ">u4"
#: the sender of a run's frames, by direction (runs are never the proxy's own frames)
_RUN_ORIGIN: Final = {rpb.TO_BROKER: rpb.CLIENT, rpb.TO_CLIENT: rpb.BROKER}


#: buffers per writev (the kernel's IOV_MAX on Linux)
_IOV_MAX: Final = 1024


@dataclass(slots=True)
class BatchResult:
    bytes_written: int = 0
    frames: int = 0
    #: conn id -> (frames, wire bytes) recorded in this batch
    per_connection: dict[int, list[int]] = field(default_factory=dict)
    #: conn id -> protocol version seen in CONNECT (client) or CONNECTED (broker)
    versions: dict[int, tuple[bool, int]] = field(default_factory=dict)
    #: frames begun in a run written here whose end was not (it was in a dropped run, or the connection
    #: ended first): given up, counted as dropped
    frames_lost: int = 0
    #: conn id -> those frames of the connection
    lost_per_connection: dict[int, int] = field(default_factory=dict)
    #: segments of the recording so far (the current one included)
    segments: int = 0

    def count(self, conn_id: int, wire_bytes: int, frames: int = 1) -> None:
        counts = self.per_connection.setdefault(conn_id, [0, 0])
        counts[0] += frames
        counts[1] += wire_bytes
        self.frames += frames

    def lose(self, conn_id: int, frames: int) -> None:
        if frames:
            self.lost_per_connection[conn_id] = self.lost_per_connection.get(conn_id, 0) + frames
            self.frames_lost += frames


def _records_in(parts: Sequence[bytes | memoryview]) -> Iterator[list[bytes | memoryview]]:
    """The parts of each framed record in turn: a record's first part opens with its size (and CRC32C), and
    holds either that one record or its start, or several whole records (a row, see ``_encode_row``)."""
    index = 0
    while index < len(parts):
        part = parts[index]
        index += 1
        missing = _RECORD_HEAD.size + _SIZE_PREFIX.unpack_from(part)[0] - len(part)
        if missing < 0:
            view, pos = memoryview(part), 0
            while pos < len(view):
                size = _RECORD_HEAD.size + _SIZE_PREFIX.unpack_from(view, pos)[0]
                yield [view[pos:pos + size]]
                pos += size
            continue
        record = [part]
        while missing > 0:
            record.append(parts[index])
            missing -= len(parts[index])
            index += 1
        yield record


def write_index(path: Path, index: bytes) -> None:
    """Replace the index of the recording at ``path`` atomically (write, fsync, rename)."""
    tmp = path / (INDEX_NAME + ".tmp")
    with open(tmp, "wb") as out:
        out.write(index)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path / INDEX_NAME)


class SegmentFiles:
    """The segment files of one recording; used from one thread at a time (the writer process's)."""

    def __init__(self, path: Path, recording_id: str, config: RecordConfig, clock: Callable[[], int]) -> None:
        self.path = path
        self.recording_id = recording_id
        self.config = config
        self.clock = clock
        self.segments: list[str] = []
        self._file: int | None = None
        self._size = 0
        self._dirty = False

    def _open_next(self) -> None:
        self._close_current()
        name = segment_name(len(self.segments) + 1)
        header = rpb.Record(header=rpb.SegmentHeader(
            format_version=FORMAT_VERSION, recording_id=self.recording_id,
            segment_index=len(self.segments) + 1, created_ns=self.clock(),
            include_payloads=self.config.include_payloads, redact=self.config.redact))
        self._file = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self.segments.append(name)
        self._size = 0
        self._write(SEGMENT_MAGIC + encode_record(header))

    def _write(self, data: bytes) -> None:
        self._write_parts([data], len(data))

    def _write_parts(self, parts: Sequence[bytes | memoryview], size: int) -> None:
        """Write ``parts`` (``size`` bytes in all) in order, gathered by the kernel (no joined copy)."""
        assert self._file is not None
        index = 0
        while index < len(parts):
            chunk = parts[index:index + _IOV_MAX]
            written = os.writev(self._file, chunk)
            chunk_size = sum(len(part) for part in chunk)
            if written < chunk_size:  # a short write (a signal, a full disk): the rest one by one
                rest = b"".join(chunk)
                view = memoryview(rest)[written:]
                while view:
                    view = view[os.write(self._file, view):]
            index += len(chunk)
        self._size += size
        self._dirty = True

    def append(self, parts: Sequence[bytes | memoryview]) -> int:
        """Append framed records given as parts (see ``encode_batch``), rotating past the size limit; the bytes written.

        A batch that fits in the current segment goes out as it is (``writev``, no copy);
        otherwise it is cut between records where the limit falls.
        """
        if self._file is None:
            self._open_next()
        total = sum(map(len, parts))
        if self._size + total <= self.config.max_segment_bytes:
            self._write_parts(parts, total)
            return total
        return self._append_rotating(_records_in(parts))

    def _append_rotating(self, records: Iterator[list[bytes | memoryview]]) -> int:
        total = 0
        pending: list[bytes | memoryview] = []
        pending_size = 0
        for rec in records:
            size = sum(map(len, rec))
            if self._size + pending_size + size > self.config.max_segment_bytes and \
                    (pending or self._size > len(SEGMENT_MAGIC) + 64):
                if pending:
                    self._write_parts(pending, pending_size)
                    total += pending_size
                    pending, pending_size = [], 0
                self._open_next()
            pending += rec
            pending_size += size
        if pending:
            self._write_parts(pending, pending_size)
            total += pending_size
        return total

    def sync(self, index: bytes | None) -> None:
        """fsync the current segment and atomically replace the index."""
        if self._file is not None and self._dirty:
            os.fsync(self._file)
            self._dirty = False
        if index is not None:
            write_index(self.path, index)

    def _close_current(self) -> None:
        if self._file is not None:
            if self._dirty:
                os.fsync(self._file)
                self._dirty = False
            os.close(self._file)
            self._file = None

    def close(self, index: bytes | None) -> None:
        self._close_current()
        self.sync(index)


def encode_batch(items: Sequence[QueueItem], config: RecordConfig,
                  streams: dict[tuple[int, int], RunCutter] | None = None, result: BatchResult | None = None
                  ) -> tuple[list[bytes | memoryview], BatchResult]:
    """Turn queue items into framed records, in order, as the parts to write (runs in the writer process;
    ``streams`` is its state), counted in ``result`` (a new one when not given): a record is one part, or
    three for a frame of a run, and the records of a row of a run's frames of one size are one part (see
    ``_encode_run_frames``); a part holds whole records or belongs to one."""
    out: list[bytes | memoryview] = []
    if result is None:
        result = BatchResult()
    if streams is None:
        streams = {}
    for item in items:
        if type(item) is RunItem:
            _encode_run(item, streams, config, out, result)
            continue
        if isinstance(item, rpb.Record):
            if item.HasField("closed"):
                conn_id = item.closed.conn_id
                for direction in (rpb.TO_BROKER, rpb.TO_CLIENT):
                    ended = streams.pop((conn_id, direction), None)
                    if ended is not None:
                        result.lose(conn_id, ended.finish())
            out.append(encode_record(item))
            continue
        assert isinstance(item, FrameItem)
        raw = item.raw
        frame_type = frame_type_of(raw)
        if frame_type in (api.BaseCommand.CONNECT, api.BaseCommand.CONNECTED):
            version = _protocol_version(raw, frame_type)
            if version is not None:
                result.versions[item.conn_id] = (frame_type == api.BaseCommand.CONNECTED, version)
        out.append(_frame_record(item.conn_id, item.direction, item.origin, item.ts_ns, raw, item.rules, config))
        result.count(item.conn_id, len(raw))
    return out, result


def end_streams(streams: dict[tuple[int, int], RunCutter]) -> BatchResult:
    """Give up the frames begun and not finished in ``streams`` (``encode_batch``'s state), and forget them."""
    result = BatchResult()
    for (conn_id, _direction), cutter in streams.items():
        result.lose(conn_id, cutter.finish())
    streams.clear()
    return result


def _frame_record(conn_id: int, direction: int, origin: int, ts_ns: int, raw: bytes, rules: Sequence[str],
                  config: RecordConfig) -> bytes:
    """One frame's record, redacted and stripped as ``config`` says (the general way)."""
    redacted = False
    if config.redact:
        raw, redacted = redact(raw)
    record = rpb.FrameRecord(conn_id=conn_id, direction=direction, origin=origin, ts_ns=ts_ns, rules=rules)
    wire_size = len(raw)
    stripped = None if config.include_payloads else strip_payload(raw)
    if stripped is not None:
        record.data = stripped
        record.original_size = wire_size
        record.payload_stripped = True
    else:
        record.data = raw
    if redacted:
        record.redacted = True
    return encode_frame_record(record)


def _encode_run(item: RunItem, streams: dict[tuple[int, int], RunCutter], config: RecordConfig,
                out: list[bytes | memoryview], result: BatchResult) -> None:
    """Cut a run into whole frames (after the stream's carried frame start) and append their records."""
    key = (item.conn_id, item.direction)
    cutter = streams.get(key)
    if cutter is None:
        cutter = streams[key] = RunCutter()
    cut_short = cutter.cut_short
    origin = _RUN_ORIGIN[item.direction]
    completed, pos = cutter.begin(item.data, item.lead, item.stream_pos)
    if completed is not None:
        _encode_run_frames(item, origin, completed, 0, config, out, result)
    cutter.end(item.data, _encode_run_frames(item, origin, item.data, pos, config, out, result))
    # (not cutter.lost: the frames that begin in a dropped run were counted when it was dropped)
    result.lose(item.conn_id, cutter.cut_short - cut_short)


def _encode_run_frames(item: RunItem, origin: int, data: bytes | memoryview, pos: int, config: RecordConfig,
                       out: list[bytes | memoryview], result: BatchResult) -> int:
    """Append the records of the whole frames in ``data`` from ``pos``; returns where the first partial one starts.

    Frames of one size in a row (a producer's, mostly) are framed together (:func:`_encode_row`): their
    records as one part.  Any other frame's record goes out as three parts (its size and CRC32C, the
    head of its body, and the frame as a view of ``data``) that the kernel gathers: the frame's bytes
    are copied once, to the file.
    """
    # FrameRecord fields 1-4 and the tag of field 5, in field order as protobuf writes them: the
    # same for every frame of the run, so each record is written with no message object
    fields = (b"\x08" + varint(item.conn_id) + b"\x10" + bytes((item.direction,)) + b"\x18" + bytes((origin,))
              + b"\x20" + varint(item.ts_ns) + b"\x2a")
    general = not config.include_payloads
    secret_types = SECRET_PATHS if config.redact else {}
    kinds = _ROW_KINDS_REDACTED if config.redact else _ROW_KINDS
    unpack, pack, crc = _SIZE_PREFIX.unpack_from, _RECORD_HEAD.pack, _crc32c.crc32c
    view = memoryview(data)
    #: frame size -> (the record body up to the frame's bytes, its CRC32C, the body's size): frames of
    #: a run mostly share sizes, and mostly follow one of their own size
    heads: dict[int, tuple[bytes, int, int]] = {}
    last_size = -1
    body_head, head_crc, body_size = b"", 0, 0
    append = out.append
    frames = wire_bytes = 0
    end = len(data)
    #: frames to walk one by one before looking for a row again (a row was too short there)
    walk = 0
    while end - pos >= 10:
        size = unpack(data, pos)[0] + 4
        stop = pos + size
        if stop > end:
            break
        if size != last_size:
            head = heads.get(size)
            if head is None:
                fields_and_size = fields + varint(size)
                body = b"\x12" + varint(len(fields_and_size) + size) + fields_and_size
                head = heads[size] = (body, crc(body), len(body) + size)
            body_head, head_crc, body_size = head
            last_size = size
        if walk:
            walk -= 1
        elif not general and size >= 10 and end - pos >= _ROW_FROM * size and unpack(data, stop)[0] + 4 == size:
            count = _encode_row(view, pos, size, body_head, kinds, out)
            if count:
                pos += count * size
                frames += count
                wire_bytes += count * size
                continue
            walk = _WALK_FOR
        # a command in canonical form opens 08 TYPE (see scanner); others, secrets and stripped
        # payloads go the general way
        kind = data[pos + 9]
        if general or size < 10 or data[pos + 8] != 0x08 or kind > 0x7F or kind in secret_types:
            append(_frame_record(item.conn_id, item.direction, origin, item.ts_ns, bytes(data[pos:stop]), (),
                                 config))
        else:
            frame = view[pos:stop]
            append(pack(body_size, crc(frame, head_crc)))
            append(body_head)
            append(frame)
        pos = stop
        frames += 1
        wire_bytes += size
    if frames:
        result.count(item.conn_id, wire_bytes, frames)
    return pos


#: frames of one size in a row worth framing together (below, one by one costs less)
_ROW_FROM: Final = 32
#: after a row too short, frames framed one by one before looking for a row again
_WALK_FOR: Final = 64
#: command types (the byte after 08) a row may hold: those of canonical form (one-byte varint)
#: that hold no secret, with redaction off and on
_ROW_KINDS: Final = numpy.arange(256) <= 0x7F
_ROW_KINDS_REDACTED: Final = _ROW_KINDS & ~numpy.isin(numpy.arange(256), list(SECRET_PATHS))


def _encode_row(view: memoryview, pos: int, size: int, body_head: bytes, kinds: numpy.ndarray,
                out: list[bytes | memoryview]) -> int:
    """Frame the frames of ``size`` bytes in a row from ``pos`` (each with its record's ``body_head``) as one
    part: the records' bytes, built column by column; returns how many (0: fewer than ``_ROW_FROM``).

    A row ends before the first frame of another size, or not in canonical form, or of a type
    :func:`_encode_run_frames` sends the general way: the same frames it would frame one by one,
    into the same bytes.
    """
    count = (len(view) - pos) // size
    same = leading_same(column(view, pos, count, size, _PREFIX) != size - 4)
    canonical = (column(view, pos + 8, same, size, "u1") == 0x08) & \
        kinds[column(view, pos + 9, same, size, "u1")]
    count = leading_same(~canonical)
    if count < _ROW_FROM:
        return 0
    head = len(body_head)
    records = numpy.empty((count, 8 + head + size), numpy.uint8)
    records[:, :4] = numpy.frombuffer(_SIZE_PREFIX.pack(head + size), numpy.uint8)
    records[:, 8:8 + head] = numpy.frombuffer(body_head, numpy.uint8)
    records[:, 8 + head:] = numpy.ndarray((count, size), numpy.uint8, view, pos, (size, 1))
    # (each row's body is a 1-D view of ``records``: cheaper to make than a slice of ``view``)
    checksums = numpy.fromiter(map(_crc32c.crc32c, records[:, 8:]), ">u4", count)
    records[:, 4:8] = checksums.view(numpy.uint8).reshape(count, 4)
    out.append(records.reshape(-1).data)
    return count


def _protocol_version(raw: bytes, frame_type: int | None) -> int | None:
    try:
        cmd = frame_from_bytes(raw, max_frame_bytes=len(raw)).command
    except ProtocolError:
        return None
    sub = cmd.connect if frame_type == api.BaseCommand.CONNECT else cmd.connected
    return int(sub.protocol_version)


def _make_recording_dir(base: Path, name: str) -> Path:
    """Create ``base/name`` (``base/name-2``, ... if taken), creating ``base`` if missing."""
    try:
        base.mkdir(parents=True, exist_ok=True)
        path = base / name
        suffix = 1
        while True:
            try:
                path.mkdir()
                return path
            except FileExistsError:
                suffix += 1
                path = base / f"{name}-{suffix}"
    except OSError as exc:
        raise RecordingError(f"cannot create a recording in {base}: {exc.strerror or exc}") from None


class FrameRecorder(Protocol):
    """What the proxy's recording observer calls (:class:`proxy.server.recorder.Recorder`): never blocks."""

    def record(self, conn_id: int, direction: str | enum.Enum, origin: str | enum.Enum, ts_ns: int,
               raw: bytes, rules: Sequence[str] = ()) -> bool: ...

    def record_run(self, conn_id: int, direction: str | enum.Enum, ts_ns: int, data: bytes | memoryview, lead: int,
                   stream_pos: int, frames: int = -1) -> bool: ...

    def open_connection(self, conn_id: int, client_addr: Address, broker_addr: Address,
                        lookup_mode: str | enum.Enum | None, ts_ns: int) -> None: ...

    def close_connection(self, conn_id: int, ts_ns: int) -> None: ...


def frame_item(conn_id: int, direction: str | enum.Enum, origin: str | enum.Enum, ts_ns: int, raw: bytes,
               rules: Sequence[str]) -> FrameItem:
    """The queue item for one frame's exact bytes."""
    return FrameItem(conn_id, _code(DIRECTIONS, direction), _code(ORIGINS, origin), ts_ns, bytes(raw),
                     tuple(rules))


def run_item(conn_id: int, direction: str | enum.Enum, ts_ns: int, data: bytes | memoryview, lead: int,
             stream_pos: int, ring_offset: int = -1) -> RunItem:
    """The queue item for bytes passed through unchanged (see ``FrameRecorder.record_run``)."""
    return RunItem(conn_id, _code(DIRECTIONS, direction), ts_ns, data, lead, stream_pos, ring_offset)


class SegmentWriter:
    """Encodes batches of queue items and appends them to a recording's segments (blocking).

    What the recording's writer process runs (:mod:`proxy.recording.writer_process`):
    it keeps the cutting state of every stream; :class:`RecordingBook` keeps the account.
    """

    def __init__(self, path: Path, config: RecordConfig, clock: Callable[[], int] = time.time_ns) -> None:
        self.config = config
        self.files = SegmentFiles(path, path.name, config, clock)
        #: the cutting state per (connection, direction)
        self._streams: dict[tuple[int, int], RunCutter] = {}

    def write(self, batch: Sequence[QueueItem], pace: Callable[[], None] | None = None) -> BatchResult:
        """Encode ``batch`` and append it to the segments; what to account for (``RecordingBook.account``).

        With ``pace`` (the writer process's CPU budget) the batch goes in pieces of ``PACE_BYTES`` of
        runs, ``pace`` called between them: a long batch is held to the writer's share as it goes,
        not only once it is done.  The same records either way.
        """
        result = BatchResult()
        start = 0
        while start < len(batch):
            stop, run_bytes = start, 0
            while stop < len(batch) and (pace is None or run_bytes < PACE_BYTES):
                item = batch[stop]
                if type(item) is RunItem:
                    run_bytes += len(item.data)
                stop += 1
            records, _ = encode_batch(batch[start:stop], self.config, self._streams, result)
            result.bytes_written += self.files.append(records)
            del records  # (its rows' memory goes back before the next piece is built)
            start = stop
            if pace is not None and start < len(batch):
                pace()
        result.segments = len(self.files.segments)
        return result

    def end_streams(self) -> BatchResult:
        """Give up the frames begun and not finished in every stream still open (the recording ends; a
        connection whose close did not reach the queue): what to account for."""
        result = end_streams(self._streams)
        result.segments = len(self.files.segments)
        return result

    def sync(self, index: bytes | None) -> None:
        """fsync the current segment and replace the index when given."""
        self.files.sync(index)

    def close(self, index: bytes | None) -> None:
        """Close the segments (fsynced) and write ``index`` when given."""
        self.files.close(index)


class RecordingBook:
    """One recording's directory and account (see the module docstring); its segments are written
    by a :class:`SegmentWriter` (in the writer process), whose results :meth:`account` counts.

    :meth:`create` blocks (file I/O: call it from a worker thread); the rest only counts.
    """

    def __init__(self, config: RecordConfig, *, clock: Callable[[], int] = time.time_ns,
                 pid: int | None = None) -> None:
        self.config = config
        self.stats = RecorderStats()
        self.pid = os.getpid() if pid is None else pid
        self._clock = clock
        self.connections: dict[int, rpb.ConnectionInfo] = {}
        self._versions: dict[int, dict[bool, int]] = {}
        #: segments written so far (from the writer's results)
        self.segments = 0
        self.index_dirty = True
        self.closed = False
        self.start_ns = 0
        #: the recording directory, set by ``create``
        self.path = Path()

    def create(self) -> None:
        """Create the recording directory and write its first index (blocking)."""
        self.start_ns = self._clock()
        self.path = _make_recording_dir(Path(self.config.dir), recording_dir_name(self.start_ns, self.pid))
        write_index(self.path, self.index_bytes())

    def dropped(self, conn_id: int, frames: int) -> None:
        """``frames`` of ``conn_id`` were not queued (queue full or closed), or were given up by the writer
        (begun and not finished): counted, never written."""
        self.stats.frames_dropped += frames
        info = self.connections.get(conn_id)
        if info is not None:
            info.frames_dropped += frames
        self.index_dirty = True

    def lost(self, batch: Sequence[QueueItem]) -> None:
        """``batch`` left the queue but could not be written (the writer failed): its frames count as dropped."""
        for item in batch:
            if type(item) is RunItem:
                self.dropped(item.conn_id, count_frame_starts(item.data, item.lead))
            elif type(item) is FrameItem:
                self.dropped(item.conn_id, 1)

    def opened(self, conn_id: int, client_addr: Address, broker_addr: Address,
               lookup_mode: str | enum.Enum | None, ts_ns: int) -> rpb.Record:
        """A client connection was accepted: noted in the index; its record for the queue."""
        info = rpb.ConnectionInfo(conn_id=conn_id, start_ns=ts_ns)
        opened = rpb.ConnectionOpened(conn_id=conn_id, ts_ns=ts_ns)
        client, broker = _address(client_addr), _address(broker_addr)
        if client is not None:
            info.client.CopyFrom(client)
            opened.client.CopyFrom(client)
        if broker is not None:
            info.broker.CopyFrom(broker)
            opened.broker.CopyFrom(broker)
        if lookup_mode is not None:
            mode = LOOKUP_MODES.get(_enum_name(lookup_mode), rpb.LOOKUP_UNKNOWN)
            info.lookup_mode = mode
            opened.lookup_mode = mode
        self.connections[conn_id] = info
        self.index_dirty = True
        return rpb.Record(opened=opened)

    def closed_connection(self, conn_id: int, ts_ns: int) -> rpb.Record:
        """A client connection ended: noted in the index; its record for the queue."""
        info = self.connections.get(conn_id)
        if info is None:
            info = self.connections[conn_id] = rpb.ConnectionInfo(conn_id=conn_id)
        info.end_ns = ts_ns
        self.index_dirty = True
        return rpb.Record(closed=rpb.ConnectionClosed(conn_id=conn_id, ts_ns=ts_ns))

    def account(self, result: BatchResult) -> None:
        """Count what a ``SegmentWriter.write`` wrote (on the thread that counts drops, so the counters never race)."""
        self.stats.frames_recorded += result.frames
        self.stats.bytes_written += result.bytes_written
        self.segments = max(self.segments, result.segments)
        self.stats.segments = self.segments
        for conn_id, (frames, wire_bytes) in result.per_connection.items():
            info = self.connections.get(conn_id)
            if info is None:
                info = self.connections[conn_id] = rpb.ConnectionInfo(conn_id=conn_id)
            info.frames += frames
            info.bytes += wire_bytes
        for conn_id, frames in result.lost_per_connection.items():
            self.dropped(conn_id, frames)
        for conn_id, (from_broker, version) in result.versions.items():
            seen = self._versions.setdefault(conn_id, {})
            seen[from_broker] = version
            # CONNECTED carries the version the broker agreed to; CONNECT only the client's offer.
            self.connections[conn_id].protocol_version = seen.get(True, seen.get(False, version))
        self.index_dirty = True

    def changed_index(self) -> bytes | None:
        """The index to write at the next sync, when something changed since the last one."""
        if not self.index_dirty:
            return None
        self.index_dirty = False
        return self.index_bytes()

    def finished_index(self) -> bytes:
        """The index to write on exit: the recording is finished (it gets ``end_ns``)."""
        self.closed = True
        return self.index_bytes()

    def index_bytes(self) -> bytes:
        index = rpb.RecordingIndex(
            format_version=FORMAT_VERSION, recording_id=self.path.name, start_ns=self.start_ns,
            pid=self.pid, frames_recorded=self.stats.frames_recorded,
            frames_dropped=self.stats.frames_dropped, include_payloads=self.config.include_payloads,
            redact=self.config.redact)
        index.segments.extend(segment_name(number) for number in range(1, self.segments + 1))
        index.connections.extend(self.connections[c] for c in sorted(self.connections))
        if self.closed:
            index.end_ns = self._clock()
        data: bytes = index.SerializeToString()
        return data


__all__ = ["DEFAULT_MAX_SEGMENT_BYTES", "DEFAULT_QUEUE_BYTES", "DEFAULT_QUEUE_SIZE", "INDEX_NAME", "PACE_BYTES",
           "SEGMENT_SUFFIX", "Address", "BatchResult", "FrameItem", "FrameRecorder", "QueueItem", "RecordConfig",
           "RecorderStats", "RecordingBook", "RunItem", "SegmentFiles", "SegmentWriter", "encode_batch", "end_streams",
           "frame_item", "recording_dir_name", "run_item", "segment_name", "write_index"]
