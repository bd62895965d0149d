"""The relay's clock: timers follow Trio's monotonic clock, timestamps stay Unix epoch ns."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from proxy.server.relay import Relay, TrioEpochClock


async def test_a_wall_clock_stepped_backwards_does_not_move_the_relays_now(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    """Held frames and keepalive are timed on this clock: a wall-clock step must not stall them."""
    before = time.time_ns()
    clock = TrioEpochClock()
    start = clock()
    assert before <= start <= time.time_ns()  # epoch nanoseconds, for the recorded timestamps
    monkeypatch.setattr(time, "time_ns", lambda: before - 3600 * 1_000_000_000)  # an hour back
    autojump_clock.jump(1.5)
    assert clock() - start == 1_500_000_000
    await trio.sleep(0.25)
    assert clock() - start == 1_750_000_000


def test_every_relay_takes_its_now_from_trio() -> None:
    assert Relay.__dataclass_fields__["clock"].default_factory is TrioEpochClock


async def test_under_trios_own_clock_the_relays_now_advances_with_trio_current_time() -> None:
    """Read on every relayed read, it reads the monotonic clock Trio's own clock is made of, not Trio's."""
    before = time.time_ns()
    clock = TrioEpochClock()
    start, trio_start = clock(), trio.current_time()
    assert before <= start <= time.time_ns()
    await trio.sleep(0.05)
    elapsed_ns, trio_elapsed = clock() - start, trio.current_time() - trio_start
    assert abs(elapsed_ns - trio_elapsed * 1e9) < 1_000_000  # (two readings apart by microseconds)
    assert elapsed_ns >= 50_000_000
