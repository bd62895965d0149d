"""Reading recordings: one directory, or a parent holding several, as one stream of frames.

:func:`open_recordings` accepts what every ``REC`` argument accepts (a recording
directory, or a directory of recordings, read in start-time order) and returns a
:class:`RecordingSet`.  Its :meth:`~RecordingSet.frames` yields
:class:`RecordedFrame` objects in capture-time order across connections (and
across recordings), each with its exact wire bytes (payloads zero-filled when
they were not recorded) and a lazily decoded :class:`~proxy.protocol.frame.Frame`.
:attr:`~RecordingSet.connections` is the index of connections.  This is the API
``show``, ``export``, ``analyze`` and replay build on.

**Damage is skipped, and said.**  Every intact record is read: a damaged record
is skipped and the reader resynchronises on the next record boundary
(:class:`~proxy.recording.segment.SegmentDecoder`); a segment cut short by a crash
is read up to its last whole record; a zero-byte segment is noted; an
``index.pb`` that does not decode is ignored and the connections are rebuilt by
scanning the segments (as for a recording whose index was never finished, the
recorder having been killed).  What was skipped is in :attr:`RecordingSet.report`
(and :attr:`Recording.report`), a :class:`ReadReport`, complete once the frames
have been read to the end:

- ``report.skipped``: :class:`~proxy.recording.segment.SkippedRange` list (segment,
  offsets, bytes, records, reason; ``torn`` for a crash's cut-off tail);
- ``report.damaged_records`` / ``damaged_bytes`` / ``torn_bytes``: the totals;
- ``report.empty_segments`` and ``report.index_problem``;
- ``report.problems()``: one line per problem; ``report.summary()``: all of it
  as one line (None when nothing was skipped); ``report.to_json()``.

Commands print ``summary()`` as a warning on stderr (``show --json`` also as its
last line, FORMAT.md).  When several recordings use the same connection ids, the
ids of later recordings are shifted past the earlier ones so that ``conn`` stays
unique (FORMAT.md, "Reading several recordings").
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final

from google.protobuf.message import DecodeError

from proxy.errors import RecordingError
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import Frame, frame_from_bytes
from proxy.recording.redaction import zero_fill
from proxy.recording.segment import SegmentDecoder, SkippedRange
from proxy.recording.writer import INDEX_NAME, SEGMENT_SUFFIX

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
        """The decoded frame; raises a ProtocolError if the recorded bytes are not a valid frame.

        Read leniently: a recording may predate the wire's command checks, so a string
        that is not UTF-8 is shown escaped rather than refused.
        """
        if self._frame is None:
            self._frame = frame_from_bytes(self.raw, max_frame_bytes=max(self.size, 8), strict=False)
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


@dataclass(slots=True)
class ReadReport:
    """What a reader skipped or had to work around; empty when the recording read cleanly."""

    skipped: list[SkippedRange] = field(default_factory=list)
    #: segment files of zero bytes (a recorder killed right after creating them)
    empty_segments: list[str] = field(default_factory=list)
    #: why index.pb was not used (the segments were scanned instead)
    index_problems: list[str] = field(default_factory=list)

    @property
    def index_problem(self) -> str | None:
        return "; ".join(self.index_problems) or None

    @property
    def damaged(self) -> list[SkippedRange]:
        return [r for r in self.skipped if not r.torn]

    @property
    def damaged_records(self) -> int:
        return sum(r.records for r in self.damaged)

    @property
    def damaged_bytes(self) -> int:
        return sum(r.size for r in self.damaged)

    @property
    def torn_bytes(self) -> int:
        return sum(r.size for r in self.skipped if r.torn)

    def __bool__(self) -> bool:
        return bool(self.skipped or self.empty_segments or self.index_problems)

    @classmethod
    def merged(cls, reports: Iterable[ReadReport]) -> ReadReport:
        """One report of several (recordings, or followed recordings)."""
        report = cls()
        for other in reports:
            report.skipped.extend(other.skipped)
            report.empty_segments.extend(other.empty_segments)
            report.index_problems.extend(other.index_problems)
        return report

    def problems(self) -> list[str]:
        """One line per problem."""
        lines = [f"skipped {r.describe()}" for r in self.skipped]
        lines += [f"{name} is empty (0 bytes): no records" for name in self.empty_segments]
        lines += [_index_note(problem) for problem in self.index_problems]
        return lines

    def summary(self, limit: int = 3) -> str | None:
        """Everything as one line (the first ``limit`` ranges named), or None when nothing was skipped."""
        parts: list[str] = []
        damaged = self.damaged
        if damaged:
            records = self.damaged_records
            where = ", ".join(f"{r.segment} {r.start}-{r.end}" for r in damaged[:limit])
            more = f" and {len(damaged) - limit} more" if len(damaged) > limit else ""
            parts.append(f"skipped {records} damaged record{'s' if records != 1 else ''} "
                         f"({self.damaged_bytes} bytes at {where}{more}; reason: {damaged[0].reason})")
        torn = [r for r in self.skipped if r.torn]
        if torn:
            parts.append(f"ignored {self.torn_bytes} bytes of a cut-off record at the end of "
                         + ", ".join(r.segment for r in torn))
        if self.empty_segments:
            parts.append("empty segment" + ("s " if len(self.empty_segments) > 1 else " ")
                         + ", ".join(self.empty_segments))
        parts += [_index_note(problem) for problem in self.index_problems]
        return "; ".join(parts) or None

    def to_json(self) -> dict[str, object]:
        return {"skipped": [r.to_json() for r in self.skipped], "damaged_records": self.damaged_records,
                "damaged_bytes": self.damaged_bytes, "torn_bytes": self.torn_bytes,
                "empty_segments": list(self.empty_segments), "index": self.index_problem}


def _index_note(problem: str) -> str:
    return problem if "missing" in problem else f"{problem}: read the segments instead"


def is_recording_dir(path: Path) -> bool:
    return path.is_dir() and ((path / INDEX_NAME).is_file() or any(path.glob("segment-*" + SEGMENT_SUFFIX)))


class Recording:
    """One recording directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.id = path.name
        self._index_problems: list[str] = []
        self.index = self._read_index()
        self.segments = sorted(p.name for p in path.glob("segment-*" + SEGMENT_SUFFIX))
        if self.index is not None:
            missing = [name for name in self.index.segments if name not in self.segments]
            if missing:
                plural = "s" if len(missing) > 1 else ""
                self._index_problems.append(f"{self.id}/{INDEX_NAME} names missing segment{plural} "
                                            + ", ".join(missing))
        #: segment name -> what was skipped in it (filled in as segments are read to their end)
        self._segment_reports: dict[str, list[SkippedRange]] = {}
        self._empty: set[str] = set()
        self._connections: dict[int, rpb.ConnectionInfo] | None = None

    @property
    def report(self) -> ReadReport:
        """What was skipped in the segments read to their end so far (see the module docstring)."""
        report = ReadReport(index_problems=list(self._index_problems))
        for name in self.segments:
            report.skipped.extend(self._segment_reports.get(name, ()))
            if name in self._empty:
                report.empty_segments.append(f"{self.id}/{name}")
        return report

    @property
    def truncated_bytes(self) -> int:
        """Bytes at segment ends that did not make a whole record (a crash cut them short)."""
        return self.report.torn_bytes

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
            problem = "is empty" if not data else "is damaged"
            self._index_problems.append(f"{self.id}/{INDEX_NAME} {problem}")
            return None
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
        """Every intact record of every segment, in write order (damaged ones skipped, see :attr:`report`)."""
        for name in self.segments:
            yield from self._segment_records(name)

    def _segment_records(self, name: str) -> Iterator[rpb.Record]:
        path = self.path / name
        decoder = SegmentDecoder(f"{self.id}/{name}")
        try:
            handle = open(path, "rb")  # noqa: SIM115 - closed in finally, the generator may stop early
        except OSError as exc:
            raise RecordingError(f"{path}: cannot read: {exc.strerror or exc}") from None
        empty = True
        try:
            while chunk := handle.read(_READ_CHUNK):
                empty = False
                decoder.feed(chunk)
                yield from decoder.records()
        except OSError as exc:
            raise RecordingError(f"{path}: cannot read: {exc.strerror or exc}") from None
        finally:
            handle.close()
        yield from decoder.finish()
        self._segment_reports[name] = list(decoder.skipped)
        if empty:
            self._empty.add(name)

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
    def report(self) -> ReadReport:
        """What the reader skipped in every recording (complete once :meth:`frames` was read to its end)."""
        return ReadReport.merged(rec.report for rec in self.recordings)

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


