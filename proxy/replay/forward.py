"""``--unmatched forward``: relay what a recording cannot answer to a live cluster.

One :class:`Forwarder` per served client connection.  It reaches the upstream
with the built-in client's connection layer (:mod:`proxy.client.connection`):
lookups it needs for routing go through a pool of their own, so their request
ids never collide with the client's, which are relayed unchanged on a second
pool.  A forwarded PRODUCER or SUBSCRIBE is sent to the broker that owns its
topic; every later frame of that producer or consumer goes to the same
connection, and what the broker sends for it (receipts, messages) is relayed to
the client.  A forwarded LOOKUP's ``Connect`` / ``Redirect`` is rewritten to
point at the replay server, so the client keeps talking to it.  A broker
refusal becomes ERROR with the broker's code; an unreachable upstream becomes
ERROR ``ServiceNotReady``.

Which connection a frame goes to, and what a failure is answered with, are decided
sans-IO (:mod:`proxy.replay.routes`); this module is the Trio edge that owns the
connections and the request tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import trio

from proxy.client.connection import ClientConnection, ConnectionConfig, ConnectionPool
from proxy.client.lookup import LookupService
from proxy.client.names import parse_service_url
from proxy.errors import ClientError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import Frame, encode_command
from proxy.replay.matcher import lookup_answer
from proxy.replay.routes import ForwardRoutes, failure_answer, has_request_id

log = structlog.get_logger("pulsar_tap.replay")

class _Relay:
    """Hands a forwarded producer's or consumer's frames from the broker back to the client."""

    def __init__(self, forwarder: Forwarder, kind: str, entity_id: int) -> None:
        self.forwarder = forwarder
        self.kind = kind
        self.entity_id = entity_id

    def handle_frame(self, connection: ClientConnection, frame: Frame) -> None:
        self.forwarder.reply(frame.raw)

    def connection_closed(self, connection: ClientConnection) -> None:
        # The broker went away: tell the client, as a broker does on unload, so it re-creates.
        if self.kind == "producer":
            self.forwarder.reply(encode_command(api.CommandCloseProducer(producer_id=self.entity_id, request_id=0)))
        else:
            self.forwarder.reply(encode_command(api.CommandCloseConsumer(consumer_id=self.entity_id, request_id=0)))


class Forwarder:
    """Relays one served connection's unmatched frames to ``upstream`` (see the module docstring)."""

    def __init__(self, nursery: trio.Nursery, upstream: str, reply: Callable[[bytes], None], own_url: str,
                 *, operation_timeout: float = 30.0) -> None:
        self._nursery = nursery
        self._addresses = parse_service_url(upstream)
        config = ConnectionConfig(operation_timeout=operation_timeout)
        self._routing = LookupService(ConnectionPool(nursery, config), self._addresses)
        self._pool = ConnectionPool(nursery, config)
        self.reply = reply
        self.own_url = own_url
        self._routes: ForwardRoutes[ClientConnection] = ForwardRoutes()
        self.forwarded = 0

    def forward(self, frame: Frame) -> None:
        """Relay one frame; frames without an answer go out at once, in order, requests in a task."""
        self.forwarded += 1
        connection = self._routes.route(frame)
        request = has_request_id(frame)
        if connection is not None and not request:
            try:
                connection.send(frame.raw, frame.type)
            except ClientError as exc:
                log.warning("cannot forward", command=frame.type_name, error=str(exc))
            return
        if request:
            self._nursery.start_soon(self._request, frame, connection)

    async def _request(self, frame: Frame, connection: ClientConnection | None) -> None:
        sub: Any = frame.sub
        try:
            if connection is None:
                connection = await self._connection_for(frame)
            bound = self._routes.bind(frame, connection)
            if bound is not None:
                kind, entity_id = bound
                if kind == "producer":
                    connection.register_producer(entity_id, _Relay(self, kind, entity_id))
                else:
                    connection.register_consumer(entity_id, _Relay(self, kind, entity_id))
            answer = await connection.request(sub)
        except ClientError as exc:
            self._forget(frame)
            self.reply(failure_answer(sub.request_id, exc))
            return
        if answer.type == T.LOOKUP_RESPONSE:
            self.reply(encode_command(lookup_answer(answer, sub.request_id, self.own_url)))
        else:
            self.reply(answer.raw)

    async def _connection_for(self, frame: Frame) -> ClientConnection:
        sub: Any = frame.sub
        if frame.type in (T.PRODUCER, T.SUBSCRIBE):
            where = await self._routing.lookup(sub.topic)
            return await self._pool.get(where.logical, where.physical)
        return await self._pool.get(self._addresses[0])

    def _forget(self, frame: Frame) -> None:
        forgotten = self._routes.forget(frame)
        if forgotten is None:
            return
        connection, kind, entity_id = forgotten
        if kind == "producer":
            connection.unregister_producer(entity_id)
        else:
            connection.unregister_consumer(entity_id)


__all__ = ["Forwarder"]
