"""Delivers frame and connection events to observers without ever stalling traffic.

The relay calls :meth:`ObserverHub.publish` (synchronous, never blocks); events (frames,
runs of passed-through bytes, connections) go
into one bounded Trio memory channel and a single task hands them to each
observer.  Overflow policy: when the queue is full the event is dropped and
counted in ``dropped`` — traffic always wins over telemetry.  An observer that
raises is logged and counted, and keeps receiving later events.
"""

from __future__ import annotations

from typing import Final

import structlog
import trio

from proxy.server.hooks import ConnectionEvent, FrameEvent, Observer, RunEvent

DEFAULT_QUEUE_SIZE: Final = 10_000

log = structlog.get_logger("pulsar_tap.observers")

Event = FrameEvent | RunEvent | ConnectionEvent


class ObserverHub:
    """A bounded queue between the relays and the observers; see the module docstring."""

    def __init__(self, observers: list[Observer] | None = None, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        self.observers: list[Observer] = list(observers or [])
        # Bounded: overflow drops the event and counts it (see publish).
        self._send, self._receive = trio.open_memory_channel[Event](queue_size)
        self.dropped = 0
        self.delivered = 0
        self.observer_errors = 0

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
    def queued(self) -> int:
        """Events published and not yet delivered."""
        return self._send.statistics().current_buffer_used

    def publish(self, event: Event) -> None:
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self.dropped += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self.dropped += 1

    async def run(self) -> None:
        """Deliver events until :meth:`close` (the queue is drained first)."""
        async with self._receive:
            async for event in self._receive:
                self._deliver(event)

    def close(self) -> None:
        self._send.close()

    def _deliver(self, event: Event) -> None:
        for observer in self.observers:
            try:
                if isinstance(event, RunEvent):
                    observer.on_run(event)  # type: ignore[attr-defined]
                elif isinstance(event, FrameEvent):
                    observer.on_frame(event)
                else:
                    observer.on_connection(event)
            except Exception as exc:  # an observer bug must not take traffic down
                self.observer_errors += 1
                log.warning("observer failed", observer=type(observer).__name__, error=repr(exc))
        self.delivered += 1
