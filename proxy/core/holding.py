"""Frames held back by rules and released later, without holding the whole connection.

Three things need bytes to leave the proxy later than they arrived:

- a *delayed* frame (``Verdict.delay_s`` without a lane): it leaves at its own arrival
  plus its delay, in its direction's *stream lane* (the lane whose key is the
  :class:`~proxy.protocol.session.Direction`).  While that lane holds anything, every
  later byte of the direction — frames no rule touched, pass-through runs, frames the
  proxy injects — joins the lane behind it, so nothing overtakes a delayed frame and a
  frame split across reads stays whole.  Many delayed frames in flight are therefore
  delayed side by side, each by its own amount, as a delay on a real network is
  (Toxiproxy's ``latency``), not one after another.  Stream-lane entries are written as
  they are when due (they *are* the stream);
- a *lane*-delayed frame (``Verdict.lane``): a throttled SEND is held with the other
  frames of its lane only (one producer, or one topic) — frames of other lanes on the
  same connection keep flowing.  Its entry is a whole frame, injected between frames
  when due;
- a *deferred* frame (``Verdict.deferred``): a frame the proxy originates after a delay,
  independent of any queue (the FLOW permits a throttle releases as its bucket
  refills).  Deferred frames have no lane and leave at their own time.  A deferred
  :data:`Poll` is decided only when it is due: it gives the frames to write then (maybe
  none) and when to ask it again — how a throttle shared by many consumers hands each
  its share of the permits as tokens arrive (``proxy.rules.throttle.FairShare``).

Within any lane order is kept: an entry leaves no earlier than the one before it in
its lane (its due is raised to that one's).  :class:`HoldQueue` is the sans-IO part:
one heap of ``(due_ns, seq)`` entries per connection — dues within a lane never
decrease, so the heap order (ties broken by arrival) is the lane order.  The bounds
are :data:`MAX_HELD_FRAMES` entries and :data:`MAX_HELD_BYTES` bytes per connection:
when one is reached the relay stops reading the side that fills it until releases
make room (backpressure, as for any slow peer).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Final

from proxy.protocol.session import Direction

#: entries held per connection before the relay stops reading the side that sends them
MAX_HELD_FRAMES: Final = 10_000
#: bytes held per connection before the relay stops reading the side that sends them
MAX_HELD_BYTES: Final = 64 * 1024 * 1024


#: a deferred frame decided when it is due: ``poll(now_ns)`` -> (frames to write, when to ask again; None: done,
#: a time not after ``now_ns`` is taken as the next nanosecond)
Poll = Callable[[int], tuple[list[bytes], int | None]]


@dataclass(order=True, slots=True)
class Held:
    """Bytes to write towards ``direction`` at ``due_ns``."""

    due_ns: int
    seq: int
    direction: Direction = field(compare=False)
    frames: list[bytes] = field(compare=False)
    lane: Hashable | None = field(compare=False, default=None)
    #: True for frames the proxy originates (published to observers when released)
    originated: bool = field(compare=False, default=False)
    #: asked for ``frames`` when due (a :data:`Poll`; the proxy originates what it gives)
    poll: Poll | None = field(compare=False, default=None)

    @property
    def stream(self) -> bool:
        """Part of its direction's stream lane: written as is, not injected between frames."""
        return self.lane is self.direction


