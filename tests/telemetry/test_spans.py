"""Spans from scripted frame sequences, collected with an in-memory exporter (no sockets)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import compression
from proxy.telemetry import ExportSettings, TelemetryPipeline, build_telemetry

from .scripted import (
    BASE_NS,
    MS,
    TO_BROKER,
    TO_CLIENT,
    TOPIC,
    connect,
    create_producer,
    frame,
    message,
    produce,
    send,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def pipeline(exporter: InMemorySpanExporter) -> Iterator[TelemetryPipeline]:
    built = build_telemetry(span_exporter=exporter, seed=1)
    yield built
    built.shutdown()


def finished(pipeline: TelemetryPipeline, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    assert pipeline.force_flush(5_000)
    return list(exporter.get_finished_spans())


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def test_one_send_span_per_send_with_topic_sequence_id_and_connection_parent(
        pipeline: TelemetryPipeline, exporter: InMemorySpanExporter) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    produce(telemetry, 1, ts, 5)
    telemetry.connection_closed(1, ts + 100 * MS, "client closed")
    spans = finished(pipeline, exporter)

    connection = named(spans, "pulsar.connection")
    assert len(connection) == 1
    assert connection[0].attributes["client.address"] == "127.0.0.1"
    sends = named(spans, "SEND")
    assert [s.attributes["pulsar.sequence_id"] for s in sends] == [0, 1, 2, 3, 4]
    for span in sends:
        attrs = span.attributes
        assert attrs["pulsar.command"] == "SEND"
        assert attrs["messaging.system"] == "pulsar"
        assert attrs["messaging.destination.name"] == TOPIC
        assert attrs["messaging.operation.type"] == "send"
        assert attrs["messaging.batch.message_count"] == 1
        assert attrs["pulsar.response"] == "SEND_RECEIPT"
        assert attrs["server.address"] == "127.0.0.1" and attrs["server.port"] == 6650
        assert span.kind is SpanKind.PRODUCER
        assert span.end_time - span.start_time == MS
        assert span.parent is not None and span.parent.span_id == connection[0].context.span_id
        assert span.context.trace_id == connection[0].context.trace_id
    assert len(named(spans, "CONNECT")) == 1 and len(named(spans, "PRODUCER")) == 1


def test_lookup_hops_are_linked_across_a_redirect_even_on_another_connection(
        pipeline: TelemetryPipeline, exporter: InMemorySpanExporter) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    telemetry.frame(1, TO_BROKER, frame(api.CommandLookupTopic(topic=TOPIC, request_id=1)), ts)
    telemetry.frame(1, TO_CLIENT, frame(api.CommandLookupTopicResponse(
        request_id=1, response=api.CommandLookupTopicResponse.Redirect,
        brokerServiceUrl="pulsar://127.0.0.1:6651")), ts + MS)
    ts = connect(telemetry, 2, ts + 2 * MS, broker="pulsar://127.0.0.1:6651")
    telemetry.frame(2, TO_BROKER, frame(api.CommandLookupTopic(topic=TOPIC, request_id=1, authoritative=True)), ts)
    telemetry.frame(2, TO_CLIENT, frame(api.CommandLookupTopicResponse(
        request_id=1, response=api.CommandLookupTopicResponse.Connect,
        brokerServiceUrl="pulsar://127.0.0.1:6651")), ts + MS)
    spans = finished(pipeline, exporter)
    first, second = sorted(named(spans, "LOOKUP"), key=lambda s: s.start_time)
    assert first.attributes["pulsar.lookup.response"] == "Redirect"
    assert first.attributes["pulsar.lookup.hop"] == 1
    assert second.attributes["pulsar.lookup.response"] == "Connect"
    assert second.attributes["pulsar.lookup.hop"] == 2
    assert second.attributes["pulsar.lookup.authoritative"] is True
    assert [link.context.span_id for link in second.links] == [first.context.span_id]
    assert not first.links


def test_rule_delays_count_as_proxy_time_and_rules_are_span_events(
        pipeline: TelemetryPipeline, exporter: InMemorySpanExporter) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    # request held 100 ms by a delay rule, 3 ms upstream, response forwarded at once
    telemetry.frame(1, TO_BROKER, send(1, 7), ts, forwarded_ns=ts + 100 * MS, fired=("slow-sends",))
    telemetry.frame(1, TO_CLIENT, frame(api.CommandSendReceipt(producer_id=1, sequence_id=7)), ts + 103 * MS,
                    forwarded_ns=ts + 103 * MS)
    span = named(finished(pipeline, exporter), "SEND")[0]
    assert span.attributes["pulsar.proxy_time_ms"] == pytest.approx(100.0)
    assert span.attributes["pulsar.upstream_time_ms"] == pytest.approx(3.0)
    assert span.end_time - span.start_time == 103 * MS
    assert span.attributes["pulsar.rules"] == ("slow-sends",)
    assert [(e.name, e.attributes["rule.name"]) for e in span.events] == [("rule", "slow-sends")]


def test_an_answer_injected_by_the_proxy_is_all_proxy_time_and_an_error(
        pipeline: TelemetryPipeline, exporter: InMemorySpanExporter) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    telemetry.frame(1, TO_BROKER, send(1, 0), ts, fired=("fail-sends",))
    telemetry.frame(1, TO_CLIENT, frame(api.CommandSendError(producer_id=1, sequence_id=0,
                                                             error=api.ServerError.PersistenceError,
                                                             message="injected")),
                    ts + 2 * MS, origin="proxy")
    span = named(finished(pipeline, exporter), "SEND")[0]
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "PersistenceError"
    assert span.attributes["pulsar.error.message"] == "injected"
    assert span.attributes["pulsar.upstream_time_ms"] == 0
    assert span.attributes["pulsar.proxy_time_ms"] == pytest.approx(2.0)


def test_requests_unanswered_at_close_end_as_errors(pipeline: TelemetryPipeline,
                                                   exporter: InMemorySpanExporter) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    telemetry.frame(1, TO_BROKER, send(1, 42), ts)
    telemetry.connection_closed(1, ts + 50 * MS, "broker went away")
    spans = finished(pipeline, exporter)
    span = named(spans, "SEND")[0]
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["pulsar.outcome"] == "unanswered"
    assert span.attributes["pulsar.sequence_id"] == 42
    assert span.end_time == ts + 50 * MS
    assert named(spans, "pulsar.connection")[0].attributes["pulsar.connection.close_reason"] == "broker went away"


def test_a_send_with_w3c_trace_context_joins_that_trace(pipeline: TelemetryPipeline,
                                                        exporter: InMemorySpanExporter) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    other = "0af7651916cd43dd8448eb211c80319c"
    telemetry.frame(1, TO_BROKER, send(1, 0, properties={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}), ts)
    telemetry.frame(1, TO_BROKER, send(1, 1, batch=[{"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                                                    {"traceparent": f"00-{other}-b7ad6b7169203331-01"}],
                                       compression_type=compression.ZLIB), ts + MS)
    for sequence_id in (0, 1):
        telemetry.frame(1, TO_CLIENT, frame(api.CommandSendReceipt(producer_id=1, sequence_id=sequence_id)),
                        ts + 3 * MS)
    spans = finished(pipeline, exporter)
    connection = named(spans, "pulsar.connection")[0] if named(spans, "pulsar.connection") else None
    single, batch = sorted(named(spans, "SEND"), key=lambda s: s.attributes["pulsar.sequence_id"])
    for span in (single, batch):
        assert f"{span.context.trace_id:032x}" == TRACE_ID
        assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID
        assert span.parent.is_remote
    assert batch.attributes["messaging.batch.message_count"] == 2
    assert f"{batch.links[1].context.trace_id:032x}" == other
    assert connection is None  # still open: connection spans end with the connection
    telemetry.connection_closed(1, ts + 10 * MS)
    connection = named(finished(pipeline, exporter), "pulsar.connection")[0]
    assert single.links[0].context.span_id == connection.context.span_id


def test_a_delivery_cycle_spans_a_flow_grant_and_the_messages_it_paid_for(
        pipeline: TelemetryPipeline, exporter: InMemorySpanExporter) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    telemetry.frame(1, TO_BROKER, frame(api.CommandSubscribe(
        topic=TOPIC, subscription="sub", subType=api.CommandSubscribe.Shared, consumer_id=3, request_id=5,
        consumer_name="cons-1")), ts)
    telemetry.frame(1, TO_CLIENT, frame(api.CommandSuccess(request_id=5)), ts + MS)
    telemetry.frame(1, TO_BROKER, frame(api.CommandFlow(consumer_id=3, messagePermits=4)), ts + 2 * MS)
    telemetry.frame(1, TO_CLIENT, message(3, 0), ts + 3 * MS)
    telemetry.frame(1, TO_CLIENT, message(3, 1, batch=3), ts + 5 * MS)  # a batch of 3 uses 3 permits
    telemetry.frame(1, TO_BROKER, frame(api.CommandFlow(consumer_id=3, messagePermits=2)), ts + 6 * MS)
    telemetry.frame(1, TO_CLIENT, message(3, 2), ts + 7 * MS)
    telemetry.connection_closed(1, ts + 9 * MS)
    spans = finished(pipeline, exporter)
    complete, partial = sorted(named(spans, "DELIVERY"), key=lambda s: s.start_time)
    assert complete.attributes["pulsar.flow.permits"] == 4
    assert complete.attributes["messaging.batch.message_count"] == 4
    assert complete.attributes["pulsar.delivery.complete"] is True
    assert complete.attributes["messaging.destination.subscription.name"] == "sub"
    assert complete.attributes["messaging.client.id"] == "cons-1"
    assert complete.start_time == ts + 2 * MS and complete.end_time == ts + 5 * MS
    assert complete.kind is SpanKind.CONSUMER
    assert partial.attributes["messaging.batch.message_count"] == 1
    assert partial.attributes["pulsar.delivery.complete"] is False
    assert partial.attributes["pulsar.delivery.ended_by"] == "connection closed"
    subscribe = named(spans, "SUBSCRIBE")[0]
    assert subscribe.attributes["messaging.destination.subscription.name"] == "sub"


def test_sampling_skips_request_spans_but_keeps_connections_and_sampled_parents(
        exporter: InMemorySpanExporter) -> None:
    pipeline = build_telemetry(ExportSettings(sample=0.0), span_exporter=exporter, seed=1)
    try:
        telemetry = pipeline.telemetry
        ts = connect(telemetry, 1, BASE_NS)
        ts = create_producer(telemetry, 1, ts)
        ts = produce(telemetry, 1, ts, 10)
        telemetry.frame(1, TO_BROKER, send(1, 99, properties={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}), ts)
        telemetry.frame(1, TO_CLIENT, frame(api.CommandSendReceipt(producer_id=1, sequence_id=99)), ts + MS)
        telemetry.frame(1, TO_BROKER, send(1, 100, properties={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}),
                        ts)
        telemetry.frame(1, TO_CLIENT, frame(api.CommandSendReceipt(producer_id=1, sequence_id=100)), ts + MS)
        telemetry.connection_closed(1, ts + 2 * MS)
        spans = finished(pipeline, exporter)
        assert sorted(s.name for s in spans) == ["SEND", "pulsar.connection"]
        assert named(spans, "SEND")[0].attributes["pulsar.sequence_id"] == 99
    finally:
        pipeline.shutdown()


def test_one_percent_sampling_records_about_one_percent(exporter: InMemorySpanExporter) -> None:
    pipeline = build_telemetry(ExportSettings(sample=0.01), span_exporter=exporter, seed=7)
    try:
        telemetry = pipeline.telemetry
        ts = connect(telemetry, 1, BASE_NS)
        ts = create_producer(telemetry, 1, ts)
        produce(telemetry, 1, ts, 2000)
        sends = named(finished(pipeline, exporter), "SEND")
        assert 5 <= len(sends) <= 40
    finally:
        pipeline.shutdown()


def test_odd_frames_never_raise(pipeline: TelemetryPipeline, exporter: InMemorySpanExporter) -> None:
    """Answers to unknown requests, frames before CONNECT, unknown consumers: ignored, no spans."""
    telemetry = pipeline.telemetry
    telemetry.frame(5, TO_CLIENT, frame(api.CommandSendReceipt(producer_id=9, sequence_id=1)), BASE_NS)
    telemetry.frame(5, TO_CLIENT, message(77, 1), BASE_NS)
    telemetry.frame(5, TO_CLIENT, frame(api.CommandSuccess(request_id=404)), BASE_NS)
    telemetry.frame(5, TO_BROKER, frame(api.CommandFlow(consumer_id=77, messagePermits=1)), BASE_NS)
    telemetry.connection_closed(5, BASE_NS + MS)
    spans = finished(pipeline, exporter)
    assert [s.name for s in spans if s.name != "pulsar.connection"] == ["DELIVERY"]


def _mixed_traffic(pipeline: TelemetryPipeline) -> None:
    """Every kind of span: connections, requests (ok, error, unanswered, rules and marks fired), LOOKUP hops
    linked across a redirect, delivery cycles, and SENDs joining a W3C trace."""
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    ts = produce(telemetry, 1, ts, 3)
    telemetry.frame(1, TO_BROKER, send(1, 7), ts, forwarded_ns=ts + 100 * MS, fired=("slow-sends", "tag"))
    telemetry.frame(1, TO_CLIENT, frame(api.CommandSendReceipt(producer_id=1, sequence_id=7)), ts + 103 * MS)
    telemetry.frame(1, TO_BROKER, send(1, 8), ts, fired=("fail-sends",))
    telemetry.frame(1, TO_CLIENT, frame(api.CommandSendError(producer_id=1, sequence_id=8,
                                                             error=api.ServerError.PersistenceError,
                                                             message="injected")), ts + 2 * MS, origin="proxy")
    telemetry.frame(1, TO_BROKER, send(1, 9, properties={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}), ts)
    telemetry.frame(1, TO_CLIENT, frame(api.CommandSendReceipt(producer_id=1, sequence_id=9)), ts + MS)
    telemetry.frame(1, TO_BROKER, frame(api.CommandLookupTopic(topic=TOPIC, request_id=1)), ts)
    telemetry.frame(1, TO_CLIENT, frame(api.CommandLookupTopicResponse(
        request_id=1, response=api.CommandLookupTopicResponse.Redirect,
        brokerServiceUrl="pulsar://127.0.0.1:6651")), ts + MS)
    telemetry.frame(1, TO_BROKER, frame(api.CommandSubscribe(
        topic=TOPIC, subscription="sub", subType=api.CommandSubscribe.Shared, consumer_id=3, request_id=5,
        consumer_name="cons-1")), ts)
    telemetry.frame(1, TO_CLIENT, frame(api.CommandSuccess(request_id=5)), ts + MS)
    telemetry.frame(1, TO_BROKER, frame(api.CommandFlow(consumer_id=3, messagePermits=2)), ts + 2 * MS)
    telemetry.frame(1, TO_CLIENT, message(3, 0), ts + 3 * MS, fired=("slow-messages",))
    telemetry.frame(1, TO_CLIENT, message(3, 1, batch=2), ts + 5 * MS)
    telemetry.frame(1, TO_BROKER, send(1, 10), ts + 6 * MS)
    ts2 = connect(telemetry, 2, ts + 2 * MS, broker="pulsar://127.0.0.1:6651")
    telemetry.frame(2, TO_BROKER, frame(api.CommandLookupTopic(topic=TOPIC, request_id=1, authoritative=True)), ts2)
    telemetry.frame(2, TO_CLIENT, frame(api.CommandLookupTopicResponse(
        request_id=1, response=api.CommandLookupTopicResponse.Connect,
        brokerServiceUrl="pulsar://127.0.0.1:6651")), ts2 + MS)
    telemetry.connection_closed(1, ts + 50 * MS, "broker went away")
    telemetry.connection_closed(2, ts + 60 * MS)


def _described(spans: list[ReadableSpan]) -> list[tuple[object, ...]]:
    """Everything an exporter reads of the spans, their ids replaced by their order of first appearance."""
    ids: dict[int, int] = {}

    def of(span_id: int | None) -> int | None:
        return None if span_id is None else ids.setdefault(span_id, len(ids))

    traces: dict[int, int] = {}
    described = []
    for span in spans:
        context, parent = span.context, span.parent
        assert context is not None
        described.append((
            span.name, span.kind, of(context.span_id), traces.setdefault(context.trace_id, len(traces)),
            int(context.trace_flags), tuple(context.trace_state.items()), context.is_remote,
            None if parent is None else (of(parent.span_id), parent.is_remote),
            dict(span.attributes or {}), span.dropped_attributes,
            [(event.name, dict(event.attributes or {}), event.timestamp) for event in span.events],
            [(of(link.context.span_id), dict(link.attributes or {})) for link in span.links],
            span.status.status_code, span.status.description, span.start_time, span.end_time,
            span.resource, span.instrumentation_scope))
    return described


def test_spans_written_directly_are_the_spans_the_sdk_tracer_writes(exporter: InMemorySpanExporter) -> None:
    """Requests and deliveries skip the SDK's live span (:class:`~proxy.telemetry.tracer.DirectSpans`): what the
    exporter gets is what ``start_span`` ... ``end`` gave, field by field, ids aside."""
    sdk_exporter = InMemorySpanExporter()
    direct, through_sdk = (build_telemetry(span_exporter=exporter, seed=1),
                           build_telemetry(span_exporter=sdk_exporter, seed=1))
    writer, sdk_writer = direct.telemetry.spans, through_sdk.telemetry.spans
    assert writer is not None and sdk_writer is not None
    sdk_writer.direct = None
    started: list[str] = []
    start_span = writer.tracer.start_span
    writer.tracer.start_span = lambda name, *args, **kwargs: started.append(name) or start_span(  # type: ignore
        name, *args, **kwargs)
    try:
        for pipeline in (direct, through_sdk):
            _mixed_traffic(pipeline)
        spans, sdk_spans = finished(direct, exporter), finished(through_sdk, sdk_exporter)
        assert len(spans) == 16
        assert _described(spans) == _described(sdk_spans)
        # the live spans: the connections (they end later) and the SEND joining a remote trace
        assert started == ["pulsar.connection", "SEND", "pulsar.connection"]
    finally:
        direct.shutdown()
        through_sdk.shutdown()
