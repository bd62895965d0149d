"""One connection's traffic turned into timed exchanges and delivery cycles, for telemetry.

:class:`ConnectionTimeline` feeds every frame of one proxied connection to a
:class:`~proxy.protocol.session.SessionTracker` (which pairs requests with
responses: by ``request_id``, by ``(producer_id, sequence_id)`` for SEND, in order
for PING) and adds what telemetry needs on top:

- the four instants of a request/response pair as the relay reports them — request
  received from the client, forwarded to the broker, response received from the
  broker, forwarded to the client — so time inside the proxy (rule delays included)
  separates from time upstream;
- the rules that fired on either frame;
- W3C trace context (``traceparent`` / ``tracestate``) found in a SEND's message
  properties, batch entries included;
- LOOKUP answers (Connect, Redirect, Failed) and the broker they point at;
- for a SEND of a geo-replicator (producer ``pulsar.repl.*``), the cluster the
  message comes from and the replication marker it carries, if any;
- consumer delivery cycles: a FLOW grants permits, the MESSAGEs that follow use
  them (a batch uses one permit per entry, as brokers count), and the cycle ends
  when the permits are used up, the consumer goes away or the connection closes;
- how many producers, consumers and outstanding permits the connection holds.

Results come back from :meth:`ConnectionTimeline.frame` and
:meth:`ConnectionTimeline.close` as :class:`Exchange` and :class:`DeliveryCycle`
records.  No clocks, no I/O: times arrive with the frames.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T, type_name
from proxy.protocol.frame import Frame
from proxy.protocol.markers import is_replicator, marker_name
from proxy.protocol.message import decode_messages
from proxy.protocol.session import MAX_PENDING_REQUESTS, ConnectionState, Direction, RequestPair, SessionTracker
from proxy.telemetry.bulk import BookEntry, SendBook, key_ids, key_of, varint_value

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
#: Requests whose timing is kept while awaiting an answer; beyond it the oldest is forgotten.
MAX_TIMED_REQUESTS: Final = 65_536
#: Open FLOW grants kept per consumer; older grants beyond it are folded into the newest.
MAX_OPEN_CYCLES: Final = 64
#: (an enum's member read from its class costs ~0.08 us here, a module's name 0.01; these are read per frame)
_CONNECTED: Final = ConnectionState.CONNECTED
_TO_BROKER: Final = Direction.TO_BROKER
_TO_CLIENT: Final = Direction.TO_CLIENT
#: :meth:`ConnectionTimeline.book_send`'s answer for a SEND it did not file
_NOT_BOOKED: Final[tuple[bool, str | None]] = (False, None)
_LOOKUP_ANSWERS: Final = {api.CommandLookupTopicResponse.Connect: "Connect",
                          api.CommandLookupTopicResponse.Redirect: "Redirect",
                          api.CommandLookupTopicResponse.Failed: "Failed"}


@dataclass(frozen=True, slots=True)
class FiredRule:
    """A rule that fired on one frame."""

    name: str
    ts_ns: int
    command: str
    direction: str


@dataclass(frozen=True, slots=True)
class TraceContext:
    """W3C trace context carried in a message's properties."""

    traceparent: str
    tracestate: str | None = None


@dataclass(slots=True)
class RequestTiming:
    """A request as the proxy saw it, kept until its answer arrives."""

    command: str
    received_ns: int
    forwarded_ns: int | None
    size: int
    rules: list[FiredRule] = field(default_factory=list)
    traces: tuple[TraceContext, ...] = ()
    authoritative: bool | None = None
    #: labels of ``mark`` rules that fired on the request
    marks: list[str] = field(default_factory=list)
    #: a geo-replicator's SEND: (the cluster it comes from, the MarkerType name it carries or None)
    replication: tuple[str, str | None] | None = None


