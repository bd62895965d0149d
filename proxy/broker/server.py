"""The Trio side of the embedded broker: listeners, one task group per connection, keepalive.

The only module of :mod:`proxy.broker` that awaits.  Each broker of a cluster is a
:class:`BrokerNode` listening on its own port; each accepted connection gets a
nursery with a reader (bytes -> :class:`~proxy.protocol.frame.FrameDecoder` ->
:class:`~proxy.broker.connection.BrokerConnection`), a writer (drains the
connection's outbox) and a keepalive task (the shared policy of
:mod:`proxy.protocol.keepalive` on Pulsar's schedule: a PING at every tick, a close when
nothing came since the previous tick's PING, or when a tick finds the handshake
unfinished) — when one fails, all of them stop and
the socket is closed.  A malformed frame or an illegal command closes the
connection with one warning line naming the peer and the reason; a peer's reset
or cut ends that connection only (:func:`~proxy.containment.contained`).
"""

from __future__ import annotations

import itertools
import time
from typing import Final

import structlog
import trio

from proxy.broker.cluster import BrokerInfo, Cluster
from proxy.broker.connection import BrokerConnection
from proxy.containment import contained
from proxy.errors import ProtocolError
from proxy.protocol.frame import FrameDecoder
from proxy.protocol.keepalive import KeepaliveStep

log = structlog.get_logger("pulsar_tap.broker")

RECEIVE_CHUNK: Final = 256 * 1024
_connection_ids = itertools.count(1)


class _Signal:
    """A level-triggered wakeup: ``set`` from sync code, ``wait`` in the writer task."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = trio.Event()


class BrokerNode:
    """One broker of the cluster: a listener and its connections."""

    def __init__(self, cluster: Cluster, info: BrokerInfo) -> None:
        self.cluster = cluster
        self.info = info
        self.connections: set[BrokerConnection] = set()
        self._cancel: trio.CancelScope | None = None
        self.stopped = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled or :meth:`kill`-ed; reports the bound port when ready."""
        self.stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._cancel = scope
                listeners = await trio.open_tcp_listeners(self.info.port, host=self.info.host)
                self.info.port = listeners[0].socket.getsockname()[1]
                self.info.alive = True
                try:
                    async with trio.open_nursery() as nursery:
                        task_status.started(self.info.port)
                        await trio.serve_listeners(self._handle, listeners, handler_nursery=nursery)
                finally:
                    for listener in listeners:
                        await trio.aclose_forcefully(listener)
        finally:
            self.cluster.broker_down(self.info.index)
            self._cancel = None
            self.stopped.set()

    def kill(self) -> None:
        """Stop listening and drop every connection at once (a broker crash)."""
        if self._cancel is not None:
            self._cancel.cancel()

    async def _handle(self, stream: trio.SocketStream) -> None:
        try:
            peer_addr = stream.socket.getpeername()
            peer = f"{peer_addr[0]}:{peer_addr[1]}"
        except OSError:
            peer = "?"
        signal = _Signal()
        conn = BrokerConnection(self.cluster, self.info.index, next(_connection_ids), peer,
                                time.monotonic_ns, signal.set)
        decoder = FrameDecoder()
        self.connections.add(conn)
        try:
            with contained(log, "broker connection", peer=peer):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write, stream, conn, signal, nursery.cancel_scope)
                    nursery.start_soon(self._keepalive, conn, signal)
                    await self._read(stream, conn, decoder, signal)
                    nursery.cancel_scope.cancel()
        finally:
            self.connections.discard(conn)
            conn.close()
            await trio.aclose_forcefully(stream)

    async def _read(self, stream: trio.SocketStream, conn: BrokerConnection, decoder: FrameDecoder,
                    signal: _Signal) -> None:
        max_message_size = self.cluster.config.max_message_size
        decoder.set_max_message_size(max_message_size)
        while not conn.closing:
            data = await stream.receive_some(RECEIVE_CHUNK)
            if not data:
                return
            try:
                for frame in decoder.receive(data):
                    conn.handle(frame)
            except ProtocolError as exc:
                log.warning("closing connection", peer=conn.peer, reason=str(exc))
                conn.closing = True
                return
            except Exception:
                # a bug in the broker must cost this connection, not the whole cluster
                log.exception("internal error; closing connection", peer=conn.peer)
                conn.closing = True
                return
        # wait for the writer to flush what closing left behind (e.g. an auth ERROR)
        signal.set()
        await trio.sleep_forever()

    async def _write(self, stream: trio.SocketStream, conn: BrokerConnection, signal: _Signal,
                     scope: trio.CancelScope) -> None:
        while True:
            await signal.wait()
            closing = conn.closing
            out = conn.take_output()
            if out:
                await stream.send_all(b"".join(out))
            if closing:
                scope.cancel()
                return

    async def _keepalive(self, conn: BrokerConnection, signal: _Signal) -> None:
        interval = self.cluster.config.keepalive_seconds
        if interval <= 0:
            return
        while True:
            await trio.sleep(interval / 4)  # (a PING or the verdict is at most a quarter interval late)
            step, reason = conn.poll_keepalive()
            if step is KeepaliveStep.DEAD:
                log.warning("closing connection", peer=conn.peer, reason=reason)
                conn.closing = True
                signal.set()
                return


__all__ = ["BrokerNode"]
