"""The segment codec and redaction, with no I/O: bytes in, records out."""

from __future__ import annotations

import pytest
from recording_sessions import session

from proxy.errors import RecordingError
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import encode_command, encode_payload_command, frame_from_bytes
from proxy.recording.redaction import REDACTED_MARKER, redact, strip_payload, zero_fill
from proxy.recording.segment import (
    SEGMENT_MAGIC,
    SegmentDecoder,
    SkippedRange,
    decode_segment,
    encode_frame_record,
    encode_record,
    scan_segment,
)


def _segment(n: int) -> tuple[bytes, list[rpb.Record]]:
    records = [rpb.Record(header=rpb.SegmentHeader(format_version=1, recording_id="r", segment_index=1,
                                                   created_ns=1))]
    for i, frame in enumerate(session(sends=2)[:n]):
        records.append(rpb.Record(frame=rpb.FrameRecord(conn_id=1, direction=rpb.TO_BROKER, origin=rpb.CLIENT,
                                                        ts_ns=i, data=frame.raw)))
    return SEGMENT_MAGIC + b"".join(encode_record(r) for r in records), records


def test_records_round_trip_and_frame_fast_path_matches_protobuf() -> None:
    data, records = _segment(10)
    decoded, leftover = decode_segment(data)
    assert decoded == records and leftover == 0
    frame = records[1].frame
    assert encode_frame_record(frame) == encode_record(rpb.Record(frame=frame))


def test_a_segment_cut_anywhere_reads_up_to_its_last_whole_record() -> None:
    data, records = _segment(6)
    boundaries = []
    decoder = SegmentDecoder()
    decoder.feed(data)
    for _ in decoder.records():
        boundaries.append(decoder.offset)
    for cut in range(len(SEGMENT_MAGIC), len(data) + 1):
        decoded, leftover = decode_segment(data[:cut])
        whole = sum(1 for b in boundaries if b <= cut)
        assert decoded == records[:whole], cut
        assert leftover == cut - (boundaries[whole - 1] if whole else len(SEGMENT_MAGIC))


def test_a_torn_last_record_is_a_crash_tail_but_damage_before_it_is_an_error() -> None:
    data, records = _segment(4)
    torn = bytearray(data)
    torn[-1] ^= 0xFF  # last record's body damaged: a torn write
    decoded, leftover = decode_segment(bytes(torn))
    assert decoded == records[:-1] and leftover > 0
    damaged = bytearray(data)
    damaged[len(SEGMENT_MAGIC) + 12] ^= 0xFF  # inside the first record, with more after it
    with pytest.raises(RecordingError, match="checksum"):
        decode_segment(bytes(damaged))
    with pytest.raises(RecordingError, match="magic"):
        decode_segment(b"NOTASEGMENT")


def _long_segment(connections: int = 6) -> tuple[bytes, list[rpb.Record], list[tuple[int, int]]]:
    """A segment of many sessions, its records, and each record's [start, end) offsets."""
    records = [rpb.Record(header=rpb.SegmentHeader(format_version=1, recording_id="r", segment_index=1,
                                                   created_ns=1))]
    for conn in range(connections):
        records.append(rpb.Record(opened=rpb.ConnectionOpened(conn_id=conn, ts_ns=conn)))
        for i, frame in enumerate(session(sends=3)):
            records.append(rpb.Record(frame=rpb.FrameRecord(conn_id=conn, direction=rpb.TO_BROKER, origin=rpb.CLIENT,
                                                            ts_ns=i, data=frame.raw)))
        records.append(rpb.Record(closed=rpb.ConnectionClosed(conn_id=conn, ts_ns=conn + 1)))
    encoded = [encode_record(r) for r in records]
    bounds, offset = [], len(SEGMENT_MAGIC)
    for chunk in encoded:
        bounds.append((offset, offset + len(chunk)))
        offset += len(chunk)
    return SEGMENT_MAGIC + b"".join(encoded), records, bounds


def _read(data: bytes, chunk: int | None) -> tuple[list[rpb.Record], list[SkippedRange]]:
    if chunk is None:
        scan = scan_segment(data)
        return scan.records, scan.skipped
    decoder = SegmentDecoder()
    records: list[rpb.Record] = []
    for start in range(0, len(data), chunk):
        decoder.feed(data[start:start + chunk])
        records.extend(decoder.records())
    records.extend(decoder.finish())
    return records, decoder.skipped


@pytest.mark.parametrize("chunk", [None, 13, 4096], ids=["whole", "13-byte-feeds", "4k-feeds"])
def test_damage_anywhere_skips_only_the_records_it_hit_and_says_where(chunk: int | None) -> None:
    """Overwrite 1..200 bytes at random places (record headers, bodies, across boundaries): every record the
    damage did not touch is read, in order, nothing is invented, and the skipped ranges cover the damage."""
    import random

    data, records, bounds = _long_segment()
    rng = random.Random(15)
    for _ in range(120):
        damaged = bytearray(data)
        at = rng.randrange(len(SEGMENT_MAGIC), len(data) - 8)
        length = rng.choice([1, 4, 32, 200])
        fill = rng.choice([b"\x00", b"\xff", b"A", None])
        for index in range(at, min(len(data), at + length)):
            damaged[index] = rng.randrange(256) if fill is None else fill[0]
        changed = [i for i in range(at, min(len(data), at + length)) if damaged[i] != data[i]]
        if not changed:
            continue
        got, skipped = _read(bytes(damaged), chunk)
        intact = [r for r, (start, end) in zip(records, bounds, strict=True)
                  if end <= changed[0] or start > changed[-1]]
        assert got == intact, (at, length)
        assert skipped and all(r.size > 0 for r in skipped)
        first_hit = min(start for start, end in bounds if end > changed[0])
        assert skipped[0].start == first_hit, (at, length, skipped)
        assert skipped[-1].end > changed[-1]