class HoldQueue:
    """Held frames of one connection, by due time; see the module docstring."""

    def __init__(self, limit: int = MAX_HELD_FRAMES, byte_limit: int = MAX_HELD_BYTES) -> None:
        self.limit = limit
        self.byte_limit = byte_limit
        self.held_bytes = 0
        self._heap: list[Held] = []
        self._seq = itertools.count()
        #: per lane: (entries still held, the last entry added); a lane is busy while it is in here
        #: (the relay's hop asks ``lane in lanes``, a call less than lane_busy; read it, never change it)
        self.lanes: dict[Hashable, tuple[int, Held]] = {}

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def full(self) -> bool:
        return len(self._heap) >= self.limit or self.held_bytes >= self.byte_limit

    def lane_busy(self, lane: Hashable) -> bool:
        """True while ``lane`` has frames held (a later frame of it must queue behind them)."""
        return lane in self.lanes

    def last_due(self, lane: Hashable) -> int | None:
        """When the last entry held in ``lane`` leaves (None: the lane is empty)."""
        entry = self.lanes.get(lane)
        return None if entry is None else entry[1].due_ns

    def release_at(self, due_ns: int, lane: Hashable | None) -> int:
        """When a frame due at ``due_ns`` would leave: never before the last one held in its lane."""
        last = None if lane is None else self.last_due(lane)
        return due_ns if last is None else max(due_ns, last)

    def add(self, due_ns: int, direction: Direction, frames: Iterable[bytes], *, lane: Hashable | None = None,
            originated: bool = False) -> int:
        """Hold ``frames``; returns when they will leave (later than ``due_ns`` behind a busy lane).

        Bytes joining a stream lane behind its last entry are appended to that entry (the
        lane collects many pass-through runs while one delay is pending).
        """
        data = [bytes(piece) for piece in frames]
        self.held_bytes += sum(len(piece) for piece in data)
        if lane is not None and lane in self.lanes:
            last = self.lanes[lane][1]
            if due_ns <= last.due_ns:
                if lane is direction and not originated and not last.originated:
                    last.frames.extend(data)
                    return last.due_ns
                due_ns = last.due_ns
        entry = Held(due_ns, next(self._seq), direction, data, lane, originated)
        if lane is not None:
            count = self.lanes[lane][0] if lane in self.lanes else 0
            self.lanes[lane] = (count + 1, entry)
        heapq.heappush(self._heap, entry)
        return due_ns

    def add_poll(self, due_ns: int, direction: Direction, poll: Poll) -> None:
        """Ask ``poll`` at ``due_ns`` for frames the proxy originates towards ``direction`` (no lane)."""
        heapq.heappush(self._heap, Held(due_ns, next(self._seq), direction, [], None, True, poll))

    def hasten_polls(self, now_ns: int) -> bool:
        """Ask every held poll at ``now_ns`` rather than at its time (what it waits for may be due now); any?"""
        hastened = False
        for entry in self._heap:
            if entry.poll is not None and entry.due_ns > now_ns:
                entry.due_ns = now_ns
                hastened = True
        if hastened:
            heapq.heapify(self._heap)
        return hastened

    def next_due_ns(self) -> int | None:
        return self._heap[0].due_ns if self._heap else None

    def pop_due(self, now_ns: int) -> list[Held]:
        """The entries due by ``now_ns``, in release order (a poll's as the frames it gives)."""
        due: list[Held] = []
        while self._heap and self._heap[0].due_ns <= now_ns:
            entry = heapq.heappop(self._heap)
            self.held_bytes -= sum(len(piece) for piece in entry.frames)
            if entry.lane is not None:
                count, last = self.lanes[entry.lane]
                if count <= 1:
                    del self.lanes[entry.lane]
                else:
                    self.lanes[entry.lane] = (count - 1, last)
            if entry.poll is not None:
                entry = self._polled(entry, entry.poll, now_ns)
                if not entry.frames:
                    continue
            due.append(entry)
        return due

    def _polled(self, entry: Held, poll: Poll, now_ns: int) -> Held:
        """``entry`` with the frames ``poll`` gives now; ``poll`` held again when it asks to be."""
        frames, again_ns = poll(now_ns)
        if again_ns is not None:
            self.add_poll(max(again_ns, now_ns + 1), entry.direction, poll)
        return Held(entry.due_ns, entry.seq, entry.direction, [bytes(frame) for frame in frames], None, True)

    def clear(self) -> None:
        self._heap.clear()
        self.lanes.clear()
        self.held_bytes = 0
