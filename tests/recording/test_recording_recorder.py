"""The Trio recorder writing real files on a tmp dir, read back with the reader."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import trio
import trio.lowlevel
from hypothesis import given, settings
from hypothesis import strategies as st
from recording_sessions import BASE_NS, record_sessions, session

from proxy.core.hooks import Direction, Origin
from proxy.core.run_cutter import RunCutter, count_frame_starts
from proxy.errors import RecordingError
from proxy.pb import recording_pb2 as rpb
from proxy.recording.reader import Recording, open_recordings
from proxy.recording.writer import DIRECTIONS, ORIGINS, RecordConfig, frame_item, recording_dir_name, run_item
from proxy.server.recorder import Recorder


async def test_every_frame_is_read_back_with_its_exact_bytes_in_capture_order(tmp_path: Path) -> None:
    sent = session(conn=1) + session(conn=2, start_ns=BASE_NS + 75_000)
    await record_sessions(str(tmp_path), [session(conn=1), session(conn=2, start_ns=BASE_NS + 75_000)],
                          redact=False)
    recordings = open_recordings(tmp_path)
    got = list(recordings.frames())
    expected = sorted(sent, key=lambda f: f.ts_ns)
    assert [(f.conn, f.direction, f.origin, f.ts_ns, f.raw, f.rules) for f in got] == \
        [(f.conn, f.direction, f.origin, f.ts_ns, f.raw, f.rules) for f in expected]
    assert [f.frame.type_name for f in got] == [f.command for f in expected]


async def test_directory_is_named_by_utc_start_and_pid_and_index_describes_connections(tmp_path: Path) -> None:
    recorder = await record_sessions(str(tmp_path), [session(conn=5)])
    (path,) = list(tmp_path.iterdir())  # noqa: ASYNC240 - a test reading what the recorder wrote
    assert re.fullmatch(r"\d{8}T\d{6}Z-\d+", path.name)
    assert path.name == recording_dir_name(recorder.start_ns, os.getpid())
    recording = Recording(path)
    assert recording.finished
    info = recording.connections[5]
    assert (info.client.host, info.client.port, info.broker.port) == ("127.0.0.1", 50005, 6650)
    assert info.lookup_mode == rpb.REWRITE and info.protocol_version == 21
    frames = session(conn=5)
    assert info.frames == len(frames) and info.bytes == sum(len(f.raw) for f in frames)
    assert info.start_ns == frames[0].ts_ns - 1000 and info.end_ns == frames[-1].ts_ns + 1000
    assert recorder.stats.frames_recorded == len(frames) and recorder.stats.frames_dropped == 0


def test_dir_name_format() -> None:
    assert recording_dir_name(1_767_225_600_123_000_000, 42) == "20260101T000000Z-42"


async def test_auth_data_is_redacted_by_default_and_kept_with_redact_false(tmp_path: Path) -> None:
    await record_sessions(str(tmp_path / "a"), [session(auth=b"very-secret-token")])
    await record_sessions(str(tmp_path / "b"), [session(auth=b"very-secret-token")], redact=False)
    (redacted,) = [f for f in open_recordings(tmp_path / "a").frames() if f.frame.type_name == "CONNECT"]
    (kept,) = [f for f in open_recordings(tmp_path / "b").frames() if f.frame.type_name == "CONNECT"]
    assert redacted.redacted and redacted.frame.command.connect.auth_data == b"REDACTED*********"
    assert not kept.redacted and kept.frame.command.connect.auth_data == b"very-secret-token"
    for segment in (tmp_path / "a").glob("*/segment-*.ptap"):
        assert b"very-secret-token" not in segment.read_bytes()


async def test_payloads_left_out_are_zero_filled_with_true_sizes(tmp_path: Path) -> None:
    frames = session()
    await record_sessions(str(tmp_path), [frames], include_payloads=False)
    got = list(open_recordings(tmp_path).frames())
    for sent, read in zip(frames, got, strict=True):
        assert read.size == len(sent.raw)
        if sent.command in ("SEND", "MESSAGE"):
            assert read.payload_stripped and len(read.data) < len(sent.raw)
            section = read.frame.payload
            assert section is not None and section.payload == bytes(len(section.payload))
            assert section.metadata.producer_name == "prod-1"


async def test_segments_rotate_by_size_and_read_in_order(tmp_path: Path) -> None:
    sessions = [session(conn=c, start_ns=BASE_NS + c * 10_000_000, sends=20) for c in range(1, 4)]
    recorder = await record_sessions(str(tmp_path), sessions, max_segment_bytes=4096)
    recording = open_recordings(tmp_path).recordings[0]
    assert len(recording.segments) >= 4 and recorder.stats.segments == len(recording.segments)
    for name in recording.segments:
        assert (recording.path / name).stat().st_size <= 4096 + 2048  # one frame may overshoot a little
    assert len(list(recording.frames())) == sum(len(s) for s in sessions)


async def test_a_full_queue_drops_frames_counts_them_never_blocks_and_keeps_connection_records(
        tmp_path: Path) -> None:
    # Connection records are written to the segments too (a recording whose proxy died before its index
    # is read from them): a queue full of frames must not refuse them.
    frames = session(sends=50)
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path, queue_size=8)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "proxy-through", BASE_NS)
            accepted = [recorder.record(1, f.direction, f.origin, f.ts_ns, f.raw) for f in frames]  # no checkpoint
            recorder.open_connection(2, "127.0.0.1:5001", "127.0.0.1:6650", "rewrite", BASE_NS + 1)
            recorder.close_connection(1, BASE_NS + 2)
            assert not recorder.record(2, frames[0].direction, frames[0].origin, BASE_NS + 3, frames[0].raw)
            await trio.sleep(0.1)  # the write loop takes the queue: frames are accepted again
            assert recorder.record(2, frames[0].direction, frames[0].origin, BASE_NS + 4, frames[0].raw)
            recorder.close_connection(2, BASE_NS + 5)
    assert accepted.count(True) == 8  # the connection's opened record took no frame's room
    dropped = accepted.count(False)
    assert recorder.stats.frames_dropped == dropped + 1
    recording = open_recordings(tmp_path).recordings[0]
    assert recording.frames_dropped == dropped + 1
    assert recording.connections[1].frames_dropped == dropped
    assert recording.connections[1].lookup_mode == rpb.PROXY_THROUGH
    kinds = [(kind, getattr(record, kind).conn_id) for record in recording.records()
             if (kind := record.WhichOneof("kind")) != "header"]
    assert [kind for kind in kinds if kind[0] != "frame"] == [("opened", 1), ("opened", 2), ("closed", 1),
                                                              ("closed", 2)]
    assert kinds.count(("frame", 1)) == len(frames) - dropped and kinds.count(("frame", 2)) == 1


async def test_data_reaches_disk_within_a_second_while_recording(tmp_path: Path) -> None:
    frames = session()
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            for f in frames:
                recorder.record(1, f.direction, f.origin, f.ts_ns, f.raw)
            await trio.sleep(1.3)
            live = open_recordings(recorder.path).recordings[0]
            assert not live.finished
            assert len(list(live.frames())) == len(frames)
            assert live.index is not None and live.index.connections[0].frames == len(frames)


async def test_a_parent_of_several_recordings_reads_in_time_order_with_unique_connection_ids(tmp_path: Path) -> None:
    await record_sessions(str(tmp_path), [session(conn=1, start_ns=BASE_NS + 10**12)])
    await record_sessions(str(tmp_path), [session(conn=1, start_ns=BASE_NS)])
    recordings = open_recordings(tmp_path)
    assert len(recordings.recordings) == 2
    frames = list(recordings.frames())
    assert [f.ts_ns for f in frames] == sorted(f.ts_ns for f in frames)
    assert sorted({f.conn for f in frames}) == sorted(recordings.connections) == [1, 2]


def test_reading_something_that_is_not_a_recording_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="no such file"):
        open_recordings(tmp_path / "missing")
    with pytest.raises(RecordingError, match="no recording here"):
        open_recordings(tmp_path)


_KILLED_WRITER = textwrap.dedent("""
    import sys, time, trio
    from proxy.pb import PulsarApi_pb2 as api
    from proxy.protocol.frame import encode_payload_command
    from proxy.recording.writer import RecordConfig
    from proxy.server.recorder import Recorder

    async def main():
        async with Recorder(RecordConfig(dir=sys.argv[1], max_segment_bytes=1 << 30)) as rec:
            rec.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", time.time_ns())
            i = 0
            while True:
                raw = encode_payload_command(api.CommandSend(producer_id=1, sequence_id=i),
                                             api.MessageMetadata(producer_name="p", sequence_id=i, publish_time=1),
                                             bytes([i % 251]) * (1000 + i % 5000))
                rec.record(1, "to_broker", "client", time.time_ns(), raw)
                i += 1
                if i % 20 == 0:
                    # paced like real traffic: an unpaced loop only measures the drop counter
                    await trio.sleep(0.002)
    trio.run(main)