class _Tail:
    """The part of one recording directory read so far, for :class:`RecordingFollower`."""

    def __init__(self, path: Path, conn_offset: int) -> None:
        self.path = path
        self.id = path.name
        self.conn_offset = conn_offset
        self.segment: str | None = None
        self.handle: BinaryIO | None = None
        self.decoder: SegmentDecoder | None = None
        self.done_segments: set[str] = set()
        self.report = ReadReport()
        self.max_conn = -1
        self.finished = False

    def _index_finished(self) -> bool:
        index = rpb.RecordingIndex()
        try:
            index.ParseFromString((self.path / INDEX_NAME).read_bytes())
        except (OSError, DecodeError, RuntimeError, ValueError):
            return False
        return bool(index.HasField("end_ns"))

    def read(self) -> list[rpb.Record]:
        """Every record written since the last call."""
        finished = self._index_finished()  # before reading: then everything it covers is on disk
        records: list[rpb.Record] = []
        while True:
            if self.segment is None:
                waiting = sorted(p.name for p in self.path.glob("segment-*" + SEGMENT_SUFFIX)
                                 if p.name not in self.done_segments)
                if not waiting:
                    break
                self._open(waiting[0])
            assert self.handle is not None and self.decoder is not None
            while chunk := self.handle.read(_READ_CHUNK):
                self.decoder.feed(chunk)
                records.extend(self.decoder.records())
            rotated = any(p.name > (self.segment or "") for p in self.path.glob("segment-*" + SEGMENT_SUFFIX))
            if not rotated and not finished:
                break
            while chunk := self.handle.read(_READ_CHUNK):  # written between the last read and the rotation
                self.decoder.feed(chunk)
                records.extend(self.decoder.records())
            self._close_segment(records)
        if finished and self.segment is None:
            self.finished = True
        return records

    def _open(self, name: str) -> None:
        try:
            self.handle = open(self.path / name, "rb")  # noqa: SIM115 - closed in _close_segment / close
        except OSError as exc:
            raise RecordingError(f"{self.path / name}: cannot read: {exc.strerror or exc}") from None
        self.segment = name
        self.decoder = SegmentDecoder(f"{self.id}/{name}")

    def _close_segment(self, records: list[rpb.Record]) -> None:
        assert self.decoder is not None and self.handle is not None and self.segment is not None
        records.extend(self.decoder.finish())
        self.report.skipped.extend(self.decoder.skipped)
        if self.handle.tell() == 0:
            self.report.empty_segments.append(f"{self.id}/{self.segment}")
        self.handle.close()
        self.done_segments.add(self.segment)
        self.segment, self.handle, self.decoder = None, None, None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class RecordingFollower:
    """Reads a recording while the proxy writes it (``show --follow``), as ``tail -f`` reads a log.

    ``path`` is a recording directory (followed until the recorder finishes it) or
    a parent of several (the newest one is followed, then each newer one that
    appears, until the caller stops).  :meth:`frames` yields frames as they reach
    the disk, sorted by capture time within each poll, with ``conn`` ids of later
    recordings shifted past the earlier ones'.  :attr:`caught_up` turns true once
    what was already on disk has been yielded.  A record still being written is
    waited for; damaged records are skipped as :class:`Recording` skips them and
    reported in :attr:`report`.
    """

    def __init__(self, path: str | Path, *, poll_seconds: float = 0.2,
                 on_caught_up: Callable[[], None] | None = None) -> None:
        self.on_caught_up = on_caught_up
        self.base = Path(path)
        if not self.base.exists():
            raise RecordingError(f"{self.base}: no such file or directory")
        if not self.base.is_dir():
            raise RecordingError(f"{self.base}: not a recording directory")
        self.single = is_recording_dir(self.base)
        self.poll_seconds = poll_seconds
        self.caught_up = False
        self._tails: list[_Tail] = []

    @property
    def report(self) -> ReadReport:
        return ReadReport.merged(tail.report for tail in self._tails)

    @property
    def recording_ids(self) -> list[str]:
        return [tail.id for tail in self._tails]

    def _newer_recording(self) -> Path | None:
        if self.single:
            return self.base if not self._tails else None
        current = self._tails[-1].id if self._tails else None
        try:
            found = sorted(p for p in self.base.iterdir() if is_recording_dir(p))
        except OSError as exc:
            raise RecordingError(f"{self.base}: cannot read: {exc.strerror or exc}") from None
        newer = [p for p in found if current is None or p.name > current]
        if not newer:
            return None
        return newer[-1] if current is None else newer[0]

    def poll(self) -> list[RecordedFrame]:
        """The frames written since the last poll (none yet: an empty list)."""
        out: list[RecordedFrame] = []
        while True:
            if not self._tails:
                first = self._newer_recording()
                if first is None:
                    return out
                self._tails.append(_Tail(first, 0))
            tail = self._tails[-1]
            for record in tail.read():
                if record.HasField("frame"):
                    frame = frame_from_record(record.frame, tail.id, tail.conn_offset)
                    tail.max_conn = max(tail.max_conn, frame.conn)
                    out.append(frame)
            newer = None if self.single else self._newer_recording()
            if newer is None:
                break
            tail.close()  # a newer proxy run has started: this one is over (finished or killed)
            self._tails.append(_Tail(newer, max(t.max_conn for t in self._tails) + 1))
        out.sort(key=lambda f: f.ts_ns)
        return out

    @property
    def finished(self) -> bool:
        """The followed recording is finished and read (only for a single recording directory)."""
        return self.single and bool(self._tails) and self._tails[-1].finished

    def frames(self) -> Iterator[RecordedFrame]:
        """Frames as they are written, until the recording finishes (a single one) or forever (a parent)."""
        import time

        try:
            while True:
                batch = self.poll()
                yield from batch
                if not self.caught_up:
                    self.caught_up = True
                    if self.on_caught_up is not None:
                        self.on_caught_up()
                if self.finished:
                    return
                time.sleep(self.poll_seconds)
        finally:
            for tail in self._tails:
                tail.close()


def open_recordings(path: str | Path) -> RecordingSet:
    """A recording directory, or a parent of several, ready to read."""
    return RecordingSet([Recording(p) for p in find_recordings(path)])


__all__ = ["DIRECTION_NAMES", "LOOKUP_MODE_NAMES", "ORIGIN_NAMES", "REORDER_WINDOW", "ReadReport", "RecordedFrame",
           "Recording", "RecordingFollower", "RecordingSet", "find_recordings", "frame_from_record",
           "is_recording_dir", "open_recordings"]
