"""``--unmatched forward`` without the I/O: which upstream connection a frame belongs to.

A forwarded PRODUCER or SUBSCRIBE binds its producer or consumer id to the upstream
connection it was sent on (the one whose broker owns the topic); every later frame
of that producer or consumer goes to the same connection.  :class:`ForwardRoutes`
keeps that table and says, for each frame the recording cannot answer, whether it
goes straight out on a bound connection or is a request to issue (answered later);
:func:`failure_answer` is the client's answer when the upstream refused or could not
be reached.  The Trio edge that owns the connections is
:class:`proxy.replay.forward.Forwarder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from proxy.errors import BrokerError, ClientError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import Frame, encode_command
from proxy.replay.matcher import error_answer

Connection = TypeVar("Connection")


def has_request_id(frame: Frame) -> bool:
    """Whether ``frame`` is a request the broker answers by request id."""
    sub: Any = frame.sub
    return "request_id" in sub.DESCRIPTOR.fields_by_name and bool(sub.HasField("request_id"))


@dataclass
class ForwardRoutes(Generic[Connection]):
    """Producer and consumer ids of one served client, bound to the upstream connections they use."""

    producers: dict[int, Connection] = field(default_factory=dict)
    consumers: dict[int, Connection] = field(default_factory=dict)

    def route(self, frame: Frame) -> Connection | None:
        """The connection ``frame``'s producer or consumer is bound to (None: none yet, or no owner)."""
        sub: Any = frame.sub
        kind = frame.type
        if kind in (T.SEND, T.CLOSE_PRODUCER):
            return self.producers.get(sub.producer_id)
        if "consumer_id" in sub.DESCRIPTOR.fields_by_name and kind != T.SUBSCRIBE:
            return self.consumers.get(sub.consumer_id)
        return None

    def bind(self, frame: Frame, connection: Connection) -> tuple[str, int] | None:
        """A PRODUCER or SUBSCRIBE goes out on ``connection``: its id is bound there.

        Returns ``("producer" | "consumer", id)`` for the entity bound, None for other frames.
        """
        sub: Any = frame.sub
        if frame.type == T.PRODUCER:
            self.producers[sub.producer_id] = connection
            return "producer", int(sub.producer_id)
        if frame.type == T.SUBSCRIBE:
            self.consumers[sub.consumer_id] = connection
            return "consumer", int(sub.consumer_id)
        return None

    def forget(self, frame: Frame) -> tuple[Connection, str, int] | None:
        """A PRODUCER or SUBSCRIBE failed: unbind its id; the connection to unregister it from."""
        sub: Any = frame.sub
        if frame.type == T.PRODUCER:
            connection = self.producers.pop(sub.producer_id, None)
            return None if connection is None else (connection, "producer", int(sub.producer_id))
        if frame.type == T.SUBSCRIBE:
            connection = self.consumers.pop(sub.consumer_id, None)
            return None if connection is None else (connection, "consumer", int(sub.consumer_id))
        return None


def failure_answer(request_id: int, failure: ClientError) -> bytes:
    """The client's answer to a forwarded request the upstream refused (its code) or never answered."""
    if isinstance(failure, BrokerError):
        return encode_command(error_answer(request_id, _error_code(failure.server_error), failure.message))
    return encode_command(error_answer(request_id, api.ServerError.ServiceNotReady, f"upstream: {failure}"))


def _error_code(name: str) -> int:
    try:
        return int(api.ServerError.Value(name))
    except ValueError:
        return int(api.ServerError.UnknownError)


__all__ = ["ForwardRoutes", "failure_answer", "has_request_id"]
