"""Token buckets for the ``throttle`` action, and how FLOW permits are rationed.

A :class:`TokenBucket` fills at ``rate`` tokens per second up to ``burst``.  A
reservation may take more tokens than are there: the bucket goes into debt and
the reservation is told how long to wait until its tokens would have arrived,
so successive reservations queue up behind each other (pacing at exactly
``rate`` with burst 1).  Time comes in as ``now_ns``.

Producers are slowed by holding each SEND until its messages (or bytes) are
paid for.  Consumers are slowed the way the consumer protocol allows: a FLOW
grants the broker permits to push messages, so :func:`ration_permits` passes
the permits the bucket can pay for now and releases the rest in small grants at
the times their tokens arrive — the broker itself then delivers at the rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

#: a deferred grant at most this often per bucket (seconds); fewer, larger FLOWs beyond it
GRANT_INTERVAL_S: Final = 0.1
#: the most deferred grants one FLOW turns into
MAX_GRANTS: Final = 1000


class TokenBucket:
    def __init__(self, rate: float, burst: float, now_ns: int) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated_ns = now_ns

    def _refill(self, now_ns: int) -> None:
        if now_ns > self.updated_ns:
            self.tokens = min(self.burst, self.tokens + self.rate * (now_ns - self.updated_ns) / 1e9)
            self.updated_ns = now_ns

    def reserve(self, cost: float, now_ns: int) -> float:
        """Take ``cost`` tokens; the seconds to wait until they are paid for (0: go now)."""
        self._refill(now_ns)
        self.tokens -= cost
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def available(self, now_ns: int) -> float:
        self._refill(now_ns)
        return self.tokens


@dataclass(frozen=True, slots=True)
class Grant:
    after_s: float
    permits: int


def ration_permits(bucket: TokenBucket, permits: int, now_ns: int) -> tuple[int, list[Grant]]:
    """Split a FLOW of ``permits``: (permits to pass now, later grants with their delays)."""
    if permits <= 0:
        return 0, []
    tokens = bucket.available(now_ns)
    now_permits = max(0, min(permits, math.floor(tokens)))
    rest = permits - now_permits
    bucket.tokens -= permits
    grants: list[Grant] = []
    if rest:
        chunk = max(1, math.ceil(bucket.rate * GRANT_INTERVAL_S), math.ceil(rest / MAX_GRANTS))
        granted = now_permits
        while granted < permits:
            size = min(chunk, permits - granted)
            granted += size
            # permit number ``granted`` is paid for when the tokens have climbed back to it
            grants.append(Grant(max(0.0, (granted - tokens) / bucket.rate), size))
    return now_permits, grants
