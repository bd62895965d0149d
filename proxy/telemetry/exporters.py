"""Where spans and metrics go: none, the console, or an OTLP collector (HTTP or gRPC).

This is telemetry's only I/O, and it happens on the OpenTelemetry SDK's own worker
threads, never on the relay's path.  Spans go through a
:class:`~opentelemetry.sdk.trace.export.BatchSpanProcessor` whose queue is bounded
(:data:`SPAN_QUEUE_SIZE`; overflow policy: :class:`BoundedSpanProcessor` drops the
newest span and counts it, /metrics' ``pulsar_tap_dropped_events_total{source="spans"}``),
so a slow or absent collector — or spans at 100 % on a saturated proxy, more than
the exporter's thread encodes — costs memory up to that bound and nothing else.  An
unreachable collector is logged once (and its recovery once),
not per batch: :class:`ReportingSpanExporter` wraps the exporter, and the SDK
exporters' own per-batch log lines are silenced.

Settings follow SPEC.md's ``tracing:`` section: ``exporter`` none | console | otlp,
``endpoint`` the collector's base URL (``/v1/traces`` and ``/v1/metrics`` are
appended for HTTP, as OTEL_EXPORTER_OTLP_ENDPOINT does; gRPC takes it as is),
``protocol`` http | grpc, ``sample`` the ratio of request spans recorded.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Final

import structlog
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

from proxy.errors import ConfigError
from proxy.telemetry.histogram import FoldsHistograms

EXPORTERS: Final = ("none", "console", "otlp")
PROTOCOLS: Final = ("http", "grpc")
DEFAULT_HTTP_ENDPOINT: Final = "http://127.0.0.1:4318"
DEFAULT_GRPC_ENDPOINT: Final = "http://127.0.0.1:4317"
#: Spans waiting for the exporter thread; beyond it the SDK drops spans (bounded memory).
SPAN_QUEUE_SIZE: Final = 8192
SPAN_BATCH_SIZE: Final = 512
#: Seconds one export may take (the SDK retries within it) before the batch is given up.
EXPORT_TIMEOUT_S: Final = 5.0
METRIC_EXPORT_INTERVAL_MS: Final = 10_000

log = structlog.get_logger("pulsar_tap.telemetry")


@dataclass(frozen=True)
class ExportSettings:
    """The ``tracing:`` section, plus the knobs tests and benchmarks turn."""

    exporter: str = "none"
    endpoint: str | None = None
    protocol: str = "http"
    sample: float = 1.0
    timeout_s: float = EXPORT_TIMEOUT_S
    schedule_delay_ms: int = 1000
    metric_interval_ms: int = METRIC_EXPORT_INTERVAL_MS
    #: Send metrics to the OTLP collector too (they are always on /metrics).
    otlp_metrics: bool = True

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ConfigError(f"unknown exporter {self.exporter!r}; expected one of {', '.join(EXPORTERS)}",
                              key="tracing.exporter")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {self.protocol!r}; expected http or grpc", key="tracing.protocol")
        if not 0.0 <= self.sample <= 1.0:
            raise ConfigError(f"sample {self.sample} is not between 0 and 1", key="tracing.sample")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"{self.endpoint!r} is not an http:// or https:// URL", key="tracing.endpoint")

    @property
    def tracing(self) -> bool:
        return self.exporter != "none"

    def base_endpoint(self) -> str:
        if self.endpoint:
            return self.endpoint.rstrip("/")
        return DEFAULT_GRPC_ENDPOINT if self.protocol == "grpc" else DEFAULT_HTTP_ENDPOINT

    def signal_endpoint(self, signal: str) -> str:
        """The URL the exporter of ``signal`` (traces, metrics) posts to."""
        if self.protocol == "grpc":
            return self.base_endpoint()
        return f"{self.base_endpoint()}/v1/{signal}"


_SDK_EXPORTER_LOGGERS: Final = ("opentelemetry.exporter",)


def _silence_sdk_exporter_logs() -> None:
    # The SDK exporters log every failed batch; ReportingSpanExporter reports once instead.
    for name in _SDK_EXPORTER_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


class ReportingSpanExporter(SpanExporter):
    """Wraps an exporter: failures are logged once per outage, never raised into the SDK."""

    def __init__(self, inner: SpanExporter, target: str) -> None:
        self.inner = inner
        self.target = target
        self._lock = threading.Lock()
        self.failing = False
        self.failures = 0
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
            reason = None if result is SpanExportResult.SUCCESS else "export failed"
        except Exception as exc:  # an exporter bug or a transport error: report, never propagate
            result, reason = SpanExportResult.FAILURE, repr(exc)
        with self._lock:
            if result is SpanExportResult.SUCCESS:
                self.exported += len(spans)
                if self.failing:
                    self.failing = False
                    log.info("trace collector reachable again", collector=self.target)
            else:
                self.failures += 1
                if not self.failing:
                    self.failing = True
                    log.warning("trace collector unreachable; spans are dropped until it answers",
                                collector=self.target, reason=reason)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Taken(SpanExporter):
    """Counts the spans the batch processor took off its queue (every batch it takes goes to ``export``)."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.taken = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.taken += len(spans)
        return self.inner.export(spans)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class BoundedSpanProcessor(BatchSpanProcessor):
    """A batch processor that drops the newest span when its queue is full, and counts it.

    The SDK's own overflow (it pushes the oldest span out) logs a warning and counts
    the drop only in its self-metrics, which are off; here a span that finds the
    queue full is not queued at all (the cheapest thing to do with it) and counts in
    ``dropped``.  The queue's length is what was queued less what the worker thread
    took to export (both counted here: no reach into the SDK's queue).
    """

    def __init__(self, exporter: SpanExporter, *, max_queue_size: int = SPAN_QUEUE_SIZE,
                 max_export_batch_size: int = SPAN_BATCH_SIZE, schedule_delay_millis: float = 1000,
                 export_timeout_millis: float = EXPORT_TIMEOUT_S * 1000) -> None:
        self._taken = _Taken(exporter)
        super().__init__(self._taken, max_queue_size=max_queue_size, max_export_batch_size=max_export_batch_size,
                         schedule_delay_millis=schedule_delay_millis, export_timeout_millis=export_timeout_millis)
        self.max_queue_size = max_queue_size
        self.queued = 0
        self.dropped = 0

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return  # (the SDK's processor queues no unsampled span either)
        if self.queued - self._taken.taken >= self.max_queue_size:
            self.dropped += 1
            return
        self.queued += 1
        super().on_end(span)