@dataclass(slots=True)
class Exchange:
    """A finished request/response pair with its timing; ``pair`` is the session machine's view."""

    conn_id: int
    pair: RequestPair
    request: RequestTiming | None
    response_received_ns: int | None
    response_forwarded_ns: int | None
    response_origin: str | None
    rules: list[FiredRule]
    producer_name: str | None = None
    consumer_name: str | None = None
    subscription: str | None = None
    lookup_answer: str | None = None
    lookup_broker_url: str | None = None
    #: labels of ``mark`` rules that fired on the request or its answer
    marks: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        return self.pair.request_command

    @property
    def start_ns(self) -> int:
        return self.request.received_ns if self.request is not None else self.pair.start_ns

    @property
    def end_ns(self) -> int:
        """When the client got its answer (or when the session gave up on it)."""
        if self.response_forwarded_ns is not None:
            return self.response_forwarded_ns
        if self.response_received_ns is not None:
            return self.response_received_ns
        return self.pair.end_ns

    @property
    def duration_ns(self) -> int:
        return max(self.end_ns - self.start_ns, 0)

    @property
    def upstream_ns(self) -> int:
        """Time the request spent beyond the proxy: forwarded upstream until its answer came back."""
        if self.response_origin == "proxy" or self.response_received_ns is None:
            return 0
        sent = self.start_ns
        if self.request is not None and self.request.forwarded_ns is not None:
            sent = self.request.forwarded_ns
        return max(self.response_received_ns - sent, 0)

    @property
    def proxy_ns(self) -> int:
        """Time spent inside the proxy (rule delays included), both ways."""
        return max(self.duration_ns - self.upstream_ns, 0)


@dataclass(slots=True)
class DeliveryCycle:
    """A FLOW grant and the MESSAGEs it paid for."""

    conn_id: int
    consumer_id: int
    topic: str | None
    subscription: str | None
    consumer_name: str | None
    permits: int
    flow_received_ns: int
    flow_forwarded_ns: int | None
    messages: int = 0
    frames: int = 0
    bytes: int = 0
    first_message_ns: int | None = None
    last_message_ns: int | None = None
    complete: bool = False
    ended_by: str | None = None  # "permits used" | "consumer closed" | "connection closed"
    rules: list[FiredRule] = field(default_factory=list)
    #: labels of ``mark`` rules that fired on the FLOW or the MESSAGEs
    marks: list[str] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return max(self.permits - self.messages, 0)

    @property
    def end_ns(self) -> int:
        return self.last_message_ns if self.last_message_ns is not None else self.flow_received_ns


@dataclass(slots=True)
class FrameOutcome:
    """What one frame changed, for spans and metrics."""

    topic: str | None = None
    exchanges: list[Exchange] = field(default_factory=list)
    cycles: list[DeliveryCycle] = field(default_factory=list)
    #: rules that fired on a frame belonging to no exchange or cycle
    loose_rules: list[FiredRule] = field(default_factory=list)
    messages: int = 0
    producers_delta: int = 0
    consumers_delta: int = 0
    permits_delta: int = 0


