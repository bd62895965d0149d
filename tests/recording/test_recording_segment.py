"""The segment codec and redaction, with no I/O: bytes in, records out."""

from __future__ import annotations

import pytest
from recording_sessions import session

from proxy.errors import RecordingError
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import encode_command, encode_payload_command, frame_from_bytes
from proxy.recording.redaction import REDACTED_MARKER, redact, strip_payload, zero_fill
from proxy.recording.segment import SEGMENT_MAGIC, SegmentDecoder, decode_segment, encode_frame_record, encode_record


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
