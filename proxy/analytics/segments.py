"""Segment files as Spark's executors read them: byte-range splits, record boundaries, damage.

A segment (recordings/FORMAT.md) is ``PTAPSEG1`` and then records framed as
``[BODY_SIZE u32][CRC32C(body) u32][body]``.  So that every core gets work even when a
recording has fewer segments than there are cores, a segment is cut into
byte-range :class:`Split` s.  A split owns the records that *start* in its range and
reads past its end to finish the last one.

Where a split's first record starts is found by the rule the recording reader uses to
resynchronise after damage (``proxy.recording.segment``): the first offset at or after
the split's start where a whole record holds — a plausible size, a body that starts
with the tag of a ``Record`` field and a length that fills it exactly, a matching
CRC32C, and a body that decodes as a ``Record``.  Damage inside a split is skipped by
the same rule, so the records the splits read together are the records a reader of
the whole segment reads, and the damaged stretches (:class:`SkippedRange`) are each
reported once, by the split in which they start.  A record is accepted only if its
length and checksum hold.

Nothing here does I/O: a split's bytes come in as any buffer (``bytes``, an ``mmap``).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Final, Protocol

from google.protobuf.message import DecodeError

from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import crc32c
from proxy.recording.segment import MAX_RECORD_BYTES, SEGMENT_MAGIC

#: The smallest body a Record can have: a oneof tag and a zero length.
MIN_RECORD_BYTES: Final = 2
#: the first byte of every Record body: field 1..4 (header, frame, opened, closed), wire type 2
_RECORD_TAGS: Final = frozenset({0x0A, 0x12, 0x1A, 0x22})
_TAG_BYTES: Final = re.compile(rb"[\x0a\x12\x1a\x22]")
_HEADER: Final = struct.Struct(">II")
_HEADER_SIZE: Final = 8
_MAGIC_SIZE: Final = len(SEGMENT_MAGIC)


class SegmentBytes(Protocol):
    """What a split reads from: ``bytes`` of a whole segment, or an ``mmap`` of its file."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: slice, /) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Split:
    """A byte range ``[start, end)`` of one segment file; it owns the records starting in it."""

    split_id: int
    #: the recording directory's name (a segment header's recording id overrides it)
    recording: str
    segment: str
    segment_index: int
    #: a local path, or a URL Spark's binaryFile source reads
    location: str
    start: int
    end: int
    #: the whole segment's size in bytes
    size: int


@dataclass(frozen=True, slots=True)
class SkippedRange:
    """Bytes of a segment no record could be read from: ``[start, end)``."""

    recording: str
    segment: str
    start: int
    end: int
    #: records the range held, as far as their headers tell (at least 1)
    records: int
    reason: str
    #: the cut-off tail of a crash rather than damage
    torn: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        """One line: where, how much, and why."""
        where = f"{self.recording}/{self.segment} offsets {self.start}-{self.end}"
        if self.torn:
            if not self.size:
                return f"{self.recording}/{self.segment}: {self.reason} (0 bytes)"
            return f"{where}: {self.size} bytes of a cut-off record at the end ({self.reason})"
        count = f"{self.records} record{'s' if self.records != 1 else ''}"
        return f"{where}: skipped {count}, {self.size} bytes ({self.reason})"


