"""Reading recordings: one directory, or a parent holding several, as one stream of frames.

:func:`open_recordings` accepts what every ``REC`` argument accepts (a recording
directory, or a directory of recordings, read in start-time order) and returns a
:class:`RecordingSet`.  Its :meth:`~RecordingSet.frames` yields
:class:`RecordedFrame` objects in capture-time order across connections (and
across recordings), each with its exact wire bytes (payloads zero-filled when
they were not recorded) and a lazily decoded :class:`~proxy.protocol.frame.Frame`.
:attr:`~RecordingSet.connections` is the index of connections.  This is the API
``show``, ``export``, ``analyze`` and replay build on.

A segment cut short by a crash is read up to its last whole record; the bytes
lost are reported in :attr:`Recording.truncated_bytes`.  A recording whose index
was never finished (the recorder was killed) gets its connections from the
open/close records in its segments.  When several recordings use the same
connection ids, the ids of later recordings are shifted past the earlier ones so
that ``conn`` stays unique (FORMAT.md, "Reading several recordings").
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from google.protobuf.message import DecodeError

from proxy.errors import RecordingError
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import Frame, frame_from_bytes
from proxy.recording.recorder import INDEX_NAME, SEGMENT_SUFFIX
from proxy.recording.redaction import zero_fill
from proxy.recording.segment import SegmentDecoder

DIRECTION_NAMES: Final[dict[int, str]] = {rpb.TO_BROKER: "to_broker", rpb.TO_CLIENT: "to_client"}
ORIGIN_NAMES: Final[dict[int, str]] = {rpb.CLIENT: "client", rpb.BROKER: "broker", rpb.PROXY: "proxy"}
LOOKUP_MODE_NAMES: Final[dict[int, str]] = {rpb.LOOKUP_UNKNOWN: "unknown", rpb.REWRITE: "rewrite",
                                            rpb.PROXY_THROUGH: "proxy-through"}
#: How far out of capture-time order the recorder's callers may have queued frames.
REORDER_WINDOW: Final = 8192
_READ_CHUNK: Final = 1 << 20


@dataclass(slots=True)
class RecordedFrame:
    """One recorded frame.  ``raw`` is the frame as on the wire (payload zero-filled if stripped)."""

    conn: int
    direction: str
    origin: str
    ts_ns: int
    data: bytes
    size: int
    redacted: bool = False
    payload_stripped: bool = False
    rules: tuple[str, ...] = ()
    recording: str = ""
    _frame: Frame | None = field(default=None, repr=False)

    @property
    def raw(self) -> bytes:
        return zero_fill(self.data, self.size) if self.payload_stripped else self.data

    @property
    def frame(self) -> Frame:
        """The decoded frame; raises a ProtocolError if the recorded bytes are not a valid frame."""
        if self._frame is None:
            self._frame = frame_from_bytes(self.raw, max_frame_bytes=max(self.size, 8))
        return self._frame


def frame_from_record(record: rpb.FrameRecord, recording: str = "", conn_offset: int = 0) -> RecordedFrame:
    stripped = record.payload_stripped
    return RecordedFrame(
        conn=record.conn_id + conn_offset,
        direction=DIRECTION_NAMES.get(record.direction, "to_broker"),
        origin=ORIGIN_NAMES.get(record.origin, "proxy"),
        ts_ns=record.ts_ns,
        data=record.data,
        size=record.original_size if stripped and record.original_size else len(record.data),
        redacted=record.redacted,
        payload_stripped=stripped,
        rules=tuple(record.rules),
        recording=recording,
    )


def is_recording_dir(path: Path) -> bool:
    return path.is_dir() and ((path / INDEX_NAME).is_file() or any(path.glob("segment-*" + SEGMENT_SUFFIX)))


class Recording:
    """One recording directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.id = path.name
        self.index = self._read_index()
        self.segments = sorted(p.name for p in path.glob("segment-*" + SEGMENT_SUFFIX))
        #: bytes at segment ends that did not make a whole record (a crash cut them short)
        self.truncated_bytes = 0
        self._connections: dict[int, rpb.ConnectionInfo] | None = None

    def _read_index(self) -> rpb.RecordingIndex | None:
        path = self.path / INDEX_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RecordingError(f"{path}: cannot read: {exc.strerror or exc}") from None
        index = rpb.RecordingIndex()
        try:
            index.ParseFromString(data)
        except (DecodeError, RuntimeError, ValueError):
            raise RecordingError(f"{path}: not a recording index") from None
        return index

    @property
    def start_ns(self) -> int:
        if self.index is not None:
            return int(self.index.start_ns)
        for record in self.records():
            if record.HasField("header"):
                return int(record.header.created_ns)
            break
        return 0

    @property
    def finished(self) -> bool:
        """The recorder closed this recording cleanly."""
        return self.index is not None and self.index.HasField("end_ns")

    @property
    def frames_dropped(self) -> int:
        return 0 if self.index is None else int(self.index.frames_dropped)

    def records(self) -> Iterator[rpb.Record]:
        """Every whole record of every segment, in write order."""
        self.truncated_bytes = 0
        for name in self.segments:
            yield from self._segment_records(self.path / name)

    def _segment_records(self, path: Path) -> Iterator[rpb.Record]:
        decoder = SegmentDecoder()
        try:
            handle = open(path, "rb")  # noqa: SIM115 - closed in finally, the generator may stop early
        except OSError as exc:
            raise RecordingError(f"{path}: cannot read: {exc.strerror or exc}") from None
        try:
            size = path.stat().st_size
            while chunk := handle.read(_READ_CHUNK):
                decoder.feed(chunk)
                try:
                    yield from decoder.records()
                except RecordingError as exc:
                    end = decoder.pending_end
                    if end is not None and end >= size:
                        break  # a torn last record: the tail of a crash
                    raise RecordingError(f"{path}: {exc}") from None
        finally:
            handle.close()
        self.truncated_bytes += size - decoder.offset

    def frames(self, conn_offset: int = 0) -> Iterator[RecordedFrame]:
        """The recorded frames in write order."""
        for record in self.records():
            if record.HasField("frame"):
                yield frame_from_record(record.frame, self.id, conn_offset)

    @property
    def connections(self) -> dict[int, rpb.ConnectionInfo]:
        """conn id -> ConnectionInfo, from the index, completed from the segments if unfinished."""
        if self._connections is None:
            conns: dict[int, rpb.ConnectionInfo] = {}
            if self.index is not None:
                for info in self.index.connections:
                    conns[info.conn_id] = info
            if not self.finished:
                self._scan_connections(conns)
            self._connections = conns
        return self._connections

    def _scan_connections(self, conns: dict[int, rpb.ConnectionInfo]) -> None:
        counted: dict[int, list[int]] = {}
        for record in self.records():
            kind = record.WhichOneof("kind")
            if kind == "opened":
                opened = record.opened
                info = conns.setdefault(opened.conn_id, rpb.ConnectionInfo(conn_id=opened.conn_id))
                info.start_ns = opened.ts_ns
                if opened.HasField("client"):
                    info.client.CopyFrom(opened.client)
                if opened.HasField("broker"):
                    info.broker.CopyFrom(opened.broker)
                if opened.HasField("lookup_mode"):
                    info.lookup_mode = opened.lookup_mode
            elif kind == "closed":
                closed = record.closed
                conns.setdefault(closed.conn_id, rpb.ConnectionInfo(conn_id=closed.conn_id)).end_ns = closed.ts_ns
            elif kind == "frame":
                counts = counted.setdefault(record.frame.conn_id, [0, 0])
                counts[0] += 1
                counts[1] += record.frame.original_size or len(record.frame.data)
        for conn_id, (frames, wire_bytes) in counted.items():
            info = conns.setdefault(conn_id, rpb.ConnectionInfo(conn_id=conn_id))
            info.frames = max(info.frames, frames)
            info.bytes = max(info.bytes, wire_bytes)


