"""Delivers frame and connection events to observers without ever stalling traffic.

The relay calls :meth:`ObserverHub.publish` (synchronous, never blocks); events (frames,
runs of passed-through bytes, connections) go into one bounded Trio memory channel and
a single task hands them to each observer, for a slice of time per scheduling turn (the relays run in between).
While events wait, the slice keeps telemetry's share of the loop at about ``share``:
it lasts ``share / (1 - share)`` times as long as the relays ran since the hub's
previous turn (at least ``slice_seconds``, at most ``max_slice_seconds``), so a
saturated proxy spends that fraction of its time on observers rather than a fixed
few milliseconds per turn (which, against relay turns of tens of milliseconds, left
observers ~1 % of the requests).  What observers do on threads of their own (OpenTelemetry's
exporters encoding and posting spans) takes the GIL from the relays as well: the CPU time of
the process's other threads since the hub's previous turn (``side_clock``) counts as the hub's, taken
from its next slice and not counted as the relays'.  The hub keeps an account of it: what it took beyond
its share (a minimum slice longer than its due, exports that cost more than a slice: spans at 100 %
sampling had left the relays a quarter of their plain throughput) is made up in its next turns, which
deliver one event each meanwhile (at most ``MAX_OVERDRAFT_SECONDS`` is carried).  A long
run (a relay reads up to 256 KiB at once) is handed over in pieces of about
``RUN_PIECE_BYTES``, cut between frames, when an observer works frame by frame on runs
(``runs_in_pieces``: telemetry), so that it never holds the relays up for a whole run.  Overflow policy: when the
queue is full (in events, or in the bytes of queued runs) the event is dropped and
counted in ``dropped`` — traffic always wins over telemetry (a run is copied only once it
is known to fit).  An observer that raises
is logged and counted, and keeps receiving later events.

Below saturation an event goes to the queued observers in :meth:`ObserverHub.publish` itself, on the relay's
turn, when nothing waits in the queue (so no event overtakes one queued before it), it is not a run longer than
a piece, and the hub's account allows: the relays' time since observers last ran earns it ``share / (1 -
share)`` of that, what the observers take now is charged, and the hub's own turns keep the same account.
Through the queue a lone run cost the relay a copy into the ring, a wake-up of the hub's task and a trip through
the scheduler (the official client, 100 B messages, batching off: the relay's thread 1-1.5 us a message more
with an observer that does nothing, ~0.5 us when the observer is called at once); an observer slower than its
share gets the next events through the queue, as before.  The reactor's hop publishes a read's events
between :meth:`ObserverHub.defer` and :meth:`ObserverHub.flush`, around its write: the observers then work on
them after the read went on, not before (with metrics on, a round trip's added latency fell by ~70 us here, to
about the plain proxy's).  The hub's task counts what it put in its channel
and took out, and looks in the channel only when something waits there (an empty channel's ``receive_nowait``
raised ``WouldBlock``, ~1 us a run), and hands a run
to each observer's ``on_run`` directly.

Copies of runs for the queue: when every observer the queue serves takes views (``run_views = True``:
telemetry, which reads a run while it is delivered and keeps none of it), a run is copied into the hub's
run ring (:class:`~proxy.recording.run_ring.RunRing`, memory reused run after run) and delivered as views
of it, its space released once its last piece was delivered.  Each run had been copied into a ``bytes``
of its own (a receive of up to 256 KiB): the queue's copies filled the top of the heap and were freed
together as it drained, so glibc gave the pages back and the next copies faulted them in again (~110
``brk`` and 7-12 thousand minor faults a second with metrics or traces on); long runs were then copied a
second time into their pieces.  Other observers get ``bytes`` of their own, as before.  The ring is memory
of the proxy's alone (:meth:`RunRing.private <proxy.recording.run_ring.RunRing.private>`), in huge pages
where the system gives them: in shared memory of 4 KiB pages, a saturating burst's backlog faulted in
each page of it (up to the ring's 64 MiB) on the relay's thread, at its first burst and again after each
trim, ~5-15 faults per thousand frames of 1 KiB in ``bench/passthrough.py --observers``.

An observer with ``immediate = True`` (the recorder: it only queues bytes for its own
writer) is called from :meth:`ObserverHub.publish` itself (while the hub defers, at the
flush, before the relay reads again), on the relay's path, and never through the queue:
it keeps every event's order, costs no hop, and is not subject to the queue's drops (it
has its own bounded queue).  A RunEvent's ``data`` may be a view of a receive buffer the
relay reuses: an immediate observer copies what it keeps, and the hub copies it before
queueing it for the others.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import structlog
import trio

from proxy.core.hooks import ConnectionEvent, FrameEvent, Observer, RunEvent
from proxy.core.rows import column, leading_same
from proxy.recording.run_ring import RunRing

DEFAULT_QUEUE_SIZE: Final = 10_000
#: bytes of RunEvents queued at most (each holds up to a receive buffer of bytes)
DEFAULT_QUEUE_BYTES: Final = 64 * 1024 * 1024

#: how long the hub's task delivers per scheduling turn at least, while events wait
_DELIVER_SECONDS_PER_TURN: Final = 0.002
#: the fraction of the loop's time the hub takes while events wait (the relays have the rest); at 0.4 metrics
#: and traces at 1 % kept the relays at 0.45-0.55x of plain with 1 KiB frames (the hub's slices plus the copy
#: and hand-over of runs); the relays' 70 % against 60 % is ~1.17x, coverage at saturation ~0.64x
DEFAULT_SHARE: Final = 0.3
#: the longest the hub delivers in one turn (the relays wait no longer than this for it)
MAX_SLICE_SECONDS: Final = 0.02

#: the most time beyond its share (its minimum slices, its threads' CPU) the hub makes up for in later turns,
#: delivering one event a turn meanwhile: a burst of export work is repaid, an exporter busy for good does
#: not stop observers
MAX_OVERDRAFT_SECONDS: Final = 0.2

#: how often the hub's run ring is told the time (it gives back the pages of a backlog that has gone), while
#: events come or not
RING_TICK_SECONDS: Final = 1.0

#: a run longer than this is delivered in pieces of about this size, cut between frames
RUN_PIECE_BYTES: Final = 32 * 1024

_SIZE = struct.Struct(">I")
#: frames of one size in a row worth reading as one array when a run is cut (below, frame by frame costs less)
_ROW_FROM: Final = 16

log = structlog.get_logger("pulsar_tap.observers")


def piece_starts(data: bytes | memoryview, pos: int, limit: int) -> list[int]:
    """Where a run whose frames begin at ``pos`` is cut into pieces of about ``limit`` bytes: the start of each
    piece but the first.  A piece ends before the frame that would take it past ``limit`` and holds one frame
    at least (the first piece also the run's lead); the last may end inside a frame.

    Frames of one size in a row (a producer's SENDs, a broker's receipts) are read as one strided array of
    their size prefixes, their cuts worked out from the size (as :func:`~proxy.core.run_cutter.count_frame_starts`
    counts them): the walk frame by frame took ~0.2 us a frame, a quarter of the hub's time with SENDs of
    1 KiB and their receipts, and more with smaller frames.
    """
    cuts: list[int] = []
    start, end = 0, len(data)
    unpack = _SIZE.unpack_from
    while end - pos >= 4:
        size = unpack(data, pos)[0] + 4
        if end - pos >= _ROW_FROM * size and unpack(data, pos + size)[0] + 4 == size:
            # the frames from pos whose size prefixes lie in data, up to the first of another size
            prefixes = column(data, pos, (end - pos - 4) // size + 1, size, ">u4")
            same = leading_same(prefixes != prefixes[0])
            while True:
                fit = max(start + limit - pos, 0) // size  # the row's frames the piece still has room for
                if fit == 0 and pos == start:
                    fit = 1  # (one frame at least)
                if fit >= same:
                    break
                pos += fit * size
                same -= fit
                cuts.append(pos)
                start = pos
            pos += same * size
            continue
        if pos + size - start > limit and pos > start:
            cuts.append(pos)
            start = pos
        pos += size
    return cuts


def _other_threads_cpu() -> float:
    """CPU seconds of the process's threads but the calling one (the loop's)."""
    return time.process_time() - time.thread_time()

Event = FrameEvent | RunEvent | ConnectionEvent


class ObserverHub:
    """A bounded queue between the relays and the observers; see the module docstring."""

    def __init__(self, observers: list[Observer] | None = None, queue_size: int = DEFAULT_QUEUE_SIZE,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, slice_seconds: float = _DELIVER_SECONDS_PER_TURN,
                 run_piece_bytes: int = RUN_PIECE_BYTES, share: float = DEFAULT_SHARE,
                 max_slice_seconds: float = MAX_SLICE_SECONDS,
                 clock: Callable[[], float] = time.perf_counter,
                 side_clock: Callable[[], float] = _other_threads_cpu, inline: bool = True) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"share {share} is not in [0, 1)")
        self.observers: list[Observer] = list(observers or [])
        # Bounded in events and in the bytes of runs: overflow drops the event and counts it (see publish).
        self._send, self._receive = trio.open_memory_channel[Event](queue_size)
        self.queue_bytes = queue_bytes
        self._queued_run_bytes = 0
        self.dropped = 0
        self.delivered = 0
        #: events put on the queue, and taken off it by the hub's task (an event sent while the task
        #: waits goes straight to it and is never in the channel's buffer: see queued)
        self._sent = 0
        self._taken = 0
        self.observer_errors = 0
        self.slice_seconds = slice_seconds
        self.max_slice_seconds = max(max_slice_seconds, slice_seconds)
        #: the hub's time per second of the relays' (share / (1 - share))
        self._weight = share / (1.0 - share)
        self._clock = clock
        self._side_clock = side_clock
        #: seconds of the loop the hub may still take (below 0: what it took beyond its share, itself or
        #: through its threads, to be made up in its next turns; see run)
        self._balance = 0.0
        self.max_overdraft = MAX_OVERDRAFT_SECONDS
        self.run_piece_bytes = run_piece_bytes
        #: taken from the queue, not yet delivered: the pieces of a long run
        self._pieces: deque[Event] = deque()
        #: ``observers`` split into those called in ``publish`` and those the queue serves
        #: (recomputed when observers were added)
        self._immediate: list[Observer] = []
        self._queued: list[Observer] = []
        #: the queued observers with their ``on_run`` (None: they have none), which a RunEvent goes to directly
        self._run_takers: list[tuple[Observer, Callable[[RunEvent], None] | None]] = []
        self._split_of = -1
        #: copies of runs for the queued observers when they all take views (see the module docstring);
        #: made at the first run
        self._ring: RunRing | None = None
        self._ring_wanted = False
        #: the sizes of the runs in the ring, oldest first, and the bytes of the oldest delivered so far
        self._ring_sizes: deque[int] = deque()
        self._ring_delivered = 0
        #: events may go to the observers in ``publish`` when nothing waits (see the module docstring)
        self.inline = inline
        #: when observers last had the loop (a hub turn or an event delivered in ``publish``): the relays'
        #: time since then earns the hub its share
        self._turn_ended = clock()
        #: between :meth:`defer` and :meth:`flush` (a reactor hop's read and its write): the events published,
        #: in order, handed to every observer (immediate and queued) once the hop has written
        self._deferring = False
        self._deferred: list[Event] = []

    @property
    def active(self) -> bool:
        """True when someone listens; the relay skips building events otherwise."""
        return bool(self.observers)

    @property
    def needs_observation(self) -> bool:
        """True when an observer reads ``FrameEvent.observation`` (see ``hooks.Observer``)."""
        return any(getattr(observer, "needs_observation", True) for observer in self.observers)

    @property
    def takes_runs(self) -> bool:
        """True when every observer takes passed-through bytes in bulk (``on_run``, see ``hooks.Observer``)."""
        return bool(self.observers) and all(callable(getattr(observer, "on_run", None))
                                            for observer in self.observers)

    @property
    def cuts_runs(self) -> bool:
        """True when an observer works frame by frame on runs (``runs_in_pieces``): long runs come in pieces."""
        return any(getattr(observer, "runs_in_pieces", False) for observer in self.observers)

    @property
    def queued(self) -> int:
        """Events published and not yet delivered (pieces of a run taken off the queue included).

        Counted, not read off the channel: an event sent while the hub's task waits for one is
        handed to that task and never sits in the channel's buffer, yet is not delivered until
        the task runs.
        """
        return self._sent - self._taken + len(self._pieces)

    def _split(self) -> None:
        self._immediate = [observer for observer in self.observers if getattr(observer, "immediate", False)]
        self._queued = [observer for observer in self.observers if not getattr(observer, "immediate", False)]
        self._run_takers = [(observer, getattr(observer, "on_run", None)) for observer in self._queued]
        self._ring_wanted = bool(self._queued) and all(getattr(observer, "run_views", False)
                                                        for observer in self._queued)
        self._split_of = len(self.observers)

    def publish(self, event: Event) -> None:
        if self._split_of != len(self.observers):
            self._split()
        if self._deferring:
            self._deferred.append(event)
            return
        self._publish_now(event)

    def _publish_now(self, event: Event) -> None:
        for observer in self._immediate:
            self._call(observer, event)
        if self._queued:
            self._publish_queued(event)

    def defer(self) -> None:
        """Keep the events published from now on until :meth:`flush`.

        The reactor's hop defers around a read it relays: the observers' work on what it read (the
        recorder's copy, a histogram's record, a span) then comes after the hop's write instead of before
        it, off the request's latency (with metrics on, ~70 us a round trip here, the observers' cold work).
        A run's data may be a view of the receive buffer: the hop flushes before it reads again.
        """
        self._deferring = True

    def flush(self) -> None:
        """Stop deferring; the events kept meanwhile go on, in order, as :meth:`publish` would have sent them."""
        self._deferring = False
        if self._deferred:
            events, self._deferred = self._deferred, []
            for event in events:
                self._publish_now(event)

    def _publish_queued(self, event: Event) -> None:
        """:meth:`publish` for the queued observers: now if nothing waits and the account allows, else queued."""
        run_bytes = len(event.data) if type(event) is RunEvent else 0
        if self.inline and self._sent == self._taken and not self._pieces and run_bytes <= self.run_piece_bytes:
            # Nothing waits: the event goes to the observers now, on the relay's turn, if the hub's account
            # allows (the relays' time since observers last ran earns it, what they take now is charged):
            # through the queue it cost a copy, a wake-up of the hub's task and a trip through the scheduler,
            # more than telemetry's own work on a run of a frame or two.
            now = self._clock()
            balance = min(self._balance + (now - self._turn_ended) * self._weight, self.max_slice_seconds)
            if balance > 0.0:
                if type(event) is RunEvent and not self._ring_wanted and type(event.data) is not bytes:
                    # (an observer that keeps what it is given: bytes of its own, not the relay's buffer)
                    event = RunEvent(event.connection, event.direction, event.ts_ns, bytes(event.data), event.lead,
                                     event.stream_pos, event.forwarded_ns, event.frames)
                self._hand_over(event)
                ended = self._clock()
                self._balance = max(balance - (ended - now), -self.max_overdraft)
                self._turn_ended = ended
                return
        if run_bytes and self._queued_run_bytes + run_bytes > self.queue_bytes:
            # (before the copy: at saturation most runs end here, and copying them cost the relay
            # ~6 % of its time for nothing)
            self.dropped += 1
            return
        ring = None
        if type(event) is RunEvent and run_bytes:  # (the relay reuses its buffer: a copy)
            if self._ring_wanted:
                ring = self._ring if self._ring is not None else self._make_ring()
                offset = ring.put(event.data)
                if offset is None:
                    self.dropped += 1
                    return
                data: bytes | memoryview = ring.view[offset:offset + run_bytes]  # (a view: see run_views)
            else:
                data = event.data if type(event.data) is bytes else bytes(event.data)
            if data is not event.data:  # (built anew: dataclasses.replace costs ~2 us, a run per message)
                event = RunEvent(event.connection, event.direction, event.ts_ns, data, event.lead, event.stream_pos,
                                 event.forwarded_ns)
        try:
            self._send.send_nowait(event)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.dropped += 1
            if ring is not None:
                ring.take_back()
            return
        self._sent += 1
        self._queued_run_bytes += run_bytes
        if ring is not None:
            self._ring_sizes.append(run_bytes)

    def _make_ring(self) -> RunRing:
        self._ring = RunRing.private(self.queue_bytes)
        return self._ring

    async def run(self) -> None:
        """Deliver events until :meth:`close` (the queue is drained first)."""
        receive, pieces = self._receive, self._pieces
        clock, side_clock = self._clock, self._side_clock
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._tick_ring)
                await self._deliver_until_closed(receive, pieces, clock, side_clock)
                nursery.cancel_scope.cancel()
        finally:
            if self._ring is not None:
                self._ring.close()  # (views still held somewhere keep it mapped until they go)

    async def _tick_ring(self) -> None:
        """Tell the run ring the time while events come or not: it gives back the pages a backlog took once
        the backlog has gone (a task of its own: the delivery loop may wait for an event for good)."""
        while True:
            await trio.sleep(RING_TICK_SECONDS)
            if self._ring is not None:
                self._ring.tick()

    async def _deliver_until_closed(self, receive: trio.MemoryReceiveChannel[Event], pieces: deque[Event],
                                    clock: Callable[[], float], side_clock: Callable[[], float]) -> None:
        side_before = side_clock()
        async with receive:
            while True:
                if pieces:
                    await trio.lowlevel.checkpoint()  # the rest of a long run: the relays go first
                else:
                    try:
                        self._take(await receive.receive())
                    except trio.EndOfChannel:
                        return
                # What else is waiting, without a trip through the scheduler per event (the relays
                # publish many events per turn; one each would leave the queue to overflow), for
                # a slice in proportion to the relays' last turn: then the relays go on (the queue
                # absorbs the rest).  Only a backlog needs the slice (and the other threads' CPU
                # time, a system call or two): a lone event (a client that does not saturate the
                # proxy publishes one per frame) is delivered and done.
                started = clock()
                self._deliver(pieces.popleft())
                if not pieces:
                    if self._sent == self._taken:  # (nothing in the channel: no WouldBlock raised, ~1 us a run)
                        self._turn_ended = clock()
                        continue
                    try:
                        self._take(receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        self._turn_ended = clock()
                        continue
                side = side_clock()
                side_seconds, side_before = side - side_before, side  # observers' threads, since last measured
                relay_seconds = max(started - self._turn_ended - side_seconds, 0.0)
                # The hub's account: what the relays' time earned it, less its threads' CPU, less what
                # earlier turns overdrew (a minimum slice, exports beyond the share); while it is
                # overdrawn a turn delivers the one event.
                balance = min(self._balance + relay_seconds * self._weight - side_seconds, self.max_slice_seconds)
                if balance > 0.0:
                    until = started + max(balance, self.slice_seconds)
                    while clock() < until:
                        if not pieces:
                            if self._sent == self._taken:
                                break
                            try:
                                self._take(receive.receive_nowait())
                            except (trio.WouldBlock, trio.EndOfChannel):
                                break
                        self._deliver(pieces.popleft())
                self._turn_ended = clock()
                self._balance = max(balance - (self._turn_ended - started), -self.max_overdraft)

    def _take(self, event: Event) -> None:
        """Queue an event for delivery; a long run as pieces cut between frames."""
        self._taken += 1
        if type(event) is not RunEvent or len(event.data) <= self.run_piece_bytes or not self.cuts_runs:
            self._pieces.append(event)
            return
        start = 0
        for cut in piece_starts(event.data, event.lead, self.run_piece_bytes):
            self._pieces.append(self._piece(event, start, cut))
            start = cut
        self._pieces.append(self._piece(event, start, len(event.data)))

    @staticmethod
    def _piece(event: RunEvent, start: int, stop: int) -> RunEvent:
        return RunEvent(event.connection, event.direction, event.ts_ns, event.data[start:stop],
                        min(event.lead, stop) if start == 0 else 0, event.stream_pos + start,
                        event.forwarded_ns)

    def close(self) -> None:
        self._send.close()

    def _hand_over(self, event: Event) -> None:
        """Give an event to each queued observer (a run: one call each, no dispatch)."""
        if type(event) is not RunEvent:
            for observer in self._queued:
                self._call(observer, event)
        else:
            for observer, on_run in self._run_takers:
                if on_run is None:
                    self._call(observer, event)
                    continue
                try:
                    on_run(event)
                except Exception as exc:  # an observer bug must not take traffic down
                    self._failed(observer, exc)
        self.delivered += 1

    def _deliver(self, event: Event) -> None:
        self._hand_over(event)
        if type(event) is not RunEvent:
            return
        size = len(event.data)
        self._queued_run_bytes -= size
        sizes = self._ring_sizes
        if type(event.data) is not bytes:  # a view of a run in the ring: the runs delivered whole give it back
            delivered = self._ring_delivered + size
            while sizes and delivered >= sizes[0]:
                delivered -= sizes.popleft()
                assert self._ring is not None
                self._ring.release(1)
            self._ring_delivered = delivered

    def _call(self, observer: Observer, event: Event) -> None:
        try:
            if isinstance(event, RunEvent):
                observer.on_run(event)  # type: ignore[attr-defined]
            elif isinstance(event, FrameEvent):
                observer.on_frame(event)
            else:
                observer.on_connection(event)
        except Exception as exc:  # an observer bug must not take traffic down
            self._failed(observer, exc)

    def _failed(self, observer: Observer, exc: Exception) -> None:
        self.observer_errors += 1
        log.warning("observer failed", observer=type(observer).__name__, error=repr(exc))
