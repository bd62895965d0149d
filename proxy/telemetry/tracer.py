"""OpenTelemetry spans for what the proxy saw: connections, request/response pairs, deliveries.

:class:`SpanWriter` turns the records of :mod:`proxy.telemetry.tracker` into spans
with explicit start and end times (the instants the relay reported, so a span
covers exactly what the client experienced, injected delays included):

- a **connection span** (``pulsar.connection``) per proxied connection, parent of the
  rest, from accept to close;
- a **request span** per request/response pair, named after the request
  (``SEND``, ``LOOKUP``, ...), carrying ``pulsar.command``, the messaging semantic
  conventions (``messaging.system=pulsar``, ``messaging.destination.name``,
  ``messaging.operation.type``/``.name``, batch counts, sizes), the client and broker
  addresses, ids, the error code and message, ``pulsar.proxy_time_ms`` and
  ``pulsar.upstream_time_ms``; a pair left unanswered at close ends as an error;
- LOOKUP: one span per hop; a hop that follows a Redirect for the same topic links
  to the span of the hop that redirected it (across connections);
- a **delivery span** (``DELIVERY``) per FLOW grant, ending at the MESSAGE that used
  its last permit;
- a SEND whose message properties carry W3C ``traceparent`` joins that trace (the
  connection span is then a link), and further batch entries' contexts are links;
- each fired rule is a span event named ``rule`` (``rule.name``), and the list of
  rules is the ``pulsar.rules`` attribute; the labels of ``mark`` rules are the
  ``pulsar.marks`` attribute;
- a geo-replicator's SEND (producer ``pulsar.repl.*``) carries
  ``pulsar.replication=true``, ``pulsar.replication.source_cluster`` and, for a
  replicated-subscription marker, ``pulsar.replication.marker`` (its MarkerType name).

A request or delivery span that joins no W3C trace is written as the SDK's tracer would
finish it (its ids, flags, parent, resource and scope), but as a finished
:class:`~opentelemetry.sdk.trace.ReadableSpan` handed straight to the tracer's span
processor (:class:`DirectSpans`): the SDK's live span (a lock, the sampler's call,
attribute checks and copies, a context per parent) was ~60 % of a sampled request's cost
on the relay's thread, for a span that is ended the instant it starts.  A tracer that
is not the SDK's, or whose limits a span would reach, gets ``start_span`` as before.

Sampling: ``sample`` is the probability of recording a request or delivery span,
drawn from a seeded generator; connection spans are always recorded; a span that
joins a W3C trace follows that trace's sampled flag instead.
"""

from __future__ import annotations

import functools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from proxy.protocol.commands import T
from proxy.telemetry.tracker import DeliveryCycle, Exchange, FiredRule, TraceContext

CONNECTION_SPAN: Final = "pulsar.connection"
DELIVERY_SPAN: Final = "DELIVERY"
#: Topics whose last LOOKUP hop was a Redirect, remembered for the next hop's link.
MAX_PENDING_REDIRECTS: Final = 4096

_OPERATION: Final[dict[int, tuple[str, str]]] = {
    T.SEND: ("send", "send"),
    T.PRODUCER: ("create", "create_producer"),
    T.SUBSCRIBE: ("receive", "subscribe"),
    T.ACK: ("settle", "ack"),
    T.FLOW: ("receive", "flow"),
}
_PROPAGATOR: Final = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class Peer:
    """Addresses of the two sides of a connection."""

    client: str | None = None
    broker: str | None = None


def _host_port(address: str | None) -> tuple[str, int] | None:
    if not address:
        return None
    parsed = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parsed.port
    except ValueError:
        return None
    if parsed.hostname is None or port is None:
        return None
    return parsed.hostname, port


_UNSET: Final = Status(StatusCode.UNSET)
_PARENT_BASED_ALWAYS_ON: Final[str] = ParentBased(ALWAYS_ON).get_description()  # type: ignore[no-untyped-call]
_SAMPLED: Final = TraceFlags(TraceFlags.SAMPLED)
#: attributes, events and links a span may carry for :class:`DirectSpans` to write it (a span beyond one of the
#: tracer's limits takes ``start_span``, which drops and counts the excess)
_MOST_ATTRIBUTES: Final = 40
_MOST_EVENTS: Final = 16
_MOST_LINKS: Final = 4
_RULE_EVENT_ATTRIBUTES: Final = 3


