"""Hook points of the proxy: per-frame verdicts for the rules engine, events for observers.

Two kinds of plug-ins see the traffic (after Kroxylicious' filters and mitmproxy's
addons):

- a :class:`FrameHook` (the rules engine) is asked about each frame it declared an
  interest in and returns a :class:`~proxy.rules.verdict.Verdict` (the engine's own
  decision type, carried out as it is): forward, replace the bytes, answer on the
  other side's behalf, drop, delay (the direction, or only one lane of it), send
  frames later, slice into small writes, or close;
- :class:`Observer` s (recorder, tracer, metrics) receive a :class:`FrameEvent` for
  every frame — as received, and again for what the proxy changed or originated;
  those that take runs (``on_run``) get the frames the proxy passed through unchanged
  as :class:`RunEvent` s, stretches of bytes — and never change traffic.  They are
  fed through a bounded queue with counted drops (``observer_hub``), so a slow
  observer cannot stall traffic.

Both are synchronous and do no I/O on the relay's path.  The defaults do nothing,
and with neither installed the relay decodes only what the proxy itself needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Protocol

from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction, Observation
from proxy.rules.verdict import FORWARD, Verdict


class Origin(enum.StrEnum):
    """Who produced the bytes of a frame (SPEC.md, ``show --json`` ``origin``)."""

    CLIENT = "client"
    BROKER = "broker"
    PROXY = "proxy"


def origin_of(direction: Direction) -> Origin:
    """The sender of a frame received travelling in ``direction``."""
    return Origin.CLIENT if direction is Direction.TO_BROKER else Origin.BROKER


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    """Who is on either side of one proxied connection."""

    conn_id: int
    client: str            # the client's address, HOST:PORT
    listener: str          # the proxy listener it reached
    broker_url: str | None  # the upstream broker URL (None until routed)


@dataclass(slots=True)
class FrameContext:
    """What a hook knows about a frame besides its bytes."""

    connection: ConnectionInfo
    direction: Direction
    now_ns: int
    observation: Observation | None


class FrameHook(Protocol):
    """The rules engine's side of the relay."""

    def interest(self, direction: Direction) -> frozenset[int] | None:
        """Command types this hook must see in ``direction``; None means every frame."""
        ...

    def on_frame(self, ctx: FrameContext, frame: Frame) -> Verdict:
        ...

    # Optional: ``connection_closed(conn_id: int) -> None`` is called (when the hook has
    # it) once a connection has ended, to forget per-connection state.
    # Optional: a ``generation`` attribute that changes whenever ``interest`` may have
    # changed (rules replaced at run time); the relay then asks for the interest again.
    # Without it, interest is read when the connection changes phase.
    # Optional: ``connection_interest(direction, info: ConnectionInfo, session: SessionTracker | None)
    # -> ConnectionInterest``: the interest in one connection, given what its session tracker
    # knows (its producers and consumers); asked instead of ``interest`` whenever the generation
    # or the tracker's ``entities_named`` changed.


class NoRules:
    """The default hook: sees nothing, forwards everything."""

    def interest(self, direction: Direction) -> frozenset[int] | None:
        del direction
        return frozenset()

    def on_frame(self, ctx: FrameContext, frame: Frame) -> Verdict:
        del ctx, frame
        return FORWARD

    def connection_closed(self, conn_id: int) -> None:
        del conn_id


@dataclass(slots=True)
class FrameEvent:
    """One frame crossing the proxy, as observers receive it."""

    connection: ConnectionInfo
    direction: Direction
    origin: Origin
    ts_ns: int
    frame: Frame
    observation: Observation | None = None
    fired: tuple[str, ...] = ()
    #: when the frame left the proxy: ``ts_ns`` plus the rule delays ahead of it (None: not forwarded)
    forwarded_ns: int | None = None
    #: labels of ``mark`` rules that fired on it (the span of its request or delivery carries them)
    marks: tuple[str, ...] = ()


@dataclass(slots=True)
class RunEvent:
    """Bytes the proxy passed through unchanged, as received, for observers that take runs.

    ``data`` is a stretch of one direction's stream; it may begin with the rest of a
    frame begun in an earlier event (``lead`` bytes of it) and may end inside a frame
    (continued in a later event).  ``stream_pos`` is the offset of its first byte in
    the direction's stream (the same count advances by every received frame handed
    out as a :class:`FrameEvent`), so that a reader can tell when events were dropped.
    With ``ConnectionPipeline``'s ``run_views``, ``data`` is a ``memoryview`` of a buffer
    the relay reuses once ``publish`` returns: the observer hub copies it to ``bytes`` for
    the observers its queue serves (when they all set ``run_views = True``, into its run ring
    instead: ``data`` is then a ``memoryview`` valid only until ``on_run`` returns), and an
    ``immediate`` observer copies what it keeps.
    """

    connection: ConnectionInfo
    direction: Direction
    ts_ns: int
    data: bytes | memoryview
    lead: int
    stream_pos: int
    #: when the bytes left the proxy: ``ts_ns``, or later behind what a rule's delay holds
    forwarded_ns: int
    #: how many frames begin in ``data`` (past ``lead``) when the relay's scanner counted them as it read
    #: (a receive that came out as this one run); -1 when it did not: count them from ``data``
    frames: int = -1
    #: no rule looked at these frames, so none fired (as ``FrameEvent.fired``)
    fired: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True, slots=True)
class ConnectionEvent:
    """A proxied connection opened (``closed`` False) or closed, with the reason."""

    connection: ConnectionInfo
    ts_ns: int
    closed: bool
    reason: str | None = None


class Observer(Protocol):
    """Recorder, tracer, metrics: called from the observer task, never on the relay path.

    An observer may set a class attribute ``needs_observation = False`` when it never reads
    :attr:`FrameEvent.observation`: if no observer needs one (and no hook is installed),
    the relay does not run its session tracker for them and events carry ``None``.
    Observers without the attribute are given observations.

    An observer that needs only the bytes (the recorder) may also have
    ``on_run(event: RunEvent) -> None``: when every observer has it (and no hook wants
    every frame), the relay does not build a Frame and a FrameEvent for each frame it
    passes through unchanged: each stretch of them comes as one :class:`RunEvent`, and
    only the frames the proxy looks at anyway come as FrameEvents.  One that works frame
    by frame on what a run holds (telemetry) sets ``runs_in_pieces = True``: the hub then
    hands long runs over in pieces cut between frames and lets the relays run in between
    (see ``observer_hub``); others get each run whole, as received.
    """

    def on_frame(self, event: FrameEvent) -> None:
        ...

    def on_connection(self, event: ConnectionEvent) -> None:
        ...