def test_32_bytes_overwritten_inside_one_record_skip_exactly_that_record() -> None:
    data, records, bounds = _long_segment()
    index = max(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])  # the largest record
    start, end = bounds[index]
    damaged = bytearray(data)
    damaged[start + 20:start + 52] = b"\xAA" * 32
    scan = scan_segment(bytes(damaged), "segment-000001.ptap")
    assert scan.records == records[:index] + records[index + 1:]
    assert scan.skipped == [SkippedRange(start, end, 1, "checksum mismatch", segment="segment-000001.ptap")]
    assert scan.skipped[0].describe() == (f"segment-000001.ptap offsets {start}-{end}: 1 record, "
                                          f"{end - start} bytes (checksum mismatch)")
    with pytest.raises(RecordingError, match=f"record at offset {start}: checksum mismatch"):
        decode_segment(bytes(damaged))


def test_a_damaged_magic_still_reads_the_records_after_it() -> None:
    data, records, _ = _long_segment(1)
    scan = scan_segment(b"XXXXXXXX" + data[len(SEGMENT_MAGIC):])
    assert scan.records == records
    assert [(r.start, r.end, r.reason) for r in scan.skipped] == [(0, 8, "not a pulsar-tap segment (bad magic)")]


def test_a_zero_filled_tail_is_a_crash_tail_not_damage() -> None:
    """A file system may extend a file whose data never reached the disk: the tail reads as zeros."""
    data, records, _ = _long_segment(1)
    scan = scan_segment(data + bytes(3000))
    assert scan.records == records
    assert len(scan.skipped) == 1 and scan.skipped[0].torn and scan.torn_bytes == 3000
    assert decode_segment(data + bytes(3000)) == (records, 3000)


def test_a_record_whose_size_field_is_damaged_is_found_again_at_the_end_of_the_input() -> None:
    """A damaged size that points past the end looks like a record still being written until the input ends."""
    data, records, bounds = _long_segment(1)
    start, _ = bounds[3]
    damaged = bytearray(data)
    damaged[start:start + 4] = (len(data) * 2).to_bytes(4, "big")
    decoder = SegmentDecoder()
    decoder.feed(bytes(damaged))
    waiting = list(decoder.records())
    assert waiting == records[:3] and not decoder.skipped  # could be a record still being written
    rest = decoder.finish()
    assert waiting + rest == records[:3] + records[4:]
    assert len(decoder.skipped) == 1 and not decoder.skipped[0].torn


def test_connect_auth_data_and_original_auth_data_are_redacted_keeping_the_frame_size() -> None:
    raw = encode_command(api.CommandConnect(client_version="c", auth_method_name="token", auth_data=b"s3cret-token-xyz",
                                            original_auth_data="original-secret", protocol_version=21))
    redacted, changed = redact(raw)
    assert changed and len(redacted) == len(raw)
    connect = frame_from_bytes(redacted).command.connect
    assert connect.auth_data == b"REDACTED********"
    assert connect.original_auth_data.startswith(REDACTED_MARKER)
    assert b"s3cret" not in redacted and b"original-secret" not in redacted
    assert connect.auth_method_name == "token" and connect.protocol_version == 21


@pytest.mark.parametrize("cmd", [
    api.CommandAuthChallenge(challenge=api.AuthData(auth_method_name="sasl", auth_data=b"challenge-bytes")),
    api.CommandAuthResponse(response=api.AuthData(auth_method_name="sasl", auth_data=b"response-bytes")),
])
def test_auth_challenge_and_response_data_are_redacted(cmd: object) -> None:
    raw = encode_command(cmd)  # type: ignore[arg-type]
    redacted, changed = redact(raw)
    assert changed and b"-bytes" not in redacted and REDACTED_MARKER.encode() in redacted


def test_frames_without_auth_data_pass_unchanged() -> None:
    for frame in session(auth=b""):
        redacted, changed = redact(frame.raw)
        assert redacted is frame.raw and not changed


def test_stripped_payload_keeps_command_and_metadata_and_zero_fills_to_the_wire_size() -> None:
    raw = encode_payload_command(api.CommandSend(producer_id=1, sequence_id=2),
                                 api.MessageMetadata(producer_name="p", sequence_id=2, publish_time=3), b"x" * 100)
    stripped = strip_payload(raw)
    assert stripped is not None and len(stripped) == len(raw) - 100
    restored = frame_from_bytes(zero_fill(stripped, len(raw)))
    assert restored.size == len(raw)
    assert restored.payload is not None and restored.payload.metadata.producer_name == "p"
    assert restored.payload.payload == bytes(100)
    assert strip_payload(encode_command(api.CommandPing())) is None
