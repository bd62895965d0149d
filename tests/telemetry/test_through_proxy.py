"""Acceptance: the official client through the proxy to the embedded broker, telemetry attached.

The proxy runs in its own thread and Trio loop with the telemetry observer (and a
rules hook); the blocking official client produces and consumes through it; the
spans land in an in-memory exporter and /metrics text is parsed with
prometheus_client's parser.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pulsar
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from proxy.broker import ClusterConfig, ThreadedCluster
from proxy.config.proxy_config import AdminConfig, HostPort, LimitsConfig, ProxyConfig, ServiceUrl, TracingConfig
from proxy.rules.engine import RulesEngine
from proxy.rules.hook import RulesHook
from proxy.rules.loader import load_rules_text
from proxy.server.app import ProxyServer
from proxy.server.threaded import ThreadedProxy, ThreadedStack
from proxy.telemetry import TelemetryPipeline, build_telemetry, telemetry_for_proxy

MESSAGES = 20
SLOW_RULES = """
seed: 1
rules:
  - name: slow-receipts
    match: {command: [SEND_RECEIPT], direction: to_client, topic: "persistent://public/default/slow-*"}
    action: {delay: {ms: 100}}
"""


@pytest.fixture
def cluster() -> Iterator[ThreadedCluster]:
    running = ThreadedCluster(ClusterConfig(brokers=2)).start()
    yield running
    running.stop()


def topic_owned_by(cluster: ThreadedCluster, index: int, prefix: str) -> str:
    for n in range(200):
        topic = f"persistent://public/default/{prefix}-{n}"
        if cluster.cluster.owner(topic).index == index:
            return topic
    raise AssertionError("no topic name found")


def run_traffic(cluster: ThreadedCluster, exporter: InMemorySpanExporter, topics: list[str], rules: str = SLOW_RULES,
                **client_options: Any) -> tuple[list[ReadableSpan], TelemetryPipeline]:
    pipeline = build_telemetry(span_exporter=exporter, seed=3)
    config = ProxyConfig(upstream=ServiceUrl.parse(cluster.service_url), listen=HostPort("127.0.0.1", 0),
                         limits=LimitsConfig(drain_seconds=0.5))
    hook = RulesHook(RulesEngine(load_rules_text(rules)))
    proxy = ThreadedProxy(ProxyServer(config, hook=hook, observers=[pipeline.observer]), "telemetry-test-proxy")
    url = proxy.start().service_url
    try:
        client = pulsar.Client(url, operation_timeout_seconds=10, **client_options)
        try:
            for topic in topics:
                consumer = client.subscribe(topic, "telemetry-sub",
                                            initial_position=pulsar.InitialPosition.Earliest)
                producer = client.create_producer(topic, batching_enabled=False, send_timeout_millis=10_000)
                for i in range(MESSAGES):
                    producer.send(f"message-{i}".encode())
                for _ in range(MESSAGES):
                    consumer.acknowledge(consumer.receive(timeout_millis=10_000))
                producer.close()
                consumer.close()
        finally:
            client.close()
    finally:
        proxy.stop()
    assert pipeline.force_flush(10_000)
    return list(exporter.get_finished_spans()), pipeline


def test_official_client_session_yields_send_spans_lookup_links_and_delay_as_proxy_time(
        cluster: ThreadedCluster) -> None:
    exporter = InMemorySpanExporter()
    redirected = topic_owned_by(cluster, 1, "orders")   # the service URL is broker 0: lookups redirect
    slow = topic_owned_by(cluster, 0, "slow")
    spans, pipeline = run_traffic(cluster, exporter, [redirected, slow])
    try:
        for topic in (redirected, slow):
            sends = [s for s in spans if s.name == "SEND" and s.attributes["messaging.destination.name"] == topic]
            assert sorted(s.attributes["pulsar.sequence_id"] for s in sends) == list(range(MESSAGES))
            assert all(s.attributes["pulsar.outcome"] == "ok" for s in sends)
            assert all(s.attributes["pulsar.command"] == "SEND" for s in sends)

        lookups = [s for s in spans if s.name == "LOOKUP" and s.attributes["messaging.destination.name"] == redirected]
        redirects = [s for s in lookups if s.attributes["pulsar.lookup.response"] == "Redirect"]
        assert redirects, [s.attributes for s in lookups]
        followers = [s for s in lookups if s.links]
        assert followers
        assert {link.context.span_id for s in followers for link in s.links} <= \
            {s.context.span_id for s in redirects}
        assert all(s.attributes["pulsar.lookup.hop"] >= 2 for s in followers)

        slow_sends = [s for s in spans if s.name == "SEND" and s.attributes["messaging.destination.name"] == slow]
        for span in slow_sends:
            assert span.attributes["pulsar.rules"] == ("slow-receipts",)
            assert [e.name for e in span.events] == ["rule"]
            assert span.attributes["pulsar.proxy_time_ms"] >= 100.0
            assert span.end_time - span.start_time >= 100_000_000
        fast_sends = [s for s in spans if s.name == "SEND" and s.attributes["messaging.destination.name"] == redirected]
        assert all(s.attributes["pulsar.proxy_time_ms"] < 100.0 for s in fast_sends)

        connections = [s for s in spans if s.name == "pulsar.connection"]
        assert len(connections) >= 2
        assert all(s.attributes["pulsar.broker"].startswith("pulsar://127.0.0.1:") for s in connections)
        assert all(s.attributes["client.address"] == "127.0.0.1" for s in connections)
        connection_ids = {s.context.span_id for s in connections}
        assert all(s.parent is not None and s.parent.span_id in connection_ids for s in spans
                   if s.name in ("SEND", "LOOKUP", "PRODUCER", "SUBSCRIBE"))
        deliveries = [s for s in spans if s.name == "DELIVERY"]
        assert sum(s.attributes["messaging.batch.message_count"] for s in deliveries) == 2 * MESSAGES

        families = {f.name: f for f in text_string_to_metric_families(pipeline.prometheus_text())}
        histogram = families["pulsar_tap_request_duration_seconds"]
        send_count = sum(s.value for s in histogram.samples
                         if s.name.endswith("_count") and s.labels["command"] == "SEND")
        assert send_count == 2 * MESSAGES == len([s for s in spans if s.name == "SEND"])
        hits = families["pulsar_tap_rule_hits"]
        assert [s.value for s in hits.samples if s.labels.get("rule") == "slow-receipts"] == [MESSAGES]
    finally:
        pipeline.shutdown()


class _OtlpHandler(BaseHTTPRequestHandler):
    received: list[trace_service_pb2.ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/v1/traces":  # metrics arrive on /v1/metrics: accepted, not decoded
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            self.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


def test_tracing_config_sends_spans_of_a_proxied_session_to_an_otlp_collector(cluster: ThreadedCluster) -> None:
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []
    handler = type("Handler", (_OtlpHandler,), {"received": received})
    collector = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    collector_thread = threading.Thread(target=collector.serve_forever, daemon=True)
    collector_thread.start()
    try:
        port = collector.server_address[1]
        config = ProxyConfig(upstream=ServiceUrl.parse(cluster.service_url), listen=HostPort("127.0.0.1", 0),
                             limits=LimitsConfig(drain_seconds=0.5),
                             tracing=TracingConfig(exporter="otlp", endpoint=f"http://127.0.0.1:{port}"))
        proxy = ThreadedStack(config, name="telemetry-test-proxy")
        url = proxy.start().service_url
        assert proxy.stack is not None and proxy.stack.telemetry is not None
        assert proxy.stack.telemetry.metrics is not None
        try:
            client = pulsar.Client(url, operation_timeout_seconds=10)
            try:
                producer = client.create_producer("persistent://public/default/traced", batching_enabled=False)
                for i in range(5):
                    producer.send(f"m{i}".encode())
            finally:
                client.close()
        finally:
            proxy.stop()  # shuts telemetry down: the last spans are flushed
    finally:
        collector.shutdown()
        collector.server_close()
    spans = [span for request in received for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    sends = [span for span in spans if span.name == "SEND"]
    assert len(sends) == 5
    assert any(span.name == "pulsar.connection" for span in spans)


def test_telemetry_is_built_only_when_wanted() -> None:
    upstream = ServiceUrl.parse("pulsar://127.0.0.1:6650")
    assert telemetry_for_proxy(ProxyConfig(upstream=upstream)) is None
    metrics_only = telemetry_for_proxy(ProxyConfig(upstream=upstream,
                                                   admin=AdminConfig(HostPort("127.0.0.1", 0))))
    assert metrics_only is not None
    assert metrics_only.metrics is not None and metrics_only.tracer_provider is None
    assert "pulsar_tap_rule_hits" not in metrics_only.admin_metrics()
    metrics_only.shutdown()
    console = telemetry_for_proxy(ProxyConfig(upstream=upstream, tracing=TracingConfig(exporter="console")))
    assert console is not None and console.tracer_provider is not None and console.metrics is None
    console.shutdown()


def test_thousands_of_pipelined_sends_through_a_proxy_with_telemetry_all_arrive(cluster: ThreadedCluster) -> None:
    """With an observer attached every frame is a piece of its own: writes must respect IOV_MAX."""
    count = 3000
    pipeline = build_telemetry(span_exporter=InMemorySpanExporter(), seed=1)
    config = ProxyConfig(upstream=ServiceUrl.parse(cluster.service_url), listen=HostPort("127.0.0.1", 0),
                         limits=LimitsConfig(drain_seconds=0.5))
    server = ProxyServer(config, observers=[pipeline.observer])
    proxy = ThreadedProxy(server, "telemetry-test-proxy")
    url = proxy.start().service_url
    failures: list[object] = []
    try:
        client = pulsar.Client(url, operation_timeout_seconds=10)
        try:
            producer = client.create_producer("persistent://public/default/pipelined", batching_enabled=False,
                                              max_pending_messages=count, send_timeout_millis=10_000)
            for i in range(count):
                producer.send_async(b"%06d" % i, lambda result, _id: failures.append(result)
                                    if result != pulsar.Result.Ok else None)
            producer.flush()
        finally:
            client.close()
    finally:
        proxy.stop()
    assert not failures, failures[:3]
    families = {f.name: f for f in text_string_to_metric_families(pipeline.prometheus_text())}
    sends = sum(s.value for s in families["pulsar_tap_request_duration_seconds"].samples
                if s.name.endswith("_count") and s.labels["command"] == "SEND")
    assert sends == count
    assert server.observers.dropped == 0
    pipeline.shutdown()


def test_the_mark_actions_label_tags_the_span_with_the_demo_rules(cluster: ThreadedCluster) -> None:
    """rules/demo.yaml marks lookups ``label: demo-lookup``: every LOOKUP span carries the label."""
    exporter = InMemorySpanExporter()
    demo = (Path(__file__).resolve().parents[2] / "rules" / "demo.yaml").read_text(encoding="utf-8")
    topic = topic_owned_by(cluster, 1, "marked")
    spans, pipeline = run_traffic(cluster, exporter, [topic], rules=demo)
    try:
        lookups = [s for s in spans if s.name == "LOOKUP"]
        assert lookups and all(s.attributes["pulsar.marks"] == ("demo-lookup",) for s in lookups)
        assert all("mark-lookups" in s.attributes["pulsar.rules"] for s in lookups)
        assert not any("pulsar.marks" in s.attributes for s in spans if s.name == "SEND")
    finally:
        pipeline.shutdown()