class DirectSpans:
    """Finished spans written for an SDK tracer without its live span: see the module docstring.

    What ``tracer.start_span(...)`` then ``end()`` would produce for a span whose parent is a local sampled span
    (a connection's) or none, under the provider's ``ParentBased(ALWAYS_ON)`` sampler: the parent's trace id and
    flags (a root: a new trace id, sampled, and random if the id generator says so), a new span id, the
    parent's trace state.  ``attributes`` are the span's as they are (their sequences tuples, as the SDK would
    have made them: :class:`SpanWriter` builds them so).
    """

    __slots__ = ("_ids", "_on_end", "_resource", "_scope", "_info", "_root_flags")

    def __init__(self, tracer: SdkTracer) -> None:
        self._ids = tracer.id_generator
        self._on_end = tracer.span_processor.on_end
        self._resource = tracer.resource
        self._scope = tracer._instrumentation_scope
        self._info = tracer.instrumentation_info
        self._root_flags = (TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
                            if self._ids.is_trace_id_random() else _SAMPLED)

    @staticmethod
    def serves(tracer: trace.Tracer) -> bool:
        """Whether ``tracer``'s spans can be written directly: the SDK's, enabled, sampling ParentBased(ALWAYS_ON)
        (the provider :func:`~proxy.telemetry.exporters.tracer_provider` builds), no attribute value cut, limits
        above what a span here carries, and no SDK self-metrics (which count live spans)."""
        if type(tracer) is not SdkTracer:
            return False
        limits = getattr(tracer, "_span_limits", None)
        sampler = getattr(tracer, "sampler", None)
        return (getattr(tracer, "_instrumentation_scope", None) is not None and limits is not None
                and tracer._is_enabled() and type(tracer._tracer_metrics).__name__.startswith("NoOp")
                and sampler is not None and sampler.get_description() == _PARENT_BASED_ALWAYS_ON
                and limits.max_attribute_length is None and limits.max_span_attribute_length is None
                and (limits.max_span_attributes or 0) >= _MOST_ATTRIBUTES and (limits.max_events or 0) >= _MOST_EVENTS
                and (limits.max_links or 0) >= _MOST_LINKS
                and (limits.max_event_attributes or 0) >= _RULE_EVENT_ATTRIBUTES)

    @staticmethod
    def fits(attributes: dict[str, AttributeValue], rules: Sequence[FiredRule], links: Sequence[Link]) -> bool:
        return len(attributes) <= _MOST_ATTRIBUTES and len(rules) <= _MOST_EVENTS and len(links) <= _MOST_LINKS

    def span(self, name: str, parent: SpanContext | None, kind: SpanKind, attributes: dict[str, AttributeValue],
             links: Sequence[Link], rules: Sequence[FiredRule], status: Status, start_ns: int,
             end_ns: int) -> ReadableSpan:
        """Write a finished span (handed to the span processor) and return it."""
        ids = self._ids
        if parent is None:
            context = SpanContext(ids.generate_trace_id(), ids.generate_span_id(), False, self._root_flags)
        else:
            context = SpanContext(parent.trace_id, ids.generate_span_id(), False, parent.trace_flags,
                                  parent.trace_state)
        events = [Event("rule", {"rule.name": rule.name, "pulsar.command": rule.command,
                                 "pulsar.direction": rule.direction}, rule.ts_ns) for rule in rules]
        span = ReadableSpan(name, context, parent, self._resource, attributes, events, links, kind, self._info,
                            status, start_ns, end_ns, self._scope)
        self._on_end(span)
        return span


