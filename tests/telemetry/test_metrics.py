"""/metrics text: valid Prometheus exposition (checked with prometheus_client's parser) with the right numbers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from proxy.pb import PulsarApi_pb2 as api
from proxy.telemetry import TelemetryPipeline, build_telemetry
from proxy.telemetry.metrics import LANE_TOPICS, ProxyMetrics, TopicLabelPolicy

from .scripted import BASE_NS, MS, TO_BROKER, TO_CLIENT, TOPIC, connect, create_producer, frame, message, produce, send


@pytest.fixture
def pipeline() -> Iterator[TelemetryPipeline]:
    built = build_telemetry()
    yield built
    built.shutdown()


def samples(text: str) -> dict[str, list[Sample]]:
    """Every family of the exposition, by name, as parsed by prometheus_client."""
    families = {family.name: family for family in text_string_to_metric_families(text)}
    return {name: list(family.samples) for name, family in families.items()}


def value(found: dict[str, list[Sample]], family: str, sample: str, **labels: str) -> float:
    matching = [s.value for s in found[family]
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(matching)


def test_send_latency_histogram_count_equals_the_sends_fed(pipeline: TelemetryPipeline) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    produce(telemetry, 1, ts, 37)
    text = pipeline.prometheus_text()
    found = samples(text)
    histogram = "pulsar_tap_request_duration_seconds"
    assert f"# TYPE {histogram} histogram" in text
    assert value(found, histogram, f"{histogram}_count", command="SEND") == 37
    assert value(found, histogram, f"{histogram}_sum", command="SEND") == pytest.approx(37 * 0.001)
    assert value(found, histogram, f"{histogram}_bucket", command="SEND", le="0.001") == 37
    assert value(found, histogram, f"{histogram}_bucket", command="SEND", le="0.0005") == 0
    assert value(found, histogram, f"{histogram}_bucket", command="SEND", le="+Inf") == 37
    assert value(found, histogram, f"{histogram}_count", command="SEND", topic=TOPIC, outcome="ok") == 37
    assert value(found, histogram, f"{histogram}_count", command="PRODUCER") == 1
    assert value(found, histogram, f"{histogram}_count", command="CONNECT") == 1
    assert value(found, "pulsar_tap_frames", "pulsar_tap_frames_total", command="SEND", direction="to_broker") == 37
    assert value(found, "pulsar_tap_frames", "pulsar_tap_frames_total", command="SEND_RECEIPT") == 37
    assert value(found, "pulsar_tap_bytes", "pulsar_tap_bytes_total", command="SEND") > 37 * 20
    assert value(found, "pulsar_tap_messages", "pulsar_tap_messages_total", command="SEND", topic=TOPIC) == 37
    assert value(found, "pulsar_tap_active_connections", "pulsar_tap_active_connections") == 1
    assert value(found, "pulsar_tap_producers", "pulsar_tap_producers") == 1


def test_gauges_follow_connections_consumers_and_permits(pipeline: TelemetryPipeline) -> None:
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = connect(telemetry, 2, ts)
    telemetry.frame(2, TO_BROKER, frame(api.CommandSubscribe(
        topic=TOPIC, subscription="s", subType=api.CommandSubscribe.Exclusive, consumer_id=1, request_id=1)), ts)
    telemetry.frame(2, TO_CLIENT, frame(api.CommandSuccess(request_id=1)), ts + MS)
    telemetry.frame(2, TO_BROKER, frame(api.CommandFlow(consumer_id=1, messagePermits=1000)), ts + MS)
    for entry in range(10):
        telemetry.frame(2, TO_CLIENT, message(1, entry), ts + 2 * MS)
    found = samples(pipeline.prometheus_text())
    assert value(found, "pulsar_tap_active_connections", "pulsar_tap_active_connections") == 2
    assert value(found, "pulsar_tap_consumers", "pulsar_tap_consumers") == 1
    assert value(found, "pulsar_tap_outstanding_permits", "pulsar_tap_outstanding_permits") == 990
    telemetry.connection_closed(2, ts + 3 * MS)
    found = samples(pipeline.prometheus_text())
    assert value(found, "pulsar_tap_active_connections", "pulsar_tap_active_connections") == 1
    assert value(found, "pulsar_tap_consumers", "pulsar_tap_consumers") == 0
    assert value(found, "pulsar_tap_outstanding_permits", "pulsar_tap_outstanding_permits") == 0


def test_rule_hits_and_dropped_events_are_exposed(pipeline: TelemetryPipeline) -> None:
    assert pipeline.metrics is not None
    dropped = [0]
    pipeline.metrics.add_drop_source("recorder", lambda: dropped[0])
    telemetry = pipeline.telemetry
    ts = connect(telemetry, 1, BASE_NS)
    ts = create_producer(telemetry, 1, ts)
    for sequence_id in range(3):
        telemetry.frame(1, TO_BROKER, send(1, sequence_id), ts, fired=("slow-receipts", 'odd "name"\\'))
    dropped[0] = 12
    text = pipeline.prometheus_text()
    assert 'pulsar_tap_rule_hits_total{rule="slow-receipts"} 3' in text
    found = samples(text)
    assert value(found, "pulsar_tap_rule_hits", "pulsar_tap_rule_hits_total", rule='odd "name"\\') == 3
    assert value(found, "pulsar_tap_dropped_events", "pulsar_tap_dropped_events_total", source="recorder") == 12


def test_topic_labels_are_bounded_by_the_policy() -> None:
    pipeline = build_telemetry(topic_policy=TopicLabelPolicy(max_topics=2))
    try:
        telemetry = pipeline.telemetry
        ts = connect(telemetry, 1, BASE_NS)
        for index in range(5):
            ts = create_producer(telemetry, 1, ts, producer_id=index, request_id=100 + index,
                                 topic=f"{TOPIC}-{index}")
            ts = produce(telemetry, 1, ts, 2, producer_id=index)
        found = samples(pipeline.prometheus_text())
        topics = {s.labels["topic"] for s in found["pulsar_tap_request_duration_seconds"]
                  if s.labels.get("command") == "SEND"}
        assert topics == {f"{TOPIC}-0", f"{TOPIC}-1", "other"}
        assert value(found, "pulsar_tap_request_duration_seconds", "pulsar_tap_request_duration_seconds_count",
                     command="SEND", topic="other") == 6
    finally:
        pipeline.shutdown()

    no_topics = build_telemetry(topic_policy=TopicLabelPolicy(max_topics=0))
    try:
        ts = connect(no_topics.telemetry, 1, BASE_NS)
        ts = create_producer(no_topics.telemetry, 1, ts)
        produce(no_topics.telemetry, 1, ts, 1)
        assert "topic=" not in no_topics.prometheus_text()
    finally:
        no_topics.shutdown()


def test_exposition_before_any_traffic_parses() -> None:
    pipeline = build_telemetry()
    try:
        assert list(text_string_to_metric_families(pipeline.prometheus_text())) is not None
    finally:
        pipeline.shutdown()


@pytest.mark.parametrize("max_topics", [0, 3, 100])
def test_the_lanes_count_a_send_and_its_receipt_as_the_general_calls_do(max_topics: int) -> None:
    """send_passed / receipt_passed keep their own ways to the counters and the histogram's keys, a topic at a
    time: the same exposition as frame / message_count / request, past the label policy's limit and past the
    topics the lanes remember (their memory starts over), with and without a topic, a receipt without its SEND
    and a negative wait (clocks of two threads) counted as 0."""
    lanes = ProxyMetrics(topic_policy=TopicLabelPolicy(max_topics=max_topics))
    general = ProxyMetrics(topic_policy=TopicLabelPolicy(max_topics=max_topics))
    topics = [None, "", *(f"persistent://public/default/t-{i % 5000}" for i in range(LANE_TOPICS + 6000))]
    for i, topic in enumerate(topics):
        size, messages = 100 + i % 7, i % 3
        lanes.send_passed(topic, size, messages)
        general.frame("SEND", "to_broker", "client", size)
        if messages:
            general.message_count("SEND", topic, messages)
        waited = None if i % 4 == 0 else (i * 7919) % 3_000_000 - 1000
        lanes.receipt_passed(topic, 40 + i % 5, waited)
        general.frame("SEND_RECEIPT", "to_client", "broker", 40 + i % 5)
        if waited is not None:
            general.request("SEND", topic, "ok", (waited if waited > 0 else 0) / 1e9)
    text = lanes.prometheus_text()
    assert text == general.prometheus_text()
    found = samples(text)
    assert value(found, "pulsar_tap_frames", "pulsar_tap_frames_total", command="SEND") == len(topics)
    requests = value(found, "pulsar_tap_request_duration_seconds", "pulsar_tap_request_duration_seconds_count")
    assert requests == sum(1 for i in range(len(topics)) if i % 4)
    assert ('topic="other"' in text) == (0 < max_topics < 5000)
    lanes.shutdown()
    general.shutdown()
