"""One live client connection served from a recording (broker-side replay), sans-IO.

:class:`ServedSession` plays the broker's side of the Pulsar protocol for one
connection: frames from the client go in (:meth:`ServedSession.receive`), and
what to do comes out — :class:`Reply` (bytes for the client), :class:`Forward`
(relay this frame to ``--upstream``) or :class:`Close`.  Answers come from an
:class:`~proxy.replay.matcher.AnswerBook`, matched by key and remapped to the
live ids:

- CONNECT gets the recorded CONNECTED; PING gets PONG;
- LOOKUP of a recorded topic gets ``Connect`` to this server (a recorded failure
  is replayed as such); PARTITIONED_METADATA the recorded answer (0 partitions
  for a recorded topic the recording never asked about);
- PRODUCER, SUBSCRIBE and other requests get the recorded answer for their key;
- SEND gets the recorded receipt of the same producer's n-th SEND (receipts are
  continued past the recording's end);
- FLOW grants permits, and the recorded MESSAGEs of the consumer's topic and
  subscription are pushed within them (a batch uses as many permits as messages);
- ACK with a request id gets ACK_RESPONSE; CLOSE_* get SUCCESS.

A request the book cannot answer follows ``unmatched``: ``error`` answers ERROR
``UnknownError`` "not in recording" — as SEND_ERROR for a SEND, and as a failed
LOOKUP / PARTITIONED_METADATA answer with that code and message for lookups, the
reply a broker gives and clients expect there — ``close`` closes the
connection, ``forward`` relays it — and every later frame of a producer or
consumer created that way — to the upstream.  Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from google.protobuf.message import Message

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import CLIENT_COMMANDS, CONSUMER_REQUESTS, PRODUCER_REQUESTS, T
from proxy.protocol.frame import Frame, encode_command
from proxy.protocol.keepalive import PONG_FRAME
from proxy.protocol.session import ConnectionState, Direction, SessionTracker
from proxy.replay.conversation import exchange_key, with_command
from proxy.replay.matcher import (
    AnswerBook,
    connected_answer,
    error_answer,
    lookup_answer,
    permits_of,
    receipt_answer,
    remap,
)

UNMATCHED_POLICIES: Final = ("error", "forward", "close")
NOT_IN_RECORDING: Final = "not in recording"



@dataclass(frozen=True, slots=True)
class Reply:
    """Bytes to write to the client."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Forward:
    """Relay this client frame to the upstream broker; what answers goes back to the client."""

    frame: Frame


@dataclass(frozen=True, slots=True)
class Close:
    """Close the client's connection."""

    reason: str


Output = Reply | Forward | Close


@dataclass(slots=True)
class LiveProducer:
    key: tuple[Any, ...]  # (topic, requested name) as recorded
    sends: int = 0


@dataclass(slots=True)
class LiveConsumer:
    topic: str
    subscription: str
    queue: list[Frame] = field(default_factory=list)
    position: int = 0
    permits: int = 0


