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
    assert Relay.__dataclass_fields__["_clock"].default_factory is TrioEpochClock
