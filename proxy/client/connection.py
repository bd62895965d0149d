"""One client connection to a broker, on Trio (C++ ``ClientConnection``).

Pulsar protocol, "Connection establishment" and "Keep Alive": the client opens
TCP (or TLS for ``pulsar+ssl://``), sends CONNECT with its protocol version, client
version, optional auth data and — when a lookup said so — ``proxy_to_broker_url``,
answers AUTH_CHALLENGE with AUTH_RESPONSE, and is connected once CONNECTED arrives
(which may raise the frame limit with ``max_message_size``).  The handshake states
are those of :data:`proxy.protocol.session.TRANSITIONS`, played from the client
side: a frame the table does not allow breaks the connection.

Afterwards three tasks share one nursery, so that when one fails all stop:

- the reader decodes frames and dispatches them: responses to the request that
  waits for that ``request_id``, producer frames (SEND_RECEIPT, SEND_ERROR,
  CLOSE_PRODUCER) and consumer frames (MESSAGE, CLOSE_CONSUMER, ...) to the handler
  registered for that id; PING is answered with PONG;
- the writer sends whatever was queued with :meth:`ClientConnection.send`, many
  frames per write;
- the keepalive (the shared policy of :mod:`proxy.protocol.keepalive`) sends PING
  when the broker has been silent for ``keepalive_interval`` and closes the
  connection when nothing at all arrived during the interval after it.

When the connection ends, every waiting request fails with ConnectionFailed and
every registered handler hears ``connection_closed`` (producers and consumers
then reconnect with backoff).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import trio

from proxy import __version__
from proxy.client.names import BrokerAddress
from proxy.containment import contained
from proxy.errors import BrokerError, ClientClosed, ConnectionFailed, ProtocolError, RequestTimeout
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import CONSUMER_NOTICES, PRODUCER_NOTICES, T, wrap
from proxy.protocol.frame import DEFAULT_MAX_MESSAGE_SIZE, Frame, FrameDecoder, encode_command
from proxy.protocol.keepalive import PING_FRAME, PONG_FRAME, Keepalive, KeepaliveStep
from proxy.protocol.session import ConnectionState, Direction, SessionTracker

log = logging.getLogger(__name__)

#: The protocol version this client speaks (v21: the current one).
PROTOCOL_VERSION: Final = 21
CLIENT_VERSION: Final = f"pulsar-tap-{__version__}"
_READ_SIZE: Final = 256 * 1024
#: Bytes queued for writing beyond which the connection is declared broken.  Senders
#: are bounded well below this by their own limits (pending messages, permits).
MAX_QUEUED_BYTES: Final = 256 * 1024 * 1024

#: A write waits for more frames while the queue grows, up to this many bytes or scheduler passes.
_COALESCE_BYTES: Final = 256 * 1024
_COALESCE_PASSES: Final = 8



class Authentication(Protocol):
    """What CONNECT and AUTH_RESPONSE carry; :class:`TokenAuthentication` is one."""

    method_name: str

    def auth_data(self) -> bytes: ...


class TokenAuthentication:
    """Pulsar's ``token`` auth method: a JWT, or a function returning a fresh one."""

    method_name = "token"

    def __init__(self, token: str | Callable[[], str]) -> None:
        self._token = token

    def auth_data(self) -> bytes:
        token = self._token() if callable(self._token) else self._token
        return token.encode()


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """Settings every connection of a client shares."""

    auth: Authentication | None = None
    tls_trust_certs_file: str | None = None
    tls_validate_hostname: bool = True
    tls_allow_insecure: bool = False
    connection_timeout: float = 10.0
    operation_timeout: float = 30.0
    keepalive_interval: float = 30.0

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.tls_trust_certs_file)
        if self.tls_allow_insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context.check_hostname = self.tls_validate_hostname
        return context


class FrameHandler(Protocol):
    """A producer or consumer registered on a connection."""

    def handle_frame(self, connection: ClientConnection, frame: Frame) -> None: ...

    def connection_closed(self, connection: ClientConnection) -> None: ...


