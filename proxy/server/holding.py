"""Frames held back by rules and released later, without holding the whole connection.

Two things need a frame to leave the proxy later than the frames around it:

- a *lane*-delayed frame (``Verdict.lane``): a throttled SEND is held with the
  other frames of its lane only (one producer, or one topic) — frames of other
  lanes on the same connection keep flowing.  Within a lane order is kept: a frame
  leaves no earlier than the one before it in the lane, and a frame of a lane that
  still has frames held is held too, even if its own delay is 0;
- a *deferred* frame (``Verdict.later``): a frame the proxy originates after a
  delay, independent of any queue (the FLOW permits a throttle releases as its
  bucket refills).  Deferred frames have no lane and leave at their own time.

:class:`HoldQueue` is the sans-IO part: one heap of ``(due_ns, seq)`` entries per
connection — dues within a lane never decrease, so the heap order (ties broken by
arrival) is the lane order.  The bound is :data:`MAX_HELD_FRAMES` entries per
connection: when it is reached the relay stops reading the side that fills it
until releases make room (backpressure, as for any slow peer); memory per
connection is therefore bounded by that many frames.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final

from proxy.protocol.session import Direction

#: frames held per connection before the relay stops reading the side that sends them
MAX_HELD_FRAMES: Final = 10_000


@dataclass(order=True, slots=True)
class Held:
    """Frames to write towards ``direction`` at ``due_ns``."""

    due_ns: int
    seq: int
    direction: Direction = field(compare=False)
    frames: tuple[bytes, ...] = field(compare=False)
    lane: Hashable | None = field(compare=False, default=None)
    #: True for frames the proxy originates (published to observers when released)
    originated: bool = field(compare=False, default=False)


class HoldQueue:
    """Held frames of one connection, by due time; see the module docstring."""

    def __init__(self, limit: int = MAX_HELD_FRAMES) -> None:
        self.limit = limit
        self._heap: list[Held] = []
        self._seq = itertools.count()
        #: per lane: (frames still held, due of the last one)
        self._lanes: dict[Hashable, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def full(self) -> bool:
        return len(self._heap) >= self.limit

    def lane_busy(self, lane: Hashable) -> bool:
        """True while ``lane`` has frames held (a later frame of it must queue behind them)."""
        return lane in self._lanes

    def release_at(self, due_ns: int, lane: Hashable | None) -> int:
        """When a frame due at ``due_ns`` would leave: never before the last one held in its lane."""
        if lane is None or lane not in self._lanes:
            return due_ns
        return max(due_ns, self._lanes[lane][1])

    def add(self, due_ns: int, direction: Direction, frames: tuple[bytes, ...], *, lane: Hashable | None = None,
            originated: bool = False) -> int:
        """Hold ``frames``; returns when they will leave (later than ``due_ns`` behind a busy lane)."""
        if lane is not None:
            count, last_due = self._lanes.get(lane, (0, due_ns))
            due_ns = max(due_ns, last_due)
            self._lanes[lane] = (count + 1, due_ns)
        heapq.heappush(self._heap, Held(due_ns, next(self._seq), direction, frames, lane, originated))
        return due_ns

    def next_due_ns(self) -> int | None:
        return self._heap[0].due_ns if self._heap else None

    def pop_due(self, now_ns: int) -> list[Held]:
        """The entries due by ``now_ns``, in release order."""
        due: list[Held] = []
        while self._heap and self._heap[0].due_ns <= now_ns:
            entry = heapq.heappop(self._heap)
            if entry.lane is not None:
                count, last_due = self._lanes[entry.lane]
                if count <= 1:
                    del self._lanes[entry.lane]
                else:
                    self._lanes[entry.lane] = (count - 1, last_due)
            due.append(entry)
        return due

    def clear(self) -> None:
        self._heap.clear()
        self._lanes.clear()
