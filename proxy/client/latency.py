"""A bounded latency histogram for load generation (sans-IO).

Latencies are counted in logarithmic buckets 1 % wide from 1 µs up, so memory is
fixed however many samples arrive and any percentile is reported within 1 %.
"""

from __future__ import annotations

import math
from typing import Final

_RESOLUTION: Final = 1.01
_LOG_RESOLUTION: Final = math.log(_RESOLUTION)
_MIN_SECONDS: Final = 1e-6
#: 1 µs * 1.01**2800 is about 1.2e6 s: anything longer lands in the last bucket.
_BUCKETS: Final = 2800


class LatencyHistogram:
    """Counts latencies (in seconds) and answers percentiles."""

    def __init__(self) -> None:
        self._counts = [0] * _BUCKETS
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def record(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        index = 0 if seconds <= _MIN_SECONDS else min(int(math.log(seconds / _MIN_SECONDS) / _LOG_RESOLUTION),
                                                      _BUCKETS - 1)
        self._counts[index] += 1
        self.count += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def merge(self, other: LatencyHistogram) -> None:
        for index, count in enumerate(other._counts):
            self._counts[index] += count
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)

    def percentile(self, q: float) -> float:
        """The latency below which ``q`` percent of samples fall (0 when empty)."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(self.count * q / 100))
        seen = 0
        for index, count in enumerate(self._counts):
            seen += count
            if seen >= rank:
                return min(_MIN_SECONDS * _RESOLUTION ** (index + 1), self.max)
        return self.max

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def reset(self) -> None:
        self._counts = [0] * _BUCKETS
        self.count = 0
        self.total = 0.0
        self.max = 0.0
