"""The request-duration histogram's state and its recording (compiled with mypyc: see :mod:`proxy.compiled`).

What :class:`~proxy.telemetry.histogram.PreAggregatedHistogram` keeps per reader and per
attribute set (a :class:`Cell`: the SDK's explicit-bucket aggregation state) and how a
measurement goes in (:class:`Recorder`), apart from the collection and the SDK's classes
it builds (:mod:`proxy.telemetry.histogram`), so that this part, which runs once a request
on the proxy's loop thread, runs compiled.  Collection, on a reader's thread, swaps a
reader's cells under :attr:`Recorder.lock` and reads them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Final

from opentelemetry.util.types import AttributeValue

#: the SDK's default limit of attribute sets per instrument and reader
DEFAULT_CARDINALITY_LIMIT: Final = 2000
OVERFLOW_ATTRIBUTES: Final[dict[str, AttributeValue]] = {"otel.metric.overflow": True}
#: the overflow cell's key (no attribute set's key is this object)
OVERFLOW_KEY: Final = object()

Attributes = dict[str, AttributeValue]


class Cell:
    """One attribute set of one reader: the SDK's ``_ExplicitBucketHistogramAggregation`` state."""

    def __init__(self, attributes: Attributes, start_ns: int) -> None:
        self.attributes = attributes
        self.start_ns = start_ns
        #: since the last collection (None: nothing)
        self.counts: list[int] | None = None
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        #: cumulative totals up to the last collection
        self.previous_counts: list[int] | None = None
        self.previous_sum = 0.0
        self.previous_min = math.inf
        self.previous_max = -math.inf


class ReaderCells:
    """The cells of one reader and how it collects (``clock``: the time in ns a new cell starts at, unless a
    delta collection set the start of the period)."""

    def __init__(self, delta: bool, cardinality_limit: int, clock: Callable[[], int]) -> None:
        self.delta = delta
        self.cardinality_limit = cardinality_limit
        self.clock = clock
        self.cells: dict[object, Cell] = {}
        #: set by delta collections: the start of the next period
        self.previous_collection_ns: int | None = None

    def cell(self, key: object, attributes: Callable[[], Attributes]) -> Cell:
        """The cell of ``key``, created on its first measurement (or the overflow cell)."""
        cell = self.cells.get(key)
        if cell is not None:
            return cell
        attrs = attributes()
        if len(self.cells) >= self.cardinality_limit:
            key, attrs = OVERFLOW_KEY, dict(OVERFLOW_ATTRIBUTES)
            cell = self.cells.get(key)
            if cell is not None:
                return cell
        cell = self.cells[key] = Cell(attrs, self.previous_collection_ns or self.clock())
        return cell


class Recorder:
    """Measurements into every reader's cells, under :attr:`lock` (collections take it too)."""

    def __init__(self, boundaries: tuple[float, ...]) -> None:
        self.boundaries = boundaries
        self.readers: list[ReaderCells] = []
        self.lock = threading.Lock()

    def record(self, key: object, attributes: Callable[[], Attributes], value: float) -> None:
        """One measurement (finite, >= 0) of the attribute set ``key`` names (``attributes()`` spells it out)."""
        index = self.bucket(value)
        lock = self.lock
        lock.acquire()
        try:
            for reader in self.readers:
                cell, counts = self._counting(reader, key, attributes)
                counts[index] += 1
                cell.sum += value
                if value < cell.min:
                    cell.min = value
                if value > cell.max:
                    cell.max = value
        finally:
            lock.release()

    def _counting(self, reader: ReaderCells, key: object, attributes: Callable[[], Attributes]
                  ) -> tuple[Cell, list[int]]:
        """``reader``'s cell of ``key`` and its bucket counts since the last collection (begun if need be)."""
        cell = reader.cells.get(key)
        if cell is None:
            cell = reader.cell(key, attributes)
        counts = cell.counts
        if counts is None:
            counts = cell.counts = [0] * (len(self.boundaries) + 1)
        return cell, counts

    def bucket(self, value: float) -> int:
        """The index of ``value``'s bucket: of the first boundary not below it (``bisect_left``'s answer),
        found by walking the boundaries from the lowest: a request's latency lies in the first few."""
        index = 0
        for bound in self.boundaries:
            if value <= bound:
                return index
            index += 1
        return index

    def record_many(self, key: object, attributes: Callable[[], Attributes], values: list[float]) -> None:
        """:meth:`record` of each of ``values`` (finite, >= 0), in order: the same sums, bit for bit."""
        lock = self.lock
        lock.acquire()
        try:
            for reader in self.readers:
                cell, counts = self._counting(reader, key, attributes)
                # (one pass: a run's receipts, ~100 of them at the official client's pace)
                total, low, high = cell.sum, cell.min, cell.max
                for value in values:
                    counts[self.bucket(value)] += 1
                    total += value
                    if value < low:
                        low = value
                    if value > high:
                        high = value
                cell.sum, cell.min, cell.max = total, low, high
        finally:
            lock.release()
