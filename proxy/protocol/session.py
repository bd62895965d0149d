"""The per-connection session machine, shared by the proxy, the client and the broker.

One Pulsar connection, seen as the frames that cross it in both directions
(Pulsar binary protocol: "Connection establishment", "Producer", "Consumer",
"Lookup").  :class:`SessionTracker` keeps

- the connection state, moved only by :data:`TRANSITIONS` — the one table of the
  handshake and of which side may send what; a frame the table does not allow is
  a :class:`~proxy.errors.ProtocolError`;
- the ids the connection has handed out: producer id -> topic and producer name,
  consumer id -> topic, subscription and consumer name, so that frames carrying
  only ids can be attributed to a topic;
- the requests awaiting an answer, keyed by ``request_id``, by ``(producer_id,
  sequence_id)`` for SEND, and in order for PING; a response that matches one
  yields a :class:`RequestPair` with the latency.

The proxy feeds it both directions; the client feeds what it sends and receives,
the broker likewise.  Time comes in as ``now_ns``; nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Final

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import (
    ATTRIBUTION,
    BROKER_COMMANDS,
    CLIENT_COMMANDS,
    DATA_PATH_TYPES,
    RESPONSE_TYPES,
    RESPONSES,
    SUB_FIELDS,
    TYPE_NAMES,
    T,
    type_name,
)
from proxy.protocol.frame import Frame


class Direction(enum.StrEnum):
    TO_BROKER = "to_broker"
    TO_CLIENT = "to_client"


class ConnectionState(enum.Enum):
    AWAITING_CONNECT = "awaiting_connect"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSED = "closed"


class IllegalFrame(ProtocolError):
    """A frame arrived that the connection's state does not allow from that side."""


_S = ConnectionState
_TO_BROKER, _TO_CLIENT = Direction.TO_BROKER, Direction.TO_CLIENT


def _build_transitions() -> dict[tuple[ConnectionState, Direction, int], ConnectionState]:
    table: dict[tuple[ConnectionState, Direction, int], ConnectionState] = {
        # The handshake.  A broker that needs more auth data answers AUTH_CHALLENGE
        # and the client AUTH_RESPONSE, as often as it takes; ERROR refuses the client.
        (_S.AWAITING_CONNECT, _TO_BROKER, T.CONNECT): _S.CONNECTING,
        (_S.CONNECTING, _TO_CLIENT, T.CONNECTED): _S.CONNECTED,
        (_S.CONNECTING, _TO_CLIENT, T.AUTH_CHALLENGE): _S.CONNECTING,
        (_S.CONNECTING, _TO_BROKER, T.AUTH_RESPONSE): _S.CONNECTING,
        (_S.CONNECTING, _TO_CLIENT, T.ERROR): _S.CLOSED,
        (_S.CONNECTING, _TO_CLIENT, T.PING): _S.CONNECTING,
        (_S.CONNECTING, _TO_BROKER, T.PONG): _S.CONNECTING,
        (_S.CONNECTING, _TO_BROKER, T.PING): _S.CONNECTING,
        (_S.CONNECTING, _TO_CLIENT, T.PONG): _S.CONNECTING,
    }
    # Once connected, each side may send its own commands; re-authentication included.
    for command in CLIENT_COMMANDS - {T.CONNECT}:
        table[(_S.CONNECTED, _TO_BROKER, command)] = _S.CONNECTED
    for command in BROKER_COMMANDS - {T.CONNECTED}:
        table[(_S.CONNECTED, _TO_CLIENT, command)] = _S.CONNECTED
    return table


#: (state, direction, command type) -> next state.  Anything missing is a protocol error.
TRANSITIONS: Final = _build_transitions()

#: The same table split by state and direction, for the per-frame lookup (enum hashing is slow).
_ALLOWED: Final[dict[tuple[ConnectionState, bool], dict[int, ConnectionState]]] = {}
for (_state, _direction, _kind), _next in TRANSITIONS.items():
    _ALLOWED.setdefault((_state, _direction is _TO_BROKER), {})[_kind] = _next



