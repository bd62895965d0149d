"""The segment file codec: records to bytes and back, with no I/O (recordings/FORMAT.md).

A segment is the 8-byte magic ``PTAPSEG1`` followed by records framed as
``[BODY_SIZE u32 BE][CRC32C(body) u32 BE][body]``, where the body is a serialized
``pulsar_tap.recording.Record`` (proto/recording.proto).  The first record is a
``SegmentHeader``.

**Damage and crashes.**  Segments are append-only, so a crash can only cut the
last record short; other damage (a disk error, a stray write) can hit any record.
:class:`SegmentDecoder` never gives up on a segment: a record whose size is
impossible, whose checksum fails or whose body does not decode is skipped, and
the decoder *resynchronises*: the format has no record marker, so it looks, byte
by byte after the bad record, for the next offset where a whole record holds —

1. the size is plausible (2 bytes up to :data:`MAX_RECORD_BYTES`);
2. the body starts as every ``Record`` does: the tag of one of its four ``oneof``
   fields (``0x0a``, ``0x12``, ``0x1a``, ``0x22``) and a varint length that ends
   exactly at the body's end;
3. the CRC32C of the body matches (a false match is a 1 in 2**32 chance);
4. the body decodes as a ``Record`` with its required fields.

Every skipped stretch is reported as a :class:`SkippedRange` (segment offsets,
bytes, the number of records it held as far as their headers tell, the reason).
A stretch running to the end of the segment with no whole record after it is the
tail of a crash (``torn``) when its first record claims to end at or past the end
of the data, or when it is all zero bytes (a file system that extended the file
but never wrote the data); otherwise it is damage too.

**API** (stable; ``show``, ``export``, replay and ``analyze`` build on it):

- :func:`scan_segment` ``(data, name) -> SegmentScan``: every intact record of a
  whole segment's bytes and the :class:`SkippedRange` list.
- :class:`SegmentDecoder`: the same, incrementally: :meth:`~SegmentDecoder.feed`
  bytes, take :meth:`~SegmentDecoder.records` out, and call
  :meth:`~SegmentDecoder.finish` when the input has ended (it returns the records
  that only the end of the input could settle and closes the last range);
  :attr:`~SegmentDecoder.skipped` lists the ranges so far.  Without ``finish``
  (a segment still being written, ``show --follow``) an incomplete record at the
  end is simply waited for.
- :func:`decode_segment` ``(data) -> (records, torn_bytes)``: the strict reading:
  a torn tail is tolerated, any other damage raises :class:`RecordingError`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from google.protobuf.message import DecodeError

from proxy.errors import RecordingError
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import crc32c

SEGMENT_MAGIC: Final = b"PTAPSEG1"
FORMAT_VERSION: Final = 1
#: A record body larger than this is taken as corruption, not as a record to wait for.
MAX_RECORD_BYTES: Final = 64 * 1024 * 1024
#: The smallest body a Record can have: a oneof tag and a zero length.
MIN_RECORD_BYTES: Final = 2

_RECORD_HEADER = struct.Struct(">II")
_RECORD_HEADER_SIZE: Final = _RECORD_HEADER.size
#: the first byte of every Record body: field 1..4 (header, frame, opened, closed), wire type 2
_RECORD_TAGS: Final = frozenset({0x0A, 0x12, 0x1A, 0x22})
_TAG_BYTES: Final = re.compile(rb"[\x0a\x12\x1a\x22]")


def encode_record(record: rpb.Record) -> bytes:
    """One framed record: size, CRC32C of the body, body."""
    body: bytes = record.SerializeToString()
    return _RECORD_HEADER.pack(len(body), crc32c(body)) + body


def encode_frame_record(frame: rpb.FrameRecord) -> bytes:
    """Frame a FrameRecord without copying it into a Record first (the hot path of the writer).

    A Record holding only field 2 (``frame``) serializes as the tag byte 0x12, the
    length as a varint, then the FrameRecord's bytes: the same bytes protobuf writes.
    """
    inner: bytes = frame.SerializeToString()
    body = b"\x12" + varint(len(inner)) + inner
    return _RECORD_HEADER.pack(len(body), crc32c(body)) + body


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytearray, pos: int, end: int) -> tuple[int, int] | None:
    """(value, bytes used) of the varint at ``pos``, or None if it does not end before ``end``."""
    value = shift = 0
    for index in range(pos, min(end, pos + 10)):
        byte = buf[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index - pos + 1
        shift += 7
    return None


@dataclass(frozen=True, slots=True)
class SkippedRange:
    """Bytes of a segment the decoder could not use: ``[start, end)`` in segment offsets."""

    start: int
    end: int
    #: records the range held, as far as their headers tell (at least 1)
    records: int
    #: why the first record of the range was refused
    reason: str
    #: the cut-off tail of a crash rather than damage
    torn: bool = False
    #: the segment's name (set by the reader; empty for bare bytes)
    segment: str = ""

    @property
    def size(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        """One line: where, how much, and why."""
        where = f"{self.segment} " if self.segment else ""
        if self.torn:
            return f"{where}offsets {self.start}-{self.end}: {self.size} bytes of a cut-off record ({self.reason})"
        count = f"{self.records} record{'s' if self.records != 1 else ''}"
        return f"{where}offsets {self.start}-{self.end}: {count}, {self.size} bytes ({self.reason})"

    def to_json(self) -> dict[str, object]:
        return {"segment": self.segment, "start": self.start, "end": self.end, "bytes": self.size,
                "records": self.records, "reason": self.reason, "torn": self.torn}


@dataclass(slots=True)
class _Damage:
    """A range being skipped while the decoder looks for the next record boundary."""

    start: int
    reason: str
    #: where the refused record claims to end (None: its size is impossible)
    claimed_end: int | None
    #: next offset the chain of record headers from ``start`` points at, and the records counted on it
    chain: int
    chain_records: int = 0


class SegmentDecoder:
    """Incremental reader of one segment that skips damaged records (see the module docstring)."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._buf = bytearray()
        self._base = 0          # segment offset of _buf[0]
        self._pos = 0           # buffer index of the next unread byte (the damage start while resyncing)
        self._scan = 0          # buffer index where the resync scan continues
        self._magic_seen = False
        self._damage: _Damage | None = None
        self._eof = False
        #: every range skipped so far, in segment order
        self.skipped: list[SkippedRange] = []

    @property
    def offset(self) -> int:
        """Segment offset of the next unread byte (the end of the last record returned)."""
        return self._base + self._pos

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    @property
    def truncated(self) -> bool:
        """Bytes are left that do not make a whole record (yet)."""
        return self.buffered > 0

    @property
    def resyncing(self) -> bool:
        return self._damage is not None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        keep = self._pos if self._damage is None else self._scan
        if keep and keep >= len(self._buf) // 2:
            if self._damage is not None:
                self._walk_chain()
                self._scan -= keep
            del self._buf[:keep]
            self._base += keep
            self._pos -= min(self._pos, keep)
        self._buf += data

    def next_record(self) -> rpb.Record | None:
        """The next intact record, or None when more bytes are needed.  Never raises on damage."""
        while True:
            if not self._magic_seen and not self._check_magic():
                return None
            if self._damage is not None and not self._resync():
                return None
            buf, pos = self._buf, self._pos
            if len(buf) - pos < _RECORD_HEADER_SIZE:
                if self._eof and len(buf) > pos:
                    self._begin_damage(f"{len(buf) - pos} bytes, less than a record header", self._base + len(buf))
                    continue
                return None
            size, checksum = _RECORD_HEADER.unpack_from(buf, pos)
            if size < MIN_RECORD_BYTES or size > MAX_RECORD_BYTES:
                self._begin_damage(f"record claims {size} bytes", None)
                continue
            end = pos + _RECORD_HEADER_SIZE + size
            if len(buf) < end:
                if self._eof:
                    self._begin_damage(f"record claims {size} bytes, {len(buf) - pos - 8} follow", self._base + end)
                    continue
                return None
            body = bytes(buf[pos + _RECORD_HEADER_SIZE:end])
            if crc32c(body) != checksum:
                self._begin_damage("checksum mismatch", self._base + end)
                continue
            record = _parse(body)
            if record is None:
                self._begin_damage("undecodable record", self._base + end)
                continue
            self._pos = end
            return record

    def records(self) -> Iterator[rpb.Record]:
        while (record := self.next_record()) is not None:
            yield record

    def finish(self) -> list[rpb.Record]:
        """The input has ended: settle what waited for more bytes, close the last range.

        Returns the records found only now (past a record whose claimed size ran
        beyond the end of the input).
        """
        self._eof = True
        found = list(self.records())
        if self._damage is not None:  # no record boundary after it
            self._close_damage(len(self._buf))
            self._pos = len(self._buf)
        elif not self._magic_seen and self._buf:
            self.skipped.append(SkippedRange(self._base, self._base + len(self._buf), 1,
                                             "shorter than the segment magic", torn=True, segment=self.name))
            self._pos = len(self._buf)
        return found

    # -- damage -------------------------------------------------------------------------------
    def _check_magic(self) -> bool:
        buf = self._buf
        if len(buf) < len(SEGMENT_MAGIC):
            if bytes(buf) != SEGMENT_MAGIC[:len(buf)]:
                self._magic_seen = True
                self._begin_damage("not a pulsar-tap segment (bad magic)", None, scan_from=0)
                return True
            return False
        self._magic_seen = True
        if bytes(buf[:len(SEGMENT_MAGIC)]) == SEGMENT_MAGIC:
            self._pos = len(SEGMENT_MAGIC)
        else:
            self._begin_damage("not a pulsar-tap segment (bad magic)", None, scan_from=0)
        return True

    def _begin_damage(self, reason: str, claimed_end: int | None, *, scan_from: int | None = None) -> None:
        start = self._base + self._pos
        self._damage = _Damage(start, reason, claimed_end, chain=start)
        self._scan = self._pos + 1 if scan_from is None else scan_from
        if scan_from is not None:  # the damage is not a record: nothing to chain through
            self._damage.chain = -1

    def _walk_chain(self, limit: int | None = None) -> None:
        """Count the records whose headers chain from the damage start, as far as the buffer holds them."""
        damage = self._damage
        assert damage is not None
        buf, base = self._buf, self._base
        while damage.chain >= base and (limit is None or damage.chain < limit):
            index = damage.chain - base
            if index + _RECORD_HEADER_SIZE > len(buf):
                return
            damage.chain_records += 1
            size = int.from_bytes(buf[index:index + 4], "big")
            if size < MIN_RECORD_BYTES or size > MAX_RECORD_BYTES:
                damage.chain = -1
                return
            damage.chain += _RECORD_HEADER_SIZE + size

    def _resync(self) -> bool:
        """Look for the next record boundary; True once ``_pos`` is on one, False if more bytes are needed."""
        buf = self._buf
        for match in _TAG_BYTES.finditer(buf, self._scan + _RECORD_HEADER_SIZE):
            candidate = match.start() - _RECORD_HEADER_SIZE
            verdict = self._candidate(candidate)
            if verdict is None:  # cannot tell before more bytes arrive
                self._scan = candidate
                return False
            if verdict:
                self._close_damage(candidate)
                self._pos = candidate
                return True
        self._scan = max(self._scan, len(buf) - _RECORD_HEADER_SIZE)
        return False

    def _candidate(self, pos: int) -> bool | None:
        """Whether a whole, valid record starts at buffer index ``pos`` (None: not decidable yet)."""
        buf = self._buf
        size, checksum = _RECORD_HEADER.unpack_from(buf, pos)
        if size < MIN_RECORD_BYTES or size > MAX_RECORD_BYTES:
            return False
        body_start = pos + _RECORD_HEADER_SIZE
        end = body_start + size
        length_field = _read_varint(buf, body_start + 1, min(end, len(buf)))
        if length_field is None:
            return False if self._eof or len(buf) >= min(end, body_start + 11) else None
        length, used = length_field
        if 1 + used + length != size:
            return False
        if end > len(buf):
            return False if self._eof else None
        body = bytes(buf[body_start:end])
        if crc32c(body) != checksum:
            return False
        return _parse(body) is not None

    def _close_damage(self, end_index: int) -> None:
        damage = self._damage
        assert damage is not None
        end = self._base + end_index
        if damage.chain >= 0:
            self._walk_chain(limit=end)
        records = max(1, damage.chain_records)
        torn = False
        if self._eof and end_index == len(self._buf):  # nothing whole after it: a crash's tail, or damage?
            torn = (damage.claimed_end is not None and damage.claimed_end >= end) or not any(
                self._buf[max(0, damage.start - self._base):end_index])
        self.skipped.append(SkippedRange(damage.start, end, records, damage.reason, torn=torn, segment=self.name))
        self._damage = None