def span_exporter(settings: ExportSettings, console: IO[str] | None = None) -> SpanExporter | None:
    """The exporter ``settings`` ask for (None for ``none``)."""
    if settings.exporter == "none":
        return None
    if settings.exporter == "console":
        return ConsoleSpanExporter(out=console or sys.stderr)
    _silence_sdk_exporter_logs()
    endpoint = settings.signal_endpoint("traces")
    inner: SpanExporter
    if settings.protocol == "http":
        from proxy.telemetry.otlp_spans import HttpSpanExporter
        inner = HttpSpanExporter(endpoint=endpoint, timeout=settings.timeout_s)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
        inner = GrpcSpanExporter(endpoint=_grpc_target(endpoint), insecure=endpoint.startswith("http://"),
                                 timeout=settings.timeout_s)
    return ReportingSpanExporter(inner, endpoint)


def _metric_exporter(settings: ExportSettings) -> MetricExporter:
    endpoint = settings.signal_endpoint("metrics")
    if settings.protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
        return HttpMetricExporter(endpoint=endpoint, timeout=settings.timeout_s)
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
    return GrpcMetricExporter(endpoint=_grpc_target(endpoint), insecure=endpoint.startswith("http://"),
                              timeout=settings.timeout_s)


def _grpc_target(endpoint: str) -> str:
    return endpoint.split("://", 1)[-1].rstrip("/")


class FoldingPeriodicReader(FoldsHistograms, PeriodicExportingMetricReader):
    """The periodic OTLP export, the pre-aggregated latency histogram included."""


def metric_readers(settings: ExportSettings) -> list[MetricReader]:
    """Readers beyond /metrics' in-process one: a periodic OTLP export when ``exporter: otlp``."""
    if settings.exporter != "otlp" or not settings.otlp_metrics:
        return []
    _silence_sdk_exporter_logs()
    return [FoldingPeriodicReader(_metric_exporter(settings), export_interval_millis=settings.metric_interval_ms,
                                  export_timeout_millis=settings.timeout_s * 1000)]


def tracer_provider(settings: ExportSettings, resource: Resource, *, exporter: SpanExporter | None = None,
                    console: IO[str] | None = None) -> tuple[TracerProvider, BoundedSpanProcessor | None]:
    """A provider whose spans go to ``exporter`` (default: the one ``settings`` name) in bounded batches.

    Sampling decisions are the SpanWriter's; the provider only honours a remote
    parent's sampled flag (a SEND joining a W3C trace).  Returned with its span
    processor (None without an exporter), whose ``dropped`` counts the spans a full queue refused.
    """
    provider = TracerProvider(resource=resource, sampler=ParentBased(ALWAYS_ON))
    target = exporter if exporter is not None else span_exporter(settings, console)
    processor = None
    if target is not None:
        processor = BoundedSpanProcessor(
            target, max_queue_size=SPAN_QUEUE_SIZE, max_export_batch_size=SPAN_BATCH_SIZE,
            schedule_delay_millis=settings.schedule_delay_ms,
            export_timeout_millis=int(settings.timeout_s * 1000))
        provider.add_span_processor(processor)
    return provider, processor