class _Waiter:
    """One request awaiting its response."""

    __slots__ = ("done", "frame", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.frame: Frame | None = None
        self.error: BaseException | None = None


def _now_ns() -> int:
    return int(trio.current_time() * 1e9)


def error_of(frame: Frame) -> BrokerError | None:
    """The BrokerError an ERROR or SEND_ERROR frame carries (None for other frames)."""
    if frame.type in (T.ERROR, T.SEND_ERROR):
        sub: Any = frame.sub
        return BrokerError(api.ServerError.Name(sub.error), sub.message)
    return None


class ClientConnection:
    """A connection to one broker, shared by every producer, consumer and lookup on it."""

    def __init__(self, physical: BrokerAddress, logical: BrokerAddress, config: ConnectionConfig) -> None:
        self.physical = physical
        self.logical = logical
        self.config = config
        self.session = SessionTracker()
        self.max_message_size = DEFAULT_MAX_MESSAGE_SIZE
        self.server_version = ""
        self.protocol_version = 0
        self.closed = trio.Event()
        self.close_reason = ""
        self._stream: trio.abc.Stream | None = None
        self._decoder = FrameDecoder()
        self._out = bytearray()
        self._out_ready = trio.Event()
        self._next_request_id = 0
        self._waiters: dict[int, _Waiter] = {}
        self._producers: dict[int, FrameHandler] = {}
        self._consumers: dict[int, FrameHandler] = {}
        #: timed by trio's clock (``_now_ns``); the handshake's frames set last_rx_ns first
        self.keepalive = Keepalive(int(config.keepalive_interval * 1e9), 0, every_interval=True)
        self._cancel: trio.CancelScope | None = None
        self.frames_sent = 0
        self.frames_received = 0

    def __repr__(self) -> str:
        via = "" if self.physical == self.logical else f" via {self.physical.host_port}"
        return f"<ClientConnection {self.logical.host_port}{via}>"

    @property
    def is_open(self) -> bool:
        return self.session.state is ConnectionState.CONNECTED and not self.closed.is_set()

    # -- life cycle ------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[ClientConnection] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, shake hands, report started, then run until the connection ends."""
        started = False
        try:
            with trio.CancelScope() as self._cancel:
                try:
                    with trio.fail_after(self.config.connection_timeout):
                        await self._open()
                        await self._handshake()
                except trio.TooSlowError:
                    raise ConnectionFailed(f"connecting to {self.physical.host_port} timed out") from None
                task_status.started(self)
                started = True
                with contained(log, f"connection to {self.physical.host_port}"):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._read_loop, nursery.cancel_scope)
                        nursery.start_soon(self._write_loop)
                        nursery.start_soon(self._keepalive_loop)
            if not started:
                raise ConnectionFailed(f"connection to {self.physical.host_port} closed while connecting")
        except ConnectionFailed as exc:
            self.close_reason = self.close_reason or str(exc)
            if not started:
                raise
        finally:
            self._finish(self.close_reason or "connection closed")
            if self._stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await self._stream.aclose()

    def close(self, reason: str = "closed by the client") -> None:
        """Close the connection (the serve task ends and everyone is told)."""
        if not self.close_reason:
            self.close_reason = reason
        if self._cancel is not None:
            self._cancel.cancel()

    def _finish(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = self.close_reason or reason
        self.session.close(0)
        self.closed.set()
        log.debug("%r closed: %s", self, self.close_reason)
        for waiter in self._waiters.values():
            waiter.error = ConnectionFailed(f"connection to {self.logical.host_port} lost: {self.close_reason}")
            waiter.done.set()
        self._waiters.clear()
        handlers = list(self._producers.values()) + list(self._consumers.values())
        self._producers.clear()
        self._consumers.clear()
        for handler in handlers:
            handler.connection_closed(self)

    async def _open(self) -> None:
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream(self.physical.host, self.physical.port)
        except OSError as exc:
            raise ConnectionFailed(f"cannot connect to {self.physical.host_port}: {exc.strerror or exc}") from None
        if self.physical.tls:
            tls = trio.SSLStream(stream, self.config.ssl_context(), server_hostname=self.physical.host,
                                 https_compatible=True)
            try:
                await tls.do_handshake()
            except (trio.BrokenResourceError, ssl.SSLError) as exc:
                await stream.aclose()
                raise ConnectionFailed(f"TLS handshake with {self.physical.host_port} failed: {exc}") from None
            stream = tls
        self._stream = stream

    async def _handshake(self) -> None:
        connect = api.CommandConnect(client_version=CLIENT_VERSION, protocol_version=PROTOCOL_VERSION)
        auth = self.config.auth
        if auth is not None:
            connect.auth_method_name = auth.method_name
            connect.auth_data = auth.auth_data()
        if self.physical != self.logical:
            connect.proxy_to_broker_url = self.logical.host_port  # HOST:PORT, as Pulsar's own clients name it
        connect.feature_flags.supports_auth_refresh = True
        connect.feature_flags.supports_broker_entry_metadata = True
        connect.feature_flags.supports_partial_producer = True
        await self._write_now(encode_command(connect), T.CONNECT)
        while True:
            for frame in await self._read_frames():
                self._check(frame)
                if frame.type == T.CONNECTED:
                    connected: Any = frame.sub
                    self.server_version = connected.server_version
                    self.protocol_version = connected.protocol_version
                    if connected.HasField("max_message_size"):
                        self.max_message_size = connected.max_message_size
                        self._decoder.set_max_message_size(connected.max_message_size)
                    return
                if frame.type == T.ERROR:
                    error = error_of(frame)
                    raise ConnectionFailed(f"{self.physical.host_port} refused the connection: {error}")
                if frame.type == T.AUTH_CHALLENGE:
                    await self._write_now(self._auth_response(), T.AUTH_RESPONSE)
                elif frame.type == T.PING:
                    await self._write_now(PONG_FRAME, T.PONG)

    def _auth_response(self) -> bytes:
        response = api.CommandAuthResponse(client_version=CLIENT_VERSION, protocol_version=PROTOCOL_VERSION)
        auth = self.config.auth
        if auth is not None:
            response.response.auth_method_name = auth.method_name
            response.response.auth_data = auth.auth_data()
        return encode_command(response)

    def _check(self, frame: Frame) -> None:
        try:
            self.session.advance(frame.type, Direction.TO_CLIENT)
        except ProtocolError as exc:
            raise ConnectionFailed(f"{self.physical.host_port} broke the protocol: {exc}") from None

    async def _write_now(self, data: bytes, frame_type: int) -> None:
        self.session.advance(frame_type, Direction.TO_BROKER)
        assert self._stream is not None
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise ConnectionFailed(f"connection to {self.physical.host_port} broke: {exc}") from None

    async def _read_frames(self) -> list[Frame]:
        assert self._stream is not None
        try:
            data = await self._stream.receive_some(_READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ssl.SSLError) as exc:
            raise ConnectionFailed(f"connection to {self.physical.host_port} broke: {exc}") from None
        if not data:
            raise ConnectionFailed(f"{self.physical.host_port} closed the connection")
        self.keepalive.last_rx_ns = _now_ns()
        try:
            return self._decoder.receive(data)
        except ProtocolError as exc:
            raise ConnectionFailed(f"{self.physical.host_port} sent a bad frame: {exc}") from None

    # -- the three tasks -------------------------------------------------------------------

    async def _read_loop(self, scope: trio.CancelScope) -> None:
        try:
            while True:
                for frame in await self._read_frames():
                    self.frames_received += 1
                    self._check(frame)
                    self._dispatch(frame)
        except ConnectionFailed as exc:
            self.close_reason = self.close_reason or str(exc)
            scope.cancel()
        except ProtocolError as exc:
            # e.g. a command that does not decode: the stream cannot be trusted any more
            self.close_reason = self.close_reason or f"{self.physical.host_port} sent a bad frame: {exc}"
            scope.cancel()

    async def _write_loop(self) -> None:
        assert self._stream is not None
        while True:
            await self._out_ready.wait()
            # Let tasks that are ready to run queue their frames too, so that one
            # write carries many (a few scheduler passes: microseconds, not a timer).
            size, passes = -1, 0
            while size != len(self._out) and len(self._out) < _COALESCE_BYTES and passes < _COALESCE_PASSES:
                size, passes = len(self._out), passes + 1
                await trio.lowlevel.checkpoint()
            self._out_ready = trio.Event()
            data, self._out = bytes(self._out), bytearray()
            if not data:
                continue
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.close(f"write to {self.physical.host_port} failed: {exc}")
                return

    async def _keepalive_loop(self) -> None:
        if self.config.keepalive_interval <= 0:
            return
        self.keepalive.next_tick_ns = _now_ns() + self.keepalive.interval_ns  # the timer starts with the connection
        while True:
            await trio.sleep(self.config.keepalive_interval / 4)  # (at most a quarter interval late)
            step = self.keepalive.poll(_now_ns())
            if step is KeepaliveStep.DEAD:
                self.close(f"no PONG from {self.physical.host_port} within {self.config.keepalive_interval} s")
                return
            if step is KeepaliveStep.PING:
                self.send(PING_FRAME, T.PING)

    def _dispatch(self, frame: Frame) -> None:
        kind = frame.type
        if kind == T.PING:
            self.send(PONG_FRAME, T.PONG)
            return
        if kind == T.PONG:
            self.keepalive.pong_received()
            return
        if kind == T.AUTH_CHALLENGE:
            self.send(self._auth_response(), T.AUTH_RESPONSE)
            return
        sub: Any = frame.sub
        if kind in PRODUCER_NOTICES:
            handler = self._producers.get(sub.producer_id)
            if handler is not None:
                handler.handle_frame(self, frame)
            return
        if kind in CONSUMER_NOTICES:
            consumer = self._consumers.get(sub.consumer_id)
            if consumer is not None:
                consumer.handle_frame(self, frame)
            return
        request_id = getattr(sub, "request_id", None)
        if request_id is None:
            log.debug("%r ignores %s", self, frame.type_name)
            return
        if kind == T.PRODUCER_SUCCESS and sub.HasField("producer_ready") and not sub.producer_ready:
            # The broker queued the producer behind an exclusive one: wait for the second answer.
            return
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            waiter.frame = frame
            waiter.done.set()

    # -- what producers, consumers and lookups use -----------------------------------------

    def new_request_id(self) -> int:
        self._next_request_id += 1
        return self._next_request_id

    def send(self, data: bytes, frame_type: int) -> None:
        """Queue one encoded frame for writing (never blocks; order is call order)."""
        if self.closed.is_set():
            raise ConnectionFailed(f"connection to {self.logical.host_port} is closed: {self.close_reason}")
        self.session.advance(frame_type, Direction.TO_BROKER)
        if len(self._out) + len(data) > MAX_QUEUED_BYTES:
            self.close("too many bytes queued for writing")
            raise ConnectionFailed("write queue overflow")
        self._out += data
        self.frames_sent += 1
        self._out_ready.set()

    def send_command(self, sub: Any) -> None:
        """Queue a simple command (a sub-command such as CommandFlow)."""
        cmd = wrap(sub)
        self.send(encode_command(cmd), cmd.type)

    async def request(self, sub: Any) -> Frame:
        """Send a request whose ``request_id`` is set; return the answer, raising for ERROR.

        The answer must come within the operation timeout (RequestTimeout otherwise).
        """
        request_id: int = sub.request_id
        waiter = _Waiter()
        self._waiters[request_id] = waiter
        try:
            self.send_command(sub)
            with trio.move_on_after(self.config.operation_timeout):
                await waiter.done.wait()
        finally:
            self._waiters.pop(request_id, None)
        if waiter.error is not None:
            raise waiter.error
        if waiter.frame is None:
            raise RequestTimeout(f"{type(sub).__name__} {request_id} to {self.logical.host_port} timed out")
        error = error_of(waiter.frame)
        if error is not None:
            raise error
        return waiter.frame

    def register_producer(self, producer_id: int, handler: FrameHandler) -> None:
        self._check_open()
        self._producers[producer_id] = handler

    def unregister_producer(self, producer_id: int) -> None:
        self._producers.pop(producer_id, None)

    def register_consumer(self, consumer_id: int, handler: FrameHandler) -> None:
        self._check_open()
        self._consumers[consumer_id] = handler

    def unregister_consumer(self, consumer_id: int) -> None:
        self._consumers.pop(consumer_id, None)

    def _check_open(self) -> None:
        if self.closed.is_set():
            raise ConnectionFailed(f"connection to {self.logical.host_port} is closed: {self.close_reason}")


class ConnectionPool:
    """One connection per (logical broker, physical address), opened on demand (C++ ``ConnectionPool``)."""

    def __init__(self, nursery: trio.Nursery, config: ConnectionConfig) -> None:
        self._nursery = nursery
        self.config = config
        self._connections: dict[tuple[BrokerAddress, BrokerAddress], ClientConnection] = {}
        self._locks: dict[tuple[BrokerAddress, BrokerAddress], trio.Lock] = {}
        self._closed = False

    async def get(self, logical: BrokerAddress, physical: BrokerAddress | None = None) -> ClientConnection:
        """The open connection for ``logical`` reached at ``physical``; opened if needed."""
        if self._closed:
            raise ClientClosed("the client is closed")
        key = (logical, physical or logical)
        lock = self._locks.setdefault(key, trio.Lock())
        async with lock:
            connection = self._connections.get(key)
            if connection is not None and connection.is_open:
                return connection
            connection = ClientConnection(key[1], key[0], self.config)
            started: ClientConnection = await self._nursery.start(connection.serve)
            self._connections[key] = started
            return started

    def close_all(self) -> None:
        self._closed = True
        for connection in self._connections.values():
            connection.close("client closed")
        self._connections.clear()

    @property
    def connections(self) -> list[ClientConnection]:
        return [c for c in self._connections.values() if c.is_open]
