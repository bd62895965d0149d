"""The recording's writer process keeps to its share of a core (proxy.recording.writer_process.CpuBudget).

Fake clocks: a write costs CPU time and as much wall time; the budget's pauses are the
only other wall time that passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.recording.writer_process import CPU_WINDOW_SECONDS, CpuBudget


class _Clocks:
    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.pauses: list[float] = []

    def work(self, seconds: float) -> None:
        self.cpu += seconds
        self.wall += seconds

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.wall += seconds


def _budget(clocks: _Clocks, share: float = 0.25, window: float = CPU_WINDOW_SECONDS,
            max_pause: float = 0.5) -> CpuBudget:
    return CpuBudget(share, window, max_pause, cpu=lambda: clocks.cpu, wall=lambda: clocks.wall, sleep=clocks.sleep)


@pytest.mark.parametrize("write_seconds", [0.001, 0.02, 0.1])
@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_a_writer_with_a_backlog_takes_its_share_of_a_core_and_no_more(share: float, write_seconds: float) -> None:
    clocks = _Clocks()
    budget = _budget(clocks, share, max_pause=1.0)
    while clocks.wall < 30.0:
        clocks.work(write_seconds)
        budget.spent()
    assert clocks.cpu / clocks.wall == pytest.approx(share, rel=0.05)
    assert budget.paused == pytest.approx(sum(clocks.pauses))


@pytest.mark.parametrize(("write_seconds", "every"), [(0.002, 0.02), (0.01, 0.1)])
def test_a_writer_that_keeps_up_within_its_share_never_pauses(write_seconds: float, every: float) -> None:
    """The official client's rates: short writes, each answered at once; or a batch per gathering window
    (the recorder's 100 ms) of a tenth of a core's work, asked between its pieces too."""
    clocks = _Clocks()
    budget = _budget(clocks)
    for _ in range(1000):
        for _piece in range(4):
            clocks.work(write_seconds / 4)
            budget.paced()
        budget.spent()
        clocks.wall += every - write_seconds  # waiting for the next batch
    assert clocks.pauses == []


def test_a_pause_never_lasts_longer_than_its_limit() -> None:
    """A sync or a close waits for the pause: one huge write does not hold them for long."""
    clocks = _Clocks()
    budget = _budget(clocks, share=0.25, max_pause=0.5)
    clocks.work(2.0)
    budget.spent()
    assert clocks.pauses == [0.5]


def test_a_share_outside_what_a_core_has_is_refused() -> None:
    for share in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="share"):
            CpuBudget(share)


async def test_a_batch_for_the_writer_holds_a_bounded_number_of_run_bytes() -> None:
    """The writer pauses only between writes: a batch of the whole run ring (~1 s of its CPU) let it past its
    share.  Runs stay whole: a batch ends with the run that takes it to the limit or past it."""
    import trio

    from proxy.recording.writer import RunItem
    from proxy.server import recorder

    send, receive = trio.open_memory_channel[object](100)
    run = bytes(1 << 20)
    for index in range(20):
        send.send_nowait(RunItem(1, 1, 0, run, 0, index << 20))
    batch: list[object] = [receive.receive_nowait()]
    taken: list[object] = []
    ended = await recorder._gather(receive, batch, trio.current_time() + 10, taken.append)  # type: ignore[arg-type]
    assert not ended
    assert len(batch) == recorder._BATCH_BYTES // len(run)
    assert taken == batch[1:]  # each record taken off the queue is reported (its room is free again)
    assert receive.statistics().current_buffer_used == 20 - len(batch)


async def test_records_that_come_while_a_batch_gathers_are_taken_when_its_window_ends(autojump_clock: object) -> None:
    """The write loop reads the queue when a batch begins and when its window ends, not as records come (a
    wake-up per record was a turn of the loop per relayed read): records that came meanwhile wait in the
    queue until the window's end, then all join the batch; those after it wait for the next batch."""
    import trio

    from proxy.recording.writer import RunItem
    from proxy.server import recorder

    send, receive = trio.open_memory_channel[object](100)
    record = RunItem(1, 1, 0, b"r", 0, 0)
    for _ in range(3):
        send.send_nowait(record)
    batch: list[object] = [receive.receive_nowait()]
    taken: list[object] = []
    start = trio.current_time()
    waiting_mid_window: list[int] = []

    async def trickle() -> None:
        for index in range(10):  # a record a millisecond, from 1 ms into the window
            await trio.sleep_until(start + 0.001 * (index + 1))
            send.send_nowait(record)
        await trio.sleep_until(start + 0.015)
        waiting_mid_window.append(receive.statistics().current_buffer_used)
        await trio.sleep_until(start + 0.025)  # after the window
        send.send_nowait(record)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        ended = await recorder._gather(receive, batch, start + 0.02, taken.append)  # type: ignore[arg-type]
        assert trio.current_time() == start + 0.02
    assert not ended and len(batch) == 1 + 2 + 10 and taken == batch[1:]
    assert waiting_mid_window == [10]  # none taken while the window was open
    assert receive.statistics().current_buffer_used == 1


def test_a_writer_paced_within_its_batches_holds_its_share_over_a_short_stretch_of_saturation() -> None:
    """After a quiet spell, saturation (a bench phase lasts 0.4 s): batches of ~50 ms of CPU, asked between
    pieces of ~6 ms (``SegmentWriter.write`` with ``paced``).  At any moment the writer has taken no more
    than its share since saturation began, the burst the window earns and one piece: not a batch whole,
    and a burst small next to a 0.4 s stretch's share."""
    from proxy.recording.writer_process import CPU_SHARE, CPU_WINDOW_SECONDS

    clocks = _Clocks()
    budget = CpuBudget(cpu=lambda: clocks.cpu, wall=lambda: clocks.wall, sleep=clocks.sleep)
    clocks.wall += 5.0  # quiet: the burst is there in full
    start, piece, pieces_per_batch = clocks.wall, 0.006, 8
    while clocks.wall < start + 2.0:
        for index in range(pieces_per_batch):
            clocks.work(piece)
            assert clocks.cpu <= CPU_SHARE * (clocks.wall - start + CPU_WINDOW_SECONDS) + piece + 1e-9
            (budget.paced if index < pieces_per_batch - 1 else budget.spent)()
    assert CPU_SHARE * CPU_WINDOW_SECONDS <= CPU_SHARE * 0.4 / 5  # the burst: at most a fifth of 0.4 s's share


def test_the_pauses_within_one_write_come_to_no_more_than_the_longest_pause() -> None:
    """A sync or a close waits for the write under way: a write far past the writer's share pauses between
    its pieces for ``max_pause`` at most in all, and once more at most after it."""
    clocks = _Clocks()
    budget = _budget(clocks, share=0.25, max_pause=0.5)
    for _ in range(20):
        clocks.work(0.1)
        budget.paced()
    assert sum(clocks.pauses) == pytest.approx(0.5)
    clocks.work(0.1)
    budget.spent()
    assert clocks.pauses[-1] == pytest.approx(0.5) and sum(clocks.pauses) == pytest.approx(1.0)
    clocks.work(0.01)
    budget.paced()  # a new write: it may pause again
    assert len(clocks.pauses) == sum(1 for pause in clocks.pauses if pause > 0) and clocks.pauses[-1] > 0


def test_a_paced_write_asks_its_pace_between_pieces_and_writes_the_same_segments(tmp_path: Path) -> None:
    """``SegmentWriter.write`` with a pace goes in pieces of ``PACE_BYTES`` of runs, calling it between them
    (not after the last: the writer process asks its budget then); the segments are those of one piece."""
    from proxy.pb import recording_pb2 as rpb
    from proxy.recording.writer import PACE_BYTES, QueueItem, RecordConfig, RunItem, SegmentWriter

    frame = (96).to_bytes(4, "big") + (2).to_bytes(4, "big") + b"\x08\x06" + b"p" * 90
    run = frame * -(-PACE_BYTES // 4 // len(frame))  # (4 runs make a piece)
    batch: list[QueueItem] = [RunItem(1, rpb.TO_BROKER, index, run, 0, index * len(run)) for index in range(10)]
    batch.insert(3, rpb.Record(closed=rpb.ConnectionClosed(conn_id=2, ts_ns=1)))
    written = {}
    for name, paced in (("paced", True), ("whole", False)):
        calls: list[None] = []
        path = tmp_path / name / "rec"  # (the recording id, in each segment's header: the same)
        path.mkdir(parents=True)
        writer = SegmentWriter(path, RecordConfig(dir=path, max_segment_bytes=700_000), clock=lambda: 1)
        result = writer.write(batch, (lambda seen=calls: seen.append(None)) if paced else None)
        writer.close(None)
        assert result.frames == 10 * (len(run) // len(frame))
        assert len(calls) == (2 if paced else 0)  # pieces of 4 runs (and the close), 4, 2
        written[name] = [(path / segment).read_bytes() for segment in writer.files.segments]
    assert len(written["whole"]) >= 3 and written["paced"] == written["whole"]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are counted in /proc (Linux)")
@pytest.mark.parametrize("user_setting", [None, "2"])
def test_the_writer_process_runs_one_thread_unless_the_user_asks_for_more(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user_setting: str | None) -> None:
    """No library's thread spins in the writer process on the cores the relay needs (numpy's BLAS started
    one per core, which took ~30-40 ms of CPU as the child started, charged to its first write: a pause of
    ~0.2 s while the run ring filled); a user's own ``OPENBLAS_NUM_THREADS`` is kept."""
    from proxy.pb import PulsarApi_pb2 as api
    from proxy.pb import recording_pb2 as rpb
    from proxy.recording.writer import FrameItem, RecordConfig
    from proxy.recording.writer_process import WriterProcess

    if user_setting is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", user_setting)
    command = api.BaseCommand(type=api.BaseCommand.PING, ping=api.CommandPing()).SerializeToString()
    frame = (len(command) + 4).to_bytes(4, "big") + len(command).to_bytes(4, "big") + command
    process = WriterProcess(tmp_path, RecordConfig(dir=tmp_path))
    try:
        process.started()
        assert process.write([FrameItem(1, rpb.TO_BROKER, rpb.CLIENT, 1, frame, ())]).frames == 1
        child = process._process.pid
        threads = len(list(Path(f"/proc/{child}/task").iterdir()))
        environment = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    finally:
        process.close(None)
    assert f"OPENBLAS_NUM_THREADS={user_setting or 1}".encode() in environment
    if user_setting is None:
        assert threads == 1
