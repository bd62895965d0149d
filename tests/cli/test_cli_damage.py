"""Damaged copies of a real recording (the official client through the recording proxy): every command reads
every intact record, skips the damaged ones and says what it skipped; a damaged index falls back to the segments;
a zero-byte segment is named.  Also ``show --follow`` on a recording being written."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from tap_process import TapProcess, no_traceback

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.recording.reader import open_recordings
from proxy.testing.rig import RecordingProxy, official_session

TOPIC = "persistent://public/default/damage-orders"
DAMAGE_AT = 50_000


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    running = ThreadedCluster(ClusterConfig(brokers=1)).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def recording(cluster: ThreadedCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """900 unbatched messages of the official client, produced and consumed through the recording proxy."""
    with RecordingProxy(cluster.service_url, tmp_path_factory.mktemp("recordings")) as proxy:
        official_session(proxy.service_url, TOPIC, "damage-sub", 900, batching=False)
    path: Path = proxy.recording_path
    assert (path / "segment-000001.ptap").stat().st_size > DAMAGE_AT + 32
    return path


def damaged_copy(recording: Path, tmp_path: Path) -> Path:
    """The recording with 32 bytes overwritten at offset 50 000 of its segment."""
    copy = tmp_path / recording.name
    shutil.copytree(recording, copy)
    with open(copy / "segment-000001.ptap", "r+b") as segment:
        segment.seek(DAMAGE_AT)
        segment.write(b"\xde\xad\xbe\xef" * 8)
    return copy


def tap(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *argv], capture_output=True, text=True, timeout=120)


def frames_of(shown: str) -> list[tuple[int, int, str, str, int]]:
    return [(f["ts_ns"], f["conn"], f["direction"], f["command"], f["size"])
            for f in map(json.loads, shown.splitlines()) if "ts_ns" in f]


def test_the_reader_skips_the_damaged_records_and_reports_offsets_bytes_and_records(recording: Path,
                                                                                    tmp_path: Path) -> None:
    intact = list(open_recordings(recording).frames())
    recordings = open_recordings(damaged_copy(recording, tmp_path))
    frames = list(recordings.frames())
    report = recordings.report
    (skipped,) = report.skipped
    assert skipped.start <= DAMAGE_AT < skipped.end and skipped.end >= DAMAGE_AT + 32 and not skipped.torn
    assert skipped.segment == f"{recording.name}/segment-000001.ptap"
    assert 1 <= len(intact) - len(frames) <= skipped.records <= 3
    assert report.damaged_records == skipped.records and report.damaged_bytes == skipped.size
    read = Counter((f.ts_ns, f.conn, f.direction, f.data) for f in frames)
    recorded = Counter((f.ts_ns, f.conn, f.direction, f.data) for f in intact)
    assert not read - recorded  # nothing invented, every frame exact
    assert (recorded - read).total() == len(intact) - len(frames)


def test_show_and_show_json_read_around_the_damage_and_say_what_they_skipped(recording: Path,
                                                                             tmp_path: Path) -> None:
    damaged = damaged_copy(recording, tmp_path)
    clean = tap("show", str(recording), "--json")
    assert clean.returncode == 0 and "warning" not in clean.stderr
    shown = tap("show", str(damaged), "--json")
    assert shown.returncode == 0 and no_traceback_in(shown)
    lines = shown.stdout.splitlines()
    problems = json.loads(lines[-1])
    assert set(problems) >= {"problems", "skipped", "damaged_records", "damaged_bytes", "frames"}
    (skipped,) = problems["skipped"]
    assert skipped["start"] <= DAMAGE_AT < skipped["end"] and skipped["records"] >= 1
    assert problems["frames"] == len(lines) - 1
    read, recorded = Counter(frames_of(shown.stdout)), Counter(frames_of(clean.stdout))
    assert not read - recorded  # nothing invented
    assert recorded.total() - read.total() == problems["damaged_records"]
    (warning,) = [line for line in shown.stderr.splitlines() if "warning" in line]
    assert warning.startswith("pulsar-tap show: warning: skipped ") and "segment-000001.ptap" in warning
    text = tap("show", str(damaged), "--color", "never")
    assert text.returncode == 0 and no_traceback_in(text)
    assert text.stderr.count("pulsar-tap show: warning: skipped") == 1


def test_export_writes_every_intact_frame_of_a_damaged_recording(recording: Path, tmp_path: Path) -> None:
    damaged = damaged_copy(recording, tmp_path)
    clean = tap("export", str(recording), "--pcap", str(tmp_path / "clean.pcapng"))
    done = tap("export", str(damaged), "--pcap", str(tmp_path / "damaged.pcapng"))
    assert done.returncode == 0 and no_traceback_in(done)
    assert done.stderr.startswith("pulsar-tap export: warning: skipped ") and done.stderr.count("\n") == 1
    frames = {name: int(result.stdout.split(" frames")[0].rsplit(" ", 1)[1]) for name, result in
              (("clean", clean), ("damaged", done))}
    assert 1 <= frames["clean"] - frames["damaged"] <= 3
    assert (tmp_path / "damaged.pcapng").stat().st_size > 0


def test_replay_reads_around_the_damage_both_ways(recording: Path, tmp_path: Path) -> None:
    damaged = damaged_copy(recording, tmp_path)
    fresh = ThreadedCluster(ClusterConfig(brokers=1)).start()
    try:
        replayed = tap("replay", str(damaged), "--upstream", fresh.service_url, "--speed", "0", "--timeout", "3",
                       "--quiet")
    finally:
        fresh.stop()
    assert replayed.returncode in (0, 1) and no_traceback_in(replayed)
    assert replayed.stderr.startswith("pulsar-tap replay: warning: skipped ")
    assert "replayed " in replayed.stderr
    served = TapProcess("replay", str(damaged), "--serve", "--listen", "127.0.0.1:0")
    try:
        served.wait_for("^ready: listening on ")
        served.wait_for("^pulsar-tap replay: warning: skipped ", stream="stderr")
        served.send(signal.SIGTERM)
        assert served.finish() == 0 and no_traceback(served)
        served.wait_for("^replay: served 0 connections", stream="stderr")
    finally:
        served.stop()


def test_a_damaged_index_falls_back_to_scanning_the_segments(recording: Path, tmp_path: Path) -> None:
    copy = tmp_path / recording.name
    shutil.copytree(recording, copy)
    index = copy / "index.pb"
    data = bytearray(index.read_bytes())
    data[len(data) // 2:len(data) // 2 + 32] = b"\xff" * 32
    index.write_bytes(bytes(data))
    clean = tap("show", str(recording), "--json")
    shown = tap("show", str(copy), "--json")
    assert shown.returncode == 0 and no_traceback_in(shown)
    assert frames_of(shown.stdout) == frames_of(clean.stdout)
    assert f"{recording.name}/index.pb is damaged: read the segments instead" in shown.stderr
    recordings = open_recordings(copy)
    assert set(recordings.connections) == set(open_recordings(recording).connections)
    assert recordings.report.index_problem == f"{recording.name}/index.pb is damaged"


def test_a_zero_byte_segment_is_named(recording: Path, tmp_path: Path) -> None:
    copy = tmp_path / recording.name
    shutil.copytree(recording, copy)
    (copy / "segment-000002.ptap").touch()
    shown = tap("show", str(copy), "--json")
    assert shown.returncode == 0
    assert f"empty segment {recording.name}/segment-000002.ptap" in shown.stderr
    assert json.loads(shown.stdout.splitlines()[-1])["empty_segments"] == [f"{recording.name}/segment-000002.ptap"]


def test_show_follow_prints_frames_as_the_proxy_records_them_until_stopped(cluster: ThreadedCluster,
                                                                           tmp_path: Path) -> None:
    """``show --follow`` on a parent directory: it waits for the recording, prints the frames of a session
    that starts after it, with the filters applied, and ends with a summary on SIGINT."""
    follow = TapProcess("show", str(tmp_path), "--follow", "--command", "PRODUCER,SEND_RECEIPT", "--topic",
                        "follow-orders", "--color", "never")
    try:
        with RecordingProxy(cluster.service_url, tmp_path) as proxy:
            follow.wait_for("^following ", stream="stderr")
            session = threading.Thread(target=official_session, args=(proxy.service_url,
                                       "persistent://public/default/follow-orders", "follow-sub", 50),
                                       kwargs={"batching": False})
            session.start()
            follow.wait_for(r" C->B  PRODUCER .* persistent://public/default/follow-orders")
            follow.wait_for(r" B->C  SEND_RECEIPT .*sequence_id=49\b", timeout=60)
            session.join(60)
        follow.send(signal.SIGINT)
        assert follow.finish() == 0 and no_traceback(follow)
    finally:
        follow.stop()
    lines = follow.lines["stdout"]
    assert sum(" SEND_RECEIPT " in line for line in lines) == 50
    assert all(" PRODUCER " in line or " SEND_RECEIPT " in line for line in lines)
    assert "stopped by a signal" in follow.stderr


def test_show_follow_on_a_finished_recording_ends_by_itself(recording: Path) -> None:
    done = tap("show", str(recording), "--follow", "--since", "+0", "--command", "CONNECT", "--color", "never")
    assert done.returncode == 0 and no_traceback_in(done)
    assert len(done.stdout.splitlines()) == sum(1 for f in open_recordings(recording).frames()
                                                if f.frame.type_name == "CONNECT")


def no_traceback_in(result: subprocess.CompletedProcess[str]) -> bool:
    return "Traceback" not in result.stdout and "Traceback" not in result.stderr
