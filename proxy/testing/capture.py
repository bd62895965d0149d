"""``tap.recording()``: what a block of a test sent and received through the tap, decoded.

Two halves:

- :class:`CaptureObserver` is a proxy observer (``proxy.core.hooks.Observer``)
  running in the tap's loop.  It keeps, per connection, the frames that set up
  state (CONNECT, PRODUCER, SUBSCRIBE, their answers, closes), so that frames
  carrying only ids can later be attributed to their topic, and, while a capture
  window is open, every frame.  Memory is bounded: at most ``max_setup_frames``
  per connection (oldest forgotten) and ``max_frames`` in open windows (the rest
  counted in ``dropped``).  :meth:`CaptureObserver.begin` opens a window,
  :meth:`CaptureObserver.end` closes it and returns the window's frames of every
  connection it saw, preceded by that connection's set-up frames.
- :class:`Capture` (what ``tap.recording()`` returns) opens a window for a
  ``with`` block, then decodes the frames with the recording timeline
  (:mod:`proxy.recording.timeline`) and answers :meth:`Capture.frames` and
  :meth:`Capture.requests`.

Times are as the client sees them: a frame towards the client counts from when the
proxy forwarded it (rule delays included), so a request's latency is from the
proxy receiving it to the client being given its answer.  A frame a rule dropped
or replaced is listed with ``delivered=False`` and answers no request.
"""

from __future__ import annotations

import fnmatch
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Protocol

from proxy.core.hooks import ConnectionEvent, FrameEvent
from proxy.errors import ProtocolError
from proxy.protocol.commands import DATA_PATH_TYPES, T
from proxy.protocol.session import Direction, RequestPair, SessionTracker
from proxy.recording.reader import RecordedFrame
from proxy.recording.timeline import TimelineBuilder, TimelineEntry
from proxy.testing.errors import TapError
from proxy.testing.faults import full_topic_pattern

#: frames kept outside capture windows: what attributes later frames to producers and consumers
SETUP_TYPES: Final = frozenset({T.CONNECT, T.CONNECTED, T.PRODUCER, T.PRODUCER_SUCCESS, T.SUBSCRIBE, T.SUCCESS,
                                T.ERROR, T.CLOSE_PRODUCER, T.CLOSE_CONSUMER, T.UNSUBSCRIBE})
DEFAULT_MAX_SETUP_FRAMES: Final = 10_000
DEFAULT_MAX_FRAMES: Final = 500_000


