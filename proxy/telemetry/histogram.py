"""The request-duration histogram, aggregated here and added to what each metric reader collects.

OpenTelemetry's ``Histogram.record`` costs several microseconds a call (a Measurement,
the current context, cleaning and hashing the attributes, an exemplar offer, for every
reader), as much as the rest of telemetry's work on a request.  :class:`PreAggregatedHistogram`
keeps, per reader and per attribute set, the very state the SDK's explicit-bucket
aggregation keeps (``opentelemetry.sdk.metrics._internal.aggregation``: bucket counts,
sum, min and max since the reader's last collection, and the totals before it), found by
a tuple key, and at collection adds the ``Histogram`` metric the SDK would have produced
to the reader's :class:`MetricsData`:

- temporality as the reader prefers for histograms: cumulative (points from the first
  measurement of an attribute set on, every set every time) or delta (since the last
  collection; sets without new measurements left out and forgotten, as the SDK's
  ``reset_on_collect`` does);
- start times as the SDK sets them (the first measurement's time, or the previous
  collection's), the collection's own timestamp, sums added up in the same order (so
  the floats are bit for bit the SDK's), no exemplars (pulsar-tap records none);
- the reader's cardinality limit (2000 by default): a further attribute set is counted
  in the ``otel.metric.overflow = true`` set.

Readers take part by mixing in :class:`FoldsHistograms` (``FoldingInMemoryReader``,
``exporters.FoldingPeriodicReader``).  Recording happens on the proxy's loop thread and
collection on a reader's thread: one lock guards the state.  The state and its recording are
in :mod:`proxy.telemetry.histogram_cells`, which runs compiled (a request's record 0.20 us
here, 0.33 interpreted); this module builds the SDK's classes from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from time import time_ns
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    InMemoryMetricReader,
    Metric,
    MetricReader,
    MetricsData,
    ScopeMetrics,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from proxy.telemetry.histogram_cells import DEFAULT_CARDINALITY_LIMIT, Cell, ReaderCells, Recorder


class PreAggregatedHistogram:
    """An explicit-bucket histogram recorded without the SDK; see the module docstring."""

    def __init__(self, instrument: metrics_api.Histogram, boundaries: Sequence[float]) -> None:
        if not isinstance(instrument, HistogramInstrument):
            raise TypeError("the histogram must come from the SDK's MeterProvider")
        self.name = instrument.name
        self.description = instrument.description
        self.unit = instrument.unit
        self.scope: InstrumentationScope = instrument.instrumentation_scope
        #: the SDK's class of the instrument: what readers key their settings by
        self._kind = type(instrument)
        self.boundaries = tuple(float(bound) for bound in boundaries)
        self._readers: dict[int, ReaderCells] = {}
        self._recorder = Recorder(self.boundaries)
        #: :meth:`Recorder.record`: one measurement (finite, >= 0) of the attribute set a key names (compiled)
        self.record = self._recorder.record
        #: :meth:`Recorder.record_many`: several, in order
        self.record_many = self._recorder.record_many

    def add_reader(self, reader: MetricReader) -> None:
        """Keep state for ``reader`` (before anything is recorded), with its temporality and limit."""
        # The reader's settings for histograms, as the SDK's storage reads them.
        temporality = reader._instrument_class_temporality[self._kind]
        limits: dict[type, int] = getattr(reader, "_instrument_class_cardinality_limit", None) or {}
        state = ReaderCells(temporality is AggregationTemporality.DELTA,
                            limits.get(self._kind, DEFAULT_CARDINALITY_LIMIT), _now)
        self._readers[id(reader)] = state
        self._recorder.readers.append(state)

    # -- collection -----------------------------------------------------------------------
    def fold(self, reader: MetricReader, data: MetricsData) -> MetricsData:
        """``data`` (what ``reader`` collected) with this histogram's metric added, as the SDK would."""
        state = self._readers.get(id(reader))
        if state is None:
            return data
        collection_ns = _collection_time(data)
        with self._recorder.lock:
            points = self._collect(state, collection_ns)
        if not points:
            return data
        temporality = AggregationTemporality.DELTA if state.delta else AggregationTemporality.CUMULATIVE
        metric = Metric(name=self.name, description=self.description, unit=self.unit,
                        data=Histogram(data_points=points, aggregation_temporality=temporality))
        if not data.resource_metrics:
            return data
        first = data.resource_metrics[0]
        scopes = list(first.scope_metrics)
        for index, scope_metrics in enumerate(scopes):
            if scope_metrics.scope == self.scope:
                scopes[index] = replace(scope_metrics, metrics=[metric, *scope_metrics.metrics])
                break
        else:
            scopes.insert(0, ScopeMetrics(scope=self.scope, metrics=[metric], schema_url=self.scope.schema_url or ""))
        return replace(data, resource_metrics=[replace(first, scope_metrics=scopes),
                                               *data.resource_metrics[1:]])

    def _collect(self, state: ReaderCells, collection_ns: int) -> list[HistogramDataPoint]:
        cells = state.cells
        if state.delta:
            state.cells = {}
            state.previous_collection_ns = collection_ns
        points = []
        for cell in cells.values():
            point = self._point(cell, state.delta, collection_ns)
            if point is not None:
                points.append(point)
        return points

    def _point(self, cell: Cell, delta: bool, collection_ns: int) -> HistogramDataPoint | None:
        counts, sum_, min_, max_ = cell.counts, cell.sum, cell.min, cell.max
        cell.counts, cell.sum, cell.min, cell.max = None, 0.0, math.inf, -math.inf
        if delta:
            if counts is None:
                return None
            start_ns, cell.start_ns = cell.start_ns, collection_ns
            return HistogramDataPoint(attributes=cell.attributes, start_time_unix_nano=start_ns,
                                      time_unix_nano=collection_ns, count=sum(counts), sum=sum_,
                                      bucket_counts=tuple(counts), explicit_bounds=self.boundaries,
                                      min=min_, max=max_, exemplars=[])
        empty = [0] * (len(self.boundaries) + 1)
        previous = cell.previous_counts or empty
        cell.previous_counts = [now + before for now, before in zip(counts or empty, previous, strict=True)]
        cell.previous_min = min(min_, cell.previous_min)
        cell.previous_max = max(max_, cell.previous_max)
        cell.previous_sum = sum_ + cell.previous_sum
        return HistogramDataPoint(attributes=cell.attributes, start_time_unix_nano=cell.start_ns,
                                  time_unix_nano=collection_ns, count=sum(cell.previous_counts),
                                  sum=cell.previous_sum, bucket_counts=tuple(cell.previous_counts),
                                  explicit_bounds=self.boundaries, min=cell.previous_min,
                                  max=cell.previous_max, exemplars=[])


def _now() -> int:
    """The time in ns a cell starts at: this module's ``time_ns`` (read when called: a test freezes it)."""
    return time_ns()


def _collection_time(data: MetricsData) -> int:
    """The timestamp the SDK gave this collection's points (all share it), else now."""
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    return int(point.time_unix_nano)
    return time_ns()


class FoldsHistograms(MetricReader):
    """A MetricReader whose collections get :attr:`histograms` added (mix in before the reader class)."""

    histograms: list[PreAggregatedHistogram]

    def fold_in(self, histogram: PreAggregatedHistogram) -> None:
        if not hasattr(self, "histograms"):
            self.histograms = []
        self.histograms.append(histogram)
        histogram.add_reader(self)

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        for histogram in getattr(self, "histograms", ()):
            metrics_data = histogram.fold(self, metrics_data)
        super()._receive_metrics(metrics_data, timeout_millis, **kwargs)  # type: ignore[safe-super]


class FoldingInMemoryReader(FoldsHistograms, InMemoryMetricReader):
    """The in-process reader behind /metrics."""
