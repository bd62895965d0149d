"""One proxied connection on Trio: read both sides, let the pipeline decide, write.

The relay is the thin I/O loop around :class:`~proxy.core.pipeline.ConnectionPipeline`.
Its two directions and its keepalive timer share one nursery: when one ends (a peer
closed, a protocol error, a dead peer, a rule's close), the nursery is cancelled
and both sockets are closed in ``finally``.  Backpressure is natural: a direction
reads its next chunk only after it has written the last one, so a slow reader
slows its writer and memory per connection stays bounded by the receive size plus
the frames the scanner must hold.

Plain-socket directions are normally served by the server's
:class:`~proxy.server.reactor.Reactor` (many connections per wake-up) and fall back
to their own task whenever something has to wait; TLS directions always use their
task.  A peer's EOF is passed on as a half-close (see :meth:`Relay.peer_finished`).
In ``proxy-through`` mode a Redirect is followed in a task of its own (``redirects``),
so the connection's other frames keep flowing meanwhile.

Held frames (a rule's delay, a throttle's lane, deferred FLOW permits; see
``holding``) are released by one extra task per connection, started on the first
:class:`Hold`: it sleeps until the earliest due time and writes what is due.  A
delay never stops a direction from reading: frames in flight are each held until
their own time.  When the pipeline's
hold queue is full, the direction that fills it stops reading until releases make
room.  When the connection ends, held frames are discarded and the hook is told
(``connection_closed``).

Draining (graceful shutdown): :meth:`Relay.begin_drain` stops reading the client at
the next frame boundary; the broker's answers keep flowing until the server's grace
period ends.

Time: the pipeline's ``now_ns`` comes from a :class:`TrioEpochClock` — epoch
nanoseconds read from the wall clock once, when the connection is accepted, and
advanced by ``trio.current_time()`` after that.  Held frames and keepalive are timed
on Trio's monotonic clock (a wall clock stepped backwards cannot stall them, and a
test's ``autojump_clock`` drives them), while the timestamps observers record stay
Unix epoch nanoseconds.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import structlog
import trio

from proxy.config.proxy_config import ServiceUrl
from proxy.core.hooks import ConnectionEvent, ConnectionInfo
from proxy.core.pipeline import (
    TO_BROKER,
    TO_CLIENT,
    Action,
    Close,
    ConnectionPipeline,
    Fail,
    FollowRedirect,
    Hold,
    OpenUpstream,
    Send,
)
from proxy.errors import ProtocolError
from proxy.protocol.session import Direction
from proxy.server.hop import ReactorPump, Stop
from proxy.server.plain_socket import PeerLost
from proxy.server.redirects import LookupFailed, LookupLinks
from proxy.server.transport import SocketTransport, StreamTransport, Transport
from proxy.server.upstream import UpstreamUnavailable
from proxy.telemetry.logs import writes

if TYPE_CHECKING:
    from proxy.server.app import ProxyServer

log = structlog.get_logger("pulsar_tap.proxy")

_conn_ids = itertools.count(1)


def next_conn_id() -> int:
    return next(_conn_ids)


def _trios_system_clock() -> type | None:
    """Trio's own clock class (not public API; trio is pinned, and another version's is read as any clock)."""
    try:
        from trio._core._run import SystemClock
    except ImportError:
        return None
    return SystemClock


_TRIOS_SYSTEM_CLOCK: Final = _trios_system_clock()


class TrioEpochClock:
    """Unix epoch ns that advance with Trio's clock: the wall clock is read once, at creation.

    Call it (and create it) inside a Trio run.  It is read on every relayed read: under Trio's
    own clock (``offset + perf_counter()``) it reads ``perf_counter_ns`` itself, one call in
    place of two and float arithmetic; any other clock (a test's virtual time) is read as Trio reads it.
    """

    __slots__ = ("base_ns", "elapsed_ns")

    def __init__(self) -> None:
        clock = trio.lowlevel.current_clock()
        epoch_ns = time.time_ns()
        #: now is ``base_ns + elapsed_ns()`` (the reactor's hop reads it so, without this call)
        self.elapsed_ns: Callable[[], int]
        if _TRIOS_SYSTEM_CLOCK is not None and type(clock) is _TRIOS_SYSTEM_CLOCK:
            self.elapsed_ns = time.perf_counter_ns
            self.base_ns = epoch_ns - time.perf_counter_ns()
        else:
            # the run's clock itself (what trio.current_time() reads, without the lookups per call)
            trio_now, trio_start = clock.current_time, clock.current_time()
            self.elapsed_ns = lambda: int((trio_now() - trio_start) * 1e9)
            self.base_ns = epoch_ns

    def __call__(self) -> int:
        return self.base_ns + self.elapsed_ns()


@dataclass(slots=True)
class _Ending:
    reason: str = "closed"
    reset: bool = False
    hostile: bool = False
    level: str = "info"


@dataclass(eq=False)
class Relay:
    """The I/O side of one client connection."""

    server: ProxyServer
    client: Transport
    pipeline: ConnectionPipeline
    upstream: Transport | None = None
    draining: bool = False
    _ending: _Ending | None = None
    _nursery: trio.Nursery | None = None
    _client_pump: ReactorPump | None = None
    _finished: set[Direction] = field(default_factory=set)
    #: "client" or "broker": whose EOF came first (the log names it as the one who closed)
    _first_to_close: str | None = None
    #: now for the pipeline (see "Time" in the module docstring)
    clock: TrioEpochClock = field(default_factory=TrioEpochClock)
    #: set to wake the release task (new frames held)
    _held_changed: trio.Event | None = None
    #: set by the release task when it has made room in a full hold queue
    _held_room: trio.Event = field(default_factory=trio.Event)
    #: proxy-through: the proxy's own connections for following Redirects (opened on the first)
    _lookup_links: LookupLinks | None = None
    #: a keepalive tick's writes are being carried out (the next tick waits for them)
    _keepalive_busy: bool = False
    #: "client" or "broker": who half-closed, the other side lingering (until the nursery's deadline)
    _lingering: str | None = None

    @property
    def info(self) -> ConnectionInfo:
        return self.pipeline.info

    @property
    def upstream_local_address(self) -> str | None:
        """The proxy's own address on its connection to the broker (what the broker sees as peer)."""
        return self.upstream.local_address if self.upstream is not None else None

    @property
    def lookup_local_addresses(self) -> list[str]:
        """proxy-through: the proxy's own addresses on the connections it follows Redirects over."""
        return self._lookup_links.local_addresses if self._lookup_links is not None else []

    async def run(self) -> None:
        hub = self.server.observers
        wheel = self.server.keepalive
        assert wheel.running, "the server's keepalive wheel must run for its relays to be kept alive"
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                wheel.add(self)
                # (the client's direction is served by this task: one task fewer a connection)
                await self._pump(TO_BROKER)
        finally:
            wheel.discard(self)  # (before any checkpoint: the wheel never ticks a relay whose nursery closed)
            # The client's pump refers to this relay: the one cycle of a connection's objects.  Broken here,
            # they all go when the connection does; left, they waited for the collector's oldest generation
            # (dozens of objects a connection, a full collection every few hundred connections in a storm).
            self._client_pump = None
            ending = self._ending or self._lingered() or _Ending("cancelled (proxy shutting down)")
            client, upstream = self.client, self.upstream
            if type(client) is SocketTransport and (upstream is None or type(upstream) is SocketTransport) \
                    and self._lookup_links is None:
                client.close(reset=ending.reset)  # (plain sockets close at once: no shielded wait)
                if upstream is not None:
                    upstream.close()
            else:
                with trio.CancelScope(shield=True):
                    await client.aclose(reset=ending.reset)
                    if upstream is not None:
                        await upstream.aclose()
                    if self._lookup_links is not None:
                        await self._lookup_links.aclose()
            level = "warning" if ending.hostile else ending.level
            if writes(level):
                getattr(log, level)("dropped hostile client" if ending.hostile else "connection closed",
                                    conn=self.info.conn_id, client=self.info.client, broker=self.info.broker_url,
                                    reason=ending.reason, bytes_from_client=self.pipeline.bytes_in[TO_BROKER],
                                    bytes_from_broker=self.pipeline.bytes_in[TO_CLIENT],
                                    protocol_violations=self.pipeline.session.violations)
            self.pipeline.held.clear()
            closed = getattr(self.pipeline.hook, "connection_closed", None)
            if closed is not None:
                try:
                    closed(self.info.conn_id)
                except Exception as exc:  # a hook bug must not break the teardown
                    log.warning("hook failed on connection close", conn=self.info.conn_id, error=repr(exc))
            if hub.active:
                self.pipeline.announce()  # a connection that never sent CONNECT opened too
                hub.publish(ConnectionEvent(self.info, self.clock(), closed=True, reason=ending.reason))

    def end(self, ending: _Ending) -> None:
        """Record why the connection ends (first reason wins) and cancel both directions."""
        if self._ending is None:
            self._ending = self._lingered() or ending
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def peer_finished(self, direction: Direction) -> None:
        """The side sending in ``direction`` closed its end (EOF at a frame boundary).

        Like any TCP proxy, pass the half-close on: the other side reads EOF after every
        byte already sent, and may still answer; once both directions are finished (or
        the other side lingers past the drain period) the connection ends.  Closing at
        once instead would reset a socket whose peer still has unread answers in flight,
        and the kernel would discard the last bytes the proxy forwarded.
        """
        who = "client" if direction is TO_BROKER else "broker"
        if not self._finished:
            self._first_to_close = who
        self._finished.add(direction)
        target = self.upstream if direction is TO_BROKER else self.client
        if len(self._finished) == 2 or target is None:
            # the side that closed first ended the connection; the other only answered its FIN
            self.end(_Ending(self._closed_by(self._first_to_close or who)))
            return
        try:
            await target.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.end(_Ending(self._closed_by(who)))
            return
        assert self._nursery is not None
        # The other side may linger for the drain period: then the connection ends.  A deadline on the
        # connection's own scope, not a task (its reason is read when the connection ends: ``_lingered``).
        self._lingering = who
        self._nursery.cancel_scope.deadline = trio.current_time() + max(self.server.config.limits.drain_seconds, 1.0)

    def _lingered(self) -> _Ending | None:
        """The ending when the other side of a half-closed connection lingered past its deadline, else None."""
        who = self._lingering
        if who is None or self._nursery is None or trio.current_time() < self._nursery.cancel_scope.deadline:
            return None
        return _Ending(f"{self._closed_by(who)} (the other side lingered)")

    def _closed_by(self, who: str) -> str:
        """Why the connection ended when ``who`` closed it: naming the broker's last ERROR, which says why a
        refused connection was refused (an AuthenticationError's message holds no token: the broker's own text)."""
        error = self.pipeline.broker_error
        if error is None:
            return f"{who} closed the connection"
        whose = "" if who == "broker" else "the broker's "
        return f"{who} closed the connection after {whose}ERROR {error}"

    def begin_drain(self) -> None:
        """Stop reading the client at its next frame boundary (checked after each receive)."""
        self.draining = True
        pump = self._client_pump
        if pump is not None and not pump.busy and self.pipeline.scanners[TO_BROKER].at_frame_boundary:
            pump.hand_over(Stop())

    async def _pump(self, direction: Direction) -> None:
        sender = "client" if direction is TO_BROKER else "broker"
        try:
            await self._pump_loop(direction)
        except ProtocolError as exc:
            peer = self.info.client if direction is TO_BROKER else self.info.broker_url
            hostile = direction is TO_BROKER
            self.end(_Ending(f"{sender} {peer} broke the protocol: {exc}", reset=False, hostile=hostile,
                             level="warning"))
        except UpstreamUnavailable as exc:
            self.end(_Ending(f"upstream unavailable: {exc}", level="warning"))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            side = self._lost_side(sender, exc)
            error = self.pipeline.broker_error if side == "broker" else None
            after = f" (after ERROR {error})" if error is not None else ""  # (a broker resetting what it refused)
            self.end(_Ending(f"{side} connection lost: {exc}{after}"))

    def _lost_side(self, sender: str, failure: Exception) -> str:
        """Whose connection a pump's failure lost: the peer a failed read or write names (the client, when
        a receipt finds it gone, on the broker's task), anything else the sender's."""
        if isinstance(failure, PeerLost):
            return "client" if failure.peer == self.info.client else "broker"
        return sender

    async def _pump_loop(self, direction: Direction) -> None:
        source = self.client if direction is TO_BROKER else self.upstream
        assert source is not None
        reactor = self.server.reactor
        if reactor is not None and isinstance(source, SocketTransport):
            pump = ReactorPump(self, direction, source, reactor)
            if direction is TO_BROKER:
                self._client_pump = pump
            await self._serve_with_reactor(pump)
            return
        pipeline = self.pipeline
        clock = self.clock
        from_client = direction is TO_BROKER
        while True:
            if from_client and self.draining and pipeline.scanners[TO_BROKER].at_frame_boundary:
                return  # stop reading the client; the broker's answers keep flowing
            data = await source.receive()
            if not data:
                pipeline.peer_closed(direction)
                await self.peer_finished(direction)
                return
            actions = pipeline.receive(direction, data, clock())
            if actions:
                await self._carry_out(actions)

    async def _serve_with_reactor(self, pump: ReactorPump) -> None:
        """A direction's task while the reactor serves it (``hop``): carry out what the reactor hands over."""
        pump.task = trio.lowlevel.current_task()
        pump.reactor.register(pump.source.sock, pump)
        try:
            while True:
                work, pump.work = pump.work, None
                if isinstance(work, Stop):
                    if work.finished:
                        await self.peer_finished(pump.direction)
                    return
                if isinstance(work, BaseException):
                    raise work
                if work:
                    await self._carry_out(work)
                # Give the direction back to the reactor; data that came meanwhile raised no
                # new edge, so read it now.
                pump.busy = False
                while pump.on_readable():
                    # Stopped early with data left: no edge will come for it, so keep serving
                    # from this task, yielding between rounds.
                    await trio.lowlevel.checkpoint()
                if not pump.busy:
                    pump.parked = True
                    await trio.lowlevel.wait_task_rescheduled(pump.abort)
        finally:
            pump.busy = True
            pump.reactor.unregister(pump.source.sock)

    async def _carry_out(self, actions: list[Action]) -> None:
        actions = self.queue_writes(actions)
        for action in actions:
            if type(action) is Send:
                target = self.upstream if action.direction is TO_BROKER else self.client
                if target is None:
                    raise ProtocolError("data for the broker before the connection was routed")
                await target.send(action.data, action.slice_bytes)
            elif type(action) is OpenUpstream:
                await self._open_upstream(action.broker)
            elif type(action) is Hold:
                await self._held(action)
            elif type(action) is FollowRedirect:
                assert self._nursery is not None
                self._nursery.start_soon(self._follow_redirect, action)
            elif type(action) is Close:
                self.end(_Ending(action.reason, reset=action.reset, hostile=action.hostile,
                                 level="warning" if action.hostile else "info"))
                await trio.lowlevel.checkpoint()
            elif type(action) is Fail:
                raise action.error  # (what came before it is written: the pump ends the connection)

    def queue_writes(self, actions: list[Action]) -> list[Action]:
        """Queue the writes among ``actions`` on their sockets (plain or TLS) now; each Send left is
        then a ``send([])`` that returns once they are written.

        The pipeline places what it originates (an answer on the broker's behalf, a PING, held
        frames released) between whole frames of the stream as it has emitted it so far, so
        every socket must take its writes in the order they were emitted, whichever task
        carries them out: written as each task reaches them, a later write could overtake one
        waiting behind a slow socket and land inside a frame (the audit saw a SEND_ERROR inside
        a MESSAGE sent in part).  The queued pieces may be views of a receive buffer: the task
        reads nothing more until its ``send([])`` calls return.
        """
        queued: list[Action] | None = None
        for index, action in enumerate(actions):
            if type(action) is Send and action.data and not action.slice_bytes:
                target = self.upstream if action.direction is TO_BROKER else self.client
                if type(target) is SocketTransport or type(target) is StreamTransport:
                    target.queue_write(action.data)
                    if queued is None:
                        queued = list(actions)
                    queued[index] = Send(action.direction, [])
        return actions if queued is None else queued

    def hasten_polls(self) -> None:
        """The rules changed: the held polls are asked now (a throttle removed lets its permits go at once)."""
        if self.pipeline.held.hasten_polls(self.clock()) and self._held_changed is not None:
            self._held_changed.set()

    async def _held(self, action: Hold) -> None:
        """Frames were held: make sure the release task wakes for them; wait while the queue is full."""
        del action
        if self._held_changed is None:
            self._held_changed = trio.Event()
            assert self._nursery is not None
            self._nursery.start_soon(self._release_held)
        else:
            self._held_changed.set()
        held = self.pipeline.held
        while held.full:
            self._held_room = trio.Event()
            await self._held_room.wait()

    async def _release_held(self) -> None:
        held = self.pipeline.held
        try:
            while True:
                wake = self._held_changed = trio.Event()
                due = held.next_due_ns()
                if due is None:
                    await wake.wait()
                    continue
                wait_s = (due - self.clock()) / 1e9
                if wait_s > 0:
                    with trio.move_on_after(wait_s):
                        await wake.wait()
                    continue
                actions = self.pipeline.release_due(self.clock())
                self._held_room.set()  # a reader waiting on a full queue goes on
                # A released frame that joined its stream lane behind a delayed one is held again:
                # this loop finds it by its due (a Hold here would wait for room only it can make).
                actions = [action for action in actions if type(action) is not Hold]
                if actions:
                    await self._carry_out(actions)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.end(_Ending(f"write of held frames failed: {exc}"))

    async def _follow_redirect(self, action: FollowRedirect) -> None:
        """proxy-through: ask the brokers the Redirects name, then answer the client (see ``redirects``)."""
        if self._lookup_links is None:
            assert self.pipeline.upstream_connect is not None  # a LOOKUP came after CONNECT
            self._lookup_links = LookupLinks(self.pipeline.upstream_connect, self.server.upstream_tls_context,
                                             self.pipeline.directory.broker_url)
        lookup = action.redirected.lookup
        try:
            answer = await self._lookup_links.follow(action.redirected)
        except LookupFailed as exc:
            log.info("proxy-through: lookup failed", conn=self.info.conn_id, topic=lookup.topic, reason=str(exc))
            actions = self.pipeline.lookup_failed(lookup.request_id, str(exc), self.clock())
        else:
            actions = self.pipeline.lookup_answered(answer, self.clock())
        try:
            await self._carry_out(actions)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.end(_Ending(f"client connection lost: {exc}"))

    async def _open_upstream(self, broker: ServiceUrl) -> None:
        self.upstream = await self.server.connect_upstream(broker)
        if writes("debug"):
            log.debug("upstream connected", conn=self.info.conn_id, broker=str(broker))
        assert self._nursery is not None
        self._nursery.start_soon(self._pump, TO_CLIENT)

    def keepalive_tick(self) -> None:
        """The keepalive wheel's tick (see ``keepalive``): what is due is carried out by a task of this
        connection's, one at a time (no tick while the last one's writes wait)."""
        if self._keepalive_busy or self._nursery is None:
            return
        try:
            actions = self.pipeline.tick(self.clock())
        except Exception as exc:  # (a bug: it ends this connection, logged as any failure of its tasks)
            self._nursery.start_soon(_raise, exc)
            return
        if actions:
            self._keepalive_busy = True
            self._nursery.start_soon(self._keepalive_actions, actions)

    async def _keepalive_actions(self, actions: list[Action]) -> None:
        try:
            await self._carry_out(actions)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.end(_Ending(f"keepalive write failed: {exc}"))
        finally:
            self._keepalive_busy = False


async def _raise(error: Exception) -> None:
    raise error


def set_keepalive_socket_options(sock: socket.socket) -> None:
    """TCP keepalive as a second line of defence behind the protocol's PING/PONG."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
