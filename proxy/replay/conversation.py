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

Some requests were never the broker's to answer: the proxy answered them itself
(the answer the client saw was originated by the proxy — an injected ERROR or
SEND_ERROR) or swallowed them (a rule fired on the request and either no answer
reached the client or the proxy reacted at once with a frame of its own, as a
``close`` rule's CLOSE_PRODUCER).  Such an :class:`Exchange` is marked
``proxy_handled``: a replay against a live broker neither re-sends nor compares it,
because its recorded outcome says what the proxy did, not what a broker does.  The
client's own recovery (the retried PRODUCER, the re-created producer and the SENDs
it resends) are ordinary requests and are compared as usual.  A CLOSE_PRODUCER the
client received is kept as a :class:`Step` too (``closed_under_client``), so that a
replay closes the producer where the recorded one was closed.  The SENDs the client
still had in flight to it are ``abandoned`` (the client resends them on the
re-created producer): the broker refused them ("producer not connected"), or, when
the connection ended first, nothing answered them — a race, so for these the two
kinds of failure are not told apart.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction, RequestPair, SessionTracker

if TYPE_CHECKING:  # the reader does file I/O; this module only takes its frames
    from proxy.recording.reader import RecordedFrame

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
    for recorded, _originated in _client_frames(frames):
        yield recorded


def _client_frames(frames: Iterable[RecordedFrame]) -> Iterator[tuple[RecordedFrame, bool]]:
    """:func:`client_view`, each frame with whether the proxy originated it (rather than replaced a broker frame)."""
    held: dict[int, RecordedFrame] = {}  # a broker frame the proxy may still replace, per connection
    for recorded in frames:
        try:
            kind = recorded.frame.type
        except ProtocolError:
            continue  # an undecodable frame (e.g. deliberately corrupted) answers nothing
        pending = held.pop(recorded.conn, None)
        if recorded.direction == "to_broker":
            if pending is not None:
                yield pending, False
            if recorded.origin == "client":
                yield recorded, False
            continue
        if recorded.origin == "proxy":
            replaces = pending is not None and pending.frame.type == kind
            if pending is not None and not replaces:
                yield pending, False
            yield recorded, not replaces
            continue
        if pending is not None:
            yield pending, False
        held[recorded.conn] = recorded
    for recorded in held.values():
        yield recorded, False


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
    #: names of the rules that fired on the request
    rules: tuple[str, ...] = ()
    #: the proxy answered or swallowed it: not the broker's to answer (see the module docstring)
    proxy_handled: bool = False
    #: a SEND still in flight to a producer the client had been told was closed
    abandoned: bool = False

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
    #: a CLOSE_PRODUCER the client received (from the broker, or the proxy on its behalf),
    #: not one it sent: the replay closes the live producer at this point
    closed_under_client: bool = False


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
    #: the last request a rule fired on, until the next frame towards the client
    ruled: Exchange | None = None
    #: producer ids closed under the client and not yet re-created
    closed_producers: set[int] = field(default_factory=set)


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


def _observe(conv: Conversation, recorded: RecordedFrame, originated: bool) -> None:
    frame = recorded.frame
    direction = Direction.TO_BROKER if recorded.direction == "to_broker" else Direction.TO_CLIENT
    kind = frame.type
    try:
        obs = conv.tracker.observe(frame, direction, recorded.ts_ns)
    except ProtocolError:
        return
    if direction is Direction.TO_CLIENT:
        ruled, conv.ruled = conv.ruled, None
        if originated and ruled is not None and ruled.ts_ns == recorded.ts_ns:
            ruled.proxy_handled = True  # the proxy's own reaction to the request (a close, an injected answer)
        if kind == T.CONNECTED and conv.connected is None:
            conv.connected = frame
        elif kind == T.MESSAGE:
            sub: Any = frame.sub
            conv.messages.setdefault(sub.consumer_id, []).append(frame)
        elif kind == T.CLOSE_PRODUCER:
            conv.steps.append(Step(recorded.ts_ns, frame, closed_under_client=True))
            conv.closed_producers.add(frame.command.close_producer.producer_id)
        if obs.completed is not None:
            _complete(conv, obs.completed, frame, originated)
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
        conv.closed_producers.discard(sub.producer_id)
        name = sub.producer_name if sub.HasField("producer_name") else None
        conv.producers[sub.producer_id] = (sub.topic, name)
        step.owner = (sub.topic, name)
    elif kind == T.SUBSCRIBE:
        conv.consumers[sub.consumer_id] = (sub.topic, sub.subscription)
    if kind == T.SEND:
        exchange = Exchange(recorded.conn, recorded.ts_ns, frame, obs.topic, (T.SEND,) + (step.owner or (None,)))
        exchange.abandoned = sub.producer_id in conv.closed_producers
        conv.pending[("send", sub.producer_id, sub.sequence_id)] = exchange
    elif kind in REQUEST_TYPES or (kind == T.ACK and sub.HasField("request_id")):
        key = exchange_key(kind, sub, step.owner, obs.topic)
        exchange = Exchange(recorded.conn, recorded.ts_ns, frame, obs.topic, key)
        conv.pending[("req", sub.request_id)] = exchange
    else:
        return
    exchange.rules = recorded.rules
    if recorded.rules:
        conv.ruled = exchange
    step.exchange = exchange
    conv.exchanges.append(exchange)


def _complete(conv: Conversation, pair: RequestPair, response: Frame, originated: bool) -> None:
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
        if originated:
            exchange.proxy_handled = True


def build_conversations(frames: Iterable[RecordedFrame]) -> dict[int, Conversation]:
    """conn id -> its Conversation, from a recording's frames in capture order."""
    conversations: dict[int, Conversation] = {}
    for recorded, originated in _client_frames(frames):
        conv = conversations.get(recorded.conn)
        if conv is None:
            conv = conversations[recorded.conn] = Conversation(recorded.conn)
        _observe(conv, recorded, originated)
    for conv in conversations.values():
        for exchange in conv.exchanges:
            if exchange.rules and exchange.outcome == UNANSWERED:
                exchange.proxy_handled = True  # a rule kept it from the broker (drop, close)
        conv.pending.clear()  # what is left was never answered: outcome stays "unanswered"
        conv.ruled = None
    return conversations


__all__ = ["OK", "REQUEST_TYPES", "UNANSWERED", "Conversation", "Exchange", "Step", "build_conversations",
           "client_view", "error_outcome", "exchange_key", "outcome_of", "with_command"]