class ServedSession:
    """The broker side of one live connection, answered from an AnswerBook."""

    def __init__(self, book: AnswerBook, own_url: str, unmatched: str = "error") -> None:
        if unmatched not in UNMATCHED_POLICIES:
            raise ValueError(f"unmatched must be one of {', '.join(UNMATCHED_POLICIES)}")
        self.book = book
        self.own_url = own_url
        self.unmatched = unmatched
        #: the handshake, by the shared session table (the state is all this server needs of it)
        self.session = SessionTracker()
        self.producers: dict[int, LiveProducer] = {}
        self.consumers: dict[int, LiveConsumer] = {}
        self.forwarded_producers: set[int] = set()
        self.forwarded_consumers: set[int] = set()
        self._cursors: dict[tuple[Any, ...], int] = {}
        self.answered = 0
        self.unmatched_requests = 0
        self.messages_pushed = 0

    # -- the entry point -----------------------------------------------------------------------

    def receive(self, frame: Frame) -> list[Output]:
        """What to do about one frame from the client."""
        kind = frame.type
        if kind not in CLIENT_COMMANDS:
            return [Close(f"{frame.type_name} is not a client command")]
        if self.session.state is ConnectionState.AWAITING_CONNECT:
            if kind != T.CONNECT:
                return [Close(f"expected CONNECT, got {frame.type_name}")]
            self.session.advance(T.CONNECT, Direction.TO_BROKER)
            self.session.advance(T.CONNECTED, Direction.TO_CLIENT)
            return [self._reply(connected_answer(self.book.connected, frame.command.connect.protocol_version))]
        if kind == T.CONNECT:
            return [Close("a second CONNECT on one connection")]
        if kind == T.PING:
            return [Reply(PONG_FRAME)]
        if kind in (T.PONG, T.AUTH_RESPONSE):
            return []
        sub: Any = frame.sub
        if kind in PRODUCER_REQUESTS and sub.producer_id in self.forwarded_producers:
            if kind == T.CLOSE_PRODUCER:
                self.forwarded_producers.discard(sub.producer_id)
            return [Forward(frame)]
        if kind in CONSUMER_REQUESTS and sub.consumer_id in self.forwarded_consumers:
            if kind == T.CLOSE_CONSUMER:
                self.forwarded_consumers.discard(sub.consumer_id)
            return [Forward(frame)]
        handler = _HANDLERS.get(kind)
        if handler is not None:
            outputs: list[Output] = handler(self, frame, sub)
            return outputs
        if sub.DESCRIPTOR.fields_by_name.get("request_id") is not None and sub.HasField("request_id"):
            return self._answer_recorded(frame, sub, exchange_key(kind, sub, None, getattr(sub, "topic", None)))
        return []

    # -- per command ---------------------------------------------------------------------------

    def _lookup(self, frame: Frame, sub: Any) -> list[Output]:
        key = (T.LOOKUP, sub.topic)
        exchange = self.book.lookup(key, self._next(key))
        if exchange is not None and exchange.response is not None:
            return [self._reply(lookup_answer(exchange.response, sub.request_id, self.own_url))]
        if key in self.book.unanswered:
            return []
        if self.book.knows_topic(sub.topic):
            return [self._reply(api.CommandLookupTopicResponse(
                request_id=sub.request_id, brokerServiceUrl=self.own_url, authoritative=True,
                response=api.CommandLookupTopicResponse.Connect))]
        return self._unmatched(frame, sub)

    def _partitioned_metadata(self, frame: Frame, sub: Any) -> list[Output]:
        key = (T.PARTITIONED_METADATA, sub.topic)
        exchange = self.book.lookup(key, self._next(key))
        if exchange is not None and exchange.response is not None:
            return [self._reply(remap(exchange.response, request_id=sub.request_id))]
        if key in self.book.unanswered:
            return []
        if self.book.knows_topic(sub.topic):
            return [self._reply(api.CommandPartitionedTopicMetadataResponse(request_id=sub.request_id, partitions=0))]
        return self._unmatched(frame, sub)

    def _producer(self, frame: Frame, sub: Any) -> list[Output]:
        key = exchange_key(T.PRODUCER, sub, None, sub.topic)
        exchange = self.book.lookup(key, self._next(key))
        if exchange is None or exchange.response is None:
            if key in self.book.unanswered:
                return []
            outputs = self._unmatched(frame, sub)
            if outputs and isinstance(outputs[0], Forward):
                self.forwarded_producers.add(sub.producer_id)
            return outputs
        if exchange.response.type == T.PRODUCER_SUCCESS:
            self.producers[sub.producer_id] = LiveProducer(exchange.key[1:])
        return [self._reply(remap(exchange.response, request_id=sub.request_id))]

    def _send(self, frame: Frame, sub: Any) -> list[Output]:
        producer = self.producers.get(sub.producer_id)
        if producer is None:
            return self._unmatched(frame, sub)
        index = producer.sends
        producer.sends += 1
        highest = sub.highest_sequence_id if sub.HasField("highest_sequence_id") else None
        return [self._reply(receipt_answer(self.book.receipts.get(producer.key, []), index, sub.producer_id,
                                           sub.sequence_id, highest))]

    def _subscribe(self, frame: Frame, sub: Any) -> list[Output]:
        key = exchange_key(T.SUBSCRIBE, sub, None, sub.topic)
        exchange = self.book.lookup(key, self._next(key))
        if exchange is None or exchange.response is None:
            if key in self.book.unanswered:
                return []
            outputs = self._unmatched(frame, sub)
            if outputs and isinstance(outputs[0], Forward):
                self.forwarded_consumers.add(sub.consumer_id)
            return outputs
        if exchange.response.type == T.SUCCESS:
            self.consumers[sub.consumer_id] = LiveConsumer(
                sub.topic, sub.subscription, list(self.book.messages.get((sub.topic, sub.subscription), [])))
        return [self._reply(remap(exchange.response, request_id=sub.request_id))]

    def _flow(self, frame: Frame, sub: Any) -> list[Output]:
        consumer = self.consumers.get(sub.consumer_id)
        if consumer is None:
            return []
        consumer.permits += sub.messagePermits
        return self._push(sub.consumer_id, consumer)

    def _ack(self, frame: Frame, sub: Any) -> list[Output]:
        if not sub.HasField("request_id"):
            return []
        return [self._reply(api.BaseCommand(type=T.ACK_RESPONSE, ackResponse=api.CommandAckResponse(
            consumer_id=sub.consumer_id, request_id=sub.request_id)))]

    def _close_producer(self, frame: Frame, sub: Any) -> list[Output]:
        self.producers.pop(sub.producer_id, None)
        return [self._success(sub.request_id)]

    def _close_consumer(self, frame: Frame, sub: Any) -> list[Output]:
        self.consumers.pop(sub.consumer_id, None)
        return [self._success(sub.request_id)]

    def _consumer_request(self, frame: Frame, sub: Any) -> list[Output]:
        consumer = self.consumers.get(sub.consumer_id)
        owner = None if consumer is None else (consumer.topic, consumer.subscription)
        key = exchange_key(frame.type, sub, owner, None)
        exchange = self.book.lookup(key, self._next(key))
        if exchange is None and frame.type == T.UNSUBSCRIBE and consumer is not None:
            self.consumers.pop(sub.consumer_id, None)
            return [self._success(sub.request_id)]
        return self._answer_recorded(frame, sub, key, exchange)

    def _ignore(self, frame: Frame, sub: Any) -> list[Output]:
        return []

    # -- helpers -------------------------------------------------------------------------------

    def _answer_recorded(self, frame: Frame, sub: Any, key: tuple[Any, ...], exchange: Any = None) -> list[Output]:
        if exchange is None:
            exchange = self.book.lookup(key, self._next(key))
        if exchange is None or exchange.response is None:
            return [] if key in self.book.unanswered else self._unmatched(frame, sub)
        ids = {"request_id": sub.request_id}
        if "consumer_id" in sub.DESCRIPTOR.fields_by_name and sub.HasField("consumer_id"):
            ids["consumer_id"] = sub.consumer_id
        return [self._reply(remap(exchange.response, **ids))]

    def _push(self, consumer_id: int, consumer: LiveConsumer) -> list[Output]:
        outputs: list[Output] = []
        while consumer.permits > 0 and consumer.position < len(consumer.queue):
            recorded = consumer.queue[consumer.position]
            consumer.position += 1
            cmd = api.BaseCommand()
            cmd.CopyFrom(recorded.command)
            cmd.message.consumer_id = consumer_id
            outputs.append(Reply(with_command(recorded, cmd)))
            consumer.permits -= permits_of(recorded)
            self.messages_pushed += 1
        return outputs

    def _next(self, key: tuple[Any, ...]) -> int:
        index = self._cursors.get(key, 0)
        self._cursors[key] = index + 1
        return index

    def _reply(self, cmd: api.BaseCommand | Message) -> Reply:
        self.answered += 1
        return Reply(encode_command(cmd))

    def _success(self, request_id: int) -> Reply:
        return self._reply(api.BaseCommand(type=T.SUCCESS, success=api.CommandSuccess(request_id=request_id)))

    def _unmatched(self, frame: Frame, sub: Any) -> list[Output]:
        self.unmatched_requests += 1
        if self.unmatched == "close":
            return [Close(f"{frame.type_name} {NOT_IN_RECORDING}")]
        if self.unmatched == "forward":
            return [Forward(frame)]
        if frame.type == T.SEND:
            return [Reply(encode_command(api.CommandSendError(
                producer_id=sub.producer_id, sequence_id=sub.sequence_id, error=api.ServerError.UnknownError,
                message=NOT_IN_RECORDING)))]
        fields = sub.DESCRIPTOR.fields_by_name
        if "request_id" not in fields or not sub.HasField("request_id"):
            return []
        # Lookups fail the way a broker fails them (clients do not match ERROR to lookups).
        if frame.type == T.LOOKUP:
            return [self._reply(api.CommandLookupTopicResponse(
                request_id=sub.request_id, response=api.CommandLookupTopicResponse.Failed,
                error=api.ServerError.UnknownError, message=NOT_IN_RECORDING))]
        if frame.type == T.PARTITIONED_METADATA:
            return [self._reply(api.CommandPartitionedTopicMetadataResponse(
                request_id=sub.request_id, response=api.CommandPartitionedTopicMetadataResponse.Failed,
                error=api.ServerError.UnknownError, message=NOT_IN_RECORDING))]
        return [Reply(encode_command(error_answer(sub.request_id, api.ServerError.UnknownError, NOT_IN_RECORDING)))]


_HANDLERS: Final[dict[int, Any]] = {
    T.LOOKUP: ServedSession._lookup,
    T.PARTITIONED_METADATA: ServedSession._partitioned_metadata,
    T.PRODUCER: ServedSession._producer,
    T.SEND: ServedSession._send,
    T.SUBSCRIBE: ServedSession._subscribe,
    T.FLOW: ServedSession._flow,
    T.ACK: ServedSession._ack,
    T.CLOSE_PRODUCER: ServedSession._close_producer,
    T.CLOSE_CONSUMER: ServedSession._close_consumer,
    T.UNSUBSCRIBE: ServedSession._consumer_request,
    T.SEEK: ServedSession._consumer_request,
    T.GET_LAST_MESSAGE_ID: ServedSession._consumer_request,
    T.CONSUMER_STATS: ServedSession._consumer_request,
    T.REDELIVER_UNACKNOWLEDGED_MESSAGES: ServedSession._ignore,
}


__all__ = ["NOT_IN_RECORDING", "UNMATCHED_POLICIES", "Close", "Forward", "LiveConsumer", "LiveProducer", "Output",
           "Reply", "ServedSession"]
