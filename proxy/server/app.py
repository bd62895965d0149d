"""The proxy server: listeners, the broker directory, connection limits and shutdown.

:class:`ProxyServer` binds the main listener (clients' service URL), and in both
lookup modes one listener per broker discovered in lookup answers (ephemeral ports
on the listen host, or ``broker_ports``), each stable for the life of the process.
Every accepted connection becomes a :class:`~proxy.server.relay.Relay` in one
nursery (:meth:`ProxyServer.new_relay`; ``connect_upstream`` opens its broker
connection — tests give both memory streams instead of sockets).
``limits.max_connections`` is enforced at accept: an extra connection is closed at
once (logged), others are unaffected.

Shutdown (SIGTERM/SIGINT via :meth:`request_shutdown`): stop accepting, stop
reading clients at their next frame boundary, let the brokers' answers drain for
``limits.drain_seconds``, then close everything.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
import trio

from proxy.config.proxy_config import HostPort, ProxyConfig, ServiceUrl
from proxy.containment import contained
from proxy.core.hooks import ConnectionInfo, FrameHook, Observer
from proxy.core.lookup import BrokerDirectory
from proxy.core.pipeline import ConnectionPipeline, PipelineSettings
from proxy.errors import ProtocolError
from proxy.server.keepalive import KeepaliveWheel
from proxy.server.observer_hub import ObserverHub
from proxy.server.reactor import Reactor
from proxy.server.relay import Relay, TrioEpochClock, next_conn_id
from proxy.server.transport import SocketTransport, StreamTransport, Transport, peer_name
from proxy.server.upstream import client_side_context, open_upstream, upstream_context
from proxy.telemetry.logs import writes

log = structlog.get_logger("pulsar_tap.proxy")

LISTEN_BACKLOG = 4096
#: accept() errors that mean only that one pending connection went away (as Trio's listeners ignore)
_GONE_BEFORE_ACCEPT = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})


class BrokerListenerUnavailable(ProtocolError):
    """No port could be bound for a newly discovered broker (or the proxy is shutting down)."""

    server_error = "ServiceNotReady"


@dataclass(frozen=True, slots=True)
class ListenerInfo:
    address: HostPort          # where it is bound
    broker: ServiceUrl         # where its connections go by default


#: opens a relay's connection to a broker (default: a socket, TLS per the broker's URL)
UpstreamConnector = Callable[[ServiceUrl], Awaitable[Transport]]


class ProxyServer:
    """One running ``pulsar-tap run``; see the module docstring."""

    def __init__(self, config: ProxyConfig, *, hook: FrameHook | None = None,
                 observers: list[Observer] | None = None, reactor: bool = True,
                 connect_upstream: UpstreamConnector | None = None) -> None:
        self.config = config
        #: serves plain-socket relays in batches (see ``reactor``); None: one task wake-up per chunk
        self.reactor: Reactor | None = Reactor() if reactor else None
        self.hook = hook
        self.observers = ObserverHub(observers)
        self.client_tls_context: ssl.SSLContext | None = client_side_context(config.tls)
        self.upstream_tls_context: ssl.SSLContext | None = (
            upstream_context(config.tls) if config.upstream.tls or config.tls.upstream_ca else None)
        self.connect_upstream: UpstreamConnector = connect_upstream or functools.partial(
            open_upstream, context=self.upstream_tls_context)
        self.settings = PipelineSettings(
            lookup_mode=config.lookup, max_frame_bytes=config.limits.max_frame_bytes,
            verify_checksums=config.limits.verify_checksums,
            keepalive_ns=int(config.limits.keepalive_seconds * 1e9))
        self.directory = BrokerDirectory(config.advertised_host, upstream_tls=config.upstream.tls,
                                         open_listener=self._open_broker_listener,
                                         allowed=config.allowed_brokers, upstream=config.upstream)
        #: the keepalive timer of every relay (run in ``run``)
        self.keepalive = KeepaliveWheel(self.settings.keepalive_ns)
        self.listeners: list[ListenerInfo] = []
        self.relays: set[Relay] = set()
        self.active_connections = 0
        self.refused_connections = 0
        self.accepted_connections = 0
        self._listener_nursery: trio.Nursery | None = None
        self._connection_nursery: trio.Nursery | None = None
        self._stop = trio.Event()
        self._no_connections = trio.Event()
        self._accepting = False
        self._main_socket: socket.socket | None = None
        self._drain_scope: trio.CancelScope | None = None
        self._drain_cut = False

    @property
    def main_address(self) -> HostPort:
        return self.listeners[0].address

    def bind(self) -> socket.socket:
        """Bind the main listener now (so ``run`` cannot fail on it); raises OSError."""
        if self._main_socket is None:
            self._main_socket = self._bind(self.config.listen.host, self.config.listen.port)
        return self._main_socket

    def request_shutdown(self) -> None:
        self._stop.set()

    def cut_drain(self) -> None:
        """Shut down without waiting for the drain (a second SIGINT/SIGTERM)."""
        self._stop.set()
        self._drain_cut = True
        if self._drain_scope is not None:
            self._drain_scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[ProxyServer] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`request_shutdown`; ``task_status.started`` once accepting."""
        async with trio.open_nursery() as outer:
            outer.start_soon(self.observers.run)
            await outer.start(self.keepalive.run)
            if self.reactor is not None:
                await outer.start(self.reactor.run)
            try:
                async with trio.open_nursery() as connections:
                    self._connection_nursery = connections
                    async with trio.open_nursery() as listeners:
                        self._listener_nursery = listeners
                        self._accepting = True
                        sock, self._main_socket = self._main_socket or self.bind(), None
                        self._start_listener(sock, self.config.upstream)
                        log.info("proxy listening", listen=str(self.main_address), upstream=str(self.config.upstream),
                                 lookup=self.config.lookup, tls=self.client_tls_context is not None)
                        self._follow_rule_changes()
                        task_status.started(self)
                        await self._stop.wait()
                        self._accepting = False
                        listeners.cancel_scope.cancel()
                    await self._drain()
                    connections.cancel_scope.cancel()
            finally:
                self.observers.close()
                self.keepalive.stop()
                if self.reactor is not None:
                    self.reactor.stop()

    def _follow_rule_changes(self) -> None:
        """When a rule change lets a throttle's held FLOW permits go (or paces them anew), every relay asks its
        polls at once, not at their next time (which under a slow rate may be seconds away)."""
        engine = getattr(self.hook, "engine", None)
        if engine is None or not hasattr(engine, "permits_repaced"):
            return
        token = trio.lowlevel.current_trio_token()

        def hasten() -> None:
            for relay in self.relays:
                relay.hasten_polls()

        def repaced() -> None:
            # (the rules may change on another thread: the relays are asked on the proxy's own; once the
            # proxy has stopped, nothing is held)
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(hasten)
        engine.permits_repaced = repaced

    async def _drain(self) -> None:
        grace = self.config.limits.drain_seconds
        log.info("shutting down", open_connections=self.active_connections, drain_seconds=grace)
        for relay in list(self.relays):
            relay.begin_drain()
        if self.active_connections and not self._drain_cut:
            with trio.move_on_after(grace) as self._drain_scope:
                await self._no_connections.wait()
            self._drain_scope = None

    # -- listeners ---------------------------------------------------------------------------
    def _bind(self, host: str, port: int) -> socket.socket:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, type_, proto, _, address = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _start_listener(self, sock: socket.socket, broker: ServiceUrl) -> HostPort:
        host, port = sock.getsockname()[:2]
        address = HostPort(str(host), int(port))
        self.listeners.append(ListenerInfo(address, broker))
        assert self._listener_nursery is not None
        self._listener_nursery.start_soon(self._accept_loop, sock, broker, str(address))
        return address

    def _open_broker_listener(self, broker: ServiceUrl) -> int:
        """Bind a listener for a newly seen broker (called from lookup rewriting) and return its port."""
        if not self._accepting or self._listener_nursery is None:
            raise BrokerListenerUnavailable("the proxy is shutting down")
        host = self.config.listen.host
        ports: list[int] = [0]  # ephemeral
        if self.config.broker_ports is not None:
            start, end = self.config.broker_ports
            taken = {info.address.port for info in self.listeners}
            ports = [p for p in range(start, end + 1) if p not in taken]
        last_error: OSError | None = None
        for port in ports:
            try:
                sock = self._bind(host, port)
            except OSError as exc:
                last_error = exc
                continue
            address = self._start_listener(sock, broker)
            log.info("broker listener opened", listener=str(address), broker=str(broker),
                     advertised=f"{self.config.advertised_host}:{address.port}")
            return address.port
        raise BrokerListenerUnavailable(f"no port free for broker {broker} in broker_ports: {last_error}")

    async def _accept_loop(self, sock: socket.socket, broker: ServiceUrl, label: str) -> None:
        try:
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock)
                    continue
                except OSError as exc:
                    if exc.errno in _GONE_BEFORE_ACCEPT:
                        continue  # the client reset before we took it: nothing to serve
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        log.warning("cannot accept: out of resources", listener=label, error=str(exc))
                        await trio.sleep(0.1)
                        continue
                    raise
                if self.active_connections >= self.config.limits.max_connections:
                    self.refused_connections += 1
                    log.warning("connection refused: limits.max_connections reached", client=peer_name(conn),
                                limit=self.config.limits.max_connections)
                    conn.close()
                    continue
                self.active_connections += 1
                self.accepted_connections += 1
                self._no_connections = trio.Event() if self._no_connections.is_set() else self._no_connections
                assert self._connection_nursery is not None
                self._connection_nursery.start_soon(self._serve, conn, broker, label)
        finally:
            trio.lowlevel.notify_closing(sock)
            sock.close()

    async def _serve(self, conn: socket.socket, broker: ServiceUrl, label: str) -> None:
        peer = peer_name(conn)
        try:
            with contained(log, "proxied connection", client=peer):
                await self._relay(conn, broker, label, peer)
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            self.active_connections -= 1
            if self.active_connections == 0:
                self._no_connections.set()

    async def _relay(self, conn: socket.socket, broker: ServiceUrl, label: str, peer: str) -> None:
        transport: Transport
        if self.client_tls_context is not None:
            conn.setblocking(False)
            stream = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(conn)),
                                    self.client_tls_context, server_side=True)
            transport = StreamTransport(stream, peer, conn)
        else:
            transport = SocketTransport(conn, peer)
        relay = self.new_relay(transport, peer, broker, label)
        self.relays.add(relay)
        if writes("debug"):
            log.debug("connection accepted", conn=relay.info.conn_id, client=peer, listener=label)
        try:
            await relay.run()
        finally:
            self.relays.discard(relay)

    def new_relay(self, client: Transport, peer: str, broker: ServiceUrl, label: str) -> Relay:
        """The relay of one accepted client connection (call it in the Trio run; ``relay.run()`` serves it)."""
        info = ConnectionInfo(next_conn_id(), peer, label, None)
        clock = TrioEpochClock()
        pipeline = ConnectionPipeline(
            info, settings=self.settings, directory=self.directory, default_broker=broker,
            now_ns=clock(), hook=self.hook,
            publish=self.observers.publish if self.observers.active else None,
            observations=self.observers.needs_observation, runs=self.observers.takes_runs, run_views=True)
        return Relay(self, client, pipeline, clock=clock)
