"""``pulsar-tap analyze`` on real local Spark: tables, pairing, report, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from proxy.analytics.decode import connection_tables, segment_columns
from proxy.analytics.synthetic import SyntheticStats, write_synthetic_recording

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "proxy"]
SPARK_TIMEOUT = 600


def analyze(*args: str, env: dict[str, str] | None = None, timeout: float = SPARK_TIMEOUT
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "analyze", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def table(out: Path, name: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = pq.read_table(out / name).to_pylist()
    return rows


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SyntheticStats, Path]:
    """A 100 MiB synthetic recording plus a recording with one damaged segment, analysed once."""
    base = tmp_path_factory.mktemp("recordings")
    stats = write_synthetic_recording(base, 100 * 2**20, connections=48, segment_bytes=8 * 2**20)
    damaged = write_synthetic_recording(base, 2 * 2**20, connections=4, seed=2, name="20251122T093320Z-2",
                                        start_ns=1_763_900_000_000_000_000, segment_bytes=2**20)
    (damaged.path / "segment-000002.ptap").write_bytes(b"not a segment at all")
    out = tmp_path_factory.mktemp("analysis")
    done = analyze(str(base), "--out", str(out), "--master", "local[2]")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, stats, damaged.path


def test_every_table_and_both_reports_are_written(analyzed: tuple[Path, SyntheticStats, Path]) -> None:
    out, _stats, _ = analyzed
    for name in ("frames", "requests", "messages", "errors", "throughput", "replication"):
        assert (out / name).is_dir(), name
    assert "Request latency" in (out / "report.txt").read_text()
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "http" not in page.split("<body>")[1]


def test_tables_hold_what_the_recording_holds(analyzed: tuple[Path, SyntheticStats, Path]) -> None:
    out, stats, _damaged = analyzed
    synthetic = stats.path.name
    frames = [r for r in table(out, "frames") if r["recording"] == synthetic]
    assert len(frames) == stats.frames
    requests = [r for r in table(out, "requests") if r["recording"] == synthetic]
    sends = [r for r in requests if r["request_command"] == "SEND"]
    assert len(sends) == sum(1 for f in frames if f["command"] == "SEND") == stats.sends
    assert Counter(r["outcome"] for r in sends) == {"ok": stats.sends - stats.errors, "error": stats.errors}
    assert all(r["latency_us"] is not None and r["latency_us"] > 0 for r in sends)
    assert {r["topic"] for r in sends} <= {f"persistent://public/default/synthetic-{i}" for i in range(7)}
    messages = [r for r in table(out, "messages") if r["recording"] == synthetic]
    assert len(messages) == stats.messages  # batches split: one row per produced message
    errors = [r for r in table(out, "errors") if r["recording"] == synthetic]
    assert Counter(r["error_code"] for r in errors) == {"PersistenceError": stats.errors}
    throughput = [r for r in table(out, "throughput") if r["topic"].endswith(tuple("0123456"))]
    assert sum(r["messages_in"] for r in throughput) >= stats.messages


def test_requests_latency_matches_show_and_the_session_machine(analyzed: tuple[Path, SyntheticStats, Path],
                                                               tmp_path: Path) -> None:
    out, stats, _ = analyzed
    # pair the same recording in this process, as show and the live tracer do
    expected: dict[tuple[int, str, int | None, int | None], float] = {}
    rows: dict[int, list[tuple[int, tuple[object, ...]]]] = {}
    for index, segment in enumerate(sorted(stats.path.glob("segment-*.ptap")), start=1):
        cols = segment_columns(stats.path.name, segment.name, index, segment.read_bytes())
        for i, conn in enumerate(cols["conn_id"]):
            rows.setdefault(conn, []).append((cols["seq"][i], (
                cols["ts_ns"][i], cols["direction"][i], cols["origin"][i], cols["size"][i], cols["data"][i],
                cols["payload_stripped"][i], cols["rules"][i])))
    for conn, frames in rows.items():
        got = connection_tables(stats.path.name, conn, [f for _, f in sorted(frames, key=lambda x: x[0])])
        req = got.tables["requests"]
        for i, command in enumerate(req["request_command"]):
            expected[(conn, command, req["request_id"][i], req["sequence_id"][i])] = req["latency_us"][i]
    spark_rows = [r for r in table(out, "requests") if r["recording"] == stats.path.name]
    assert len(spark_rows) == len(expected)
    for r in spark_rows:
        key = (r["conn_id"], r["request_command"], r["request_id"], r["sequence_id"])
        assert abs(r["latency_us"] - expected[key]) < 1.0
    # and show --json's latency for the first SEND receipt of the recording agrees
    shown = subprocess.run([*CLI, "show", str(stats.path), "--json", "--command", "SEND_RECEIPT"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr[-2000:]
    first = json.loads(shown.stdout.splitlines()[0])
    if "latency_us" in first:
        key = (first["conn"], "SEND", None, first["fields"]["sequence_id"])
        assert abs(first["latency_us"] - expected[key]) < 1.0


def test_a_damaged_segment_is_reported_and_skipped(analyzed: tuple[Path, SyntheticStats, Path]) -> None:
    out, _stats, damaged = analyzed
    report = (out / "report.txt").read_text()
    assert "segment-000002.ptap" in report and "Skipped input" in report
    frames = [r for r in table(out, "frames") if r["recording"] == damaged.name]
    assert frames  # the other segments were read


def test_strict_mode_fails_on_a_damaged_segment(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 256 * 1024, connections=2, segment_bytes=64 * 1024)
    (stats.path / "segment-000001.ptap").write_bytes(b"PTAPSEG1\x00\x00\x00\x05garbage-after-header")
    done = analyze(str(stats.path), "--out", str(tmp_path / "out"), "--master", "local[1]", "--strict")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "segment-000001.ptap" in last and "Traceback" not in done.stderr


def test_bad_input_gives_one_clear_line(tmp_path: Path) -> None:
    done = analyze(str(tmp_path / "missing"), "--out", str(tmp_path / "out"))
    assert done.returncode != 0
    assert done.stderr.strip() == f"pulsar-tap analyze: error: {tmp_path / 'missing'}: no such file or directory"
    done = analyze(str(tmp_path), "--out", str(tmp_path / "o"), "--since", "yesterday-ish")
    assert done.returncode != 0 and "bad time" in done.stderr and "Traceback" not in done.stderr


def test_no_java_runtime_is_one_clear_error(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 64 * 1024, connections=1)
    bare_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                if not (Path(p) / "java").exists())
    done = analyze(str(stats.path), "--out", str(tmp_path / "out"),
                   env={"JAVA_HOME": str(tmp_path / "no-jdk"), "PATH": bare_path}, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "pulsar-tap analyze: error: no Java runtime found: Spark needs one (install a JDK 17+, e.g. with "
        "'bash scripts/setup.sh', or set JAVA_HOME)"]


@pytest.mark.slow
def test_a_one_gib_recording_of_many_connections_is_analysed(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 2**30, connections=400, segment_bytes=64 * 2**20)
    done = analyze(str(stats.path), "--out", str(tmp_path / "out"), "--master", "local[2]", timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    messages = pq.read_table(tmp_path / "out" / "messages", columns=["sequence_id"]).num_rows
    assert messages == stats.messages
    shutil.rmtree(tmp_path / "in")


def test_official_client_recording_pairs_exactly_as_show_does(tmp_path: Path) -> None:
    """recordings/sample: the official client producing and consuming through the proxy."""
    sample = ROOT / "recordings" / "sample"
    done = analyze(str(sample), "--out", str(tmp_path / "out"), "--master", "local[1]", "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    shown = subprocess.run([*CLI, "show", str(sample), "--json"], capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    assert shown.returncode == 0, shown.stderr[-2000:]
    frames = [json.loads(line) for line in shown.stdout.splitlines()]
    requests = table(tmp_path / "out", "requests")
    sends = [r for r in requests if r["request_command"] == "SEND"]
    assert len(sends) == sum(1 for f in frames if f["command"] == "SEND" and f["origin"] == "client") > 0
    by_end = {(r["conn_id"], r["end_ns"]): r for r in requests}
    answered = [f for f in frames if f.get("latency_us") is not None and f["origin"] != "proxy"]
    assert answered
    for frame in answered:
        row = by_end[(frame["conn"], frame["ts_ns"])]
        assert row["request_command"] == frame["request"]
        assert abs(row["latency_us"] - frame["latency_us"]) < 1.0
    produced = sum(f["num_messages"] for f in frames if f["command"] == "SEND" and f["origin"] == "client")
    assert len(table(tmp_path / "out", "messages")) == produced == 200
