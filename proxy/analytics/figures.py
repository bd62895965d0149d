"""The report's figures, computed where the rows are made and added up on the driver.

Every part of the work (a split, a group of connections) fills a :class:`Figures`
from its own rows; :meth:`Figures.merge` adds two together, so the driver never needs
the rows themselves.  Latency percentiles are exact (interpolated between the two
nearest values, as Spark's ``percentile`` is) while a command has at most
:data:`EXACT_LATENCIES` requests; above that they come from a histogram of buckets
0.5 % wide (so a percentile is within 0.5 % of the exact one).  ``max`` is always exact.
"""

from __future__ import annotations

import heapq
import math
import pickle
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from proxy.analytics.output import NS_PER_SECOND, merge_throughput

if TYPE_CHECKING:
    import pyarrow as pa

#: Up to this many requests of one command, percentiles are computed from every value.
EXACT_LATENCIES: Final = 100_000
#: Histogram buckets per factor e: bucket ``floor(ln(µs) * BUCKETS_PER_E)`` spans 0.5 %.
BUCKETS_PER_E: Final = 1 / math.log(1.005)
#: How many of the slowest requests the report lists.
SLOWEST: Final = 20
#: Points of a latency CDF (quantiles 0, 1/CDF_POINTS, ..., 1).
CDF_POINTS: Final = 200


