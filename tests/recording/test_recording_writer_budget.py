"""The recording's writer process keeps to its share of a core (proxy.recording.writer_process.CpuBudget).

Fake clocks: a write costs CPU time and as much wall time; the budget's pauses are the
only other wall time that passes.
"""

from __future__ import annotations

import pytest

from proxy.recording.writer_process import CpuBudget


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


def _budget(clocks: _Clocks, share: float = 0.25, window: float = 0.25, max_pause: float = 0.5) -> CpuBudget:
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


def test_a_writer_that_keeps_up_within_its_share_never_pauses() -> None:
    """The official client's rates: a few short writes a second, each answered at once."""
    clocks = _Clocks()
    budget = _budget(clocks)
    for _ in range(1000):
        clocks.work(0.002)
        budget.spent()
        clocks.wall += 0.02  # waiting for the next batch
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
