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
from proxy.pb import recording_pb2 as rpb
from proxy.recording.segment import SEGMENT_MAGIC, encode_record

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
