"""The run ring: the recorder copies passed-through bytes into shared memory once, the writer
process reads them where they lie, and the space is reused once they are written."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from recording_sessions import BASE_NS, session

from proxy.core.run_cutter import count_frame_starts
from proxy.pb import recording_pb2 as rpb
from proxy.recording.reader import open_recordings
from proxy.recording.run_ring import RunRing
from proxy.recording.writer import RecordConfig, RunItem
from proxy.server.recorder import Recorder


def test_runs_take_space_in_order_wrap_around_and_are_refused_when_it_is_full() -> None:
    ring = RunRing.create(100)
    try:
        assert ring.put(b"a" * 40) == 0
        assert ring.put(b"b" * 40) == 40
        assert ring.put(b"c" * 40) is None  # 20 left at the end, nothing before the oldest
        ring.release(1)  # the oldest written: 40 free at the start
        assert ring.put(b"c" * 30) == 0  # does not fit at the end: wraps
        assert ring.put(b"d" * 10) == 30
        assert ring.put(b"e" * 1) is None  # would run into the oldest ("b" at 40)
        assert bytes(ring.view[0:40]) == b"c" * 30 + b"d" * 10 and bytes(ring.view[40:80]) == b"b" * 40
        ring.take_back()  # "d" was not queued after all: its space is free again
        assert ring.put(b"f" * 10) == 30
        ring.release(3)
        assert ring.runs == 0
        assert ring.put(b"g" * 100) == 0  # empty: from the start, the whole ring
        assert ring.put(b"") is None and ring.runs == 1
    finally:
        ring.close()


def test_past_its_first_mib_the_ring_goes_back_to_its_start_when_that_is_free() -> None:
    """While the writer keeps up, runs reuse the same pages; a backlog spreads over the whole ring."""
    ring = RunRing.create(100)
    ring.reuse_from = 30
    try:
        assert [ring.put(b"a" * 10) for _ in range(3)] == [0, 10, 20]
        ring.release(2)  # 20 free at the start: less than reuse_from
        assert ring.put(b"b" * 10) == 30
        ring.release(1)  # 30 free at the start
        assert ring.put(b"c" * 10) == 0  # back to the start
        assert ring.put(b"d" * 10) == 10  # (wrapped: up to the oldest run, at 30)
        assert ring.put(b"e" * 15) is None
        ring.release(1)  # "b" written
        assert ring.put(b"e" * 15) == 20  # not wrapped any more: after the head
        assert [ring.put(b"f" * 20) for _ in range(4)] == [35, 55, 75, None]  # a backlog: the whole ring
    finally:
        ring.close()


def _resident_kib(ring: RunRing) -> int:
    """The ring's pages in memory (its memfd's allocated blocks), in KiB."""
    import os

    assert ring.fd is not None
    return os.fstat(ring.fd).st_blocks // 2


def test_the_first_pages_are_written_before_traffic_and_the_rest_given_back_once_no_run_lies_there() -> None:
    ring = RunRing.create(1 << 20)
    ring.reuse_from = 256 * 1024
    try:
        assert _resident_kib(ring) == 0
        ring.prefault()
        assert _resident_kib(ring) == 256
        for _ in range(8):
            ring.put(b"r" * (100 * 1024))
        ring.release(7)
        assert _resident_kib(ring) >= 800
        ring.tick()  # runs went past the first pages since the start: kept
        ring.tick()  # nothing came since, but a run still lies past them: kept
        assert _resident_kib(ring) >= 800 and bytes(ring.view[700 * 1024:700 * 1024 + 4]) == b"rrrr"
        ring.release(1)
        assert ring.put(b"s" * 1024) == 0  # back at the start
        ring.tick()
        assert _resident_kib(ring) == 256  # the pages runs reuse stay, and so does the run in them
        assert bytes(ring.view[:1024]) == b"s" * 1024
        # Traffic trickling on after a burst (a run in the ring at every tick) no longer keeps the burst's pages.
        ring.release(1)  # ("s")
        for _ in range(16):  # (a burst this long after the one before: the next trim still waits one tick, see below)
            ring.tick()
        assert ring.put(b"u" * (300 * 1024)) == 0  # past the first pages
        resident = []
        for _ in range(3):
            ring.put(b"v" * 1024)  # the first after "u", past the first pages; then back at the start
            ring.release(1)
            ring.tick()
            resident.append(_resident_kib(ring))
        assert ring.runs == 1 and resident[0] >= 300 and resident[1:] == [256, 256]
        ring.take_back()
        assert ring.put(b"w" * (300 * 1024)) is not None  # past the first pages again: taken back, not counted
        ring.take_back()
        ring.tick()
        for _ in range(4):  # (back two quiet ticks after "u": the next trim waits four)
            ring.tick()
        assert _resident_kib(ring) == 256
    finally:
        ring.close()


def test_bursts_that_come_back_soon_after_a_trim_have_the_pages_kept_longer_and_a_late_one_not() -> None:
    """Saturating bursts a few seconds apart would fault the pages a trim gave back in again at each burst: a
    burst back past the first pages after a trim has the next trim wait twice the quiet ticks before it (up to
    TRIM_AFTER_MOST); one that comes TRIM_AFTER_MOST or more quiet ticks later, one tick again."""
    ring = RunRing.create(1 << 20)
    ring.reuse_from = 256 * 1024
    try:
        ring.prefault()

        def burst_after(quiet: int) -> None:  # quiet ticks, then runs past the first pages, seen by a tick
            for _ in range(quiet):
                ring.tick()
            assert ring.put(b"b" * (300 * 1024)) is not None
            ring.release(1)
            ring.tick()

        def ticks_kept() -> int:  # quiet ticks until the burst's pages are given back
            for ticks in range(1, 40):
                ring.tick()
                if _resident_kib(ring) == 256:
                    return ticks
            return -1

        burst_after(0)
        assert ticks_kept() == 1  # a lone burst: given back at the first quiet tick
        burst_after(0)  # back one quiet tick after the one before
        assert ticks_kept() == 2
        burst_after(1)  # back 3 quiet ticks after the one before
        for _ in range(3):  # the next ones as far apart: their pages are kept between them
            burst_after(3)
            assert _resident_kib(ring) > 256
        assert ticks_kept() == 6
        burst_after(2)  # 8 quiet ticks: twice that is as high as the wait goes
        assert ticks_kept() == 16
        burst_after(0)  # 16 quiet ticks after the one before: a lone burst again
        assert ticks_kept() == 1
    finally:
        ring.close()


def _thread_faults() -> int:
    """Minor page faults of the calling thread so far (Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


#: a run of 262 frames of 1000 B: its length is no multiple of a page, so runs lie across page boundaries
_UNALIGNED_RUN = ((996).to_bytes(4, "big") + b"p" * 996) * 262


def test_pages_populated_ahead_of_the_newest_run_take_its_copies_without_a_fault() -> None:
    """Past the first pages (written before traffic), a backlog's copies would fault each page in; pages
    populated ahead (on a worker thread, in the proxy) are written into without one, and a trim gives them back."""
    ring = RunRing.create(8 << 20)
    ring.reuse_from = 1 << 20
    try:
        ring.prefault()
        assert _resident_kib(ring) == 1024 and ring.ready_to == 1 << 20
        offsets = [ring.put(_UNALIGNED_RUN) for _ in range(5)]  # past the first MiB: into fresh pages
        head = offsets[-1] + len(_UNALIGNED_RUN)  # type: ignore[operator]
        assert head > ring.populate_at  # (the recorder then has a worker thread populate)
        assert ring.ready_to == head and head % 4096  # the copies faulted in the pages up to the head
        ring.populating = True
        reached = ring.populate_ahead(ring.ready_to)  # (from the middle of a page)
        ring.populating = False
        assert reached == 8 << 20  # the whole ring: less than POPULATE_AHEAD past the head
        ring.populated(reached)
        assert ring.ready_to == 8 << 20 and _resident_kib(ring) == 8 << 10
        before = _thread_faults()
        while ring.put(_UNALIGNED_RUN) is not None:  # the rest of the ring, from the middle of the head's page
            pass
        assert _thread_faults() - before < 8  # (~5 runs of 64 pages each without the populating)
        ring.release(ring.runs)
        ring.tick()
        ring.tick()
        assert _resident_kib(ring) == 1024 and ring.ready_to == 1 << 20
    finally:
        ring.close()


async def test_under_a_stream_past_the_first_pages_the_recorder_populates_the_ring_ahead_of_the_relay(
        tmp_path: Path) -> None:
    """A backlog building past the ring's first pages (a saturated proxy: the writer falls behind) has a worker
    thread populate the pages ahead of it: the relay's next copies take no page fault."""
    with trio.fail_after(20):
        async with Recorder(RecordConfig(dir=tmp_path, queue_bytes=48 << 20)) as recorder:
            ring = recorder._ring
            assert ring is not None and ring.reuse_from == 16 << 20 and ring.ready_to == 16 << 20
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            position = 0

            def relay_receives(count: int) -> None:  # (no checkpoint in between, as a relay's turn)
                nonlocal position
                for _ in range(count):
                    assert recorder.record_run(1, "to_broker", BASE_NS, _UNALIGNED_RUN, 0, position)
                    position += len(_UNALIGNED_RUN)

            relay_receives(66)  # just past the first 16 MiB
            for _ in range(1000):  # the worker thread populates ahead (within fail_after)
                if ring.ready_to >= (32 << 20) + len(_UNALIGNED_RUN):
                    break
                await trio.sleep(0.01)
            else:
                pytest.fail("no pages were populated ahead of the runs")
            before = _thread_faults()
            relay_receives(60)  # ~15 MiB more
            faults = _thread_faults() - before
            assert ring._head == 126 * len(_UNALIGNED_RUN)  # (in the pages past the first: not back at the start)
            assert faults < 16  # (~3,800 without the populating)


def test_a_trim_waits_while_pages_are_populated() -> None:
    ring = RunRing.create(4 << 20)
    ring.reuse_from = 1 << 20
    try:
        ring.prefault()
        ring.put(b"r" * (2 << 20))
        ring.release(1)
        ring.populating = True
        ring.trim()
        assert _resident_kib(ring) >= 2048  # kept: a worker thread may be populating
        ring.populating = False
        ring.trim()
        assert _resident_kib(ring) == 1024
    finally:
        ring.close()


def test_a_run_in_the_ring_crosses_to_the_writer_process_as_its_place_not_its_bytes() -> None:
    ring = RunRing.create(1 << 16)
    try:
        data = b"".join(f.raw for f in session() if f.direction == "to_broker")
        offset = ring.put(data)
        assert offset is not None
        item = RunItem(1, rpb.TO_BROKER, BASE_NS, ring.view[offset:offset + len(data)], 0, 0, offset)
        buffers: list[pickle.PickleBuffer] = []
        pickled = pickle.dumps(item, protocol=5, buffer_callback=buffers.append)
        assert not buffers and len(pickled) < 200 and data[:64] not in pickled
        del item
    finally:
        ring.close()


async def test_a_run_is_copied_when_recorded_so_the_relay_may_reuse_its_buffer(tmp_path: Path) -> None:
    """``record_run`` gets a view of the relay's receive buffer, which the relay overwrites with the
    next receive right after: the recording still holds every frame as it was received."""
    frames = [f for f in session(sends=20) if f.direction == "to_broker"]
    buffer = bytearray(64 * 1024)
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            position = 0
            for frame in frames:  # one frame per receive, into the same buffer
                buffer[:len(frame.raw)] = frame.raw
                assert recorder.record_run(1, "to_broker", BASE_NS, memoryview(buffer)[:len(frame.raw)], 0, position)
                buffer[:len(frame.raw)] = b"\xff" * len(frame.raw)
                position += len(frame.raw)
    got = [f.raw for f in open_recordings(tmp_path).frames()]
    assert len(got) == len(frames)
    assert got[1:] == [f.raw for f in frames[1:]]  # (the first, CONNECT, is redacted)


async def test_a_full_ring_drops_runs_counts_their_frames_and_never_blocks(tmp_path: Path) -> None:
    frames = [f for f in session(sends=200) if f.direction == "to_broker"]
    runs: list[bytes] = [b""]  # whole frames, about 1000 bytes a run
    for f in frames:
        if len(runs[-1]) + len(f.raw) > 1000:
            runs.append(b"")
        runs[-1] += f.raw
    positions = [sum(map(len, runs[:index])) for index in range(len(runs))]
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path, queue_bytes=4096)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            accepted = [recorder.record_run(1, "to_broker", BASE_NS, run, 0, position)  # no checkpoint
                        for run, position in zip(runs, positions, strict=True)]
    assert 0 < accepted.count(True) < len(runs)
    assert sum(len(run) for run, ok in zip(runs, accepted, strict=True) if ok) <= 4096
    refused = sum(count_frame_starts(run, 0) for run, ok in zip(runs, accepted, strict=True) if not ok)
    recording = open_recordings(tmp_path).recordings[0]
    assert recording.frames_dropped == recorder.stats.frames_dropped == refused
    assert len(list(recording.frames())) == len(frames) - refused