@dataclass(slots=True)
class Latencies:
    """Latencies (µs) of one request command: count, max, exact values while few, and a histogram."""

    count: int = 0
    max: float = -math.inf
    values: list[float] | None = field(default_factory=list)
    buckets: Counter[int] = field(default_factory=Counter)

    def add(self, latency_us: float) -> None:
        self.count += 1
        self.max = max(self.max, latency_us)
        if self.values is not None:
            self.values.append(latency_us)
            if len(self.values) > EXACT_LATENCIES:
                self.values = None
        self.buckets[_bucket(latency_us)] += 1

    def add_all(self, latencies_us: list[float]) -> None:
        """:meth:`add` for each, in one go."""
        self.count += len(latencies_us)
        self.max = max(self.max, max(latencies_us))
        if self.values is not None:
            self.values.extend(latencies_us)
            if len(self.values) > EXACT_LATENCIES:
                self.values = None
        log, per_e = math.log, BUCKETS_PER_E
        self.buckets.update(math.floor(log(value) * per_e) if value > 0 else _NOT_POSITIVE for value in latencies_us)

    def merge(self, other: Latencies) -> None:
        self.count += other.count
        self.max = max(self.max, other.max)
        if self.values is not None and other.values is not None and self.count <= EXACT_LATENCIES:
            self.values.extend(other.values)
        else:
            self.values = None
        self.buckets.update(other.buckets)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1)."""
        if self.values is not None:
            ordered = sorted(self.values)
            position = q * (len(ordered) - 1)
            low = math.floor(position)
            high = min(low + 1, len(ordered) - 1)
            return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
        rank = q * (self.count - 1)
        seen = 0
        for bucket in sorted(self.buckets):
            seen += self.buckets[bucket]
            if seen > rank:
                return min(self.max, _bucket_value(bucket))
        return self.max

    def cdf(self) -> list[tuple[float, float]]:
        """``(latency_us, fraction of requests at most that slow)`` points, for a plot."""
        if not self.count:
            return []
        return [(self.quantile(i / CDF_POINTS), i / CDF_POINTS) for i in range(CDF_POINTS + 1)]


#: the bucket of latencies of 0 (or less: a clock that went back)
_NOT_POSITIVE: Final = -(1 << 30)


def _bucket(latency_us: float) -> int:
    return math.floor(math.log(latency_us) * BUCKETS_PER_E) if latency_us > 0 else _NOT_POSITIVE


def _bucket_value(bucket: int) -> float:
    return 0.0 if bucket == _NOT_POSITIVE else math.exp((bucket + 0.5) / BUCKETS_PER_E)


#: (latency_us, recording, conn_id, request_command, response_command, topic, start_ns, outcome, error_code)
SlowRequest = tuple[float, str, int, str, "str | None", "str | None", int, str, "str | None"]


@dataclass
class Figures:
    """Everything the report shows, in mergeable form."""

    #: rows per table (and "problems": frames that did not decode)
    counts: Counter[str] = field(default_factory=Counter)
    latencies: dict[str, Latencies] = field(default_factory=dict)
    #: the slowest answered requests, slowest first
    slowest: list[SlowRequest] = field(default_factory=list)
    #: (second, error code or outcome) -> errors
    errors: Counter[tuple[int, str]] = field(default_factory=Counter)
    #: (second, topic) -> [replicated messages, sum of lag_ms, max lag_ms]
    replication_lag: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    #: (second, marker kind) -> markers seen
    markers: Counter[tuple[int, str]] = field(default_factory=Counter)
    #: the throughput table (per topic and second), once merged
    throughput: pa.Table | None = None
    #: damaged or cut-off stretches of segments, one line each
    skipped: list[str] = field(default_factory=list)

    # -- filling ----------------------------------------------------------------------------
    def add_requests(self, table: pa.Table) -> None:
        """Rows of the ``requests`` table."""
        import pyarrow.compute as pc

        self.counts["requests"] += table.num_rows
        answered = table.filter(pc.not_equal(table["outcome"], "unanswered"))
        if not answered.num_rows:
            return
        commands = answered["request_command"]
        for command in sorted(pc.unique(commands).to_pylist()):
            latencies = answered["latency_us"].filter(pc.equal(commands, command)).to_pylist()
            stats = self.latencies.get(command)
            if stats is None:
                stats = self.latencies[command] = Latencies()
            stats.add_all(latencies)
        # the slowest of these first, in the order _keep_slowest keeps them
        order = pc.sort_indices(answered, sort_keys=[("latency_us", "descending"), ("start_ns", "ascending"),
                                                     ("recording", "ascending"), ("conn_id", "ascending"),
                                                     ("request_command", "ascending")])
        slow = answered.take(order.slice(0, SLOWEST))
        self._keep_slowest(list(zip(*(slow[name].to_pylist() for name in (
            "latency_us", "recording", "conn_id", "request_command", "response_command", "topic", "start_ns",
            "outcome", "error_code")), strict=True)))

    def add_errors(self, table: pa.Table) -> None:
        """Rows of the ``errors`` table."""
        self.counts["errors"] += table.num_rows
        for ts_ns, outcome, error_code in zip(*(table[name].to_pylist() for name in ("ts_ns", "outcome",
                                                                                    "error_code")), strict=True):
            if outcome == "undecodable":
                self.counts["problems"] += 1
            self.errors[(ts_ns // NS_PER_SECOND, error_code or outcome)] += 1

    def add_replication(self, table: pa.Table) -> None:
        self.counts["replication"] += table.num_rows
        if not table.num_rows:
            return
        for ts_ns, topic, kind, lag_ms in zip(*(table[c].to_pylist() for c in ("ts_ns", "topic", "kind", "lag_ms")),
                                              strict=True):
            second = ts_ns // NS_PER_SECOND
            if kind == "replicated_message":
                entry = self.replication_lag.setdefault((second, topic or "(unknown)"), [0, 0.0, -math.inf])
                entry[0] += 1
                entry[1] += lag_ms
                entry[2] = max(entry[2], lag_ms)
            else:
                self.markers[(second, kind)] += 1

    def _keep_slowest(self, rows: list[SlowRequest]) -> None:
        self.slowest = heapq.nsmallest(SLOWEST, [*self.slowest, *rows], key=_slow_order)

    # -- merging ----------------------------------------------------------------------------
    def merge(self, other: Figures) -> None:
        self.counts.update(other.counts)
        for command, stats in other.latencies.items():
            if command in self.latencies:
                self.latencies[command].merge(stats)
            else:
                self.latencies[command] = stats
        self._keep_slowest(other.slowest)
        self.errors.update(other.errors)
        for key, (count, total, peak) in other.replication_lag.items():
            entry = self.replication_lag.setdefault(key, [0, 0.0, -math.inf])
            entry[0] += count
            entry[1] += total
            entry[2] = max(entry[2], peak)
        self.markers.update(other.markers)
        if other.throughput is not None:
            self.throughput = merge_throughput([t for t in (self.throughput, other.throughput) if t is not None])
        self.skipped += other.skipped

    def to_bytes(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def from_bytes(data: bytes) -> Figures:
        figures = pickle.loads(data)
        assert isinstance(figures, Figures)
        return figures


def _slow_order(row: SlowRequest) -> tuple[float, int, str, int, str]:
    return (-row[0], row[6], row[1], row[2], row[3])


def merge_all(parts: Iterable[Figures]) -> Figures:
    total = Figures()
    for part in parts:
        total.merge(part)
    return total


__all__ = ["CDF_POINTS", "EXACT_LATENCIES", "SLOWEST", "Figures", "Latencies", "SlowRequest", "merge_all"]