@dataclass(frozen=True, slots=True)
class CapturedRaw:
    """One frame as the observer kept it (bytes and facts; decoded later, outside the proxy's loop)."""

    conn: int
    direction: str
    origin: str
    ts_ns: int
    forwarded_ns: int | None
    raw: bytes
    fired: tuple[str, ...] = ()

    @property
    def delivered(self) -> bool:
        """Reached its receiver: forwarded (maybe changed), or written by the proxy itself."""
        return self.origin == "proxy" or self.forwarded_ns is not None

    def to_json(self) -> dict[str, Any]:
        import base64

        return {"conn": self.conn, "direction": self.direction, "origin": self.origin, "ts_ns": self.ts_ns,
                "forwarded_ns": self.forwarded_ns, "raw": base64.b64encode(self.raw).decode("ascii"),
                "fired": list(self.fired)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CapturedRaw:
        import base64

        return cls(int(data["conn"]), str(data["direction"]), str(data["origin"]), int(data["ts_ns"]),
                   None if data["forwarded_ns"] is None else int(data["forwarded_ns"]),
                   base64.b64decode(data["raw"]), tuple(data["fired"]))


@dataclass(frozen=True, slots=True)
class CaptureWindow:
    """What :meth:`CaptureObserver.end` returns."""

    begin_ns: int
    end_ns: int
    frames: list[CapturedRaw]
    dropped: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"begin_ns": self.begin_ns, "end_ns": self.end_ns, "dropped": self.dropped,
                "frames": [frame.to_json() for frame in self.frames]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaptureWindow:
        return cls(int(data["begin_ns"]), int(data["end_ns"]), [CapturedRaw.from_json(f) for f in data["frames"]],
                   int(data["dropped"]))


@dataclass
class _Connection:
    setup: deque[tuple[int, CapturedRaw]]
    #: frames kept while a window is open (any type), with their arrival order
    recent: list[tuple[int, CapturedRaw]] = field(default_factory=list)
    closed: bool = False


class CaptureObserver:
    """Keeps what capture windows need; see the module docstring.  Thread-safe."""

    #: it reads bytes and facts only: the relay need not run its session tracker for it
    needs_observation = False

    def __init__(self, *, max_setup_frames: int = DEFAULT_MAX_SETUP_FRAMES,
                 max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        self.max_setup_frames = max_setup_frames
        self.max_frames = max_frames
        self._lock = threading.Lock()
        self._connections: dict[int, _Connection] = {}
        #: open windows: id -> (begin ts, frames dropped for lack of room)
        self._windows: dict[int, list[int]] = {}
        self._next_id = 1
        self._order = 0
        self._kept = 0
        #: the latest receive time seen (the tap waits for it to pass a window's end)
        self.last_ts_ns = 0

    # -- the observer side (the proxy's loop) --------------------------------------------------------
    def on_frame(self, event: FrameEvent) -> None:
        frame = event.frame
        captured = CapturedRaw(event.connection.conn_id, str(event.direction), str(event.origin), event.ts_ns,
                               event.forwarded_ns, frame.raw, event.fired)
        with self._lock:
            self.last_ts_ns = max(self.last_ts_ns, event.ts_ns)
            conn = self._connections.get(captured.conn)
            if conn is None:
                conn = self._connections[captured.conn] = _Connection(deque(maxlen=self.max_setup_frames))
            self._order += 1
            item = (self._order, captured)
            if frame.type in SETUP_TYPES:
                conn.setup.append(item)
            if self._windows and event.ts_ns >= min(begin for begin, _ in self._windows.values()):
                if self._kept >= self.max_frames:
                    for window in self._windows.values():
                        window[1] += 1
                    return
                conn.recent.append(item)
                self._kept += 1

    def on_connection(self, event: ConnectionEvent) -> None:
        if not event.closed:
            return
        with self._lock:
            conn = self._connections.get(event.connection.conn_id)
            if conn is None:
                return
            if self._windows:
                conn.closed = True
            else:
                del self._connections[event.connection.conn_id]

    # -- the tap's side ------------------------------------------------------------------------------------
    def begin(self) -> int:
        """Open a window from now; returns its id."""
        with self._lock:
            window_id = self._next_id
            self._next_id += 1
            self._windows[window_id] = [time.time_ns(), 0]
            return window_id

    def end(self, window_id: int, end_ns: int | None = None) -> CaptureWindow:
        """Close a window: its frames (received up to ``end_ns``), each connection's set-up frames first."""
        with self._lock:
            window = self._windows.pop(window_id, None)
            if window is None:
                raise TapError(f"no open capture window {window_id}")
            begin_ns, dropped = window
            end_ns = time.time_ns() if end_ns is None else end_ns
            frames: list[CapturedRaw] = []
            for conn in self._connections.values():
                inside = [(order, f) for order, f in conn.recent if begin_ns <= f.ts_ns <= end_ns]
                if not inside:
                    continue
                first = inside[0][0]
                setup = [(order, f) for order, f in conn.setup if order < first and f.ts_ns < begin_ns]
                frames.extend(f for _, f in sorted(setup + inside, key=lambda item: item[0]))
            self._forget_unneeded()
            return CaptureWindow(begin_ns, end_ns, frames, dropped)

    def _forget_unneeded(self) -> None:
        """Drop window frames no open window needs, and closed connections once no window is open."""
        oldest = min((begin for begin, _ in self._windows.values()), default=None)
        kept = 0
        for conn_id, conn in list(self._connections.items()):
            if oldest is None:
                conn.recent = []
                if conn.closed:
                    del self._connections[conn_id]
            else:
                conn.recent = [(order, f) for order, f in conn.recent if f.ts_ns >= oldest]
                kept += len(conn.recent)
        self._kept = kept


# -- what users read ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CapturedFrame:
    """One frame of a capture, decoded (keys as ``pulsar-tap show --json`` names them)."""

    ts_ns: int
    conn: int
    direction: str
    origin: str
    command: str
    topic: str | None
    fields: dict[str, Any]
    size: int
    #: False when a rule dropped or replaced it before it reached its receiver
    delivered: bool
    rules: tuple[str, ...] = ()
    num_messages: int | None = None
    payload_size: int | None = None
    #: for a response: milliseconds since its request
    latency_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"ts_ns": self.ts_ns, "conn": self.conn, "direction": self.direction, "origin": self.origin,
                "command": self.command, "topic": self.topic, "fields": self.fields, "size": self.size,
                "delivered": self.delivered, "rules": list(self.rules), "num_messages": self.num_messages,
                "payload_size": self.payload_size, "latency_ms": self.latency_ms}


@dataclass(frozen=True, slots=True)
class CapturedRequest:
    """A request the block's clients made and what answered it (``outcome`` ok | error | unanswered)."""

    command: str
    response: str | None
    topic: str | None
    outcome: str
    start_ns: int
    #: milliseconds from the proxy receiving the request to the client being given the answer (None: unanswered)
    latency_ms: float | None
    conn: int
    error_code: str | None = None
    error_message: str | None = None
    producer_id: int | None = None
    consumer_id: int | None = None
    sequence_id: int | None = None
    request_id: int | None = None
    num_messages: int = 0

    @classmethod
    def of(cls, pair: RequestPair, conn: int) -> CapturedRequest:
        answered = pair.outcome != "unanswered"
        return cls(pair.request_command, pair.response_command, pair.topic, pair.outcome, pair.start_ns,
                   pair.latency_ns / 1e6 if answered else None, conn, pair.error_code, pair.error_message,
                   pair.producer_id, pair.consumer_id, pair.sequence_id, pair.request_id, pair.num_messages)


def _names(value: str | Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset({value.upper()})
    return frozenset(v.upper() for v in value)


def topic_matcher(topic: str | None) -> re.Pattern[str] | None:
    """A topic filter written as in :meth:`Fault.topic` (short names, globs, their partitions)."""
    if topic is None:
        return None
    pattern = full_topic_pattern(topic)
    return re.compile(pattern["regex"] if isinstance(pattern, dict) else fnmatch.translate(pattern))


class CaptureSource(Protocol):
    """Where a capture's frames come from (a tap in this process or in a child process)."""

    def capture_begin(self) -> int: ...

    def capture_end(self, window_id: int) -> CaptureWindow: ...


class Capture:
    """``with tap.recording() as rec:`` — the block's traffic; read it after the block (see the module docstring)."""

    def __init__(self, source: CaptureSource) -> None:
        self._source = source
        self._window_id: int | None = None
        self._frames: list[CapturedFrame] | None = None
        self._requests: list[CapturedRequest] = []
        #: frames not kept because the capture limit was reached
        self.dropped = 0
        self.begin_ns = 0
        self.end_ns = 0

    def __enter__(self) -> Capture:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    async def __aenter__(self) -> Capture:
        from proxy.testing.injection import run_blocking

        await run_blocking(self.start)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        from proxy.testing.injection import run_blocking

        await run_blocking(self.stop, finish=True)

    def start(self) -> None:
        if self._window_id is not None:
            raise TapError("this capture is already running")
        self._frames = None
        self._window_id = self._source.capture_begin()

    def stop(self) -> None:
        if self._window_id is None:
            return
        window_id, self._window_id = self._window_id, None
        window = self._source.capture_end(window_id)
        self.begin_ns, self.end_ns, self.dropped = window.begin_ns, window.end_ns, window.dropped
        self._frames, self._requests = decode_window(window)

    def _decoded(self) -> list[CapturedFrame]:
        if self._frames is None:
            raise TapError("the capture is still running: read it after its block")
        return self._frames

    def frames(self, command: str | Iterable[str] | None = None, *, topic: str | None = None,
               direction: str | None = None, origin: str | None = None,
               delivered: bool | None = None) -> list[CapturedFrame]:
        """The block's frames in the order the client saw them, filtered (a topic as in ``Fault.topic``)."""
        commands = _names(command)
        topic_re = topic_matcher(topic)
        return [f for f in self._decoded()
                if (commands is None or f.command in commands)
                and (topic_re is None or (f.topic is not None and topic_re.fullmatch(f.topic) is not None))
                and (direction is None or f.direction == direction)
                and (origin is None or f.origin == origin)
                and (delivered is None or f.delivered == delivered)]

    def requests(self, command: str | Iterable[str] | None = None, *, topic: str | None = None,
                 outcome: str | None = None) -> list[CapturedRequest]:
        """The requests the block's clients made, with what answered them and the latency the client saw."""
        self._decoded()
        commands = _names(command)
        topic_re = topic_matcher(topic)
        return [r for r in self._requests
                if (commands is None or r.command in commands)
                and (topic_re is None or (r.topic is not None and topic_re.fullmatch(r.topic) is not None))
                and (outcome is None or r.outcome == outcome)]

    def messages_sent(self, topic: str | None = None) -> int:
        """Messages in the block's SEND frames (a batch counts its messages)."""
        return sum(f.num_messages or 0 for f in self.frames("SEND", topic=topic, origin="client"))


def _client_view_ns(frame: CapturedRaw) -> int:
    if frame.direction == "to_client" and frame.forwarded_ns is not None:
        return frame.forwarded_ns
    return frame.ts_ns


def decode_window(window: CaptureWindow) -> tuple[list[CapturedFrame], list[CapturedRequest]]:
    """The window's frames decoded in the order the client saw them, and the requests of the window."""
    ordered = sorted(enumerate(window.frames), key=lambda item: (_client_view_ns(item[1]), item[0]))
    builder = TimelineBuilder()
    frames: list[CapturedFrame] = []
    requests: list[CapturedRequest] = []
    for _, raw in ordered:
        recorded = RecordedFrame(conn=raw.conn, direction=raw.direction, origin=raw.origin,
                                 ts_ns=_client_view_ns(raw), data=raw.raw, size=len(raw.raw), rules=raw.fired)
        # The session as the client knows it: everything it sent (delivered or not), what it was given.
        tracked = raw.origin == "client" or (raw.direction == "to_client" and raw.delivered)
        entry = builder.entry(recorded) if tracked else _untracked_entry(builder, recorded)
        if raw.ts_ns < window.begin_ns:
            continue  # a connection's set-up frame from before the block: context only
        frames.append(_captured_frame(entry, raw))
        pair = entry.completed
        if pair is not None and pair.start_ns >= window.begin_ns:
            requests.append(CapturedRequest.of(pair, raw.conn))
    for conn, tracker in builder.trackers.items():
        requests.extend(CapturedRequest.of(pair, conn) for pair in _unanswered(tracker, window)
                        if pair.start_ns >= window.begin_ns)
    requests.sort(key=lambda r: r.start_ns)
    return frames, requests


def _unanswered(tracker: SessionTracker, window: CaptureWindow) -> Sequence[RequestPair]:
    return [pair for pair in tracker.close(window.end_ns) if pair.request_command not in ("PING", "PONG")]


def _untracked_entry(builder: TimelineBuilder, recorded: RecordedFrame) -> TimelineEntry:
    entry = TimelineBuilder().entry(recorded)  # decoded on its own, attributed with the connection's ids
    entry.completed = None
    tracker = builder.trackers.get(recorded.conn)
    # Only data-path frames take the connection's ids; the proxy's own set-up frames (a CONNECT
    # to the broker a lookup named, say) keep what they say themselves.
    if tracker is not None and entry.error is None and recorded.frame.type in DATA_PATH_TYPES:
        try:
            observation = tracker.attribute(recorded.frame, Direction(recorded.direction))
        except ProtocolError:  # a frame the tracker cannot attribute keeps its own topic
            return entry
        entry.topic = observation.topic or entry.topic
    return entry


def _captured_frame(entry: TimelineEntry, raw: CapturedRaw) -> CapturedFrame:
    return CapturedFrame(
        ts_ns=raw.ts_ns, conn=raw.conn, direction=raw.direction, origin=raw.origin, command=entry.command,
        topic=entry.topic, fields=entry.fields, size=len(raw.raw), delivered=raw.delivered, rules=raw.fired,
        num_messages=entry.num_messages, payload_size=entry.payload_size,
        latency_ms=None if entry.latency_ns is None else entry.latency_ns / 1e6)


__all__ = ["SETUP_TYPES", "Capture", "CaptureObserver", "CaptureSource", "CaptureWindow", "CapturedFrame",
           "CapturedRaw", "CapturedRequest", "decode_window", "topic_matcher"]