def _build_watched() -> dict[tuple[ConnectionState, Direction], frozenset[int]]:
    every = frozenset(TYPE_NAMES)
    watched = {}
    for state in ConnectionState:
        for direction in Direction:
            stays = {kind for (s, d, kind), next_state in TRANSITIONS.items()
                     if s is state and d is direction and next_state is state}
            watched[(state, direction)] = every - stays
    return watched


_WATCHED: Final = _build_watched()


def watched_types(state: ConnectionState, direction: Direction) -> frozenset[int]:
    """The frame types that move ``state`` or that the table refuses there, from ``direction``.

    Every other type leaves the state as it is, so a user that does not look at every frame
    (the proxy passes most through as bytes) keeps the state and :attr:`SessionTracker.violations`
    exact by handing :meth:`SessionTracker.advance` just these.
    """
    return _WATCHED[(state, direction)]


#: Requests held at most per connection; beyond it the oldest is forgotten (counted).
MAX_PENDING_REQUESTS: Final = 65_536

#: every command type outside the data path: cheap, and they keep the id maps complete
_CONTROL_TYPES: Final = frozenset(TYPE_NAMES) - DATA_PATH_TYPES


def accounted_types(to_client_seen: frozenset[int] | None) -> frozenset[int]:
    """The frame types (either direction) a tracker must observe for exact attribution.

    ``to_client_seen`` is what the tracker's user looks at travelling to the client (None:
    everything).  Control frames always: they create and close producers and consumers, and
    their requests name the topics that their responses are attributed to.  Data-path frames
    only where a response's attribution depends on its request being pending: an ACK with a
    request_id is answered by ACK_RESPONSE or ERROR.  SEND_RECEIPT and SEND_ERROR are
    attributed by producer_id alone, and FLOW permits are left out (``permits`` is then not kept).
    """
    if to_client_seen is None or to_client_seen & {T.ACK_RESPONSE, T.ERROR}:
        return _CONTROL_TYPES | {T.ACK, T.ACK_RESPONSE}
    return _CONTROL_TYPES


@dataclass(slots=True)
class ProducerInfo:
    producer_id: int
    topic: str
    producer_name: str | None
    ready: bool = False


@dataclass(slots=True)
class ConsumerInfo:
    consumer_id: int
    topic: str
    subscription: str
    sub_type: str
    consumer_name: str | None
    ready: bool = False
    #: FLOW permits granted and not yet used by MESSAGEs (batch entries count per message)
    permits: int = 0


@dataclass(slots=True)
class PendingRequest:
    type: int
    key: Any
    start_ns: int
    topic: str | None
    producer_id: int | None = None
    consumer_id: int | None = None
    num_messages: int = 0


@dataclass(frozen=True, slots=True)
class RequestPair:
    """A request and the response that answered it (or the lack of one)."""

    request_type: int
    response_type: int | None
    start_ns: int
    end_ns: int
    topic: str | None
    outcome: str  # "ok" | "error" | "unanswered"
    error_code: str | None = None
    error_message: str | None = None
    request_id: int | None = None
    producer_id: int | None = None
    consumer_id: int | None = None
    sequence_id: int | None = None
    num_messages: int = 0

    @property
    def latency_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def request_command(self) -> str:
        return type_name(self.request_type)

    @property
    def response_command(self) -> str | None:
        return None if self.response_type is None else type_name(self.response_type)


@dataclass(slots=True)
class Observation:
    """What one frame meant: its attribution and the request it completed, if any."""

    topic: str | None = None
    producer: ProducerInfo | None = None
    consumer: ConsumerInfo | None = None
    completed: RequestPair | None = None


def server_error_name(code: int) -> str:
    try:
        return str(api.ServerError.Name(code))
    except ValueError:
        return f"UNKNOWN({code})"


