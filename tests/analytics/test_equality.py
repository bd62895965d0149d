"""The scaled pipeline's steps give the reference's tables row for row, however the input is split.

No Spark here: :func:`analyze_in_process` runs the same three steps the executors
run, and :func:`reference_tables` is the sequential decoder (every connection through
the session machine in one go) the pipeline was before it scaled.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from proxy.analytics.reference import reference_tables
from proxy.analytics.segments import Split, SplitReader, plan_splits
from proxy.analytics.steps import analyze_in_process
from proxy.analytics.synthetic import Features, SyntheticStats, write_synthetic_recording
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import recording_pb2 as rpb
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.recording.segment import SEGMENT_MAGIC, encode_frame_record, encode_record

ROOT = Path(__file__).resolve().parents[2]
COMPARED = ("frames", "requests", "messages", "replication")


def rows(out: Path, name: str) -> Counter[tuple[Any, ...]]:
    table = pq.read_table(out / name).to_pylist()
    return Counter(tuple(sorted(row.items())) for row in table)


def expected(reference: dict[str, list[dict[str, Any]]], name: str, like: Path) -> Counter[tuple[Any, ...]]:
    columns = set(pq.read_schema(next(like.rglob("*.parquet"))).names) | {"command", "request_command"}
    return Counter(tuple(sorted((k, v) for k, v in row.items() if k in columns)) for row in reference[name])


def assert_same_as_reference(recordings: list[Path], out: Path) -> None:
    reference = reference_tables(recordings)
    for name in COMPARED:
        got, want = rows(out, name), expected(reference, name, out / name)
        assert got == want, (name, list((got - want).items())[:2], list((want - got).items())[:2])
    undecodable = sum(1 for e in pq.read_table(out / "errors").to_pylist() if e["outcome"] == "undecodable")
    assert undecodable == len(reference["problems"])


def damage(path: Path, offset: int, length: int = 32) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + length] = bytes((b ^ 0xA5) for b in data[offset:offset + length])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> SyntheticStats:
    """Chunked messages across segments, geo-replicated messages and markers, a damaged record mid-segment."""
    stats = write_synthetic_recording(tmp_path_factory.mktemp("rich"), 3 * 2**20, connections=12,
                                      segment_bytes=2**20, features=Features(chunked=True, replication=True))
    damage(stats.path / "segment-000002.ptap", 50_000)
    return stats


@pytest.mark.parametrize("split_bytes", [64 * 1024, 300_000, 16 * 2**20])
def test_tables_equal_the_reference_for_any_split_size(rich: SyntheticStats, tmp_path: Path,
                                                       split_bytes: int) -> None:
    result = analyze_in_process([str(rich.path)], str(tmp_path / "out"), split_bytes=split_bytes)
    assert result.splits >= 3
    assert_same_as_reference([rich.path], tmp_path / "out")
    messages = pq.read_table(tmp_path / "out" / "messages").to_pylist()
    chunked = [m for m in messages if m["key"] == "chunky"]
    assert len(chunked) >= rich.chunked - 1  # the damaged record may have held one chunk
    replication = pq.read_table(tmp_path / "out" / "replication").to_pylist()
    assert {r["kind"] for r in replication} == {"replicated_message", "REPLICATED_SUBSCRIPTION_SNAPSHOT"}
    assert all(r["lag_ms"] > 0 for r in replication if r["kind"] == "replicated_message")
    assert all(r["topic"] is not None for r in replication)


def test_a_recording_without_payloads_gives_the_reference_tables(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 2**20, connections=6, segment_bytes=300_000,
                                      features=Features(chunked=True, replication=True, include_payloads=False))
    analyze_in_process([str(stats.path)], str(tmp_path / "out"), split_bytes=100_000)
    assert_same_as_reference([stats.path], tmp_path / "out")


def test_the_official_client_sample_gives_the_reference_tables(tmp_path: Path) -> None:
    sample = ROOT / "recordings" / "sample"
    analyze_in_process([str(sample)], str(tmp_path / "out"), split_bytes=2048)
    assert_same_as_reference([sample], tmp_path / "out")


def test_a_damaged_record_is_skipped_and_the_rest_of_its_segment_is_read(rich: SyntheticStats,
                                                                         tmp_path: Path) -> None:
    result = analyze_in_process([str(rich.path)], str(tmp_path / "out"), split_bytes=64 * 1024)
    (skipped,) = result.figures.skipped
    assert "segment-000002.ptap offsets" in skipped and "checksum mismatch" in skipped
    frames = pq.read_table(tmp_path / "out" / "frames").num_rows
    assert rich.frames - 3 <= frames < rich.frames  # one or two records lost, not a segment


def _segment(records: int) -> tuple[bytes, list[int]]:
    data = bytearray(SEGMENT_MAGIC)
    starts = []
    rng = random.Random(3)
    for i in range(records):
        starts.append(len(data))
        data += encode_record(rpb.Record(frame=rpb.FrameRecord(conn_id=1, direction=rpb.TO_BROKER,
                                                               origin=rpb.CLIENT, ts_ns=i,
                                                               data=rng.randbytes(rng.randint(1, 3000)))))
    return bytes(data), starts


def _read(data: bytes, split_bytes: int) -> tuple[list[int], list[str]]:
    offsets, skipped = [], []
    for split in plan_splits([("r", "segment-000001.ptap", "-", len(data))], split_bytes):
        reader = SplitReader(data, split)
        offsets += [offset for offset, _ in reader.records()]
        skipped += [s.describe() for s in reader.skipped]
    return offsets, skipped


@pytest.mark.parametrize("split_bytes", [500, 4096, 10_000, 1 << 30])
def test_splits_read_every_record_exactly_once_and_skip_damage_once(split_bytes: int) -> None:
    data, starts = _segment(200)
    assert _read(data, split_bytes) == (starts, [])
    damaged = bytearray(data)
    damaged[starts[50] + 20:starts[50] + 24] = b"\x00\xff\x00\xff"  # inside record 50's body
    damaged[starts[120]:starts[120] + 4] = b"\xff\xff\xff\xff"      # record 121's size: impossible
    offsets, skipped = _read(bytes(damaged), split_bytes)
    assert offsets == [s for i, s in enumerate(starts) if i not in (50, 120)]
    assert len(skipped) == 2
    assert "checksum mismatch" in skipped[0] and "claims 4294967295 bytes" in skipped[1]


def test_a_torn_tail_is_reported_as_cut_off() -> None:
    data, starts = _segment(20)
    offsets, skipped = _read(data[:-7], 1000)
    assert offsets == starts[:-1]
    assert len(skipped) == 1 and "cut-off record" in skipped[0]


def test_an_empty_segment_file_is_said_to_be_empty() -> None:
    split = Split(0, "r", "segment-000003.ptap", 3, "-", 0, 0, 0)
    reader = SplitReader(b"", split)
    assert list(reader.records()) == []
    assert [s.describe() for s in reader.skipped] == ["r/segment-000003.ptap: an empty segment file (0 bytes)"]


def test_a_segment_that_is_not_one_is_reported_not_fatal() -> None:
    split = Split(0, "r", "segment-000001.ptap", 1, "-", 0, 20, 20)
    reader = SplitReader(b"not a segment at all", split)
    assert list(reader.records()) == []
    assert "bad magic" in reader.skipped[0].describe()


class Segment:
    """A one-segment recording written frame by frame, a millisecond apart."""

    def __init__(self, recording: Path) -> None:
        self.recording = recording
        self.data = bytearray(SEGMENT_MAGIC)
        self.data += encode_record(rpb.Record(header=rpb.SegmentHeader(
            format_version=1, recording_id=recording.name, segment_index=1, created_ns=1)))
        self.now = 1_763_800_000_000_000_000

    def frame(self, conn_id: int, direction: int, raw: bytes) -> None:
        self.now += 1_000_000
        self.data += encode_frame_record(rpb.FrameRecord(
            conn_id=conn_id, direction=direction, origin=rpb.CLIENT if direction == rpb.TO_BROKER else rpb.BROKER,
            ts_ns=self.now, data=raw))

    def save(self) -> Path:
        self.recording.mkdir(parents=True)
        (self.recording / "segment-000001.ptap").write_bytes(bytes(self.data))
        return self.recording


def test_sends_pair_with_receipts_as_the_session_machine_pairs_them_across_splits(tmp_path: Path) -> None:
    """A resent SEND replaces the waiting one, a stray receipt answers nothing, SEND_ERROR fails it (a batch's
    under its highest sequence id too, as a broker refuses a transactional batch), the last SEND of a connection
    is unanswered, two producers with the same sequence ids stay apart; split anywhere."""
    segment = Segment(tmp_path / "in" / "20251122T083320Z-7")
    frame = segment.frame

    def send(conn_id: int, producer_id: int, sequence_id: int, messages: int = 1) -> None:
        metadata = api.MessageMetadata(producer_name=f"p{producer_id}", sequence_id=sequence_id, publish_time=1)
        frame(conn_id, rpb.TO_BROKER, encode_payload_command(
            api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=messages), metadata,
            b"x" * 40))

    def receipt(conn_id: int, producer_id: int, sequence_id: int) -> None:
        frame(conn_id, rpb.TO_CLIENT, encode_command(api.CommandSendReceipt(producer_id=producer_id,
                                                                            sequence_id=sequence_id)))

    for conn_id in (1, 2):
        frame(conn_id, rpb.TO_BROKER, encode_command(api.CommandConnect(client_version="t", protocol_version=21)))
        for producer_id in (1, 2):
            frame(conn_id, rpb.TO_BROKER, encode_command(api.CommandProducer(
                topic=f"persistent://public/default/t{conn_id}{producer_id}", producer_id=producer_id,
                request_id=producer_id)))
            frame(conn_id, rpb.TO_CLIENT, encode_command(api.CommandProducerSuccess(
                request_id=producer_id, producer_name=f"p{producer_id}")))
    for conn_id in (1, 2):
        send(conn_id, 1, 0)
        send(conn_id, 2, 0)           # the same sequence id, another producer
        receipt(conn_id, 2, 0)
        send(conn_id, 1, 0)           # resent before its receipt: replaces the first
        receipt(conn_id, 1, 0)
        receipt(conn_id, 1, 0)        # a second receipt: nothing waits for it
        receipt(conn_id, 1, 7)        # a receipt for a SEND never seen
        send(conn_id, 1, 1)
        frame(conn_id, rpb.TO_CLIENT, encode_command(api.CommandSendError(
            producer_id=1, sequence_id=1, error=api.PersistenceError, message="disk")))
        send(conn_id, 1, 1)           # sent again after its error: answered below
        frame(conn_id, rpb.TO_BROKER, encode_command(api.CommandCloseProducer(producer_id=2, request_id=9)))
        frame(conn_id, rpb.TO_BROKER, encode_command(api.CommandProducer(
            topic="persistent://public/default/moved", producer_id=2, request_id=10)))
        send(conn_id, 2, 1)           # producer id 2 now names another topic
        receipt(conn_id, 1, 1)
        send(conn_id, 1, 10, messages=3)
        send(conn_id, 1, 13)
        frame(conn_id, rpb.TO_CLIENT, encode_command(api.CommandSendError(
            producer_id=1, sequence_id=12, error=api.NotAllowedError, message="Transaction buffer disable!")))
        receipt(conn_id, 1, 13)
        send(conn_id, 2, 2)           # never answered
    recording = segment.save()
    for split_bytes in (200, 700, 1 << 20):
        out = tmp_path / f"out-{split_bytes}"
        analyze_in_process([str(recording)], str(out), split_bytes=split_bytes)
        assert_same_as_reference([recording], out)
        sends = [r for r in pq.read_table(out / "requests").to_pylist() if r["request_command"] == "SEND"]
        assert Counter((r["conn_id"], r["producer_id"], r["sequence_id"], r["outcome"], r["topic"])
                       for r in sends) == Counter(
            (conn_id, *row) for conn_id in (1, 2) for row in (
                (2, 0, "ok", f"persistent://public/default/t{conn_id}2"),
                (1, 0, "ok", f"persistent://public/default/t{conn_id}1"),
                (1, 1, "error", f"persistent://public/default/t{conn_id}1"),
                (1, 1, "ok", f"persistent://public/default/t{conn_id}1"),
                (1, 10, "error", f"persistent://public/default/t{conn_id}1"),
                (1, 13, "ok", f"persistent://public/default/t{conn_id}1"),
                (2, 1, "unanswered", "persistent://public/default/moved"),
                (2, 2, "unanswered", "persistent://public/default/moved")))


def test_a_damaged_frame_gets_the_same_verdict_and_problem_text_as_the_one_process_reader() -> None:
    """Spark's frame parser runs the protocol's own checks: bytes flipped, cut or added anywhere in a frame get
    the error (class and text) the recording reader gives, or the same type and command size, and the same
    payload section (its quick path for common frames included)."""
    from proxy.analytics.decode import parse_frame
    from proxy.errors import ProtocolError
    from proxy.protocol.frame import frame_from_bytes

    def verdict(parse: Any) -> tuple[str, Any]:
        try:
            return "ok", parse()
        except (ProtocolError, ValueError) as exc:
            return type(exc).__name__, str(exc)

    def head(frame_type: int, cmd_size: int, section: Any) -> tuple[Any, ...]:
        return (frame_type, cmd_size, None if section is None else (
            section.broker_entry_metadata_raw, section.checksum, section.checksum_start, section.metadata_start,
            section.metadata_end, section.payload))

    metadata = api.MessageMetadata(producer_name="p", sequence_id=2, publish_time=1)
    frames = [encode_payload_command(api.CommandSend(producer_id=1, sequence_id=2), metadata, b"x" * 50),
              encode_payload_command(api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(
                  ledgerId=1, entryId=2)), metadata, b"y" * 20,
                  broker_entry_metadata=api.BrokerEntryMetadata(broker_timestamp=3)),
              encode_payload_command(api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(
                  ledgerId=1, entryId=2)), metadata, b"z" * 9),
              encode_command(api.CommandPing()), encode_command(api.CommandFlow(consumer_id=1, messagePermits=10))]
    rng = random.Random(7)
    outcomes: Counter[str] = Counter()
    for _ in range(5000):
        data = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            if roll < 0.5 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif roll < 0.75:
                del data[rng.randrange(len(data) + 1):]
            else:
                data += bytes(rng.randrange(1, 5))
        raw, limit = bytes(data), max(len(data), 8)
        spark = verdict(lambda: parse_frame(raw, limit))  # noqa: B023 (called at once)
        reader = verdict(lambda: (lambda f: (f.type, f.cmd_size, f.payload))(
            frame_from_bytes(raw, limit, strict=False)))  # noqa: B023
        if spark[0] == "ok" and reader[0] == "ok":
            spark, reader = ("ok", head(*spark[1])), ("ok", head(*reader[1]))
        assert spark == reader, raw.hex()
        outcomes[spark[0]] += 1
    assert outcomes["ok"] > 100 and outcomes["MalformedFrame"] > 1000, outcomes


def test_messages_of_a_batch_get_each_column_as_the_reference_reads_it(tmp_path: Path) -> None:
    """Per message, a batch's rows read presence, not only values: a sequence id or key set to its default
    (0, "") is kept, an absent one comes from the batch (first sequence id + index) or is null; properties
    count repeated keys once; event time 0 is null.  Batches that break half-way (a message without
    payload_size, a property without value, stray bytes, a payload past the end) and encrypted or
    unbatched payloads give the reference's rows and problems too, split anywhere."""
    from proxy.protocol.batch import build_batch

    segment = Segment(tmp_path / "in" / "20251122T083320Z-8")
    segment.frame(1, rpb.TO_BROKER, encode_command(api.CommandConnect(client_version="t", protocol_version=21)))
    segment.frame(1, rpb.TO_BROKER, encode_command(api.CommandProducer(
        topic="persistent://public/default/columns", producer_id=1, request_id=1)))
    sequence = 100

    def send(body: bytes, count: int | None, **fields: Any) -> None:
        nonlocal sequence
        metadata = api.MessageMetadata(producer_name="p", sequence_id=sequence, publish_time=5,
                                       uncompressed_size=len(body), **fields)
        if count is not None:
            metadata.num_messages_in_batch = count
        segment.frame(1, rpb.TO_BROKER, encode_payload_command(
            api.CommandSend(producer_id=1, sequence_id=sequence, num_messages=count or 1), metadata, body))
        sequence += 10

    def single(**fields: Any) -> api.SingleMessageMetadata:
        properties = fields.pop("properties", [])
        meta = api.SingleMessageMetadata(**fields)
        for key, value in properties:
            meta.properties.add(key=key, value=value)
        return meta

    varied = [single(payload_size=3), single(payload_size=0, sequence_id=0, partition_key=""),
              single(payload_size=3, sequence_id=7, partition_key="k", event_time=0),
              single(payload_size=3, event_time=99, properties=[("a", "1")]),
              single(payload_size=3, properties=[("a", "1"), ("a", "2"), ("b", "3")]),
              single(payload_size=3, properties=[("a", "1"), ("b", "2")], partition_key="\u00e9")]
    send(build_batch((meta, b"xyz"[:meta.payload_size]) for meta in varied), len(varied))
    send(build_batch([(single(payload_size=3), b"abc")]), 1, partition_key="outer", event_time=4)
    # no properties, but a 0x0a byte (the properties' tag) in the metadata: sequence id 10, payload size 10
    send(build_batch([(single(payload_size=10, sequence_id=10), b"0123456789")]), 1)

    def raw_batch(*parts: tuple[api.SingleMessageMetadata, bytes]) -> bytes:
        out = b""
        for meta, payload in parts:
            encoded = meta.SerializePartialToString()
            out += len(encoded).to_bytes(4, "big") + encoded + payload
        return out

    send(raw_batch((single(payload_size=1), b"a"), (single(sequence_id=3), b"")), 2)  # no payload_size
    lacking = single(payload_size=1)
    lacking.properties.add(key="only-key")
    send(raw_batch((single(payload_size=1), b"a"), (lacking, b"b")), 2)  # a property without its value
    send(raw_batch((single(payload_size=1), b"a")) + b"zz", 1)  # stray bytes
    # a property without its key, tagged over-long (0x8a 0x00): no 0x0a byte anywhere, yet a property
    over_long = b"\x8a\x00\x03\x12\x01v\x18\x01"
    send(len(over_long).to_bytes(4, "big") + over_long + b"a", 1)
    send(raw_batch((single(payload_size=9), b"a")), 1)  # the payload runs past the end
    send(raw_batch((single(payload_size=1), b"a")), 2)  # fewer messages than announced
    send(b"plain message", None, event_time=12, partition_key="solo")
    send(b"sealed", None, encryption_keys=[api.EncryptionKeys(key="k", value=b"v")])
    recording = segment.save()
    for split_bytes in (150, 600, 1 << 20):
        out = tmp_path / f"out-{split_bytes}"
        analyze_in_process([str(recording)], str(out), split_bytes=split_bytes)
        assert_same_as_reference([recording], out)
        messages = pq.read_table(out / "messages").to_pylist()
        assert len(messages) == len(varied) + 1 + 1 + 2
        assert {(m["sequence_id"], m["key"], m["properties_count"], m["event_time_ms"]) for m in messages} >= {
            (100, None, 0, None), (0, "", 0, None), (7, "k", 0, None), (103, None, 1, 99), (104, None, 2, None),
            (105, "\u00e9", 2, None), (110, None, 0, None), (10, None, 0, None), (190, "solo", 0, 12),
            (200, None, 0, None)}
        undecodable = [e for e in pq.read_table(out / "errors").to_pylist() if e["outcome"] == "undecodable"]
        assert len(undecodable) == 6