async def test_a_run_the_full_queue_refuses_is_counted_and_never_copied_into_the_ring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue's room is checked before the copy: at saturation most runs are refused, and copying each
    into the ring first cost the relay their bytes' worth of memory traffic for nothing."""
    copied: list[int] = []
    put = RunRing.put

    def counting_put(ring: RunRing, data: bytes | memoryview) -> int | None:
        copied.append(len(data))
        return put(ring, data)

    monkeypatch.setattr(RunRing, "put", counting_put)
    run = b"".join(f.raw for f in session(sends=20) if f.direction == "to_broker")
    frames_per_run = count_frame_starts(run, 0)
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path, queue_size=8)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            accepted = [recorder.record_run(1, "to_broker", BASE_NS, run, 0, index * len(run))  # no checkpoint
                        for index in range(50)]
    assert accepted == [True] * 8 + [False] * 42
    assert copied == [len(run)] * 8
    assert recorder.stats.frames_dropped == 42 * frames_per_run
    assert recorder.stats.frames_recorded + recorder.stats.frames_dropped == 50 * frames_per_run


async def test_a_dropped_run_whose_frames_the_relay_counted_is_counted_without_a_walk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run the relay's scanner counted (``RunEvent.frames``) is counted dropped as that many frames: the
    recorder does not walk it again on the relay's path (at saturation most runs are dropped); a run
    without a count (-1) is walked, as before."""
    walked: list[int] = []

    def counting_walk(data: bytes | memoryview, lead: int) -> int:
        walked.append(len(data))
        return count_frame_starts(data, lead)

    monkeypatch.setattr("proxy.server.recorder.count_frame_starts", counting_walk)
    run = b"".join(f.raw for f in session(sends=20) if f.direction == "to_broker")
    frames_per_run = count_frame_starts(run, 0)
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=tmp_path, queue_size=4)) as recorder:
            recorder.open_connection(1, "127.0.0.1:5000", "127.0.0.1:6650", "rewrite", BASE_NS)
            accepted = [recorder.record_run(1, "to_broker", BASE_NS, run, 0, index * len(run),
                                            frames_per_run if index % 2 else -1)  # no checkpoint
                        for index in range(20)]
    assert accepted == [True] * 4 + [False] * 16
    assert walked == [len(run)] * 8  # the refused runs without a count only
    assert recorder.stats.frames_dropped == 16 * frames_per_run
    assert recorder.stats.frames_recorded + recorder.stats.frames_dropped == 20 * frames_per_run


async def test_after_the_writer_process_died_runs_are_counted_as_dropped_and_the_ring_never_stays_full(
        tmp_path: Path) -> None:
    """Runs taken by a batch the dead writer could not write give their ring space back: later runs
    are still taken (and counted dropped when their batch fails too); the ring never stays full.

    (A run may be refused while a batch is on its way to the dead writer and holds its runs' room: on a
    loaded machine that takes longer than the pauses here.  A refused run is counted dropped too, and the
    same run offered again after a pause must be taken: a ring that stayed full would time the test out.)"""
    import os
    import signal

    from test_recording_recorder import _writer_processes_of

    run = b"".join(f.raw for f in session(sends=20) if f.direction == "to_broker")[100:]  # whole frames or not
    frames_per_run = count_frame_starts(run, 0)
    with trio.fail_after(20):
        async with Recorder(RecordConfig(dir=tmp_path, queue_bytes=4 * len(run))) as recorder:
            (child,) = _writer_processes_of(os.getpid())
            os.kill(child, signal.SIGKILL)
            offered = 0
            for index in range(40):  # ten rings' worth, a few at a time
                offered += 1
                while not recorder.record_run(1, "to_broker", BASE_NS, run, 0, index * len(run)):
                    await trio.sleep(0.05)
                    offered += 1
                if index % 3 == 2:
                    await trio.sleep(0.05)
            assert recorder.failure is not None
    assert recorder.stats.frames_recorded == 0
    assert recorder.stats.frames_dropped == offered * frames_per_run
    assert not _writer_processes_of(os.getpid())


def _frame_starts_one_by_one(data: bytes, lead: int) -> int:
    pos, count = lead, 0
    while pos < len(data):
        count += 1
        if len(data) - pos < 4:
            break
        pos += struct.unpack_from(">I", data, pos)[0] + 4
    return count


@settings(max_examples=400, deadline=None)
@given(groups=st.lists(st.tuples(st.one_of(st.sampled_from([6, 300, 1020]), st.integers(0, 70_000)),
                                 st.integers(1, 120)), max_size=12),
       filler=st.binary(min_size=8, max_size=8), lead=st.integers(0, 9), cut=st.integers(0, 10**6))
def test_the_frames_a_dropped_run_loses_are_counted_as_one_by_one(groups: list[tuple[int, int]], filler: bytes,
                                                                   lead: int, cut: int) -> None:
    """Counting rows of equal frames at once gives the frame-by-frame count, wherever the run is cut."""
    frames = [struct.pack(">I", size) + (filler * (size // 8 + 1))[:size] for size, repeat in groups
              for _ in range(repeat)]
    data = b"\x07" * lead + b"".join(frames)
    data = data[:cut % (len(data) + 1)]
    lead = min(lead, len(data))
    assert count_frame_starts(data, lead) == _frame_starts_one_by_one(data, lead)
    assert count_frame_starts(memoryview(bytearray(data)), lead) == _frame_starts_one_by_one(data, lead)