def batch_spans(first_sequence_id: int, num_messages: int | None, sequence_id: int) -> bool:
    """Whether a SEND whose first message has ``first_sequence_id`` and that holds ``num_messages`` (at least
    one) spans ``sequence_id``: a SEND_ERROR under that id ends it (a broker refusing a transactional batch
    answers under the batch's highest sequence id).  The tracker and ``analyze`` pair by this one rule."""
    return first_sequence_id <= sequence_id < first_sequence_id + max(num_messages or 1, 1)


class SessionTracker:
    """Follows one connection's frames in both directions; see the module docstring."""

    def __init__(self, *, strict: bool = True, max_pending: int = MAX_PENDING_REQUESTS) -> None:
        self.strict = strict
        self.state = ConnectionState.AWAITING_CONNECT
        #: frames the table did not allow, counted by a lenient tracker (a strict one raises)
        self.violations = 0
        self.protocol_version: int | None = None
        self.max_message_size: int | None = None
        self.client_version: str | None = None
        self.proxy_to_broker_url: str | None = None
        self.producers: dict[int, ProducerInfo] = {}
        self.consumers: dict[int, ConsumerInfo] = {}
        self._pending: OrderedDict[Any, PendingRequest] = OrderedDict()
        self._pings: dict[Direction, deque[int]] = {_TO_BROKER: deque(maxlen=64), _TO_CLIENT: deque(maxlen=64)}
        self._max_pending = max_pending
        self.forgotten_requests = 0
        #: counts the producers and consumers registered and the names the broker gave them, so a
        #: user can tell when what the id maps hold has grown (the proxy's rules look again then)
        self.entities_named = 0

    @property
    def pending_requests(self) -> int:
        return len(self._pending)

    def check(self, frame_type: int, direction: Direction) -> ConnectionState:
        """The state after ``frame_type`` from ``direction``; raises IllegalFrame if not allowed."""
        allowed = _ALLOWED.get((self.state, direction is _TO_BROKER))
        next_state = allowed.get(frame_type) if allowed is not None else None
        if next_state is None:
            side = "client" if direction is _TO_BROKER else "broker"
            raise IllegalFrame(f"{type_name(frame_type)} from the {side} is not allowed while "
                               f"the connection is {self.state.value}")
        return next_state

    def observe(self, frame: Frame, direction: Direction, now_ns: int) -> Observation:
        """Account for one frame crossing the connection."""
        if frame.type not in TYPE_NAMES:
            raise IllegalFrame(f"unknown command type {frame.type}")
        next_state = self._next_state(frame.type, direction)
        cmd = frame.command
        obs = self._observe(frame, cmd, direction, now_ns)
        self.state = next_state
        return obs

    def advance(self, frame_type: int, direction: Direction) -> ConnectionState:
        """Move by the table for ``frame_type`` from ``direction``; the state it is in now.

        A frame the table does not allow raises IllegalFrame on a strict tracker; a lenient
        one (a proxy, a reader of recordings) counts it in :attr:`violations` and stays put.
        """
        self.state = self._next_state(frame_type, direction)
        return self.state

    def _next_state(self, frame_type: int, direction: Direction) -> ConnectionState:
        try:
            return self.check(frame_type, direction)
        except IllegalFrame:
            if self.strict:
                raise
            self.violations += 1
            return self.state

    def attribute(self, frame: Frame, direction: Direction) -> Observation:
        """The attribution :meth:`observe` gives a :data:`DATA_PATH_TYPES` frame, changing nothing.

        ``completed`` stays None, no request is added, no permits are counted.  An ACK_RESPONSE
        whose consumer is unknown is not attributed to its ACK's topic (observe would be).
        """
        del direction  # the attribution of a data-path frame is the same either way
        obs = Observation()
        kind = frame.type
        if kind not in DATA_PATH_TYPES:
            raise ValueError(f"attribute() is for data-path frames, not {type_name(kind)}")
        self._attribute(kind, getattr(frame.command, SUB_FIELDS[kind]), obs)
        return obs

    def close(self, now_ns: int) -> list[RequestPair]:
        """The connection closed: every request still pending ends unanswered."""
        self.state = ConnectionState.CLOSED
        ended = [self._pair(req, None, now_ns, "unanswered") for req in self._pending.values()]
        self._pending.clear()
        return ended

    # -- the work, per command ---------------------------------------------------------------

    def _observe(self, frame: Frame, cmd: api.BaseCommand, direction: Direction, now_ns: int) -> Observation:
        kind = frame.type
        obs = Observation()
        if kind == T.CONNECT:
            self.protocol_version = cmd.connect.protocol_version
            self.client_version = cmd.connect.client_version
            if cmd.connect.HasField("proxy_to_broker_url"):
                self.proxy_to_broker_url = cmd.connect.proxy_to_broker_url
            self._add(PendingRequest(kind, "connect", now_ns, None))
            return obs
        if kind == T.CONNECTED:
            self.protocol_version = min(self.protocol_version or cmd.connected.protocol_version,
                                        cmd.connected.protocol_version)
            if cmd.connected.HasField("max_message_size"):
                self.max_message_size = cmd.connected.max_message_size
            obs.completed = self._complete("connect", kind, now_ns, "ok")
            return obs
        if kind == T.ERROR and self.state is ConnectionState.CONNECTING and "connect" in self._pending:
            obs.completed = self._complete("connect", kind, now_ns, "error",
                                           server_error_name(cmd.error.error), cmd.error.message)
            return obs
        if kind in (T.PING, T.PONG):
            return self._observe_ping(kind, direction, now_ns)
        sub = getattr(cmd, SUB_FIELDS[kind])
        self._attribute(kind, sub, obs)
        if kind == T.FLOW and obs.consumer is not None:
            obs.consumer.permits += sub.messagePermits
        elif kind == T.MESSAGE and obs.consumer is not None:
            section = frame.payload
            metadata = section.metadata if section is not None else None
            used = metadata.num_messages_in_batch if metadata is not None and metadata.HasField(
                "num_messages_in_batch") else 1
            obs.consumer.permits = max(0, obs.consumer.permits - used)
        if kind == T.SEND:
            self._observe_send(sub, obs, now_ns)
        elif kind in (T.SEND_RECEIPT, T.SEND_ERROR):
            self._observe_send_answer(kind, sub, obs, now_ns)
        elif kind in RESPONSES and direction is _TO_BROKER:
            self._observe_request(kind, sub, obs, now_ns)
        elif kind in RESPONSE_TYPES and direction is _TO_CLIENT and sub.HasField("request_id"):
            self._observe_response(kind, sub, obs, now_ns)
        if kind in (T.CLOSE_PRODUCER, T.CLOSE_CONSUMER) and direction is _TO_CLIENT:
            # The broker closed it (e.g. topic unload); the client will create it anew.
            if kind == T.CLOSE_PRODUCER:
                self.producers.pop(sub.producer_id, None)
            else:
                self.consumers.pop(sub.consumer_id, None)
        return obs

    def _attribute(self, kind: int, sub: Any, obs: Observation) -> None:
        field = ATTRIBUTION.get(kind)
        if field is None or not sub.HasField(field):
            return
        if field == "producer_id":
            obs.producer = self.producers.get(sub.producer_id)
            obs.topic = obs.producer.topic if obs.producer else None
        elif field == "consumer_id":
            obs.consumer = self.consumers.get(sub.consumer_id)
            obs.topic = obs.consumer.topic if obs.consumer else None
        elif field == "topic":
            obs.topic = sub.topic
        else:  # request_id: a response names its request's topic
            pending = self._pending.get(("req", sub.request_id))
            obs.topic = pending.topic if pending else None

    def _observe_request(self, kind: int, sub: Any, obs: Observation, now_ns: int) -> None:
        if kind == T.ACK and not sub.HasField("request_id"):
            return
        req = PendingRequest(kind, ("req", sub.request_id), now_ns, obs.topic, num_messages=0)
        if kind == T.PRODUCER:
            req.producer_id = sub.producer_id
            self.producers[sub.producer_id] = ProducerInfo(
                sub.producer_id, sub.topic, sub.producer_name if sub.HasField("producer_name") else None)
            obs.producer = self.producers[sub.producer_id]
            self.entities_named += 1
        elif kind == T.SUBSCRIBE:
            req.consumer_id = sub.consumer_id
            self.consumers[sub.consumer_id] = ConsumerInfo(
                sub.consumer_id, sub.topic, sub.subscription, api.CommandSubscribe.SubType.Name(sub.subType),
                sub.consumer_name if sub.HasField("consumer_name") else None)
            obs.consumer = self.consumers[sub.consumer_id]
            self.entities_named += 1
        elif kind == T.CLOSE_PRODUCER:
            req.producer_id = sub.producer_id
        elif kind in (T.CLOSE_CONSUMER, T.UNSUBSCRIBE, T.SEEK, T.GET_LAST_MESSAGE_ID, T.CONSUMER_STATS, T.ACK):
            req.consumer_id = sub.consumer_id
            if kind == T.ACK:
                req.num_messages = len(sub.message_id)
        self._add(req)

    def _observe_response(self, kind: int, sub: Any, obs: Observation, now_ns: int) -> None:
        key = ("req", sub.request_id)
        req = self._pending.get(key)
        if req is None or kind not in RESPONSES.get(req.type, ()):
            return
        obs.topic = obs.topic or req.topic
        if kind == T.PRODUCER_SUCCESS:
            producer = self.producers.get(req.producer_id or 0)
            if producer is not None:
                if producer.producer_name != sub.producer_name:
                    producer.producer_name = sub.producer_name
                    self.entities_named += 1
                obs.producer = producer
            if sub.HasField("producer_ready") and not sub.producer_ready:
                return  # queued for exclusive access: the request is still pending
            if producer is not None:
                producer.ready = True
        error_code, message = response_error(kind, sub)
        if error_code is None and req.type == T.SUBSCRIBE and req.consumer_id in self.consumers:
            self.consumers[req.consumer_id].ready = True
        if error_code is not None:
            # A failed creation leaves no producer or consumer behind.
            if req.type == T.PRODUCER and req.producer_id is not None:
                self.producers.pop(req.producer_id, None)
            if req.type == T.SUBSCRIBE and req.consumer_id is not None:
                self.consumers.pop(req.consumer_id, None)
        elif req.type == T.CLOSE_PRODUCER and req.producer_id is not None:
            self.producers.pop(req.producer_id, None)
        elif req.type in (T.CLOSE_CONSUMER, T.UNSUBSCRIBE) and req.consumer_id is not None:
            self.consumers.pop(req.consumer_id, None)
        obs.completed = self._complete(key, kind, now_ns, "ok" if error_code is None else "error",
                                       error_code, message)

    def _observe_send(self, sub: Any, obs: Observation, now_ns: int) -> None:
        req = PendingRequest(T.SEND, ("send", sub.producer_id, sub.sequence_id), now_ns, obs.topic,
                             producer_id=sub.producer_id, num_messages=sub.num_messages)
        self._add(req)

    def _observe_send_answer(self, kind: int, sub: Any, obs: Observation, now_ns: int) -> None:
        key = ("send", sub.producer_id, sub.sequence_id)
        if key not in self._pending:
            if kind != T.SEND_ERROR:
                return
            key = self._batch_answered(sub.producer_id, sub.sequence_id)
            if key is None:
                return
        error_code, message = response_error(kind, sub)
        obs.completed = self._complete(key, kind, now_ns, "ok" if error_code is None else "error",
                                       error_code, message)

    def _batch_answered(self, producer_id: int, sequence_id: int) -> Any:
        """The pending SEND a SEND_ERROR under a later id than its first ends (a broker refusing a
        transactional batch answers so, under the batch's highest sequence id), or None: the latest SEND of
        this producer whose messages' sequence ids span it.  By the span, not by a SEND's
        highest_sequence_id, which a SEND accounted from its fields (no decoding) and ``analyze`` do not
        keep.  Rare (an answer that matched no SEND's first id), so a walk of the pending requests."""
        for key, req in reversed(self._pending.items()):
            if req.type == T.SEND and req.producer_id == producer_id and \
                    batch_spans(key[2], req.num_messages, sequence_id):
                return key
        return None

    def observe_send(self, producer_id: int, sequence_id: int, num_messages: int, now_ns: int) -> str | None:
        """:meth:`observe` of a client's SEND while connected, from its fields (no decoding); its topic.

        The caller has checked that the state is CONNECTED (where the table keeps it).
        """
        producer = self.producers.get(producer_id)
        topic = producer.topic if producer else None
        self._add(PendingRequest(T.SEND, ("send", producer_id, sequence_id), now_ns, topic,
                                 producer_id=producer_id, num_messages=num_messages))
        return topic

    def observe_send_receipt(self, producer_id: int, sequence_id: int, now_ns: int) -> RequestPair | None:
        """:meth:`observe` of a broker's SEND_RECEIPT while connected, from its fields: the SEND it answers."""
        return self._complete(("send", producer_id, sequence_id), T.SEND_RECEIPT, now_ns, "ok")

    def _observe_ping(self, kind: int, direction: Direction, now_ns: int) -> Observation:
        obs = Observation()
        if kind == T.PING:
            self._pings[direction].append(now_ns)
            return obs
        # A PONG answers the oldest PING sent the other way.
        pings = self._pings[_TO_CLIENT if direction is _TO_BROKER else _TO_BROKER]
        if pings:
            start = pings.popleft()
            obs.completed = RequestPair(T.PING, T.PONG, start, now_ns, None, "ok")
        return obs

    def _add(self, req: PendingRequest) -> None:
        self._pending[req.key] = req
        if len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
            self.forgotten_requests += 1

    def _complete(self, key: Any, response_type: int, now_ns: int, outcome: str,
                  error_code: str | None = None, message: str | None = None) -> RequestPair | None:
        req = self._pending.pop(key, None)
        if req is None:
            return None
        return self._pair(req, response_type, now_ns, outcome, error_code, message)

    @staticmethod
    def _pair(req: PendingRequest, response_type: int | None, now_ns: int, outcome: str,
              error_code: str | None = None, message: str | None = None) -> RequestPair:
        key = req.key
        return RequestPair(
            req.type, response_type, req.start_ns, now_ns, req.topic, outcome, error_code, message,
            request_id=key[1] if isinstance(key, tuple) and key[0] == "req" else None,
            producer_id=req.producer_id, consumer_id=req.consumer_id,
            sequence_id=key[2] if isinstance(key, tuple) and key[0] == "send" else None,
            num_messages=req.num_messages,
        )


def response_error(kind: int, sub: Any) -> tuple[str | None, str | None]:
    """The ServerError name and message a response carries, if it reports a failure."""
    fields = sub.DESCRIPTOR.fields_by_name
    for code_field, message_field in (("error", "message"), ("error_code", "error_message")):
        if code_field in fields and sub.HasField(code_field):
            message = getattr(sub, message_field) if message_field in fields and sub.HasField(message_field) else None
            return server_error_name(getattr(sub, code_field)), message
    failed = (kind == T.LOOKUP_RESPONSE and sub.response == api.CommandLookupTopicResponse.Failed) or (
        kind == T.PARTITIONED_METADATA_RESPONSE and sub.response == api.CommandPartitionedTopicMetadataResponse.Failed)
    if failed:
        return "UnknownError", sub.message if sub.HasField("message") else None
    return None, None
