"""A recording as its clients saw it: per connection, the requests sent and what answered them.

Both replays start here.  The proxy records every frame as received and, again
with origin ``proxy``, every frame it changed or originated (recordings/FORMAT.md),
so the frames a client actually saw are: what it sent (origin ``client``), and
towards it the broker's frames, except where the proxy replaced one (a
``proxy``-origin frame of the same type right after it on that connection), plus
what the proxy originated (an injected ERROR, a CLOSE_PRODUCER).  :func:`client_view`
selects those; :func:`build_conversations` runs each connection through the
shared :class:`~proxy.protocol.session.SessionTracker` to pair requests with their
answers and to attribute id-only frames to a topic, and keys every request by
what identifies it without ids: command, topic, subscription, producer name
(:func:`exchange_key`).  Nothing here does I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction, RequestPair, SessionTracker

if TYPE_CHECKING:  # the reader does file I/O; this module only takes its frames
    from proxy.recording.reader import RecordedFrame

T = api.BaseCommand.Type
_HEADER = struct.Struct(">II")

#: outcome of a request that got a successful answer
OK: Final = "ok"
#: outcome of a request that was never answered
UNANSWERED: Final = "unanswered"

#: client commands that ask for an answer (CONNECT and SEND are paired separately)
REQUEST_TYPES: Final = frozenset({
    T.LOOKUP, T.PARTITIONED_METADATA, T.PRODUCER, T.SUBSCRIBE, T.UNSUBSCRIBE, T.CLOSE_PRODUCER,
    T.CLOSE_CONSUMER, T.SEEK, T.GET_LAST_MESSAGE_ID, T.CONSUMER_STATS, T.GET_TOPICS_OF_NAMESPACE,
    T.GET_SCHEMA, T.GET_OR_CREATE_SCHEMA, T.NEW_TXN, T.ADD_PARTITION_TO_TXN, T.ADD_SUBSCRIPTION_TO_TXN,
    T.END_TXN, T.END_TXN_ON_PARTITION, T.END_TXN_ON_SUBSCRIPTION, T.TC_CLIENT_CONNECT_REQUEST,
    T.WATCH_TOPIC_LIST, T.WATCH_TOPIC_LIST_CLOSE,
})


def error_outcome(code: str | None) -> str:
    return f"error:{code or 'UnknownError'}"


def outcome_of(pair: RequestPair) -> str:
    """``ok``, ``error:CODE`` or ``unanswered`` for a completed request."""
    if pair.outcome == "ok":
        return OK
    if pair.outcome == "error":
        return error_outcome(pair.error_code)
    return UNANSWERED


def with_command(frame: Frame, cmd: api.BaseCommand) -> bytes:
    """``frame`` with its command replaced and everything after it (the payload section) kept byte for byte.

    The checksum covers only the payload section, so it stays valid.
    """
    body: bytes = cmd.SerializeToString()
    rest = frame.raw[8 + frame.cmd_size:]
    return _HEADER.pack(4 + len(body) + len(rest), len(body)) + body + rest


def client_view(frames: Iterable[RecordedFrame]) -> Iterator[RecordedFrame]:
    """The frames the clients sent and received, in capture order (see the module docstring)."""
    held: dict[int, RecordedFrame] = {}  # a broker frame the proxy may still replace, per connection
    for recorded in frames:
        try:
            kind = recorded.frame.type
        except ProtocolError:
            continue  # an undecodable frame (e.g. deliberately corrupted) answers nothing
        pending = held.pop(recorded.conn, None)
        if recorded.direction == "to_broker":
            if pending is not None:
                yield pending
            if recorded.origin == "client":
                yield recorded
            continue
        if recorded.origin == "proxy":
            if pending is not None and pending.frame.type != kind:
                yield pending
            yield recorded
            continue
        if pending is not None:
            yield pending
        held[recorded.conn] = recorded
    yield from held.values()


@dataclass(slots=True)
class Exchange:
    """One recorded request, what answered it, and the key it is matched by."""

    conn: int
    ts_ns: int
    request: Frame
    topic: str | None
    key: tuple[Any, ...]
    response: Frame | None = None
    outcome: str = UNANSWERED

    @property
    def command(self) -> str:
        return self.request.type_name


@dataclass(slots=True)
class Step:
    """One frame a client sent, in order, with its exchange when it asked for an answer."""

    ts_ns: int
    frame: Frame
    exchange: Exchange | None = None
    #: the producer's or consumer's key (topic, name / subscription) for id-bearing frames
    owner: tuple[Any, ...] | None = None


@dataclass(slots=True)
class Conversation:
    """One recorded client connection."""

    conn: int
    steps: list[Step] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    #: consumer id -> the MESSAGE frames it received, in order
    messages: dict[int, list[Frame]] = field(default_factory=dict)
    #: consumer id -> (topic, subscription)
    consumers: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: producer id -> (topic, requested producer name or None)
    producers: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    connected: Frame | None = None
    tracker: SessionTracker = field(default_factory=lambda: SessionTracker(strict=False))
    pending: dict[Any, Exchange] = field(default_factory=dict)


def exchange_key(kind: int, sub: Any, owner: tuple[Any, ...] | None, topic: str | None) -> tuple[Any, ...]:
    """What identifies a request regardless of ids: its command and key fields.

    ``owner`` is the (topic, requested producer name) or (topic, subscription) of the
    producer or consumer an id-bearing request refers to.
    """
    if kind in (T.LOOKUP, T.PARTITIONED_METADATA, T.GET_SCHEMA, T.GET_OR_CREATE_SCHEMA):
        return (kind, sub.topic)
    if kind == T.PRODUCER:
        return (kind, sub.topic, sub.producer_name if sub.HasField("producer_name") else None)
    if kind == T.SUBSCRIBE:
        return (kind, sub.topic, sub.subscription)
    if kind == T.GET_TOPICS_OF_NAMESPACE:
        return (kind, sub.namespace)
    if owner is not None:
        return (kind, *owner)
    return (kind, topic)


def _observe(conv: Conversation, recorded: RecordedFrame) -> None:
    frame = recorded.frame
    direction = Direction.TO_BROKER if recorded.direction == "to_broker" else Direction.TO_CLIENT
    kind = frame.type
    try:
        obs = conv.tracker.observe(frame, direction, recorded.ts_ns)
    except ProtocolError:
        return
    if direction is Direction.TO_CLIENT:
        if kind == T.CONNECTED and conv.connected is None:
            conv.connected = frame
        elif kind == T.MESSAGE:
            sub: Any = frame.sub
            conv.messages.setdefault(sub.consumer_id, []).append(frame)
        if obs.completed is not None:
            _complete(conv, obs.completed, frame)
        return
    step = Step(recorded.ts_ns, frame)
    conv.steps.append(step)
    if kind in (T.CONNECT, T.PING, T.PONG, T.AUTH_RESPONSE):
        return
    sub = frame.sub
    if obs.producer is not None:
        step.owner = (obs.producer.topic, conv.producers.get(obs.producer.producer_id, (None, None))[1])
    if obs.consumer is not None:
        step.owner = (obs.consumer.topic, obs.consumer.subscription)
    if kind == T.PRODUCER:
        name = sub.producer_name if sub.HasField("producer_name") else None
        conv.producers[sub.producer_id] = (sub.topic, name)
        step.owner = (sub.topic, name)
    elif kind == T.SUBSCRIBE:
        conv.consumers[sub.consumer_id] = (sub.topic, sub.subscription)
    if kind == T.SEND:
        exchange = Exchange(recorded.conn, recorded.ts_ns, frame, obs.topic, (T.SEND,) + (step.owner or (None,)))
        conv.pending[("send", sub.producer_id, sub.sequence_id)] = exchange
    elif kind in REQUEST_TYPES or (kind == T.ACK and sub.HasField("request_id")):
        key = exchange_key(kind, sub, step.owner, obs.topic)
        exchange = Exchange(recorded.conn, recorded.ts_ns, frame, obs.topic, key)
        conv.pending[("req", sub.request_id)] = exchange
    else:
        return
    step.exchange = exchange
    conv.exchanges.append(exchange)


def _complete(conv: Conversation, pair: RequestPair, response: Frame) -> None:
    if pair.request_id is not None:
        key: Any = ("req", pair.request_id)
    elif pair.sequence_id is not None:
        key = ("send", pair.producer_id, pair.sequence_id)
    else:
        return
    exchange = conv.pending.pop(key, None)
    if exchange is not None:
        exchange.response = response
        exchange.outcome = outcome_of(pair)


def build_conversations(frames: Iterable[RecordedFrame]) -> dict[int, Conversation]:
    """conn id -> its Conversation, from a recording's frames in capture order."""
    conversations: dict[int, Conversation] = {}
    for recorded in client_view(frames):
        conv = conversations.get(recorded.conn)
        if conv is None:
            conv = conversations[recorded.conn] = Conversation(recorded.conn)
        _observe(conv, recorded)
    for conv in conversations.values():
        conv.pending.clear()  # what is left was never answered: outcome stays "unanswered"
    return conversations


__all__ = ["OK", "REQUEST_TYPES", "UNANSWERED", "Conversation", "Exchange", "Step", "build_conversations",
           "client_view", "error_outcome", "exchange_key", "outcome_of", "with_command"]
