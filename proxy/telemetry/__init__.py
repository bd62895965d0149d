"""Telemetry: OpenTelemetry spans and metrics from the traffic the proxy observes, and logs.

The core is sans-IO (:mod:`~proxy.telemetry.tracker` pairs and times requests,
:mod:`~proxy.telemetry.tracer` writes spans with explicit timestamps,
:mod:`~proxy.telemetry.metrics` counts); the only I/O is the exporters'
(:mod:`~proxy.telemetry.exporters`), on the SDK's worker threads.
:func:`build_telemetry` assembles it all from the ``tracing:`` settings;
:class:`TelemetryPipeline.observer` plugs into the proxy's observer hook and
:meth:`TelemetryPipeline.prometheus_text` is the admin API's /metrics body.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path as _Path
from typing import IO, TYPE_CHECKING

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from proxy import compiled as _compiled

#: Modules scripts/setup.sh compiles with mypyc (proxy.compiled): the bulk path's walk of each SEND's and receipt's
#: command, and the latency histogram's recording.
COMPILED_MODULES = ("bulk_forms", "histogram_cells")
# (before the package's modules are imported: the observer imports bulk_forms)
_compiled.guard(__name__, _Path(__file__).parent, COMPILED_MODULES, _compiled.TELEMETRY_LANE)

from proxy.telemetry.exporters import ExportSettings, metric_readers, tracer_provider  # noqa: E402
from proxy.telemetry.metrics import ProxyMetrics, TopicLabelPolicy  # noqa: E402
from proxy.telemetry.observer import Telemetry, TelemetryObserver  # noqa: E402
from proxy.telemetry.tracer import SpanWriter  # noqa: E402

if TYPE_CHECKING:
    from proxy.config.proxy_config import ProxyConfig

__all__ = ["ExportSettings", "Telemetry", "TelemetryObserver", "TelemetryPipeline", "build_telemetry",
           "telemetry_for_proxy"]

#: Families the admin API renders itself from the rules engine (its counts are authoritative).
ADMIN_OWNED_FAMILIES = ("pulsar_tap_rule_hits",)


@dataclass
class TelemetryPipeline:
    """The assembled telemetry of one proxy process."""

    telemetry: Telemetry
    observer: TelemetryObserver
    tracer_provider: TracerProvider | None
    metrics: ProxyMetrics | None

    def prometheus_text(self, exclude: Iterable[str] = ()) -> str:
        return self.metrics.prometheus_text(exclude) if self.metrics is not None else ""

    def admin_metrics(self) -> str:
        """The admin API's ``metrics`` provider: everything but what it renders itself."""
        return self.prometheus_text(exclude=ADMIN_OWNED_FAMILIES)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Blocking: push buffered spans and metrics out (call from a worker thread in async code)."""
        ok = True
        if self.tracer_provider is not None:
            ok = self.tracer_provider.force_flush(timeout_millis) and ok
        if self.metrics is not None:
            ok = self.metrics.provider.force_flush(timeout_millis) and ok
        return ok

    def shutdown(self, ts_ns: int | None = None) -> None:
        """Blocking: end open spans, flush and stop the exporters."""
        if ts_ns is not None:
            self.telemetry.close(ts_ns)
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.metrics is not None:
            self.metrics.shutdown()


def build_telemetry(settings: ExportSettings | None = None, *, metrics: bool = True,
                    span_exporter: SpanExporter | None = None, topic_policy: TopicLabelPolicy | None = None,
                    seed: int | None = None, console: IO[str] | None = None) -> TelemetryPipeline:
    """Telemetry per ``settings``; ``span_exporter`` overrides the configured one (tests: in-memory)."""
    settings = settings or ExportSettings()
    resource = Resource.create({"service.name": "pulsar-tap"})
    provider: TracerProvider | None = None
    spans: SpanWriter | None = None
    processor = None
    if settings.tracing or span_exporter is not None:
        provider, processor = tracer_provider(settings, resource, exporter=span_exporter, console=console)
        spans = SpanWriter(provider.get_tracer("pulsar-tap"), sample=settings.sample,
                           rng=random.Random(seed))
    proxy_metrics = None
    if metrics:
        proxy_metrics = ProxyMetrics(topic_policy=topic_policy, extra_readers=metric_readers(settings),
                                     resource=resource)
        if processor is not None:
            # (bound to a variable: mypy cannot carry the narrowing into the lambda)
            span_processor = processor
            proxy_metrics.add_drop_source("spans", lambda: span_processor.dropped)
    telemetry = Telemetry(spans, proxy_metrics)
    return TelemetryPipeline(telemetry, TelemetryObserver(telemetry), provider, proxy_metrics)


def telemetry_for_proxy(config: ProxyConfig, *, seed: int | None = None) -> TelemetryPipeline | None:
    """Telemetry for ``pulsar-tap run``: spans per ``tracing:``, metrics when /metrics is served.

    None when neither is wanted (then the relay needs no observer at all).
    """
    tracing = config.tracing
    settings = ExportSettings(exporter=tracing.exporter, endpoint=tracing.endpoint, protocol=tracing.protocol,
                              sample=tracing.sample)
    want_metrics = config.admin is not None or settings.exporter == "otlp"
    if not settings.tracing and not want_metrics:
        return None
    return build_telemetry(settings, metrics=want_metrics, seed=seed)
