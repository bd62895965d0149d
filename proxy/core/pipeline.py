"""One proxied connection, sans-IO: bytes in from either side, actions out.

The relay feeds :meth:`ConnectionPipeline.receive` what it read from the client
(direction ``to_broker``) or from the broker (``to_client``) and carries out the
returned actions in order: :class:`Send` bytes to a side, :class:`OpenUpstream`
before the CONNECT goes out, :class:`Hold` (bytes put aside in
:attr:`ConnectionPipeline.held` until a time: a rule's delay — which holds the
frame and whatever follows it in its direction until the frame's own time, see
``holding`` — a lane's throttle, or a deferred frame), :class:`Close`, :class:`Fail`
(a read's good frames came before a bad one: raise its error once they are sent).  :meth:`ConnectionPipeline.tick`
drives keepalive and :meth:`ConnectionPipeline.release_due` hands back the held
frames whose time has come.  Nothing here awaits, reads a clock or touches a socket.

What the pipeline does itself (Pulsar binary protocol, "Connection establishment",
"Keep Alive", "Topic lookup"):

- the connection's state is the shared session machine's (``proxy.protocol.session``,
  lenient): a frame its table refuses is forwarded and counted
  (``session.violations``), except out of turn in the handshake, which closes both
  sides.  The first frame from the client must be CONNECT; it chooses the broker (the
  listener's, or CONNECT's ``proxy_to_broker_url`` if the directory allows it);
  the proxy strips ``proxy_to_broker_url`` and lowers ``protocol_version`` to what
  it understands (never raises it);
- CONNECTED's ``max_message_size`` becomes the frame limit of both directions;
- lookup answers are rewritten (``lookup``) — also those a rule makes the proxy
  write itself (``redirect``, ``error`` on LOOKUP), so no real broker address
  reaches a client;
- keepalive (``proxy.protocol.keepalive``): a side silent for ``keepalive`` gets a
  PING from the proxy (its PONG is swallowed); silent for as long again after it, it
  is dead and both sides are closed.  PINGs and PONGs of the client and the broker pass through, paired in order so the
  proxy never swallows a PONG someone else asked for;
- with ``verify_checksums`` a SEND with a bad CRC32C is answered SEND_ERROR
  ChecksumError instead of being forwarded;
- the last ERROR the broker sent is kept (``broker_error``) for the line that logs the
  connection's end (the scanners always hand ERRORs from the broker over: they are rare).

Every other frame is passed through as bytes by the :class:`FrameScanner` unless a
hook (rules) or observers want it; observers that all take runs (``runs``) get the
passed-through bytes as one :class:`RunEvent` per stretch instead.  The hook is asked
only about the frame types it declared (``interest``, or per connection
``connection_interest``, asked again whenever the tracker registers a producer or
consumer), and its :class:`Verdict` decides.  The session tracker
observes every frame for observers that read the observation (``observations``);
for a hook alone it observes the control frames (``accounted_types``: what keeps the
producer / consumer maps and the request attribution exact), and the data-path frames
(SEND, MESSAGE, FLOW, ACK, receipts) only when the hook looks at them, and then only to
attribute them (``SessionTracker.attribute``) — so a hook costs in proportion to what
its rules can match.  FLOW permits are then not counted (``permits_exact`` is False).

It runs once or more per relayed read, so ``scripts/setup.sh`` compiles it with mypyc, in the
relay's lane (:data:`proxy.compiled.RELAY_LANE`: one extension with the reactor's hop and the
scanner, whose calls to each other are C calls): what it declares is checked at run time there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from proxy.config.proxy_config import ServiceUrl
from proxy.core.holding import HoldQueue
from proxy.core.hooks import (
    ConnectionEvent,
    ConnectionInfo,
    FrameContext,
    FrameEvent,
    FrameHook,
    Origin,
    RunEvent,
    origin_of,
)
from proxy.core.interest import NO_INTEREST, ConnectionInterest
from proxy.core.lookup import BROKER_NAMING_TYPES, BrokerDirectory, Redirected, failed_answer, rewrite_broker_urls
from proxy.core.run_cutter import count_frame_starts
from proxy.core.scanner import FrameScanner, Piece
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import DEFAULT_MAX_FRAME_BYTES, Frame, encode_command, frame_from_bytes
from proxy.protocol.keepalive import PING_FRAME, Keepalive, KeepaliveStep
from proxy.protocol.session import (
    ConnectionState,
    Direction,
    Observation,
    SessionTracker,
    accounted_types,
    server_error_name,
    watched_types,
)
from proxy.rules.verdict import FORWARD, Verdict

TO_BROKER: Final = Direction.TO_BROKER
TO_CLIENT: Final = Direction.TO_CLIENT
#: a broker's ERROR message is cut to this many characters for the log (it is the broker's text, any length)
MAX_ERROR_MESSAGE_CHARS: Final = 300
#: the newest protocol version this proxy's definitions know
MAX_PROTOCOL_VERSION: Final = max(v.number for v in api.ProtocolVersion.DESCRIPTOR.values)

#: proxy-through: the client's LOOKUPs kept until answered (to follow a Redirect); beyond it, the oldest go
MAX_PENDING_LOOKUPS: Final = 4096


# -- actions ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Send:
    """Write ``data`` (in order, as one write when possible) towards ``direction``."""

    direction: Direction
    data: list[Piece | bytes]
    slice_bytes: int = 0


@dataclass(frozen=True, slots=True)
class OpenUpstream:
    """Connect to ``broker`` before carrying out the following actions."""

    broker: ServiceUrl


@dataclass(frozen=True, slots=True)
class Hold:
    """Frames were put aside until ``due_ns``: call ``release_due`` then (or earlier)."""

    due_ns: int


@dataclass(frozen=True, slots=True)
class FollowRedirect:
    """proxy-through: look the topic up where the Redirect says, then call ``lookup_answered``."""

    redirected: Redirected


@dataclass(frozen=True, slots=True)
class Close:
    """End the connection on both sides; ``reset`` sends RST to the client."""

    reason: str
    reset: bool = False
    hostile: bool = False


@dataclass(frozen=True, slots=True)
class Fail:
    """The bytes broke the protocol after the actions before this one: raise ``error`` once they are done."""

    error: ProtocolError


Action = Send | OpenUpstream | Hold | FollowRedirect | Close | Fail


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    lookup_mode: str = "rewrite"
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    verify_checksums: bool = False
    keepalive_ns: int = 30 * 1_000_000_000


class ConnectionPipeline:
    """The sans-IO logic of one client connection and its upstream; see the module docstring."""

    def __init__(self, info: ConnectionInfo, *, settings: PipelineSettings, directory: BrokerDirectory,
                 default_broker: ServiceUrl, now_ns: int, hook: FrameHook | None = None,
                 publish: Callable[[FrameEvent | RunEvent | ConnectionEvent], None] | None = None,
                 observations: bool = True, runs: bool = False, run_views: bool = False) -> None:
        self.info = info
        self.settings = settings
        self.directory = directory
        self.default_broker = default_broker
        self.broker: ServiceUrl | None = None
        #: CONNECT's proxy_to_broker_url, when the client named its broker (proxy-through)
        self.proxied_to: str | None = None
        #: the CONNECT as sent upstream (proxy-through opens lookup connections with it)
        self.upstream_connect: bytes | None = None
        #: proxy-through: the client's LOOKUPs awaiting an answer, by request id
        self._lookups: OrderedDict[int, api.CommandLookupTopic] = OrderedDict()
        self.hook = hook
        self.publish = publish
        #: the connection's "opened" event went to the observers (once routed: it names the broker)
        self.announced = False
        # Telemetry: a received frame's event is held until the verdict is known, so that it
        # carries the rules that fired and when the frame left (after the delays ahead of it).
        self._held_event: FrameEvent | None = None
        # The session tracker decodes every frame it sees: run it only for a hook, or for observers
        # that read FrameEvent.observation (``observations``; a recorder needs raw bytes only).
        self._observations = publish is not None and observations
        tracked = hook is not None or self._observations
        # Observers that take passed-through bytes in bulk (``runs``: the recorder) get each
        # stretch of them as one RunEvent, and no frame is decoded for them.
        self._runs = publish is not None and runs
        # ``run_views``: ``publish`` copies what it keeps of a RunEvent's bytes before it returns
        # (the observer hub does), so they are handed over as a view of the receive buffer, uncopied
        self._run_views = run_views
        #: per direction, the stream offset of the next byte handed out (the RunEvents' stream_pos)
        self._stream_pos = {TO_BROKER: 0, TO_CLIENT: 0}
        # The shared session machine, lenient: a frame its table refuses is counted in
        # ``session.violations`` and forwarded, except where the proxy cannot go on (out of turn
        # in the handshake, see _session_moved).  It sees only the frames that move the state or
        # that the table refuses (``watched_types``; all others are loops), unless it is also the
        # ``tracker`` keeping ids and requests for a hook or observers.
        self.session = SessionTracker(strict=False)
        self.tracker = self.session if tracked else None
        #: per direction, the frame types the session must see in its current state
        self._watched: dict[Direction, frozenset[int]] = {}
        # Per direction: the frame types the hook looks at, and those the tracker observes
        # (None: every type); set by _refresh_wanted, again whenever the hook's interest changes.
        self._hook_types: dict[Direction, frozenset[int] | None] = {TO_BROKER: frozenset(), TO_CLIENT: frozenset()}
        self._hook_interest: dict[Direction, ConnectionInterest] = {}
        self._accounted: frozenset[int] | None = None
        self._hook_generation: object = None
        #: the tracker's ``entities_named`` when the hook's interest was last asked
        self._entities_seen = 0
        #: the tracker's FLOW permits are exact only if every FLOW and MESSAGE was observed
        self.permits_exact = self.tracker is not None
        self.scanners = {TO_BROKER: FrameScanner(settings.max_frame_bytes),
                         TO_CLIENT: FrameScanner(settings.max_frame_bytes)}
        # keepalive of the side whose frames travel in a direction: client -> to_broker, broker -> to_client
        self.sides = {TO_BROKER: Keepalive(settings.keepalive_ns, now_ns),
                      TO_CLIENT: Keepalive(settings.keepalive_ns, now_ns)}
        self.started_ns = now_ns
        self.bytes_in = {TO_BROKER: 0, TO_CLIENT: 0}
        #: the last ERROR decoded from the broker, "ErrorCode: message" on one line (None: none seen)
        self.broker_error: str | None = None
        # Frames the proxy originates into a stream that is in the middle of a passed-through
        # frame wait here until that stream reaches a frame boundary (never spliced inside one).
        self._injections: dict[Direction, list[Piece | bytes]] = {TO_BROKER: [], TO_CLIENT: []}
        self._injections_waiting = False
        #: frames a rule holds back (a lane's delay) or sends later (deferred FLOW permits)
        self.held = HoldQueue()
        self._refresh_wanted()

    # -- input -----------------------------------------------------------------------------
    def receive(self, direction: Direction, data: bytes | memoryview, now_ns: int) -> list[Action]:
        """Bytes read from one side (``direction`` is where they travel)."""
        actions = self.relay_read(direction, data, now_ns)
        return [Send(direction, [data])] if actions is None else actions

    def relay_read(self, direction: Direction, data: bytes | memoryview, now_ns: int) -> list[Action] | None:
        """:meth:`receive` for the relay's hop: None when ``data`` goes on as it is, as one write."""
        if self.hook is not None and getattr(self.hook, "generation", None) != self._hook_generation:
            self._refresh_wanted()  # the rules changed: look at what they can match now
        self.sides[direction].last_rx_ns = now_ns
        self.bytes_in[direction] += len(data)
        scanner = self.scanners[direction]
        lead = scanner.passing_through if self._runs else 0
        scanned = scanner.frames_scanned
        try:
            pieces = scanner.feed(data)
        except ProtocolError as exc:
            # The whole frames of this read before the bad one passed every check: they go
            # on as if the read had ended there (a broker would have taken them), then the
            # error ends the connection.
            passed = scanner.passed_before_error
            if not passed:
                raise
            actions = self._receive_pieces(direction, passed, lead, now_ns)
            actions.append(Fail(exc))
            return actions
        # (the frames the scanner counted in this receive, counted only for observers of runs, are those that
        # begin in what it handed out: it carries a frame's head it has not read whole into the next receive, and
        # hands out each frame it counts)
        if len(pieces) == 1 and type(pieces[0]) is not Frame and not self._injections_waiting \
                and direction not in self.held.lanes:
            if self._runs:
                self._publish_run(direction, pieces[0], lead, now_ns, scanner.frames_scanned - scanned)
            # the fast path: nothing to look at, nothing held
            return None if pieces[0] is data else [Send(direction, pieces)]
        return self._receive_pieces(direction, pieces, lead, now_ns,
                                    scanner.frames_scanned - scanned if self._runs else -1)

    def _receive_pieces(self, direction: Direction, pieces: list[Piece], lead: int, now_ns: int,
                        frames: int = -1) -> list[Action]:
        """What the scanner handed out of a read: each wanted Frame looked at, the rest sent as it is.

        ``frames``: how many frames begin in ``pieces`` (-1: not known).  When they are all runs, the
        runs before the last are the rest of a frame begun before and a head the scanner carried over
        (a frame or none, counted from their bytes), and the last run has the rest of the count.
        """
        actions: list[Action] = []
        run: list[Piece | bytes] = []
        last = len(pieces) - 1 if frames >= 0 and self._runs and all(type(piece) is not Frame for piece in pieces) \
            else -1
        for index, piece in enumerate(pieces):
            if type(piece) is not Frame:
                run.append(piece)
                if self._runs:
                    counted = -1
                    if index == last:
                        counted = frames
                    elif last >= 0 and not isinstance(piece, Frame):  # (it is not: narrowed for the types)
                        counted = count_frame_starts(piece, min(lead, len(piece)))
                        frames -= counted
                    lead = self._publish_run(direction, piece, lead, now_ns, counted)
                continue
            lead = 0  # (a Frame ends where the next one begins)
            if self._runs:
                self._stream_pos[direction] += len(piece.raw)
            forwarded = self._on_frame(piece, direction, now_ns, actions, run)
            self._release_event(forwarded is not None)
            if forwarded is not None:
                run.append(forwarded)
        self._flush(direction, run, actions)
        if self._injections[direction] and self.scanners[direction].at_frame_boundary:
            self._emit(direction, self._injections[direction], actions)
            self._injections[direction] = []
            self._injections_waiting = bool(self._injections[TO_BROKER] or self._injections[TO_CLIENT])
        return actions

    def inject(self, direction: Direction, frames: list[Piece | bytes], actions: list[Action]) -> None:
        """Send frames the proxy originates towards ``direction``, between whole frames only."""
        if self.scanners[direction].at_frame_boundary and not self._injections[direction]:
            self._emit(direction, frames, actions)
        else:
            self._injections[direction].extend(frames)
            self._injections_waiting = True

    def release_due(self, now_ns: int) -> list[Action]:
        """The held frames due by ``now_ns``: a stream lane's bytes as they are, others between frames."""
        actions: list[Action] = []
        for entry in self.held.pop_due(now_ns):
            if entry.stream:
                actions.append(Send(entry.direction, list[Piece | bytes](entry.frames)))
            else:
                self.inject(entry.direction, list[Piece | bytes](entry.frames), actions)
            if entry.originated:
                for data in entry.frames:
                    self._publish_proxy_frame(entry.direction, data, now_ns)
        return actions

    def _emit(self, direction: Direction, pieces: list[Piece | bytes], actions: list[Action]) -> None:
        """Write ``pieces`` towards ``direction`` now — or, while its stream lane holds frames, behind them."""
        last_due = self.held.last_due(direction)
        if last_due is None:
            actions.append(Send(direction, pieces))
            return
        # (pieces may be views of a receive buffer that is reused: the queue keeps copies)
        self.held.add(last_due, direction, pieces, lane=direction)  # type: ignore[arg-type]
        actions.append(Hold(last_due))

    def _forward_time(self, direction: Direction, now_ns: int) -> int:
        """When a frame received now in ``direction`` leaves: now, or behind what its stream lane holds."""
        last_due = self.held.last_due(direction)
        return now_ns if last_due is None else max(now_ns, last_due)

    def peer_closed(self, direction: Direction) -> None:
        """The side sending in ``direction`` closed; raises MalformedFrame if mid-frame."""
        self.scanners[direction].close()

    def tick(self, now_ns: int) -> list[Action]:
        """Keepalive and handshake deadlines; call it every fraction of the keepalive interval."""
        interval = self.settings.keepalive_ns
        if self.session.state is not ConnectionState.CONNECTED:
            if now_ns - self.started_ns > 2 * interval:
                return [Close(f"no handshake within {2 * interval / 1e9:g}s")]
            return []
        actions: list[Action] = []
        for direction, side in self.sides.items():
            step = side.poll(now_ns)
            if step is KeepaliveStep.DEAD:
                who = "client" if direction is TO_BROKER else "broker"
                return [Close(f"{who} silent for {side.idle_ns(now_ns) / 1e9:.1f}s and no PONG: peer is dead")]
            if step is KeepaliveStep.PING:
                towards = TO_CLIENT if direction is TO_BROKER else TO_BROKER
                self.inject(towards, [PING_FRAME], actions)
                self._publish_proxy_frame(towards, PING_FRAME, now_ns)
        return actions

    # -- frames the pipeline looks at ----------------------------------------------------------
    def _on_frame(self, frame: Frame, direction: Direction, now_ns: int, actions: list[Action],
                  run: list[Piece | bytes]) -> bytes | None:
        """Handle one wanted frame; returns the bytes to forward in place, or None."""
        kind = frame.type
        if self.settings.lookup_mode == "proxy-through" and kind in (T.LOOKUP, T.LOOKUP_RESPONSE) \
                and self._proxy_through_lookup(frame, direction, actions):
            return None  # a Redirect the proxy follows: the client never sees it
        observation = self._observe(frame, direction, now_ns)
        data: bytes | None = frame.raw
        if kind == T.CONNECT and direction is TO_BROKER:
            data = self._on_connect(frame, actions, run)
            self.announce()
        elif kind == T.CONNECTED and direction is TO_CLIENT:
            self._on_connected(frame)
        elif kind in BROKER_NAMING_TYPES and direction is TO_CLIENT:
            data = rewrite_broker_urls(frame, self.directory, self.settings.lookup_mode) or frame.raw
        elif kind == T.PING:
            # The PONG this PING asks for belongs to the sender: let it through.
            self.sides[TO_CLIENT if direction is TO_BROKER else TO_BROKER].ping_relayed()
        elif kind == T.PONG:
            if self.sides[direction].pong_received():
                return None  # it answers the proxy's own PING
        elif kind == T.SEND and self.settings.verify_checksums and direction is TO_BROKER:
            section = frame.payload
            if section is not None and not section.checksum_ok():
                send = frame.command.send
                error = encode_command(api.CommandSendError(
                    producer_id=send.producer_id, sequence_id=send.sequence_id,
                    error=api.ServerError.ChecksumError, message="checksum mismatch (checked by pulsar-tap)"))
                self._flush(direction, run, actions)
                self.inject(TO_CLIENT, [error], actions)
                self._publish_proxy_frame(TO_CLIENT, error, now_ns)
                return None
        elif kind == T.ERROR and direction is TO_CLIENT:
            self.broker_error = _one_line_error(frame.command.error)
        if data is None:
            return None
        if data is not frame.raw:
            self._publish_proxy_frame(direction, data, now_ns)
        if self.hook is not None:
            hook_types = self._hook_types[direction]
            if hook_types is not None and kind not in hook_types:
                return data
            if data is not frame.raw:
                frame = frame_from_bytes(data, self.scanners[direction].max_frame_bytes)
            verdict = self.hook.on_frame(FrameContext(self.info, direction, now_ns, observation), frame)
            if verdict is not FORWARD:
                return self._apply(verdict, frame, data, direction, now_ns, actions, run)
        return data

    def _proxy_through_lookup(self, frame: Frame, direction: Direction, actions: list[Action]) -> bool:
        """Remember the client's LOOKUPs; turn a Redirect answering one into FollowRedirect (True)."""
        if frame.type == T.LOOKUP and direction is TO_BROKER:
            self._lookups[frame.command.lookupTopic.request_id] = frame.command.lookupTopic
            if len(self._lookups) > MAX_PENDING_LOOKUPS:
                self._lookups.popitem(last=False)
            return False
        if frame.type != T.LOOKUP_RESPONSE or direction is not TO_CLIENT:
            return False
        answer = frame.command.lookupTopicResponse
        lookup = self._lookups.pop(answer.request_id, None)
        if answer.response != api.CommandLookupTopicResponse.Redirect:
            return False
        broker = self.directory.broker_url(answer.brokerServiceUrl, answer.brokerServiceUrlTls)
        if lookup is None or broker is None:
            self.inject(TO_CLIENT, [failed_answer(answer.request_id, "cannot follow the Redirect")], actions)
            return True
        actions.append(FollowRedirect(Redirected(lookup, broker, answer.authoritative)))
        return True

    def lookup_answered(self, answer: bytes, now_ns: int) -> list[Action]:
        """proxy-through: the owner broker's answer to a lookup the proxy followed, for the client.

        It goes to the client as the first broker's answer would have: observed, rewritten
        (Connect with ``proxy_through_service_url``), shown to the hook (a delay or a drop
        applies), and written between whole frames of the broker's stream.
        """
        actions: list[Action] = []
        frame = frame_from_bytes(answer, 2**31)
        observation = self._observe(frame, TO_CLIENT, now_ns)
        data = rewrite_broker_urls(frame, self.directory, self.settings.lookup_mode) or frame.raw
        if data is not frame.raw:
            self._publish_proxy_frame(TO_CLIENT, data, now_ns)
        verdict = FORWARD
        hook_types = self._hook_types[TO_CLIENT]
        if self.hook is not None and (hook_types is None or T.LOOKUP_RESPONSE in hook_types):
            verdict = self.hook.on_frame(FrameContext(self.info, TO_CLIENT, now_ns, observation),
                                         frame_from_bytes(data, 2**31))
        due_ns = now_ns + int(verdict.delay_s * 1e9)
        self._release_event(verdict.forward, verdict.fired, due_ns, verdict.marks)
        if not verdict.forward:
            return actions
        out = verdict.replacement if verdict.replacement is not None else data
        if due_ns > now_ns:
            self.held.add(due_ns, TO_CLIENT, [out])
            actions.append(Hold(due_ns))
        else:
            self.inject(TO_CLIENT, [out], actions)
        return actions

    def lookup_failed(self, request_id: int, message: str, now_ns: int) -> list[Action]:
        """proxy-through: following a Redirect failed; the client gets a Failed answer (ServiceNotReady)."""
        actions: list[Action] = []
        answer = failed_answer(request_id, message)
        self.inject(TO_CLIENT, [answer], actions)
        self._publish_proxy_frame(TO_CLIENT, answer, now_ns)
        return actions

    def announce(self) -> None:
        """Tell the observers the connection opened (at most once; from CONNECT on, naming its broker)."""
        if self.announced:
            return
        self.announced = True
        if self.publish is not None:
            self.publish(ConnectionEvent(self.info, self.started_ns, closed=False))

    def _observe(self, frame: Frame, direction: Direction, now_ns: int) -> Observation | None:
        """Move the session by ``frame``; the observation of it, if a hook or observers read one."""
        observation = None
        session, tracker, accounted = self.session, self.tracker, self._accounted
        state, violations = session.state, session.violations
        if tracker is not None and (accounted is None or frame.type in accounted):
            observation = tracker.observe(frame, direction, now_ns)  # (moves the state too)
            if tracker.entities_named != self._entities_seen and self.hook is not None:
                self._refresh_wanted()  # a producer or consumer registered: the rules may match more now
        else:
            if frame.type in self._watched[direction]:
                session.advance(frame.type, direction)
            if tracker is not None:
                hook_types = self._hook_types[direction]
                if hook_types is None or frame.type in hook_types:
                    observation = tracker.attribute(frame, direction)
        if self.publish is not None:
            self._held_event = FrameEvent(self.info, direction, origin_of(direction), now_ns, frame, observation,
                                          forwarded_ns=self._forward_time(direction, now_ns))
        if session.state is not state or session.violations != violations:
            self._session_moved(frame.type, direction, state)
        return observation

    def _release_event(self, forwarded: bool = True, fired: tuple[str, ...] = (),
                       forwarded_ns: int | None = None, marks: tuple[str, ...] = ()) -> None:
        """Publish the held event of the frame being handled (telemetry; see __init__)."""
        event, self._held_event = self._held_event, None
        if event is None or self.publish is None:
            return
        if forwarded_ns is None:
            forwarded_ns = event.forwarded_ns
        if fired or marks or not forwarded or event.forwarded_ns != forwarded_ns:
            # (built anew rather than with dataclasses.replace, which costs three times as much)
            event = FrameEvent(event.connection, event.direction, event.origin, event.ts_ns, event.frame,
                               event.observation, fired or event.fired, forwarded_ns if forwarded else None,
                               marks or event.marks)
        self.publish(event)

    def _session_moved(self, kind: int, direction: Direction, before: ConnectionState) -> None:
        """The frame just seen moved the session, or was one its table refuses (counted).

        A refused frame is forwarded like any other, except out of turn in the handshake —
        anything before CONNECT, a second CONNECT from the client, a CONNECTED from the broker
        nobody asked for: the proxy routes by CONNECT and sizes frames by CONNECTED, so that
        closes the connection.
        """
        if self.session.state is before and (
                before is ConnectionState.AWAITING_CONNECT
                or (kind == T.CONNECT and direction is TO_BROKER) or (kind == T.CONNECTED and direction is TO_CLIENT)):
            self.session.check(kind, direction)  # raises IllegalFrame, the table's reason
        self._refresh_wanted()

    def _on_connect(self, frame: Frame, actions: list[Action], run: list[Piece | bytes]) -> bytes:
        connect = frame.command.connect
        changed = False
        broker = self.default_broker
        cmd = api.BaseCommand()
        cmd.CopyFrom(frame.command)
        if connect.HasField("proxy_to_broker_url"):
            broker = self.directory.route(connect.proxy_to_broker_url)
            self.proxied_to = connect.proxy_to_broker_url
            cmd.connect.ClearField("proxy_to_broker_url")
            changed = True
        if connect.protocol_version > MAX_PROTOCOL_VERSION:
            cmd.connect.protocol_version = MAX_PROTOCOL_VERSION
            changed = True
        dial, target = self.directory.hop(broker)
        if target is not None:  # behind an upstream proxy: name the broker to it, as its clients do
            cmd.connect.proxy_to_broker_url = target
            changed = True
        self.broker = broker
        # (built anew, the held event changed in place: dataclasses.replace cost ~2 us each, at every CONNECT)
        info = self.info
        self.info = ConnectionInfo(info.conn_id, info.client, info.listener, str(broker))
        if self._held_event is not None:  # the CONNECT itself is the routed connection's first frame
            self._held_event.connection = self.info  # (held: no observer has it yet)
        self._flush(TO_BROKER, run, actions)
        actions.append(OpenUpstream(dial))
        self.upstream_connect = encode_command(cmd) if changed else frame.raw
        return self.upstream_connect

    def _on_connected(self, frame: Frame) -> None:
        connected = frame.command.connected
        if connected.HasField("max_message_size") and connected.max_message_size > 0:
            for scanner in self.scanners.values():
                scanner.set_max_message_size(connected.max_message_size)

    def _apply(self, verdict: Verdict, frame: Frame, data: bytes, direction: Direction, now_ns: int,
               actions: list[Action], run: list[Piece | bytes]) -> bytes | None:
        """Carry out a hook's verdict on one frame (everything before it is flushed first)."""
        if verdict.lane is None and not verdict.changes_traffic:
            # the rules only took note (mark, record): the frame stays in its run, one write with it
            self._release_event(True, verdict.fired, None, verdict.marks)
            return data
        back = TO_CLIENT if direction is TO_BROKER else TO_BROKER
        self._flush(direction, run, actions)
        lane = verdict.lane
        # A throttle's lane holds this frame and its lane only.  A plain delay holds this frame
        # until its own time in the direction's stream lane, which everything after it joins.
        if lane is None and verdict.delay_s > 0:
            lane = direction
        in_lane = lane is not None and (verdict.delay_s > 0 or self.held.lane_busy(lane))
        due_ns = now_ns + int(verdict.delay_s * 1e9)
        if in_lane:
            # never before its lane's last frame, nor before what its direction's stream holds
            due_ns = self.held.release_at(self.held.release_at(due_ns, lane), direction)
        self._release_event(verdict.forward, verdict.fired, due_ns if in_lane else None, verdict.marks)
        # the verdict addresses frames by side: those towards the sender answer it
        to_sender, to_receiver = (verdict.to_client, verdict.to_broker) if direction is TO_BROKER \
            else (verdict.to_broker, verdict.to_client)
        answers = [self._towards(back, extra) for extra in to_sender
                   if not (back is TO_CLIENT and self._follows(extra, actions))]
        if answers:
            self.inject(back, list(answers), actions)
            for extra in answers:
                self._publish_proxy_frame(back, extra, now_ns)
        for deferred in verdict.deferred:
            towards = TO_BROKER if deferred.to_broker else TO_CLIENT
            later_ns = now_ns + int(deferred.after_s * 1e9)
            if deferred.poll is not None:
                self.held.add_poll(later_ns, towards, deferred.poll)
            else:
                self.held.add(later_ns, towards, (self._towards(towards, deferred.data),), originated=True)
            actions.append(Hold(later_ns))
        forwarded: list[bytes] = []
        if verdict.forward:
            out = verdict.replacement if verdict.replacement is not None else data
            if out is not frame.raw:
                self._publish_proxy_frame(direction, out, now_ns)
            forwarded.append(out)
        for extra in to_receiver:
            forwarded.append(extra)
            self._publish_proxy_frame(direction, extra, now_ns)
        if forwarded and in_lane:
            self.held.add(due_ns, direction, forwarded, lane=lane)
            actions.append(Hold(due_ns))
        elif forwarded and self.held.lane_busy(direction):
            self._emit(direction, list[Piece | bytes](forwarded), actions)
        elif forwarded:
            actions.append(Send(direction, list[Piece | bytes](forwarded), verdict.slice_bytes))
        if verdict.close is not None:
            actions.append(Close(f"closed by rule ({verdict.close})", reset=verdict.close == "reset"))
        return None

    def _follows(self, data: bytes, actions: list[Action]) -> bool:
        """proxy-through: a rule's Redirect answer is followed by the proxy like the broker's (True)."""
        if self.settings.lookup_mode != "proxy-through":
            return False
        try:
            frame = frame_from_bytes(data, 2**31)
        except ProtocolError:
            return False
        return self._proxy_through_lookup(frame, TO_CLIENT, actions)

    def _towards(self, direction: Direction, data: bytes) -> bytes:
        """A frame the proxy writes itself: lookup answers to the client are rewritten too."""
        if direction is not TO_CLIENT:
            return data
        try:
            frame = frame_from_bytes(data, 2**31)
        except ProtocolError:
            return data
        if frame.type not in BROKER_NAMING_TYPES:
            return data
        return rewrite_broker_urls(frame, self.directory, self.settings.lookup_mode) or data

    def _flush(self, direction: Direction, run: list[Piece | bytes], actions: list[Action]) -> None:
        if run:
            self._emit(direction, list(run), actions)
            run.clear()

    def _publish_run(self, direction: Direction, piece: Piece, lead: int, now_ns: int, frames: int = -1) -> int:
        """Hand passed-through bytes to the observers that take runs (a copy unless ``run_views``: the
        buffer is reused); ``lead`` of them finish a frame begun before, ``frames`` frames begin in them
        (-1: not counted; see ``RunEvent.frames``).  Returns the lead of a run that follows this one in
        the same receive.

        Runs follow one another in a receive only where the scanner completed a frame head it
        carried over from the receive before: that head (one frame start, at its start), then the
        rest of its frame, then the frames after it.  So only the first frame begun in a run needs
        a look to tell where the next run's first frame begins.
        """
        assert self.publish is not None
        # (never a Frame here; typed bytes as the hub's queued observers get it, see RunEvent: a view is
        # passed on as it is, untyped, which compiled code does not check)
        run: Any = piece
        data = run if self._run_views else bytes(run)
        size = len(data)
        position = self._stream_pos[direction]
        self._stream_pos[direction] = position + size
        self.publish(RunEvent(self.info, direction, now_ns, data, min(lead, size), position,
                              self._forward_time(direction, now_ns), frames))
        if lead >= size:
            return lead - size
        if size - lead < 4:
            return 0
        return max(lead + int.from_bytes(data[lead:lead + 4], "big") + 4 - size, 0)

    def _publish_proxy_frame(self, direction: Direction, data: bytes, now_ns: int) -> None:
        if self.publish is None:
            return
        self._release_event()  # the received frame's event goes first
        try:
            frame = frame_from_bytes(data, 2**31)
        except ProtocolError:
            return  # a deliberately corrupted frame: observers see what was received
        self.publish(FrameEvent(self.info, direction, Origin.PROXY, now_ns, frame))

    def _refresh_wanted(self) -> None:
        """Tell both scanners which frames to hand over (the rest passes through as bytes)."""
        generation = getattr(self.hook, "generation", None)
        entities = self.tracker.entities_named if self.tracker is not None else 0
        # The hook is asked again unless nothing its answer depends on moved: a hook with a generation
        # answers alike for the same generation and the same producers and consumers (the session's
        # state moving alone, at CONNECT and CONNECTED, changes only the frames the session watches).
        if self.hook is not None and (generation is None or generation != self._hook_generation
                                      or entities != self._entities_seen or not self._hook_interest):
            self._hook_generation = generation
            self._entities_seen = entities
            interest_in = getattr(self.hook, "connection_interest", None)
            for direction in (TO_BROKER, TO_CLIENT):
                self._hook_interest[direction] = interest = \
                    interest_in(direction, self.info, self.tracker) if interest_in is not None \
                    else ConnectionInterest(self.hook.interest(direction))
                self._hook_types[direction] = interest.types
        if self.tracker is None or self._observations:
            self._accounted = None
        else:
            self._accounted = accounted_types(self._hook_types[TO_CLIENT])
            if T.FLOW not in self._accounted or T.MESSAGE not in self._accounted:
                self.permits_exact = False  # and stays so: permits missed now are never recounted
        for direction, scanner in self.scanners.items():
            want_all = self.publish is not None and not self._runs
            watched = self._watched[direction] = watched_types(self.session.state, direction)
            wanted: set[int] = {T.PING, T.PONG, *watched}
            if self.tracker is not None and self._accounted is not None:
                wanted |= self._accounted
            interest = self._hook_interest.get(direction, NO_INTEREST)
            if self.hook is not None:
                hook_types = self._hook_types[direction]
                if hook_types is None:
                    want_all = True
                else:
                    wanted |= hook_types - interest.sampled_kinds
            if direction is TO_BROKER:
                if self.settings.lookup_mode == "proxy-through":
                    wanted.add(T.LOOKUP)  # to follow the Redirect that may answer it
                if self.settings.verify_checksums:
                    wanted.add(T.SEND)
            else:
                # (a broker's ERROR is rare and says why the connection may end: the closing line names it)
                wanted |= BROKER_NAMING_TYPES | {T.ERROR}
            # (with nobody observing, a pick the hook's sampler settles alone need not be handed out)
            scanner.set_wanted(wanted, want_all=want_all, sampler=interest.sampler, barrier=interest.barrier,
                               settle=self.publish is None)


def _one_line_error(error: api.CommandError) -> str:
    """An ERROR's code and message as one log-safe line: whitespace collapsed, the message cut short."""
    message = " ".join(error.message.split())
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS] + "..."
    return f"{server_error_name(error.error)}: {message}" if message else server_error_name(error.error)
