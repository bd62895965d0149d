"""Prometheus text exposition (format 0.0.4) of what an OpenTelemetry MetricReader collected.

The admin API's ``GET /metrics`` serves :func:`render` of an in-process reader's
:class:`~opentelemetry.sdk.metrics.export.MetricsData`; no Prometheus library is
needed at run time.  Mapping (as the OpenTelemetry/Prometheus compatibility
specification does it): a monotonic cumulative sum is a ``counter`` whose samples
end in ``_total``; a non-monotonic sum and a gauge are a ``gauge``; an explicit-bucket
histogram is a ``histogram`` with cumulative ``_bucket{le=...}`` samples, ``_sum``
and ``_count``.  Instrument names are already Prometheus names (``pulsar_tap_...``);
characters Prometheus does not allow become ``_``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Final

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    Sum,
)
from opentelemetry.util.types import AttributeValue

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_BAD_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_:]")
_BAD_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(name: str) -> str:
    cleaned = _BAD_NAME_CHARS.sub("_", name)
    return f"_{cleaned}" if cleaned[:1].isdigit() else cleaned


def _label_name(name: str) -> str:
    cleaned = _BAD_LABEL_CHARS.sub("_", name)
    return f"_{cleaned}" if cleaned[:1].isdigit() else cleaned


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value)) if abs(value) < 1e15 else repr(float(value))
    return repr(float(value))


def _labels(attributes: Mapping[str, AttributeValue] | None, extra: tuple[str, str] | None = None) -> str:
    pairs = [(_label_name(k), str(v)) for k, v in sorted((attributes or {}).items())]
    if extra is not None:
        pairs.append(extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in pairs) + "}"


def _render_metric(metric: Metric, out: list[str]) -> None:
    name = metric_name(metric.name)
    data = metric.data
    help_text = _escape_help(metric.description or metric.name)
    if isinstance(data, Sum) and data.is_monotonic:
        if not name.endswith("_total"):
            name += "_total"
        kind = "counter"
    elif isinstance(data, Sum | Gauge):
        kind = "gauge"
    elif isinstance(data, Histogram):
        kind = "histogram"
    else:  # exponential histograms are not configured by pulsar-tap
        return
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    for point in data.data_points:
        if isinstance(point, NumberDataPoint):
            out.append(f"{name}{_labels(point.attributes)} {_number(point.value)}")
        elif isinstance(point, HistogramDataPoint):
            cumulative = 0
            for bound, count in zip(point.explicit_bounds, point.bucket_counts, strict=False):
                cumulative += count
                out.append(f"{name}_bucket{_labels(point.attributes, ('le', _number(float(bound))))} {cumulative}")
            out.append(f"{name}_bucket{_labels(point.attributes, ('le', '+Inf'))} {point.count}")
            out.append(f"{name}_sum{_labels(point.attributes)} {_number(point.sum)}")
            out.append(f"{name}_count{_labels(point.attributes)} {point.count}")


def render(data: MetricsData | None, exclude: Iterable[str] = ()) -> str:
    """The exposition text of everything in ``data`` but the instruments named in ``exclude``."""
    out: list[str] = []
    skipped = frozenset(exclude)
    if data is not None:
        for metric in _metrics(data):
            if metric.name not in skipped:
                _render_metric(metric, out)
    return "\n".join(out) + "\n" if out else ""


def _metrics(data: MetricsData) -> Iterable[Metric]:
    seen: set[str] = set()
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                # one family per name: a second scope re-registering a name would break the text format
                if metric.name not in seen:
                    seen.add(metric.name)
                    yield metric
