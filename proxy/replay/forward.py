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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import trio

from proxy.client.connection import ClientConnection, ConnectionConfig, ConnectionPool
from proxy.client.lookup import LookupService
from proxy.client.names import parse_service_url
from proxy.errors import BrokerError, ClientError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import Frame, encode_command
from proxy.replay.matcher import error_answer, lookup_answer

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
        self._producers: dict[int, ClientConnection] = {}
        self._consumers: dict[int, ClientConnection] = {}
        self.forwarded = 0

    def forward(self, frame: Frame) -> None:
        """Relay one frame; frames without an answer go out at once, in order, requests in a task."""
        self.forwarded += 1
        sub: Any = frame.sub
        kind = frame.type
        connection = None
        if kind in (T.SEND, T.CLOSE_PRODUCER):
            connection = self._producers.get(sub.producer_id)
        elif "consumer_id" in sub.DESCRIPTOR.fields_by_name and kind != T.SUBSCRIBE:
            connection = self._consumers.get(sub.consumer_id)
        has_request_id = "request_id" in sub.DESCRIPTOR.fields_by_name and sub.HasField("request_id")
        if connection is not None and not has_request_id:
            try:
                connection.send(frame.raw, kind)
            except ClientError as exc:
                log.warning("cannot forward", command=frame.type_name, error=str(exc))
            return
        if has_request_id:
            self._nursery.start_soon(self._request, frame, connection)

    async def _request(self, frame: Frame, connection: ClientConnection | None) -> None:
        sub: Any = frame.sub
        kind = frame.type
        try:
            if connection is None:
                connection = await self._connection_for(frame)
            if kind == T.PRODUCER:
                self._producers[sub.producer_id] = connection
                connection.register_producer(sub.producer_id, _Relay(self, "producer", sub.producer_id))
            elif kind == T.SUBSCRIBE:
                self._consumers[sub.consumer_id] = connection
                connection.register_consumer(sub.consumer_id, _Relay(self, "consumer", sub.consumer_id))
            answer = await connection.request(sub)
        except BrokerError as exc:
            self._forget(frame)
            self.reply(encode_command(error_answer(sub.request_id, _error_code(exc.server_error), exc.message)))
            return
        except ClientError as exc:
            self._forget(frame)
            self.reply(encode_command(error_answer(sub.request_id, api.ServerError.ServiceNotReady,
                                                   f"upstream: {exc}")))
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
        sub: Any = frame.sub
        if frame.type == T.PRODUCER:
            connection = self._producers.pop(sub.producer_id, None)
            if connection is not None:
                connection.unregister_producer(sub.producer_id)
        elif frame.type == T.SUBSCRIBE:
            connection = self._consumers.pop(sub.consumer_id, None)
            if connection is not None:
                connection.unregister_consumer(sub.consumer_id)


def _error_code(name: str) -> int:
    try:
        return int(api.ServerError.Value(name))
    except ValueError:
        return int(api.ServerError.UnknownError)


__all__ = ["Forwarder"]
