"""OTLP export to collectors the tests run on loopback, and what happens when none answers."""

from __future__ import annotations

import gzip
import io
import socket
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from functools import partial

import grpc
import pytest
import structlog
import trio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from proxy.telemetry import ExportSettings, build_telemetry
from proxy.telemetry.exporters import SPAN_BATCH_SIZE, SPAN_QUEUE_SIZE
from proxy.telemetry.otlp_spans import SpanEncoder

from .scripted import BASE_NS, connect, create_producer, produce
from .test_spans import _mixed_traffic

HTTP_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"


class OtlpHttpReceiver:
    """A minimal OTLP/HTTP collector: decodes each POSTed ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, trace_service_pb2.ExportTraceServiceRequest]] = []
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.received = trio.Event()

    async def serve(self, stream: trio.SocketStream) -> None:
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                body, buffer = buffer[:length], buffer[length:]
                if headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if path == "/v1/metrics":
                    metrics_request = metrics_service_pb2.ExportMetricsServiceRequest()
                    metrics_request.ParseFromString(body)
                    self.metrics.append(metrics_request)
                else:
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    self.requests.append((path, request))
                self.received.set()
                await stream.send_all(HTTP_OK)

    def spans(self) -> list[Span]:
        return [span for _, request in self.requests for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]


def attributes(span: Span) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


async def test_otlp_http_exporter_delivers_spans_to_a_loopback_collector() -> None:
    receiver = OtlpHttpReceiver()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, receiver.serve, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            pipeline = build_telemetry(ExportSettings(exporter="otlp", endpoint=f"http://127.0.0.1:{port}/",
                                                      protocol="http", schedule_delay_ms=50))
            telemetry = pipeline.telemetry
            ts = connect(telemetry, 1, BASE_NS)
            ts = create_producer(telemetry, 1, ts)
            produce(telemetry, 1, ts, 3)
            assert await trio.to_thread.run_sync(pipeline.force_flush, 10_000)
            await trio.to_thread.run_sync(pipeline.shutdown)
            nursery.cancel_scope.cancel()
    assert {path for path, _ in receiver.requests} == {"/v1/traces"}
    exported = {metric.name for request in receiver.metrics for resource in request.resource_metrics
                for scope in resource.scope_metrics for metric in scope.metrics}
    assert {"pulsar_tap_request_duration_seconds", "pulsar_tap_frames"} <= exported
    sends = [span for span in receiver.spans() if span.name == "SEND"]
    assert len(sends) == 3
    found = attributes(sends[0])
    assert found["pulsar.command"] == "SEND"
    assert found["messaging.system"] == "pulsar"
    assert found["messaging.destination.name"] == "persistent://public/default/orders"
    assert sorted(attributes(span)["pulsar.sequence_id"] for span in sends) == [0, 1, 2]  # type: ignore[type-var]
    assert sends[0].start_time_unix_nano >= BASE_NS
    resource = receiver.requests[0][1].resource_spans[0].resource
    assert any(kv.key == "service.name" and kv.value.string_value == "pulsar-tap" for kv in resource.attributes)


class GrpcTraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_grpc_exporter_delivers_spans_to_a_loopback_collector() -> None:
    collector = GrpcTraceCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        pipeline = build_telemetry(ExportSettings(exporter="otlp", endpoint=f"http://127.0.0.1:{port}",
                                                  protocol="grpc", otlp_metrics=False, timeout_s=5))
        ts = connect(pipeline.telemetry, 1, BASE_NS)
        ts = create_producer(pipeline.telemetry, 1, ts)
        produce(pipeline.telemetry, 1, ts, 2)
        assert pipeline.force_flush(10_000)
        pipeline.shutdown()
    finally:
        server.stop(grace=None)
    names = [span.name for request in collector.requests for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    assert names.count("SEND") == 2


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_collector_is_logged_once_and_never_slows_the_feed() -> None:
    pipeline = build_telemetry(ExportSettings(exporter="otlp", endpoint=f"http://127.0.0.1:{closed_port()}",
                                              otlp_metrics=False, timeout_s=0.5, schedule_delay_ms=20))
    telemetry = pipeline.telemetry
    with structlog.testing.capture_logs() as logs:
        ts = connect(telemetry, 1, BASE_NS)
        ts = create_producer(telemetry, 1, ts)
        started = time.monotonic()
        for _ in range(3):
            ts = produce(telemetry, 1, ts, 300)
            pipeline.force_flush(5_000)
        ts = produce(telemetry, 1, ts, 1000)
        feed_seconds = time.monotonic() - started
        pipeline.shutdown()
    warnings = [entry for entry in logs if "unreachable" in entry["event"]]
    assert len(warnings) == 1, logs
    assert warnings[0]["log_level"] == "warning"
    assert str(warnings[0]["collector"]).endswith("/v1/traces")
    # 1900 SENDs fed while exports fail: the feed itself never waits for the network
    assert feed_seconds < 10
    assert telemetry.frames_seen == 2 + 2 + 2 * 1900


def test_bad_settings_are_config_errors() -> None:
    from proxy.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tracing\.exporter"):
        ExportSettings(exporter="jaeger")
    with pytest.raises(ConfigError, match=r"tracing\.sample"):
        ExportSettings(sample=1.5)
    with pytest.raises(ConfigError, match=r"tracing\.endpoint"):
        ExportSettings(exporter="otlp", endpoint="127.0.0.1:4318")
    assert ExportSettings(exporter="otlp", endpoint="http://c:4318/").signal_endpoint("traces") == \
        "http://c:4318/v1/traces"
    assert ExportSettings(exporter="otlp", protocol="grpc", endpoint="http://c:4317").signal_endpoint("traces") == \
        "http://c:4317"


def test_console_exporter_writes_spans_to_its_stream() -> None:
    out = io.StringIO()
    pipeline = build_telemetry(ExportSettings(exporter="console"), metrics=False, console=out)
    ts = connect(pipeline.telemetry, 1, BASE_NS)
    ts = create_producer(pipeline.telemetry, 1, ts)
    produce(pipeline.telemetry, 1, ts, 1)
    assert pipeline.force_flush(5_000)
    pipeline.shutdown()
    text = out.getvalue()
    assert '"name": "SEND"' in text and '"pulsar.sequence_id": 0' in text


def test_the_own_otlp_encoding_is_the_sdks_byte_for_byte() -> None:
    """:class:`~proxy.telemetry.otlp_spans.SpanEncoder` (the OTLP/HTTP exporter's) writes the bytes the SDK's
    encoder serializes: the spans of scripted traffic, and spans with every field and attribute type, over two
    resources and three scopes (one with a version, a schema and attributes)."""
    exporter = InMemorySpanExporter()
    pipeline = build_telemetry(span_exporter=exporter, seed=1)
    try:
        _mixed_traffic(pipeline)
        assert pipeline.force_flush(5_000)
        spans = list(exporter.get_finished_spans())
    finally:
        pipeline.shutdown()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "other", "n": 3}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("a")
    versioned = provider.get_tracer("b", "1.2", schema_url="https://schema", attributes={"k": "v"})
    connection = tracer.start_span("pulsar.connection", context=Context(), kind=SpanKind.SERVER, start_time=5)
    remote = SpanContext(2**127 + 5, 2**63 + 7, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("a", "b"), ("c", "d")]))
    every_type = {"s": "é", "t": True, "f": False, "zero": 0, "negative": -5, "big": 2**63 - 1, "d": 1.5, "z": 0.0,
                  "strings": ["x", "y"], "ints": (1, 2), "bytes": b"\x00\x01", "empty": "", "map": {"in": 1}}
    span = tracer.start_span("SEND", context=trace.set_span_in_context(connection), kind=SpanKind.PRODUCER,
                             attributes=every_type, start_time=10,
                             links=[Link(remote, {"pulsar.link": "batch_entry"}), Link(connection.get_span_context())])
    span.add_event("rule", {"rule.name": "r"}, timestamp=11)
    span.add_event("", {}, timestamp=12)
    span.set_status(Status(StatusCode.ERROR, "boom"))
    span.end(end_time=20)
    child = versioned.start_span("", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)), start_time=1)
    child.set_status(Status(StatusCode.OK))
    child.end(end_time=1)
    connection.end(end_time=30)
    spans += exporter.get_finished_spans()
    assert len({span.resource for span in spans}) == 2 and len({span.instrumentation_scope for span in spans}) == 3
    encoder = SpanEncoder()
    for _ in range(2):  # (the second time from its caches)
        assert encoder.request(spans) == encode_spans(spans).SerializeToString()
    assert encoder.request(spans[:1]) == encode_spans(spans[:1]).SerializeToString()
    assert encoder.request([]) == b""


class HeldExporter(SpanExporter):
    """An exporter whose exports wait until ``release`` is set (a collector slower than the traffic)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        assert self.release.wait(30)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


def test_spans_a_full_queue_refuses_are_dropped_and_counted_on_metrics(caplog: pytest.LogCaptureFixture) -> None:
    """More spans than the exporter takes: the queue keeps SPAN_QUEUE_SIZE, the rest are dropped without a log
    line each and counted as pulsar_tap_dropped_events_total{source="spans"}; every span is exported or counted."""
    exporter = HeldExporter()
    pipeline = build_telemetry(span_exporter=exporter, seed=1)
    try:
        telemetry = pipeline.telemetry
        assert telemetry.spans is not None
        ts = connect(telemetry, 1, BASE_NS)
        ts = create_producer(telemetry, 1, ts)
        produce(telemetry, 1, ts, SPAN_QUEUE_SIZE + SPAN_BATCH_SIZE + 300)
        telemetry.connection_closed(1, ts)
        exporter.release.set()
        assert pipeline.force_flush(10_000)
        written = telemetry.spans.spans_written + 1  # (and the connection's)
        text = pipeline.prometheus_text()
        sample = 'pulsar_tap_dropped_events_total{source="spans"}'
        dropped = [line for line in text.splitlines() if line.startswith(sample)]
        assert len(dropped) == 1
        count = float(dropped[0].rsplit(" ", 1)[1])
        assert 300 <= count <= written - SPAN_QUEUE_SIZE
        assert exporter.exported + count == written
        assert not [record for record in caplog.records if "Queue full" in record.getMessage()]
    finally:
        exporter.release.set()
        pipeline.shutdown()