class SpanWriter:
    """Writes spans through an OpenTelemetry tracer; see the module docstring."""

    def __init__(self, tracer: trace.Tracer, *, sample: float = 1.0, rng: random.Random | None = None) -> None:
        self.tracer = tracer
        #: spans written without the tracer's live span (None: the tracer cannot be served so)
        self.direct = DirectSpans(tracer) if isinstance(tracer, SdkTracer) and DirectSpans.serves(tracer) else None
        self.sample = sample
        self._rng = rng or random.Random(0)
        #: the generator's draws: :meth:`sampled` is ``sample >= 1.0 or draw() < sample`` (the data path in
        #: bulk draws so itself, in the same order, and adds what it skipped to ``spans_skipped``)
        self.draw = self._rng.random
        self._connections: dict[int, trace.Span] = {}
        self._redirects: OrderedDict[str, tuple[SpanContext, int]] = OrderedDict()
        self.spans_written = 0
        self.spans_skipped = 0

    # -- connections ----------------------------------------------------------------------
    def connection_opened(self, conn_id: int, peer: Peer, ts_ns: int) -> None:
        if conn_id in self._connections:
            return
        attributes: dict[str, AttributeValue] = {"pulsar.connection.id": conn_id, "messaging.system": "pulsar"}
        _peer_attributes(attributes, peer)
        self._connections[conn_id] = self.tracer.start_span(
            CONNECTION_SPAN, context=Context(), kind=SpanKind.SERVER, attributes=attributes, start_time=ts_ns)

    def connection_routed(self, conn_id: int, peer: Peer) -> None:
        """The connection's broker became known (the relay routes it after CONNECT)."""
        span = self._connections.get(conn_id)
        if span is not None:
            attributes: dict[str, AttributeValue] = {}
            _peer_attributes(attributes, peer)
            span.set_attributes(attributes)

    def connection_closed(self, conn_id: int, ts_ns: int, reason: str | None = None) -> None:
        span = self._connections.pop(conn_id, None)
        if span is None:
            return
        if reason:
            span.set_attribute("pulsar.connection.close_reason", reason)
        span.end(end_time=ts_ns)

    def loose_rules(self, conn_id: int, rules: Sequence[FiredRule]) -> None:
        """Rules that fired on frames outside any request or delivery: events on the connection span."""
        span = self._connections.get(conn_id)
        if span is not None:
            _rule_events(span, rules)

    # -- requests -------------------------------------------------------------------------
    def exchange(self, exchange: Exchange, peer: Peer) -> None:
        traces = exchange.request.traces if exchange.request is not None else ()
        if not traces and not self.sampled():
            return
        self.sampled_exchange(exchange, peer)

    def sampled(self) -> bool:
        """Draw whether the next request without trace context gets a span (counted as skipped if not).

        Drawn once per request, in the order requests end, before anything is built for it.
        """
        if self._sampled():
            return True
        self.spans_skipped += 1
        return False

    def sampled_exchange(self, exchange: Exchange, peer: Peer) -> None:
        """The span of an exchange that :meth:`sampled` chose (or that joins a W3C trace)."""
        pair = exchange.pair
        traces = exchange.request.traces if exchange.request is not None else ()
        direct = self.direct if not traces else None
        links: list[Link]
        connection = self._connections.get(exchange.conn_id)
        if direct is not None:
            parent_span = connection.get_span_context() if connection is not None else None
            links = []
        else:
            parent, links = self._parent_and_links(exchange.conn_id, traces)
        hop = 1
        if pair.request_type == T.LOOKUP and pair.topic:
            redirected = self._redirects.pop(pair.topic, None)
            if redirected is not None:
                links.append(Link(redirected[0], {"pulsar.link": "redirected_by"}))
                hop = redirected[1] + 1
        attributes = self._exchange_attributes(exchange, peer)
        if pair.request_type == T.LOOKUP:
            attributes["pulsar.lookup.hop"] = hop
        kind = SpanKind.PRODUCER if pair.request_type == T.SEND else SpanKind.SERVER
        if pair.outcome == "unanswered":
            status = Status(StatusCode.ERROR, "unanswered: the connection closed first")
        elif pair.outcome == "error":
            status = Status(StatusCode.ERROR, pair.error_message or pair.error_code or "error")
        else:
            status = _UNSET
        end_ns = max(exchange.end_ns, exchange.start_ns)
        span_context: SpanContext
        if direct is not None and direct.fits(attributes, exchange.rules, links):
            span_context = direct.span(exchange.command, parent_span, kind, attributes, links, exchange.rules,
                                       status, exchange.start_ns, end_ns).context
        else:
            if direct is not None:
                parent = trace.set_span_in_context(connection) if connection is not None else Context()
            span = self.tracer.start_span(exchange.command, context=parent, kind=kind, attributes=attributes,
                                          links=links, start_time=exchange.start_ns)
            _rule_events(span, exchange.rules)
            if status is not _UNSET:
                span.set_status(status)
            span_context = span.get_span_context()
            span.end(end_time=end_ns)
        if pair.request_type == T.LOOKUP and exchange.lookup_answer == "Redirect" and pair.topic:
            self._redirects[pair.topic] = (span_context, hop)
            self._redirects.move_to_end(pair.topic)
            if len(self._redirects) > MAX_PENDING_REDIRECTS:
                self._redirects.popitem(last=False)
        self.spans_written += 1

    def _exchange_attributes(self, exchange: Exchange, peer: Peer) -> dict[str, AttributeValue]:
        pair = exchange.pair
        attributes: dict[str, AttributeValue] = {
            "pulsar.command": exchange.command,
            "messaging.system": "pulsar",
            "pulsar.connection.id": exchange.conn_id,
            "pulsar.outcome": pair.outcome,
            "pulsar.proxy_time_ms": exchange.proxy_ns / 1e6,
            "pulsar.upstream_time_ms": exchange.upstream_ns / 1e6,
        }
        _peer_attributes(attributes, peer)
        if pair.response_command is not None:
            attributes["pulsar.response"] = pair.response_command
        if pair.topic:
            attributes["messaging.destination.name"] = pair.topic
        operation = _OPERATION.get(pair.request_type)
        if operation is not None:
            attributes["messaging.operation.type"], attributes["messaging.operation.name"] = operation
        for name, value in (("pulsar.request_id", pair.request_id), ("pulsar.producer_id", pair.producer_id),
                            ("pulsar.consumer_id", pair.consumer_id), ("pulsar.sequence_id", pair.sequence_id)):
            if value is not None:
                attributes[name] = value
        if pair.request_type == T.SEND:
            attributes["messaging.batch.message_count"] = max(pair.num_messages, 1)
        elif pair.request_type == T.ACK and pair.num_messages:
            attributes["messaging.batch.message_count"] = pair.num_messages
        if exchange.request is not None:
            attributes["pulsar.request.size"] = exchange.request.size
            if exchange.request.authoritative is not None:
                attributes["pulsar.lookup.authoritative"] = exchange.request.authoritative
        if exchange.producer_name or exchange.consumer_name:
            attributes["messaging.client.id"] = exchange.producer_name or exchange.consumer_name or ""
        if exchange.subscription:
            attributes["messaging.destination.subscription.name"] = exchange.subscription
        if pair.error_code:
            attributes["error.type"] = pair.error_code
            attributes["pulsar.error.code"] = pair.error_code
        if pair.error_message:
            attributes["pulsar.error.message"] = pair.error_message
        if exchange.lookup_answer:
            attributes["pulsar.lookup.response"] = exchange.lookup_answer
        if exchange.lookup_broker_url:
            attributes["pulsar.lookup.broker_url"] = exchange.lookup_broker_url
        if exchange.request is not None and exchange.request.replication is not None:
            source, marker = exchange.request.replication
            attributes["pulsar.replication"] = True
            attributes["pulsar.replication.source_cluster"] = source
            if marker is not None:
                attributes["pulsar.replication.marker"] = marker
        if exchange.rules:
            attributes["pulsar.rules"] = tuple(dict.fromkeys(rule.name for rule in exchange.rules))
        if exchange.marks:
            attributes["pulsar.marks"] = tuple(dict.fromkeys(exchange.marks))
        return attributes

    # -- deliveries -----------------------------------------------------------------------
    def delivery(self, cycle: DeliveryCycle, peer: Peer) -> None:
        if not self._sampled():
            self.spans_skipped += 1
            return
        attributes: dict[str, AttributeValue] = {
            "pulsar.command": "FLOW",
            "messaging.system": "pulsar",
            "messaging.operation.type": "receive",
            "messaging.operation.name": "deliver",
            "pulsar.connection.id": cycle.conn_id,
            "pulsar.consumer_id": cycle.consumer_id,
            "pulsar.flow.permits": cycle.permits,
            "messaging.batch.message_count": cycle.messages,
            "pulsar.delivery.frames": cycle.frames,
            "pulsar.delivery.bytes": cycle.bytes,
            "pulsar.delivery.complete": cycle.complete,
        }
        _peer_attributes(attributes, peer)
        if cycle.ended_by:
            attributes["pulsar.delivery.ended_by"] = cycle.ended_by
        if cycle.topic:
            attributes["messaging.destination.name"] = cycle.topic
        if cycle.subscription:
            attributes["messaging.destination.subscription.name"] = cycle.subscription
        if cycle.consumer_name:
            attributes["messaging.client.id"] = cycle.consumer_name
        if cycle.rules:
            attributes["pulsar.rules"] = tuple(dict.fromkeys(rule.name for rule in cycle.rules))
        if cycle.marks:
            attributes["pulsar.marks"] = tuple(dict.fromkeys(cycle.marks))
        end_ns = max(cycle.end_ns, cycle.flow_received_ns)
        direct = self.direct
        if direct is not None and direct.fits(attributes, cycle.rules, ()):
            connection = self._connections.get(cycle.conn_id)
            direct.span(DELIVERY_SPAN, connection.get_span_context() if connection is not None else None,
                        SpanKind.CONSUMER, attributes, (), cycle.rules, _UNSET, cycle.flow_received_ns, end_ns)
        else:
            parent, links = self._parent_and_links(cycle.conn_id, ())
            span = self.tracer.start_span(DELIVERY_SPAN, context=parent, kind=SpanKind.CONSUMER,
                                          attributes=attributes, links=links, start_time=cycle.flow_received_ns)
            _rule_events(span, cycle.rules)
            span.end(end_time=end_ns)
        self.spans_written += 1

    # -- helpers --------------------------------------------------------------------------
    def _sampled(self) -> bool:
        return self.sample >= 1.0 or self.draw() < self.sample

    def _parent_and_links(self, conn_id: int, traces: Sequence[TraceContext]) -> tuple[Context, list[Link]]:
        connection = self._connections.get(conn_id)
        connection_context = trace.set_span_in_context(connection) if connection is not None else Context()
        links: list[Link] = []
        parent: Context | None = None
        for found in traces:
            carrier = {"traceparent": found.traceparent}
            if found.tracestate:
                carrier["tracestate"] = found.tracestate
            context = _PROPAGATOR.extract(carrier, context=Context())
            span_context = trace.get_current_span(context).get_span_context()
            if not span_context.is_valid:
                continue
            if parent is None:
                parent = context
            else:
                links.append(Link(span_context, {"pulsar.link": "batch_entry"}))
        if parent is None:
            return connection_context, links
        if connection is not None:
            links.insert(0, Link(connection.get_span_context(), {"pulsar.link": "connection"}))
        return parent, links

    def close_all(self, ts_ns: int) -> None:
        for conn_id in list(self._connections):
            self.connection_closed(conn_id, ts_ns, "telemetry stopped")


def _peer_attributes(attributes: dict[str, AttributeValue], peer: Peer) -> None:
    attributes.update(_peer_items(peer))


@functools.lru_cache(maxsize=4096)
def _peer_items(peer: Peer) -> tuple[tuple[str, AttributeValue], ...]:
    """A connection's address attributes, in order (parsed once per connection: two ``urlsplit`` per span
    were ~15 % of a request span's cost)."""
    items: list[tuple[str, AttributeValue]] = []
    client = _host_port(peer.client)
    if client is not None:
        items += (("client.address", client[0]), ("client.port", client[1]))
    broker = _host_port(peer.broker)
    if broker is not None:
        items += (("server.address", broker[0]), ("server.port", broker[1]))
    if peer.broker:
        items.append(("pulsar.broker", peer.broker))
    return tuple(items)


def _rule_events(span: trace.Span, rules: Sequence[FiredRule]) -> None:
    for rule in rules:
        span.add_event("rule", {"rule.name": rule.name, "pulsar.command": rule.command,
                                "pulsar.direction": rule.direction}, timestamp=rule.ts_ns)
