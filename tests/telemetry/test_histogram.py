"""The pre-aggregated latency histogram exports what OpenTelemetry's own Histogram would.

The same measurements go to an SDK ``Histogram`` (the reference, with the view pulsar-tap
used before) and to :class:`PreAggregatedHistogram`, each on its own MeterProvider, with
collections in between; the clock is frozen at the same instants for both.  Every
collection must give the same points — attributes, start and collection times, count,
sum (bit for bit), buckets, min, max, temporality, the overflow set past the cardinality
limit — as OTLP encodes them and as /metrics renders them, for cumulative and delta readers.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal import _view_instrument_match, metric_reader_storage
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader, MetricsData
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from proxy.telemetry import histogram as histogram_module
from proxy.telemetry import prometheus
from proxy.telemetry.histogram import FoldingInMemoryReader, PreAggregatedHistogram
from proxy.telemetry.metrics import LATENCY_BUCKETS_S, REQUEST_DURATION, ProxyMetrics

RESOURCE = Resource.create({"service.name": "pulsar-tap"})


class FrozenClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000_000_000

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FrozenClock:
    frozen = FrozenClock()
    for module in (_view_instrument_match, metric_reader_storage, histogram_module):
        monkeypatch.setattr(module, "time_ns", frozen)
    return frozen


def _gauge(options: CallbackOptions) -> Iterable[Observation]:
    del options
    return [Observation(1)]


def _reader_settings(temporality: AggregationTemporality, limit: int | None) -> dict[str, Any]:
    settings: dict[str, Any] = {"preferred_temporality": {HistogramInstrument: temporality}}
    if limit is not None:
        settings["cardinality_limits"] = {HistogramInstrument: limit}
    return settings


class Reference:
    """The SDK's own histogram, as ProxyMetrics configured it before."""

    def __init__(self, temporality: AggregationTemporality, limit: int | None) -> None:
        self.reader = InMemoryMetricReader(**_reader_settings(temporality, limit))
        provider = MeterProvider(metric_readers=[self.reader], resource=RESOURCE, views=[View(
            instrument_name=REQUEST_DURATION, aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS_S))])
        meter = provider.get_meter("pulsar-tap")
        self.instrument = meter.create_histogram(REQUEST_DURATION, unit="s", description="latency")
        meter.create_observable_gauge("pulsar_tap_producers", callbacks=[_gauge])

    def record(self, key: tuple[str, str, str], value: float) -> None:
        self.instrument.record(value, {"command": key[0], "outcome": key[1], "topic": key[2]})

    def collect(self) -> MetricsData | None:
        return self.reader.get_metrics_data()


class Ours:
    def __init__(self, temporality: AggregationTemporality, limit: int | None) -> None:
        self.reader = FoldingInMemoryReader(**_reader_settings(temporality, limit))
        provider = MeterProvider(metric_readers=[self.reader], resource=RESOURCE)
        meter = provider.get_meter("pulsar-tap")
        self.histogram = PreAggregatedHistogram(
            meter.create_histogram(REQUEST_DURATION, unit="s", description="latency"), LATENCY_BUCKETS_S)
        self.reader.fold_in(self.histogram)
        meter.create_observable_gauge("pulsar_tap_producers", callbacks=[_gauge])

    def record(self, key: tuple[str, str, str], value: float) -> None:
        self.histogram.record(key, lambda: {"command": key[0], "outcome": key[1], "topic": key[2]}, value)

    def collect(self) -> MetricsData | None:
        return self.reader.get_metrics_data()


def _otlp(data: MetricsData | None) -> list[tuple[str, list[str]]]:
    """Every metric's points as OTLP encodes them (timestamps included), in a stable order."""
    if data is None:
        return []
    out = []
    for resource_metrics in encode_metrics(data).resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                body = getattr(metric, kind)
                temporality = getattr(body, "aggregation_temporality", None)
                points = sorted(str(point) for point in body.data_points)
                out.append((f"{scope_metrics.scope.name} {metric.name} {metric.unit} {kind} {temporality}", points))
    return sorted(out)


def _values(rng: random.Random) -> float:
    return rng.choice((0.0, 0.0001, 0.00025, 30.0, 31.5, rng.random() * 0.01, rng.expovariate(200),
                       rng.random() * 40))


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
@pytest.mark.parametrize("limit", [None, 5])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_collections_match_the_sdk_histogram_point_for_point(clock: FrozenClock, temporality: AggregationTemporality,
                                                              limit: int | None, seed: int) -> None:
    rng = random.Random(seed)
    reference, ours = Reference(temporality, limit), Ours(temporality, limit)
    keys = [(command, outcome, f"persistent://public/default/t{topic}") for command in ("SEND", "LOOKUP")
            for outcome in ("ok", "error", "unanswered") for topic in range(3)]
    compared, texts = 0, []
    for step in range(1500):
        clock.now += rng.choice((1, 1000, 2_000_000))
        if rng.random() < 0.02:
            got, expected = ours.collect(), reference.collect()
            assert _otlp(got) == _otlp(expected)
            assert prometheus.render(got) == prometheus.render(expected)
            texts.append(prometheus.render(got))
            compared += 1
            if rng.random() < 0.3:  # some attribute sets go quiet for a while
                keys = keys[rng.randint(0, 5):] or keys
            continue
        key = rng.choice(keys) if step > 3 else keys[step]
        value = _values(rng)
        reference.record(key, value)
        ours.record(key, value)
    clock.now += 1
    got, expected = ours.collect(), reference.collect()
    assert _otlp(got) == _otlp(expected)
    assert prometheus.render(got) == prometheus.render(expected)
    assert compared > 10
    if limit is not None:
        assert any("otel_metric_overflow" in text for text in texts)


def test_an_empty_histogram_is_left_out_as_the_sdk_leaves_it_out(clock: FrozenClock) -> None:
    reference, ours = Reference(AggregationTemporality.CUMULATIVE, None), Ours(AggregationTemporality.CUMULATIVE,
                                                                               None)
    assert _otlp(ours.collect()) == _otlp(reference.collect())
    assert REQUEST_DURATION not in prometheus.render(ours.collect())


def test_proxy_metrics_refuses_a_reader_that_would_leave_the_histogram_out() -> None:
    with pytest.raises(TypeError, match="does not fold in the latency histogram"):
        ProxyMetrics(extra_readers=[InMemoryMetricReader()])


@pytest.mark.parametrize("seed", [1, 2])
def test_requests_in_groups_count_as_each_request_alone(clock: FrozenClock, seed: int) -> None:
    """``ProxyMetrics.requests`` (a run's receipts of one topic at once, in one pass over them) records what
    ``request`` of each value in turn records: the same text, sums bit for bit."""
    rng = random.Random(seed)
    one_by_one, grouped = ProxyMetrics(), ProxyMetrics()
    for _ in range(400):
        topic = rng.choice(("persistent://public/default/a", "persistent://public/default/b", None))
        values = [_values(rng) for _ in range(rng.choice((1, 1, 1, 2, 7)))]
        for value in values:
            one_by_one.request("SEND", topic, "ok", value)
        grouped.requests("SEND", topic, "ok", values)
    text = grouped.prometheus_text()
    assert text == one_by_one.prometheus_text()
    assert 'seconds_count{command="SEND",outcome="ok",topic="persistent://public/default/a"}' in text
    one_by_one.shutdown()
    grouped.shutdown()