def _parse(body: bytes) -> rpb.Record | None:
    if not body or body[0] not in _RECORD_TAGS:
        return None
    record = rpb.Record()
    try:
        record.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError):
        return None
    # the tag check above means a oneof field is set; its required fields must be too
    return record if record.IsInitialized() else None


@dataclass(slots=True)
class SegmentScan:
    """What :func:`scan_segment` read: the intact records and the skipped ranges."""

    records: list[rpb.Record] = field(default_factory=list)
    skipped: list[SkippedRange] = field(default_factory=list)

    @property
    def torn_bytes(self) -> int:
        return sum(r.size for r in self.skipped if r.torn)

    @property
    def damaged(self) -> list[SkippedRange]:
        return [r for r in self.skipped if not r.torn]


def scan_segment(data: bytes | bytearray | memoryview, name: str = "") -> SegmentScan:
    """Every intact record of a whole segment, and what was skipped (see the module docstring)."""
    decoder = SegmentDecoder(name)
    decoder.feed(data)
    records = list(decoder.records())
    records.extend(decoder.finish())
    return SegmentScan(records, decoder.skipped)


def decode_segment(data: bytes) -> tuple[list[rpb.Record], int]:
    """Every whole record of a segment's bytes, and the count of trailing bytes left over.

    The strict reading: a cut-off (torn) tail is tolerated, any other damage raises
    RecordingError naming the offset of the first damaged record.
    """
    scan = scan_segment(data)
    damaged = scan.damaged
    if damaged:
        first = damaged[0]
        raise RecordingError(f"record at offset {first.start}: {first.reason}")
    return scan.records, scan.torn_bytes


__all__ = ["FORMAT_VERSION", "MAX_RECORD_BYTES", "SEGMENT_MAGIC", "SegmentDecoder", "SegmentScan", "SkippedRange",
           "decode_segment", "encode_frame_record", "encode_record", "scan_segment", "varint"]
