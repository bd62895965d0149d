"""The broker-side replay server on Trio: ``pulsar-tap replay REC --serve --listen H:P``.

:class:`ReplayServer` listens where a broker would and gives every accepted
connection a :class:`~proxy.replay.served.ServedSession` over one shared
:class:`~proxy.replay.matcher.AnswerBook`; any number of clients are served at
once, each in its own task of the server's nursery.  Per connection a reader
decodes frames and carries out the session's outputs, and a writer drains a
bounded queue of bytes for the client (overflow policy: the reader waits — a
client that stops reading slows only itself; frames relayed from the upstream
that find the queue full close that client's connection).  With ``--unmatched
forward`` a :class:`~proxy.replay.forward.Forwarder` relays what the recording
cannot answer.  Lookups are answered with ``advertise`` (default: the listen
host) and the bound port.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import structlog
import trio

from proxy.containment import contained
from proxy.errors import ProtocolError, UsageError
from proxy.protocol.frame import FrameDecoder
from proxy.replay.forward import Forwarder
from proxy.replay.matcher import AnswerBook
from proxy.replay.served import UNMATCHED_POLICIES, Close, Forward, Reply, ServedSession

log = structlog.get_logger("pulsar_tap.replay")

#: bytes objects waiting for one client's writer (see the module docstring for overflow)
OUTGOING_QUEUE: Final = 4096
_READ_SIZE: Final = 256 * 1024
#: how long a closing connection may take to flush what it still has to write
_FLUSH_SECONDS: Final = 2.0


@dataclass(slots=True)
class ServerStats:
    connections: int = 0
    answered: int = 0
    unmatched: int = 0
    messages_pushed: int = 0


class ReplayServer:
    """Serves a recording to live clients as if it were the broker."""

    def __init__(self, book: AnswerBook, host: str = "127.0.0.1", port: int = 0, *, unmatched: str = "error",
                 upstream: str | None = None, advertise: str | None = None) -> None:
        if unmatched not in UNMATCHED_POLICIES:
            raise UsageError(f"--unmatched must be one of {', '.join(UNMATCHED_POLICIES)}")
        if unmatched == "forward" and not upstream:
            raise UsageError("--unmatched forward needs --upstream URL")
        self.book = book
        self.host = host
        self.port = port
        self.unmatched = unmatched
        self.upstream = upstream
        self.advertise = advertise or host
        self.address = f"{host}:{port}"
        self.stats = ServerStats()
        self._stop = trio.Event()

    @property
    def own_url(self) -> str:
        return f"pulsar://{self.advertise}:{self.port}"

    def request_shutdown(self) -> None:
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`request_shutdown`; reports ``HOST:PORT`` once accepting."""
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        sock = listeners[0].socket
        self.port = int(sock.getsockname()[1])
        self.address = f"{self.host}:{self.port}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._serve, listeners)
            log.info("replay server listening", listen=self.address, unmatched=self.unmatched)
            task_status.started(self.address)
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.stats.connections += 1
        try:
            peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            peer = "?"
        session = ServedSession(self.book, self.own_url, self.unmatched)
        try:
            with contained(log, "replay connection", client=peer):
                await self._serve_connection(stream, peer, session)
        finally:
            self.stats.answered += session.answered
            self.stats.unmatched += session.unmatched_requests
            self.stats.messages_pushed += session.messages_pushed
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()

    async def _serve_connection(self, stream: trio.SocketStream, peer: str, session: ServedSession) -> None:
        send, receive = trio.open_memory_channel[bytes](OUTGOING_QUEUE)
        flushed = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_loop, stream, receive, flushed)
            forwarder = None
            if self.unmatched == "forward" and self.upstream:

                def relay(data: bytes) -> None:
                    try:
                        send.send_nowait(data)
                    except trio.WouldBlock:
                        log.warning("client not reading: closing", client=peer)
                        nursery.cancel_scope.cancel()
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        pass

                forwarder = Forwarder(nursery, self.upstream, relay, self.own_url)
            reason = await self._read_loop(stream, session, send, forwarder)
            log.debug("replay connection ended", client=peer, reason=reason)
            send.close()
            with trio.move_on_after(_FLUSH_SECONDS):
                await flushed.wait()
            nursery.cancel_scope.cancel()

    async def _read_loop(self, stream: trio.SocketStream, session: ServedSession,
                         send: trio.MemorySendChannel[bytes], forwarder: Forwarder | None) -> str:
        decoder = FrameDecoder()
        while True:
            try:
                data = await stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                return f"read failed: {exc}"
            if not data:
                return "client closed"
            try:
                frames = decoder.receive(data)
            except ProtocolError as exc:
                log.warning("bad frame from client: closing", reason=str(exc))
                return f"bad frame: {exc}"
            for frame in frames:
                for output in session.receive(frame):
                    if isinstance(output, Reply):
                        await send.send(output.data)
                    elif isinstance(output, Forward):
                        if forwarder is not None:
                            forwarder.forward(output.frame)
                    elif isinstance(output, Close):
                        log.info("closing a replay connection", reason=output.reason)
                        return output.reason

    @staticmethod
    async def _write_loop(stream: trio.SocketStream, receive: trio.MemoryReceiveChannel[bytes],
                          flushed: trio.Event) -> None:
        try:
            async with receive:
                while True:
                    try:
                        first = await receive.receive()
                    except trio.EndOfChannel:
                        return
                    batch = [first]
                    while len(batch) < 256:
                        try:
                            batch.append(receive.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    try:
                        await stream.send_all(b"".join(batch))
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        return
        finally:
            flushed.set()


__all__ = ["OUTGOING_QUEUE", "ReplayServer", "ServerStats"]