""")


def test_a_recorder_killed_mid_write_leaves_a_recording_readable_to_its_last_whole_frame(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            segments = list(tmp_path.glob("*/segment-*.ptap"))
            if segments and segments[0].stat().st_size > 300_000:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the recorder subprocess wrote nothing")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    _wait_for_no_writer_process_of(proc.pid)
    recordings = open_recordings(tmp_path)
    recording = recordings.recordings[0]
    assert not recording.finished
    frames = list(recordings.frames())
    assert len(frames) > 100
    for i, frame in enumerate(frames):
        send = frame.frame
        assert send.command.send.sequence_id == i
        assert send.payload is not None and send.payload.checksum_ok()
    assert recordings.connections[1].frames == len(frames)
    on_disk = sum(p.stat().st_size for p in recording.path.glob("segment-*.ptap"))
    assert recording.truncated_bytes < on_disk
    # and `show` reads it to the last whole frame too; a record the kill cut off is its --json problems line
    shown = subprocess.run([sys.executable, "-m", "proxy", "show", str(tmp_path), "--json"],
                           capture_output=True, text=True, timeout=120, check=True)
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    problems = [line for line in lines if "problems" in line]
    assert len(lines) - len(problems) == len(frames)
    if recording.truncated_bytes:
        assert problems == [lines[-1]]
        assert problems[0]["frames"] == len(frames) and problems[0]["torn_bytes"] == recording.truncated_bytes
        assert problems[0]["damaged_records"] == 0
    else:
        assert not problems


def _writer_processes_of(parent: int) -> list[int]:
    """Pids of the recording writer processes started by ``parent`` (their command line names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"proxy.recording.writer_process" in args and str(parent).encode() in args:
                found.append(int(entry.name))
    return found


def _wait_for_no_writer_process_of(parent: int) -> None:
    deadline = time.monotonic() + 10
    while _writer_processes_of(parent):
        assert time.monotonic() < deadline, "the writer process outlived the killed proxy"
        time.sleep(0.05)


async def test_a_writer_process_that_died_stops_recording_not_the_proxy(tmp_path: Path) -> None:
    """The recorder hands its batches to a writer process.  If that process dies, recording stops
    with one clear reason (``failure``, logged), what would have been written counts as dropped,
    the recorder exits normally (traffic wins), and its index is still finished."""
    frames = session()
    with trio.fail_after(20):
        async with Recorder(RecordConfig(dir=tmp_path)) as recorder:
            (child,) = _writer_processes_of(os.getpid())
            os.kill(child, signal.SIGKILL)
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            for f in frames:
                recorder.record(1, f.direction, f.origin, f.ts_ns, f.raw)
            await trio.sleep(0.3)
            assert recorder.failure is not None and "writer process ended" in recorder.failure
            recorder.record(1, frames[0].direction, frames[0].origin, frames[0].ts_ns, frames[0].raw)
    assert not _writer_processes_of(os.getpid())
    recording = open_recordings(tmp_path).recordings[0]
    assert recording.finished
    assert recording.frames_dropped == recorder.stats.frames_dropped == len(frames) + 1
    assert recording.connections[1].frames_dropped == len(frames) + 1


async def test_the_proxy_observer_hook_feeds_the_recorder(tmp_path: Path) -> None:
    from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, Origin
    from proxy.protocol.frame import frame_from_bytes
    from proxy.protocol.session import Direction
    from proxy.recording.observer import RecordingObserver, broker_address

    assert broker_address("pulsar+ssl://broker-1:6651") == ("broker-1", 6651)
    assert broker_address("pulsar://10.0.0.5") == ("10.0.0.5", 6650)
    assert broker_address(None) is None
    frames = session()
    conn = ConnectionInfo(conn_id=9, client="127.0.0.1:41000", listener="127.0.0.1:6650",
                          broker_url="pulsar://127.0.0.1:6651")
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path)) as recorder:
            observer = RecordingObserver(recorder, lookup_mode="proxy-through")
            observer.on_connection(ConnectionEvent(conn, BASE_NS, closed=False))
            for f in frames:
                observer.on_frame(FrameEvent(conn, Direction(f.direction), Origin(f.origin), f.ts_ns,
                                             frame_from_bytes(f.raw), fired=f.rules))
            observer.on_connection(ConnectionEvent(conn, frames[-1].ts_ns + 1, closed=True, reason="eof"))
    recordings = open_recordings(tmp_path)
    info = recordings.connections[9]
    assert (info.client.port, info.broker.port, info.lookup_mode) == (41000, 6651, rpb.PROXY_THROUGH)
    got = list(recordings.frames())
    assert [(g.origin, g.rules) for g in got] == [(f.origin, f.rules) for f in frames]


