"""The segment file codec: records to bytes and back, with no I/O (recordings/FORMAT.md).

A segment is the 8-byte magic ``PTAPSEG1`` followed by records framed as
``[BODY_SIZE u32 BE][CRC32C(body) u32 BE][body]``, where the body is a serialized
``pulsar_tap.recording.Record`` (proto/recording.proto).  The first record is a
``SegmentHeader``.  Segments are append-only, so a crash can only cut the last
record short: :class:`SegmentDecoder` yields every whole record and reports the
cut-off tail as ``truncated`` instead of raising, which is what lets a recording
killed mid-write still be read up to its last whole frame.  Damage anywhere
before the tail (a bad checksum followed by more data) is a :class:`RecordingError`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

from google.protobuf.message import DecodeError

from proxy.errors import RecordingError
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import crc32c

SEGMENT_MAGIC: Final = b"PTAPSEG1"
FORMAT_VERSION: Final = 1
#: A record body larger than this is taken as corruption, not as a record to wait for.
MAX_RECORD_BYTES: Final = 64 * 1024 * 1024

_RECORD_HEADER = struct.Struct(">II")
_RECORD_HEADER_SIZE: Final = _RECORD_HEADER.size


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
    body = b"\x12" + _varint(len(inner)) + inner
    return _RECORD_HEADER.pack(len(body), crc32c(body)) + body


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class SegmentDecoder:
    """Incremental reader of one segment: ``feed`` bytes, take whole records out.

    When the input ends, :attr:`truncated` tells whether a partial record was left
    over (the crash case); :meth:`finish` returns that count of bytes.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._magic_seen = False
        #: offset in the segment of the next unread byte
        self.offset = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def next_record(self) -> rpb.Record | None:
        """The next whole record, or None when more bytes are needed."""
        buf, pos = self._buf, self._pos
        if not self._magic_seen:
            if len(buf) - pos < len(SEGMENT_MAGIC):
                if bytes(buf[pos:]) != SEGMENT_MAGIC[:len(buf) - pos]:
                    raise RecordingError("not a pulsar-tap segment (bad magic)")
                return None
            if bytes(buf[pos:pos + len(SEGMENT_MAGIC)]) != SEGMENT_MAGIC:
                raise RecordingError("not a pulsar-tap segment (bad magic)")
            self._magic_seen = True
            pos += len(SEGMENT_MAGIC)
            self._pos = pos
            self.offset += len(SEGMENT_MAGIC)
        if len(buf) - pos < _RECORD_HEADER_SIZE:
            return None
        size, checksum = _RECORD_HEADER.unpack_from(buf, pos)
        if size > MAX_RECORD_BYTES:
            raise RecordingError(f"record at offset {self.offset} claims {size} bytes")
        end = pos + _RECORD_HEADER_SIZE + size
        if len(buf) < end:
            return None
        body = bytes(buf[pos + _RECORD_HEADER_SIZE:end])
        if crc32c(body) != checksum:
            raise RecordingError(f"record at offset {self.offset} fails its checksum")
        record = rpb.Record()
        try:
            record.ParseFromString(body)
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise RecordingError(f"record at offset {self.offset} is undecodable: {exc}") from None
        if not record.IsInitialized():
            raise RecordingError(f"record at offset {self.offset} lacks required fields")
        self._pos = end
        self.offset += end - pos
        return record

    def records(self) -> Iterator[rpb.Record]:
        while (record := self.next_record()) is not None:
            yield record

    @property
    def pending_end(self) -> int | None:
        """Where the record being read would end (segment offset), once its size is buffered."""
        if not self._magic_seen or self.buffered < 4:
            return None
        size = int.from_bytes(self._buf[self._pos:self._pos + 4], "big")
        return self.offset + _RECORD_HEADER_SIZE + size

    @property
    def truncated(self) -> bool:
        """Bytes are left that do not make a whole record (the writer stopped mid-record)."""
        return self.buffered > 0


def decode_segment(data: bytes) -> tuple[list[rpb.Record], int]:
    """Every whole record of a segment's bytes, and the count of trailing bytes left over.

    A checksum failure in the very last record is treated as a torn write (the
    tail of a crash), not as corruption.
    """
    decoder = SegmentDecoder()
    decoder.feed(data)
    records: list[rpb.Record] = []
    while True:
        try:
            record = decoder.next_record()
        except RecordingError:
            end = decoder.pending_end
            if end is not None and end >= len(data):
                return records, len(data) - decoder.offset
            raise
        if record is None:
            return records, decoder.buffered
        records.append(record)


__all__ = ["FORMAT_VERSION", "MAX_RECORD_BYTES", "SEGMENT_MAGIC", "SegmentDecoder", "decode_segment",
           "encode_frame_record", "encode_record"]