class ConnectionTimeline:
    """Follows one connection; see the module docstring."""

    def __init__(self, conn_id: int, *, inspect_trace_context: bool = True) -> None:
        self.conn_id = conn_id
        self.session = SessionTracker(strict=False)
        self.inspect_trace_context = inspect_trace_context
        self._timings: OrderedDict[Any, RequestTiming] = OrderedDict()
        self._pings: dict[Direction, deque[RequestTiming]] = {
            Direction.TO_BROKER: deque(maxlen=64), Direction.TO_CLIENT: deque(maxlen=64)}
        self._cycles: dict[int, deque[DeliveryCycle]] = {}
        self.producers = 0
        self.consumers = 0
        self.frames_not_understood = 0
        #: SENDs read in bulk, not yet filed with the session (see proxy.telemetry.bulk)
        self.book = SendBook()
        #: :meth:`bulk_producer`'s answers for the session's producers by id varint, until they may change
        #: (any frame the session observes, its close): a run of one SEND, below saturation the common
        #: case, had looked its producer up anew
        self._bulk_producers: dict[bytes, tuple[bool, str | None]] = {}

    @property
    def outstanding_permits(self) -> int:
        return sum(cycle.remaining for cycles in self._cycles.values() for cycle in cycles)

    def permits_by_consumer(self) -> dict[int, int]:
        """consumer id -> FLOW permits granted and not yet used, for every consumer on the connection."""
        permits = dict.fromkeys(self.session.consumers, 0)
        for consumer_id, cycles in self._cycles.items():
            permits[consumer_id] = sum(cycle.remaining for cycle in cycles)
        return permits

    def frame(self, frame: Frame, direction: Direction, origin: str, received_ns: int,
              forwarded_ns: int | None = None, fired: tuple[str, ...] = (),
              marks: tuple[str, ...] = ()) -> FrameOutcome:
        """Account for one frame; ``forwarded_ns`` is when it left the proxy (None: not forwarded/unknown)."""
        if self.book.entries:
            self.settle()
        out = FrameOutcome()
        kind = frame.type
        command = type_name(kind)
        rules = [FiredRule(name, received_ns, command, direction.value) for name in fired]
        if origin == "proxy" and direction is _TO_BROKER:
            # The proxy's own copy of a request it changed, or one it originated: the client's
            # original (if any) is already accounted for, and the client waits on no answer to it.
            out.loose_rules = rules
            return out
        self._bulk_producers.clear()
        try:
            observation = self.session.observe(frame, direction, received_ns)
        except ProtocolError:
            self.frames_not_understood += 1
            out.loose_rules = rules
            return out
        out.topic = observation.topic
        placed = False
        if direction is _TO_BROKER or kind == T.PING:
            placed = self._start_request(frame, kind, command, direction, received_ns, forwarded_ns, rules, marks)
        if observation.completed is not None:
            exchange = self._finish(observation.completed, frame, direction, origin, received_ns, forwarded_ns,
                                    rules)
            exchange.marks.extend(marks)
            out.exchanges.append(exchange)
            placed = True
        if kind == T.FLOW and direction is _TO_BROKER:
            out.permits_delta += self._grant(frame, received_ns, forwarded_ns, rules, marks)
            placed = True
        elif kind == T.MESSAGE and direction is _TO_CLIENT:
            placed = self._deliver(frame, forwarded_ns or received_ns, rules, out, marks) or placed
        if kind in (T.SEND, T.MESSAGE):
            out.messages = _message_count(frame, kind)
        self._count_ids(out)
        if not placed:
            out.loose_rules = rules
        return out

    # -- the data path's fast path (see proxy.telemetry.data_path) ----------------------------
    @property
    def connected(self) -> bool:
        """True when the connection is connected (where data-path frames leave it)."""
        return self.session.state is _CONNECTED

    def fast_send_ready(self, producer_id: int) -> bool:
        """True when a client's SEND from ``producer_id`` may take :meth:`send` instead of :meth:`frame`.

        The connection must be connected (a SEND leaves it so) and the producer no
        geo-replicator (whose SENDs carry replication details read from the payload).
        """
        if not self.connected:
            return False
        producer = self.session.producers.get(producer_id)
        return producer is None or not is_replicator(producer.producer_name)

    def send(self, producer_id: int, sequence_id: int, num_messages: int, size: int, received_ns: int,
             forwarded_ns: int | None, traces: tuple[TraceContext, ...]) -> str | None:
        """:meth:`frame` of a client's SEND that no rule fired on, from its fields: its topic.

        The caller checked :meth:`fast_send_ready` and read ``traces`` (if it inspects them).
        """
        if self.book.entries:
            self.settle()
        self.book.other_keys.add(key_of(producer_id, sequence_id))
        topic = self.session.observe_send(producer_id, sequence_id, num_messages, received_ns)
        self._timings[("send", producer_id, sequence_id)] = RequestTiming(
            "SEND", received_ns, forwarded_ns, size, traces=traces)
        if len(self._timings) > MAX_TIMED_REQUESTS:
            self._timings.popitem(last=False)
        return topic

    def send_receipt(self, producer_id: int, sequence_id: int, received_ns: int, forwarded_ns: int | None,
                     origin: str) -> Exchange | None:
        """:meth:`frame` of a broker's SEND_RECEIPT that no rule fired on, while connected: the exchange it ends."""
        if self.book.entries:
            self.settle()
        pair = self.session.observe_send_receipt(producer_id, sequence_id, received_ns)
        if pair is None:
            return None
        timing = self._timings.pop(("send", producer_id, sequence_id), None)
        return self._exchange(pair, timing, received_ns, forwarded_ns, origin, [])

    def close(self, now_ns: int) -> FrameOutcome:
        """The connection closed: pending requests end unanswered, open cycles end."""
        if self.book.entries:
            self.settle()
        out = FrameOutcome()
        self._bulk_producers.clear()
        for pair in self.session.close(now_ns):
            timing = self._timings.pop(_key_of(pair), None)
            out.exchanges.append(Exchange(self.conn_id, pair, timing, None, None, None,
                                          list(timing.rules) if timing else []))
        self._timings.clear()
        for consumer_id in list(self._cycles):
            out.permits_delta -= self._end_cycles(consumer_id, "connection closed", out)
        out.producers_delta, out.consumers_delta = -self.producers, -self.consumers
        self.producers = self.consumers = 0
        return out

    # -- the data path in bulk (see proxy.telemetry.bulk) ------------------------------------
    def bulk_capacity(self) -> tuple[int, bool]:
        """(SENDs the book may take, whether it forgets its oldest SEND past the session's limit itself).

        While the session and the timings hold nothing, the book is all the pending
        requests there are: past MAX_PENDING_REQUESTS (= MAX_TIMED_REQUESTS) it forgets
        its oldest, as both would (a SEND whose receipt a full queue dropped stays
        pending until then).  Otherwise it takes what fits before they would forget theirs.
        """
        book = self.book
        pending = self.session.pending_requests
        if book.other_keys and not pending:
            book.other_keys.clear()
        if not pending and not self._timings:
            return MAX_PENDING_REQUESTS, True
        return min(MAX_PENDING_REQUESTS - pending, MAX_TIMED_REQUESTS - len(self._timings)) - len(book.entries) - 1, \
            False

    def bulk_forget_oldest(self) -> None:
        """The book holds more SENDs than the session keeps: the oldest is forgotten (see :meth:`bulk_capacity`)."""
        entries = self.book.entries
        del entries[next(iter(entries))]
        self.session.forgotten_requests += 1

    def bulk_producer(self, producer_id: bytes) -> tuple[bool, str | None]:
        """(whether its SENDs may go in the book, its topic) of the producer whose id varint is ``producer_id``.

        A geo-replicator's SENDs carry replication details read from the payload (see
        :meth:`fast_send_ready`).
        """
        known = self._bulk_producers.get(producer_id)
        if known is None:
            producer = self.session.producers.get(varint_value(producer_id))
            if producer is None:
                return True, None  # (not kept: ids a client makes up would grow the cache without bound)
            known = self._bulk_producers[producer_id] = (not is_replicator(producer.producer_name), producer.topic)
        return known

    def book_send(self, key: bytes, producer_id: bytes, received_ns: int, forwarded_ns: int, size: int,
                  messages: int) -> tuple[bool, str | None]:
        """A client's SEND read alone (its key, producer id varint and fields) filed in the book as the bulk walk
        files it: (True, its topic); (False, None) when it may not be (the book is full, its producer's SENDs
        do not go there, another path holds its key) and nothing changed.

        The caller checked it carries no trace context to read (see ``proxy.telemetry.bulk_forms.take_sends``).
        """
        capacity, forgets = self.bulk_capacity()
        if capacity <= 0:
            return _NOT_BOOKED
        producer = self.bulk_producer(producer_id)
        book = self.book
        if not producer[0] or (book.other_keys and key in book.other_keys):
            return _NOT_BOOKED
        entries = book.entries
        entries[key] = (received_ns, forwarded_ns, size, messages, producer[1])
        if forgets and len(entries) > capacity:
            self.bulk_forget_oldest()
        return producer

    def bulk_exchange(self, key: bytes, entry: BookEntry, received_ns: int, forwarded_ns: int,
                      origin: str) -> Exchange:
        """The exchange a receipt read in bulk ends, as :meth:`send_receipt` would build it (for a sampled span)."""
        producer_id, sequence_id = key_ids(key)
        send_received_ns, send_forwarded_ns, size, messages, topic = entry
        pair = RequestPair(T.SEND, T.SEND_RECEIPT, send_received_ns, received_ns, topic, "ok",
                           producer_id=producer_id, sequence_id=sequence_id, num_messages=messages)
        timing = RequestTiming("SEND", send_received_ns, send_forwarded_ns, size)
        return self._exchange(pair, timing, received_ns, forwarded_ns, origin, [])

    def settle(self) -> None:
        """File the book's SENDs with the session, in the order they came: another path goes on from here."""
        book = self.book
        entries = list(book.entries.items())
        book.entries.clear()  # (in place: a run in bulk holds on to the dict)
        for key, (received_ns, forwarded_ns, size, messages, _topic) in entries:
            producer_id, sequence_id = key_ids(key)
            self.session.observe_send(producer_id, sequence_id, messages, received_ns)
            self._timings[("send", producer_id, sequence_id)] = RequestTiming(
                "SEND", received_ns, forwarded_ns, size)
            if len(self._timings) > MAX_TIMED_REQUESTS:
                self._timings.popitem(last=False)
        book.other_keys.update(key for key, _entry in entries)

    # -- requests -------------------------------------------------------------------------
    def _start_request(self, frame: Frame, kind: int, command: str, direction: Direction, received_ns: int,
                       forwarded_ns: int | None, rules: list[FiredRule], marks: tuple[str, ...]) -> bool:
        key = _request_key(frame, kind)
        if key is None:
            return False
        timing = RequestTiming(command, received_ns, forwarded_ns, frame.size, list(rules), marks=list(marks))
        if kind == T.PING:
            self._pings[direction].append(timing)
            return True
        if kind == T.SEND:
            self.book.other_keys.add(key_of(frame.command.send.producer_id, frame.command.send.sequence_id))
            if self.inspect_trace_context:
                timing.traces = _trace_contexts(frame)
            producer = self.session.producers.get(frame.command.send.producer_id)
            if producer is not None and is_replicator(producer.producer_name):
                timing.replication = _replication_of(frame)
        elif kind == T.LOOKUP:
            timing.authoritative = frame.command.lookupTopic.authoritative
        self._timings[key] = timing
        if len(self._timings) > MAX_TIMED_REQUESTS:
            self._timings.popitem(last=False)
        return True

    def _finish(self, pair: RequestPair, frame: Frame, direction: Direction, origin: str, received_ns: int,
                forwarded_ns: int | None, rules: list[FiredRule]) -> Exchange:
        if pair.request_type == T.PING:
            pings = self._pings[_TO_CLIENT if direction is _TO_BROKER else _TO_BROKER]
            timing = pings.popleft() if pings else None
        else:
            timing = self._timings.pop(_key_of(pair), None)
        exchange = self._exchange(pair, timing, received_ns, forwarded_ns, origin, rules)
        if frame.type == T.LOOKUP_RESPONSE:
            answer = frame.command.lookupTopicResponse
            exchange.lookup_answer = _LOOKUP_ANSWERS.get(answer.response)
            if answer.HasField("brokerServiceUrl"):
                exchange.lookup_broker_url = answer.brokerServiceUrl
            elif answer.HasField("brokerServiceUrlTls"):
                exchange.lookup_broker_url = answer.brokerServiceUrlTls
        return exchange

    def _exchange(self, pair: RequestPair, timing: RequestTiming | None, received_ns: int,
                  forwarded_ns: int | None, origin: str, rules: list[FiredRule]) -> Exchange:
        exchange = Exchange(self.conn_id, pair, timing, received_ns, forwarded_ns, origin,
                            [*(timing.rules if timing else ()), *rules], marks=list(timing.marks) if timing else [])
        if pair.producer_id is not None and (producer := self.session.producers.get(pair.producer_id)):
            exchange.producer_name = producer.producer_name
        if pair.consumer_id is not None and (consumer := self.session.consumers.get(pair.consumer_id)):
            exchange.consumer_name = consumer.consumer_name
            exchange.subscription = consumer.subscription
        return exchange

    # -- delivery cycles ------------------------------------------------------------------
    def _grant(self, frame: Frame, received_ns: int, forwarded_ns: int | None, rules: list[FiredRule],
               marks: tuple[str, ...]) -> int:
        flow = frame.command.flow
        consumer = self.session.consumers.get(flow.consumer_id)
        cycle = DeliveryCycle(self.conn_id, flow.consumer_id, consumer.topic if consumer else None,
                              consumer.subscription if consumer else None,
                              consumer.consumer_name if consumer else None,
                              flow.messagePermits, received_ns, forwarded_ns, rules=list(rules),
                              marks=list(marks))
        cycles = self._cycles.setdefault(flow.consumer_id, deque())
        cycles.append(cycle)
        if len(cycles) > MAX_OPEN_CYCLES:
            oldest = cycles.popleft()
            cycles[0].permits += oldest.remaining
        return int(flow.messagePermits)

    def _deliver(self, frame: Frame, ts_ns: int, rules: list[FiredRule], out: FrameOutcome,
                 marks: tuple[str, ...]) -> bool:
        consumer_id = frame.command.message.consumer_id
        cycles = self._cycles.get(consumer_id)
        if not cycles:
            return False
        used = _message_count(frame, T.MESSAGE)
        out.permits_delta -= min(used, sum(c.remaining for c in cycles))
        cycle = cycles[0]
        cycle.rules.extend(rules)
        cycle.marks.extend(marks)
        cycle.frames += 1
        cycle.bytes += frame.size
        if cycle.first_message_ns is None:
            cycle.first_message_ns = ts_ns
        while used > 0 and cycles:
            cycle = cycles[0]
            take = min(used, cycle.remaining)
            cycle.messages += take
            used -= take
            cycle.last_message_ns = ts_ns
            if cycle.first_message_ns is None:
                cycle.first_message_ns = ts_ns
            if cycle.remaining == 0:
                cycle.complete = True
                cycle.ended_by = "permits used"
                out.cycles.append(cycles.popleft())
        if not cycles:
            del self._cycles[consumer_id]
        return True

    def _end_cycles(self, consumer_id: int, reason: str, out: FrameOutcome) -> int:
        remaining = 0
        for cycle in self._cycles.pop(consumer_id, ()):
            remaining += cycle.remaining
            cycle.ended_by = reason
            out.cycles.append(cycle)
        return remaining

    def _count_ids(self, out: FrameOutcome) -> None:
        producers, consumers = len(self.session.producers), len(self.session.consumers)
        out.producers_delta, out.consumers_delta = producers - self.producers, consumers - self.consumers
        self.producers, self.consumers = producers, consumers
        if out.consumers_delta < 0 or len(self._cycles) > consumers:
            for consumer_id in [c for c in self._cycles if c not in self.session.consumers]:
                out.permits_delta -= self._end_cycles(consumer_id, "consumer closed", out)