async def test_frames_arriving_one_by_one_are_handed_to_the_writer_in_few_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hand-off to the writer process wakes a thread, the child and the Trio loop: frames
    trickling in (as they do through a proxy) are gathered for a moment and written together, all of them."""
    from proxy.recording import writer_process

    batches: list[int] = []
    real_write = writer_process.WriterProcess.write

    def counting_write(self: writer_process.WriterProcess, batch: list[object]) -> object:
        batches.append(len(batch))
        return real_write(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_process.WriterProcess, "write", counting_write)
    frames = session() * 10
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            for f in frames:
                recorder.record(1, f.direction, f.origin, f.ts_ns, f.raw)
                await trio.lowlevel.checkpoint()  # the writer task runs between frames
    assert sum(batches) == len(frames) + 1  # every frame, and the opened record
    assert len(batches) <= 3
    assert len(list(open_recordings(tmp_path).frames())) == len(frames)


def _stream_of(frames: list, direction: str) -> bytes:  # type: ignore[type-arg]
    return b"".join(f.raw for f in frames if f.direction == direction and f.origin != "proxy")


def _cut(data: bytes, sizes: list[int]) -> list[tuple[int, bytes]]:
    """``data`` cut into pieces of the given sizes (cycled): (stream offset, piece)."""
    pieces, pos, index = [], 0, 0
    while pos < len(data):
        size = sizes[index % len(sizes)]
        pieces.append((pos, data[pos:pos + size]))
        pos += size
        index += 1
    return pieces


def _leads(data: bytes, pieces: list[tuple[int, bytes]]) -> list[int]:
    """For each piece, how many of its first bytes finish a frame begun in an earlier piece."""
    starts, pos = set(), 0
    while pos < len(data):
        starts.add(pos)
        pos += int.from_bytes(data[pos:pos + 4], "big") + 4
    leads = []
    for offset, piece in pieces:
        lead = 0
        while lead < len(piece) and offset + lead not in starts:
            lead += 1
        leads.append(lead)
    return leads


async def test_runs_of_passed_through_bytes_are_recorded_as_the_same_frame_records(tmp_path: Path) -> None:
    """The proxy hands the recorder what it passed through unchanged as runs of bytes cut anywhere
    (inside a size prefix, inside a payload): the recording holds every frame whole, byte for byte,
    in order, with auth data redacted — the same records as frames handed over one by one."""
    from proxy.core.hooks import ConnectionEvent, ConnectionInfo, RunEvent
    from proxy.protocol.session import Direction
    from proxy.recording.observer import RecordingObserver

    frames = [f for f in session(sends=6) if f.origin != "proxy"]
    conn = ConnectionInfo(conn_id=4, client="127.0.0.1:41000", listener="127.0.0.1:6650",
                          broker_url="pulsar://127.0.0.1:6651")
    by_frame = tmp_path / "one-by-one"
    await record_sessions(by_frame, [frames])  # the reference: every frame on its own
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path / "runs")) as recorder:
            observer = RecordingObserver(recorder)
            observer.on_connection(ConnectionEvent(conn, BASE_NS, closed=False))
            for direction, sizes in (("to_broker", [1, 3, 7, 200, 2, 64]), ("to_client", [5, 11, 4096, 3])):
                data = _stream_of(frames, direction)
                pieces = _cut(data, sizes)
                for (offset, piece), lead in zip(pieces, _leads(data, pieces), strict=True):
                    observer.on_run(RunEvent(conn, Direction(direction), BASE_NS, piece, lead, offset, BASE_NS))
            observer.on_connection(ConnectionEvent(conn, BASE_NS + 1, closed=True, reason="eof"))
    got = list(open_recordings(tmp_path / "runs").frames())
    reference = list(open_recordings(by_frame).frames())
    for direction in ("to_broker", "to_client"):
        assert [g.raw for g in got if g.direction == direction] == \
            [r.raw for r in reference if r.direction == direction]
    assert all(g.origin == ("client" if g.direction == "to_broker" else "broker") for g in got)
    connect = next(g for g in got if g.frame.type_name == "CONNECT")
    assert connect.redacted and b"token-secret-123" not in connect.raw
    index = open_recordings(tmp_path / "runs").connections[4]
    assert (index.frames, index.bytes) == (len(frames), sum(len(f.raw) for f in frames))


def test_a_run_is_written_as_protobuf_would_write_its_frame_records() -> None:
    """The writer frames a run's records without message objects: the bytes are protobuf's own."""
    from proxy.recording import writer as rec

    config = RecordConfig(dir=Path("unused"))
    frames = [f.raw for f in session(sends=2) if f.direction == "to_client" and f.origin == "broker"]
    run = rec.RunItem(7, rpb.TO_CLIENT, BASE_NS, b"".join(frames), 0, 0)
    fast, result = rec.encode_batch([run], config)
    general, _ = rec.encode_batch([rec.FrameItem(7, rpb.TO_CLIENT, rpb.BROKER, BASE_NS, raw, ())
                                    for raw in frames], config)
    assert b"".join(fast) == b"".join(general) and result.frames == len(frames)


def test_a_dropped_run_loses_only_the_frames_it_touched() -> None:
    """A run the queue dropped leaves a gap in its stream: the frames the gap cuts are left out,
    every other frame is recorded whole, and nothing is mis-cut after it.  Each frame left out is
    counted once: where the run was dropped (the frames that begin in it) or by the writer (the
    frame begun before the gap)."""
    from proxy.recording import writer as rec

    config = RecordConfig(dir=Path("unused"), redact=False)
    frames = [f.raw for f in session(sends=8) if f.direction == "to_broker"]
    data = b"".join(frames)
    pieces = _cut(data, [37])
    leads = _leads(data, pieces)
    items = [rec.RunItem(1, rpb.TO_BROKER, BASE_NS, piece, lead, offset)
             for (offset, piece), lead in zip(pieces, leads, strict=True)]
    for dropped in (len(items) // 2, len(items) // 2 + 2, 3):
        _check_gap(frames, pieces, items, dropped, config)


def _check_gap(frames: list[bytes], pieces: list[tuple[int, bytes]], items: list, dropped: int,  # type: ignore[type-arg]
               config: RecordConfig) -> None:
    from proxy.recording import writer as rec
    from proxy.recording.segment import SEGMENT_MAGIC, scan_segment

    records, result = rec.encode_batch(items[:dropped] + items[dropped + 1:], config)
    kept = [r.frame.data for r in scan_segment(SEGMENT_MAGIC + b"".join(records)).records]
    gap_start, gap_end = pieces[dropped][0], pieces[dropped][0] + len(pieces[dropped][1])
    untouched, touched, pos = [], 0, 0
    for raw in frames:
        if pos + len(raw) <= gap_start or pos >= gap_end:
            untouched.append(raw)
        elif pos < gap_start or pos + len(raw) > gap_end:
            touched += 1  # cut by the gap: neither start nor end was recorded
        pos += len(raw)
    assert kept == untouched and touched >= 1
    counted_where_dropped = count_frame_starts(items[dropped].data, items[dropped].lead)
    assert result.frames == len(kept)
    assert result.frames + result.frames_lost + counted_where_dropped == len(frames)
    assert result.lost_per_connection == ({1: result.frames_lost} if result.frames_lost else {})


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6), dropped=st.sets(st.integers(0, 40)),
       truncate=st.integers(0, 2000), ends=st.sampled_from(["closed", "recording ends"]))
def test_every_frame_of_a_stream_is_recorded_or_counted_once_whatever_runs_were_dropped(
        sizes: list[int], dropped: set[int], truncate: int, ends: str) -> None:
    """Whatever runs are dropped (each counting the frames that begin in it, as the recorder does), and
    whether the stream ends on a whole frame or inside one (the peer went away mid-frame), the frames
    written, the frames counted where runs were dropped and those the writer gave up add up to the
    frames that began in the stream: none is left out, none counted twice.  That holds when the
    connection's close reaches the writer, and when the recording ends without it (a full queue
    refused the close)."""
    from proxy.recording import writer as rec
    from proxy.recording.segment import SEGMENT_MAGIC, scan_segment

    config = RecordConfig(dir=Path("unused"), redact=False)
    data = b"".join(_mixed_stream_frames())
    data = data[:len(data) - truncate]
    pieces = _cut(data, sizes)
    items = [rec.RunItem(1, rpb.TO_BROKER, BASE_NS, piece, lead, offset)
             for (offset, piece), lead in zip(pieces, _leads(data, pieces), strict=True)]
    counted_where_dropped = sum(count_frame_starts(item.data, item.lead)
                                for index, item in enumerate(items) if index in dropped)
    kept_items: list[rec.QueueItem] = [item for index, item in enumerate(items) if index not in dropped]
    if ends == "closed":
        kept_items.append(rpb.Record(closed=rpb.ConnectionClosed(conn_id=1, ts_ns=BASE_NS)))
    streams: dict[tuple[int, int], RunCutter] = {}
    records, result = rec.encode_batch(kept_items, config, streams)
    ended = rec.end_streams(streams) if ends != "closed" else None
    recorded = [r.frame.data for r in scan_segment(SEGMENT_MAGIC + b"".join(records)).records if r.HasField("frame")]
    given_up = result.frames_lost + (ended.frames_lost if ended is not None else 0)
    assert len(recorded) == result.frames
    assert result.frames + counted_where_dropped + given_up == count_frame_starts(data, 0)
    assert set(recorded) <= set(_mixed_stream_frames())  # whole frames only, never mis-cut


def _mixed_stream_frames() -> list[bytes]:
    """A client's frames as the proxy passes them: a session's (with auth data), then SENDs of many sizes."""
    from proxy.pb import PulsarApi_pb2 as api
    from proxy.protocol.frame import encode_payload_command

    frames = [f.raw for f in session(sends=4) if f.direction == "to_broker" and f.origin == "client"]
    for index, size in enumerate([0, 1, 90, 1000, 1000, 1000, 5000, 17, 1000, 70_000, 3, 3, 3]):
        frames.append(encode_payload_command(api.CommandSend(producer_id=1, sequence_id=index),
                                             api.MessageMetadata(producer_name="p", sequence_id=index,
                                                                 publish_time=1), b"x" * size))
    return frames


def test_runs_cut_anywhere_encode_to_the_records_of_the_frames_one_by_one() -> None:
    """The run encoder (records as parts, frames as views, heads shared by frame size) writes the very
    bytes the general one does frame by frame, with redaction and payload stripping on or off."""
    import random

    from proxy.recording import writer as rec

    frames = _mixed_stream_frames()
    data = b"".join(frames)
    rng = random.Random(17)
    for redact in (True, False):
        for include_payloads in (True, False):
            config = RecordConfig(dir=Path("unused"), redact=redact, include_payloads=include_payloads)
            general, _ = rec.encode_batch([rec.FrameItem(3, rpb.TO_BROKER, rpb.CLIENT, BASE_NS, raw, ())
                                           for raw in frames], config)
            for _attempt in range(5):
                pieces = _cut(data, [rng.randint(1, 9000) for _ in range(7)])
                items = [rec.RunItem(3, rpb.TO_BROKER, BASE_NS, piece, lead, offset)
                         for (offset, piece), lead in zip(pieces, _leads(data, pieces), strict=True)]
                parts, result = rec.encode_batch(items, config)
                assert b"".join(parts) == b"".join(general)
                assert (result.frames, result.per_connection[3]) == (len(frames), [len(frames), len(data)])


def test_a_batch_of_record_parts_rotates_segments_exactly_where_whole_records_do(tmp_path: Path) -> None:
    """Segments end between records, at the same records whether a batch comes as parts (a run's
    frames) or as whole records; a batch that fits is written as it is."""
    from proxy.recording import writer as rec

    frames = _mixed_stream_frames() * 3
    config = RecordConfig(dir=tmp_path, max_segment_bytes=20_000)
    whole, _ = rec.encode_batch([rec.FrameItem(3, rpb.TO_BROKER, rpb.CLIENT, BASE_NS, raw, ()) for raw in frames],
                                config)
    data = b"".join(frames)
    parts, _ = rec.encode_batch([rec.RunItem(3, rpb.TO_BROKER, BASE_NS, data, 0, 0)], config)
    assert len(parts) > len(whole)  # the run's records came as parts
    written = {}
    for name, batch in (("whole", whole), ("parts", parts)):
        (tmp_path / name).mkdir()
        files = rec.SegmentFiles(tmp_path / name, "rec-1", config, clock=lambda: 1)
        assert files.append(batch) + files.append(batch) == 2 * sum(len(part) for part in batch)
        files.close(b"")
        written[name] = [(tmp_path / name / segment).read_bytes() for segment in files.segments]
    assert len(written["whole"]) >= 4 and written["parts"] == written["whole"]


def _row_stream_frames(blocks: list[tuple[int, int]]) -> list[bytes]:
    """A stream of rows: per block (kind, frames) that many frames in a row, all of one size unless the kind
    varies them: SENDs of one payload size, receipts, CONNECTs holding auth data (redacted), commands not in
    canonical form (a type past one varint byte, or not opening 08), frames of 10 bytes (the least a command
    takes), SENDs of varying size."""
    from proxy.pb import PulsarApi_pb2 as api
    from proxy.protocol.frame import encode_command, encode_payload_command

    def send(sequence_id: int, payload: int) -> bytes:
        return encode_payload_command(api.CommandSend(producer_id=1, sequence_id=sequence_id),
                                      api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1),
                                      b"y" * payload)

    def bare(command: bytes) -> bytes:
        return (len(command) + 4).to_bytes(4, "big") + len(command).to_bytes(4, "big") + command

    connect = encode_command(api.BaseCommand(type=api.BaseCommand.CONNECT, connect=api.CommandConnect(
        client_version="c", auth_method_name="token", auth_data=b"secret-token", protocol_version=21)))
    receipt = encode_command(api.BaseCommand(type=api.BaseCommand.SEND_RECEIPT, send_receipt=api.CommandSendReceipt(
        producer_id=1, sequence_id=5, message_id=api.MessageIdData(ledgerId=1, entryId=2))))
    makers = [lambda index: send(index % 100, 90), lambda index: send(index % 100, 1000), lambda index: receipt,
              lambda index: connect, lambda index: bare(b"\x08\x86\x01"), lambda index: bare(b"\x10\x06" * 3),
              lambda index: bare(b"\x08\x12"), lambda index: send(1, index % 3)]
    return [makers[kind](index) for kind, count in blocks for index in range(count)]


@settings(max_examples=120, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 90)), min_size=1, max_size=8),
       sizes=st.lists(st.integers(1, 40_000), min_size=1, max_size=5), redact=st.booleans(),
       include_payloads=st.booleans(), ts_ns=st.integers(0, 2**63 - 1), conn_id=st.integers(0, 2**40))
def test_rows_of_frames_of_one_size_are_framed_into_the_bytes_of_their_records_one_by_one(
        blocks: list[tuple[int, int]], sizes: list[int], redact: bool, include_payloads: bool, ts_ns: int,
        conn_id: int) -> None:
    """Frames of one size in a row are framed together (one part of records built as columns): whatever the
    frames, where the runs cut them (inside a size prefix, inside a row), redaction and payloads on or off,
    the bytes are those of the general record path frame by frame."""
    from proxy.recording import writer as rec

    frames = _row_stream_frames(blocks)
    data = b"".join(frames)
    config = RecordConfig(dir=Path("unused"), redact=redact, include_payloads=include_payloads)
    general, _ = rec.encode_batch([rec.FrameItem(conn_id, rpb.TO_CLIENT, rpb.BROKER, ts_ns, raw, ()) for raw in frames],
                                  config)
    pieces = _cut(data, sizes)
    items = [rec.RunItem(conn_id, rpb.TO_CLIENT, ts_ns, memoryview(piece), lead, offset)
             for (offset, piece), lead in zip(pieces, _leads(data, pieces), strict=True)]
    parts, result = rec.encode_batch(items, config)
    assert b"".join(parts) == b"".join(general)
    assert (result.frames, result.per_connection[conn_id]) == (len(frames), [len(frames), len(data)])


@settings(max_examples=25, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 90)), min_size=1, max_size=8),
       max_segment_bytes=st.integers(4_000, 100_000))
def test_segments_rotate_between_the_records_of_a_row_where_whole_records_do(
        tmp_path_factory: pytest.TempPathFactory, blocks: list[tuple[int, int]], max_segment_bytes: int) -> None:
    """A row's records come as one part; a segment still ends between records, at the record where it
    ends when records come one by one."""
    from proxy.recording import writer as rec

    frames = _row_stream_frames(blocks) * 2
    config = RecordConfig(dir=Path("unused"), redact=False, max_segment_bytes=max_segment_bytes)
    whole, _ = rec.encode_batch([rec.FrameItem(3, rpb.TO_BROKER, rpb.CLIENT, BASE_NS, raw, ()) for raw in frames],
                                config)
    parts, _ = rec.encode_batch([rec.RunItem(3, rpb.TO_BROKER, BASE_NS, b"".join(frames), 0, 0)], config)
    written = {}
    for name, batch in (("whole", whole), ("parts", parts)):
        directory = tmp_path_factory.mktemp(name)
        files = rec.SegmentFiles(directory, "rec-1", config, clock=lambda: 1)
        assert files.append(batch) + files.append(batch) == 2 * sum(len(part) for part in batch)
        files.close(b"")
        written[name] = [(directory / segment).read_bytes() for segment in files.segments]
    assert written["parts"] == written["whole"]


async def test_runs_trickling_in_go_to_the_writer_a_gathering_window_at_a_time(tmp_path: Path) -> None:
    """A client below saturation hands the recorder a run per read: they reach the writer process in one batch
    per gathering window (each batch costs the proxy's loop a few turns, which interrupt the relays), unless
    the run ring fills up first: then the window ends early (a batch per ring's worth, not per window).

    With a ring of a few runs, a writer starved of CPU (niced, on a machine whose cores are busy) may not free
    room within the 10 ms between runs: a run refused then is counted, never lost (as the queue's drops are).
    Whether the window ended early shows only where the writer kept up (every write done within 20 ms, while
    two runs came): then a window's 10 runs would have overfilled the ring of 4 and none may be refused; where a
    write took longer (CI's busy cores: 13 of 20 refused), only the accounting and the ring's bound are checked."""
    run = b"".join(f.raw for f in session(sends=3) if f.direction == "to_broker")
    per_run = count_frame_starts(run, 0)
    for queue_bytes, batches_allowed in ((64 << 20, range(1, 5)), (4 * len(run), range(4, 26))):
        async with Recorder(RecordConfig(dir=tmp_path / str(queue_bytes), queue_bytes=queue_bytes)) as recorder:
            batches: list[int] = []
            write_seconds: list[float] = []
            write_batch = recorder._write_batch

            async def counting(batch: list[object], write: object = write_batch, sizes: list[int] = batches,
                               took: list[float] = write_seconds) -> None:
                sizes.append(len(batch))
                start = time.monotonic()
                await write(batch)  # type: ignore[operator]
                took.append(time.monotonic() - start)

            recorder._write_batch = counting  # type: ignore[method-assign,assignment]
            recorder.open_connection(1, ("127.0.0.1", 1), ("127.0.0.1", 2), None, BASE_NS)
            taken = []
            for index in range(20):  # ~0.2 s of runs, 10 ms apart
                taken.append(recorder.record_run(1, "to_broker", BASE_NS + index, run, 0, index * len(run)))
                await trio.sleep(0.01)
        frames = list(open_recordings(recorder.path).frames())
        refused = taken.count(False)
        kept_up = max(write_seconds) < 0.02  # (two runs came meanwhile: the ring held them)
        if queue_bytes == 64 << 20 or kept_up:
            assert refused == 0, (batches, write_seconds)  # (room was never wanting)
        assert len(frames) == (20 - refused) * per_run and recorder.stats.frames_dropped == refused * per_run
        if kept_up or queue_bytes == 64 << 20:
            assert len(batches) in batches_allowed, (batches, refused, write_seconds)
        else:  # (a batch holds at most the ring's 4 runs, and the connection's opening)
            assert -(-(20 - refused) // 4) <= len(batches) <= 25, (batches, refused, write_seconds)


@pytest.mark.parametrize("direction", [*Direction, "to_broker", "TO_CLIENT", "To_Broker"])
@pytest.mark.parametrize("origin", [*Origin, "client", "BROKER", "Proxy"])
def test_queue_items_carry_the_codes_of_directions_and_origins_given_as_members_or_names_in_any_case(
        direction: str, origin: str) -> None:
    """The relay passes enum members (looked up as they are, its fast way); a name in another case still
    finds its code, and the code is the same either way."""
    direction_code = DIRECTIONS[str(direction).lower()]
    assert run_item(1, direction, 0, b"x", 0, 0).direction == direction_code
    item = frame_item(1, direction, origin, 0, b"x", ())
    assert (item.direction, item.origin) == (direction_code, ORIGINS[str(origin).lower()])