def find_recordings(path: str | Path) -> list[Path]:
    """The recording directories ``path`` names: itself, or its sub-directories that are recordings."""
    base = Path(path)
    if not base.exists():
        raise RecordingError(f"{base}: no such file or directory")
    if not base.is_dir():
        raise RecordingError(f"{base}: not a recording directory")
    if is_recording_dir(base):
        return [base]
    try:
        found = sorted(p for p in base.iterdir() if is_recording_dir(p))
    except OSError as exc:
        raise RecordingError(f"{base}: cannot read: {exc.strerror or exc}") from None
    if not found:
        raise RecordingError(f"{base}: no recording here (expected index.pb or segment files)")
    return found


def _in_time_order(frames: Iterable[RecordedFrame], window: int) -> Iterator[RecordedFrame]:
    """Re-sort a nearly sorted stream by capture time, holding at most ``window`` frames."""
    heap: list[tuple[int, int, RecordedFrame]] = []
    counter = itertools.count()
    for frame in frames:
        heapq.heappush(heap, (frame.ts_ns, next(counter), frame))
        if len(heap) > window:
            yield heapq.heappop(heap)[2]
    while heap:
        yield heapq.heappop(heap)[2]


class RecordingSet:
    """One or several recordings read as one (the ``REC`` argument of every command)."""

    def __init__(self, recordings: list[Recording]) -> None:
        self.recordings = sorted(recordings, key=lambda r: (r.start_ns, r.id))
        self.conn_offsets: list[int] = []
        seen: set[int] = set()
        for rec in self.recordings:
            ids = set(rec.connections)
            offset = max(seen) + 1 - min(ids) if ids & seen else 0
            self.conn_offsets.append(offset)
            seen.update(i + offset for i in ids)

    @property
    def connections(self) -> dict[int, rpb.ConnectionInfo]:
        merged: dict[int, rpb.ConnectionInfo] = {}
        for rec, offset in zip(self.recordings, self.conn_offsets, strict=True):
            for conn_id, info in rec.connections.items():
                merged[conn_id + offset] = info
        return merged

    @property
    def truncated_bytes(self) -> int:
        return sum(r.truncated_bytes for r in self.recordings)

    @property
    def frames_dropped(self) -> int:
        return sum(r.frames_dropped for r in self.recordings)

    def frames(self, *, window: int = REORDER_WINDOW) -> Iterator[RecordedFrame]:
        """Every frame, in capture-time order across connections and recordings."""
        streams = [_in_time_order(rec.frames(offset), window)
                   for rec, offset in zip(self.recordings, self.conn_offsets, strict=True)]
        if len(streams) == 1:
            return streams[0]
        return heapq.merge(*streams, key=lambda f: f.ts_ns)


def open_recordings(path: str | Path) -> RecordingSet:
    """A recording directory, or a parent of several, ready to read."""
    return RecordingSet([Recording(p) for p in find_recordings(path)])


__all__ = ["DIRECTION_NAMES", "LOOKUP_MODE_NAMES", "ORIGIN_NAMES", "REORDER_WINDOW", "RecordedFrame", "Recording",
           "RecordingSet", "find_recordings", "frame_from_record", "is_recording_dir", "open_recordings"]