def _request_key(frame: Frame, kind: int) -> Any:
    """The key the session machine files a request under (None: not a request it pairs)."""
    if kind == T.CONNECT:
        return "connect"
    if kind == T.PING:
        return "ping"
    if kind == T.SEND:
        send = frame.command.send
        return ("send", send.producer_id, send.sequence_id)
    sub = frame.sub
    if sub.DESCRIPTOR.fields_by_name.get("request_id") is not None and sub.HasField("request_id"):
        return ("req", sub.request_id)  # type: ignore[attr-defined]
    return None


def _key_of(pair: RequestPair) -> Any:
    if pair.request_type == T.CONNECT:
        return "connect"
    if pair.sequence_id is not None:
        return ("send", pair.producer_id, pair.sequence_id)
    return ("req", pair.request_id)


def _message_count(frame: Frame, kind: int) -> int:
    if kind == T.SEND:
        send = frame.command.send
        return send.num_messages if send.HasField("num_messages") else 1
    section = frame.payload
    if section is None:
        return 1
    try:
        metadata = section.metadata
    except ProtocolError:
        return 1
    return int(metadata.num_messages_in_batch) if metadata.HasField("num_messages_in_batch") else 1


def _trace_contexts(frame: Frame) -> tuple[TraceContext, ...]:
    """W3C trace contexts in a SEND's message properties: the frame's own, then each batch entry's."""
    section = frame.payload
    if section is None or (TRACEPARENT.encode() not in frame.raw and _section_is_plain(section)):
        return ()
    try:
        metadata = section.metadata
        found = _from_properties({kv.key: kv.value for kv in metadata.properties})
        if found is not None:
            return (found,)
        if not metadata.HasField("num_messages_in_batch"):
            return ()
        contexts: list[TraceContext] = []
        for message in decode_messages(metadata, section.payload):
            context = _from_properties(message.properties)
            if context is not None and context not in contexts:
                contexts.append(context)
        return tuple(contexts)
    except ProtocolError:
        return ()


def _section_is_plain(section: Any) -> bool:
    """True when a payload section's bytes are uncompressed, so a text search can rule properties out."""
    try:
        return bool(section.metadata.compression == api.NONE)
    except ProtocolError:
        return True


def _from_properties(properties: dict[str, str]) -> TraceContext | None:
    parent = properties.get(TRACEPARENT)
    if not parent:
        return None
    return TraceContext(parent, properties.get(TRACESTATE))


def _replication_of(frame: Frame) -> tuple[str, str | None]:
    """A replicator's SEND: the cluster its message comes from and the marker it carries."""
    try:
        section = frame.payload
        metadata = section.metadata if section is not None else None
    except ProtocolError:
        metadata = None
    if metadata is None:
        return "", None
    marker = marker_name(metadata.marker_type) if metadata.HasField("marker_type") else None
    return metadata.replicated_from, marker