def plan_splits(segments: list[tuple[str, str, str, int]], split_bytes: int, first_id: int = 0) -> list[Split]:
    """Cut segments into splits of about ``split_bytes``.

    ``segments`` are ``(recording, segment file name, location, size)``.  A segment
    smaller than one and a half splits stays whole.
    """
    splits: list[Split] = []
    for recording, segment, location, size in segments:
        index = segment_index(segment)
        pieces = max(1, round(size / split_bytes)) if size > split_bytes * 3 // 2 else 1
        step = -(-size // pieces)
        for piece in range(pieces):
            start = piece * step
            end = size if piece == pieces - 1 else min(size, start + step)
            splits.append(Split(first_id + len(splits), recording, segment, index, location, start, end, size))
    return splits


def taper_splits(splits: list[Split], tasks: int, pieces: int = 4) -> list[Split]:
    """``splits`` with the ``tasks`` smallest (the last a largest-first claimer takes) cut in ``pieces``, renumbered.

    Tasks that claim splits as they go (largest first) end their decoding at most one
    split apart: small last splits let them end together.  Cutting every split that
    small would cost a task's per-split work (opening, edge files) many times over.
    Ids stay in segment order, as :func:`plan_splits` gives them.
    """
    if tasks <= 1 or not splits:
        return splits
    order = sorted(range(len(splits)), key=lambda index: (-(splits[index].end - splits[index].start), index))
    last = set(order[-tasks:])
    tapered: list[Split] = []
    for index, split in enumerate(splits):
        count = pieces if index in last else 1
        step = -(-(split.end - split.start) // count)
        for piece in range(count):
            start = split.start + piece * step
            end = split.end if piece == count - 1 else min(split.end, start + step)
            if start < end or count == 1:
                tapered.append(replace(split, split_id=len(tapered), start=start, end=end))
    return tapered


_SEGMENT_INDEX: Final = re.compile(r"segment-(\d+)\.ptap$")


def segment_index(name: str) -> int:
    match = _SEGMENT_INDEX.search(name)
    return int(match.group(1)) if match else 0


def parse_record(body: bytes) -> rpb.Record | None:
    """The Record a body holds, or None when it is not one (the reader's last acceptance test)."""
    if not body or body[0] not in _RECORD_TAGS:
        return None
    try:
        record = rpb.Record.FromString(body)
    except (DecodeError, RuntimeError, ValueError):
        return None
    if record.WhichOneof("kind") is None or not record.IsInitialized():
        return None
    return record


def _varint(data: SegmentBytes, pos: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    chunk = data[pos:min(end, pos + 10)]
    for index, byte in enumerate(chunk):
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index + 1
        shift += 7
    return None


def record_starts_at(data: SegmentBytes, pos: int) -> bool:
    """Whether a whole, valid record starts at ``pos`` (the resynchronisation test)."""
    total = len(data)
    if pos + _HEADER_SIZE + MIN_RECORD_BYTES > total:
        return False
    size, checksum = _HEADER.unpack(data[pos:pos + _HEADER_SIZE])
    if size < MIN_RECORD_BYTES or size > MAX_RECORD_BYTES:
        return False
    body_start = pos + _HEADER_SIZE
    end = body_start + size
    if end > total:
        return False
    varint = _varint(data, body_start + 1, end)
    if varint is None or 1 + varint[1] + varint[0] != size:
        return False
    body = data[body_start:end]
    return crc32c(body) == checksum and parse_record(body) is not None


def next_record_start(data: SegmentBytes, pos: int, limit: int | None = None) -> int | None:
    """The first offset at or after ``pos`` (and before ``limit``) where a whole record starts."""
    total = len(data)
    stop = total if limit is None else min(total, limit)
    window = 1 << 16
    while pos < stop:
        chunk_end = min(stop, pos + window) + _HEADER_SIZE
        chunk = data[pos:chunk_end]
        for match in _TAG_BYTES.finditer(chunk, _HEADER_SIZE):
            candidate = pos + match.start() - _HEADER_SIZE
            if candidate >= stop:
                return None
            if record_starts_at(data, candidate):
                return candidate
        pos = min(stop, pos + window)
    return None


@dataclass(slots=True)
class SplitReader:
    """Reads the records a split owns; see the module docstring.

    :meth:`records` yields ``(offset, record)``; :attr:`skipped` lists the damaged or
    cut-off stretches that start in the split.
    """

    data: SegmentBytes
    split: Split
    skipped: list[SkippedRange] = field(default_factory=list)

    def records(self) -> Iterator[tuple[int, rpb.Record]]:
        data, split = self.data, self.split
        total = len(data)
        pos: int | None
        if split.start == 0:
            if total < _MAGIC_SIZE and data[0:total] == SEGMENT_MAGIC[:total]:
                self._skip(0, total, "shorter than the segment magic" if total else "an empty segment file",
                           claimed_end=None, torn=True)
                return
            if data[0:_MAGIC_SIZE] == SEGMENT_MAGIC:
                pos = _MAGIC_SIZE
            else:
                pos = self._resync(0, "not a pulsar-tap segment (bad magic)", None, scan_from=0)
        else:
            pos = next_record_start(data, split.start)
        end, unpack, crc, parse, header_size = split.end, _HEADER.unpack, crc32c, parse_record, _HEADER_SIZE
        # Damage is reported by the split whose records run into it, even past the split's end.
        while pos is not None and pos < total:
            if pos + header_size > total:
                pos = self._resync(pos, f"{total - pos} bytes, less than a record header", total)
                continue
            size, checksum = unpack(data[pos:pos + header_size])
            if size < MIN_RECORD_BYTES or size > MAX_RECORD_BYTES:
                pos = self._resync(pos, f"record claims {size} bytes", None)
                continue
            record_end = pos + header_size + size
            if record_end > total:
                pos = self._resync(pos, f"record claims {size} bytes, {total - pos - header_size} follow",
                                   record_end)
                continue
            body = data[pos + header_size:record_end]
            if crc(body) != checksum:
                pos = self._resync(pos, "checksum mismatch", record_end)
                continue
            record = parse(body)
            if record is None:
                pos = self._resync(pos, "undecodable record", record_end)
                continue
            if pos >= end:
                return  # a whole record starting after this split: the next one's
            yield pos, record
            pos = record_end

    def _resync(self, start: int, reason: str, claimed_end: int | None, *, scan_from: int | None = None) -> int | None:
        """Skip the damage starting at ``start``: the next record start, or None at the segment's end."""
        found = next_record_start(self.data, start + 1 if scan_from is None else scan_from)
        end = len(self.data) if found is None else found
        torn = False
        if found is None:  # nothing whole after it: the tail of a crash, or damage?
            torn = (claimed_end is not None and claimed_end >= end) or not any(self.data[start:end])
        self._skip(start, end, reason, claimed_end=claimed_end, torn=torn)
        return found

    def _skip(self, start: int, end: int, reason: str, *, claimed_end: int | None, torn: bool) -> None:
        del claimed_end
        self.skipped.append(SkippedRange(self.split.recording, self.split.segment, start, end,
                                         _chained_records(self.data, start, end), reason, torn))


def _chained_records(data: SegmentBytes, start: int, end: int) -> int:
    """How many records the headers chaining from ``start`` announce before ``end`` (at least 1)."""
    count, pos = 0, start
    while pos < end and pos + _HEADER_SIZE <= len(data):
        count += 1
        size = int.from_bytes(data[pos:pos + 4], "big")
        if size < MIN_RECORD_BYTES or size > MAX_RECORD_BYTES:
            break
        pos += _HEADER_SIZE + size
    return max(1, count)


def segment_recording_id(data: SegmentBytes) -> str | None:
    """The recording id in a segment's header record, if the header is intact."""
    if data[0:_MAGIC_SIZE] != SEGMENT_MAGIC or len(data) < _MAGIC_SIZE + _HEADER_SIZE:
        return None
    size, checksum = _HEADER.unpack(data[_MAGIC_SIZE:_MAGIC_SIZE + _HEADER_SIZE])
    end = _MAGIC_SIZE + _HEADER_SIZE + size
    if size > MAX_RECORD_BYTES or end > len(data):
        return None
    body = data[_MAGIC_SIZE + _HEADER_SIZE:end]
    record = parse_record(body) if crc32c(body) == checksum else None
    if record is None or not record.HasField("header"):
        return None
    return record.header.recording_id or None


__all__ = ["MIN_RECORD_BYTES", "SegmentBytes", "SkippedRange", "Split", "SplitReader", "next_record_start",
           "parse_record", "plan_splits", "record_starts_at", "segment_index", "segment_recording_id",
           "taper_splits"]
