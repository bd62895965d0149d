"""Which consumer gets a message: Failover's active consumer and Key_Shared's hash ranges.

Failover (Pulsar's ``AbstractDispatcherSingleActiveConsumer``): consumers are
ordered by priority level (lower number first), then by consumer name (Java's
UTF-16 order); of those at the best priority level, a partition ``p`` goes to
consumer ``p % count``.  A non-partitioned topic goes to the consumer owning the
topic name's place on a hash ring: each of those consumers puts 100 points on it,
``murmur3("<name><j>")`` for j in 0..99 (31-bit, a later consumer winning a tie),
and the topic's point ``murmur3(full topic name)`` belongs to the first point at or
after it, wrapping round to the lowest.  Which consumer is active thus depends on
the topic's name, and one leaving hands over to whoever owns its points next.

Key_Shared in AUTO_SPLIT mode (``HashRangeAutoSplitStickyKeyConsumerSelector``):
the hash space [0, 65536) is cut into ranges named by their inclusive upper end.
The first consumer owns everything; each new consumer takes the lower half of the
largest range; a leaving consumer's range merges into its upper neighbour (or the
lower one when it held the top range).  In STICKY mode consumers bring their own
ranges.  A message's hash is Murmur3_32(sticky key) mod 65536.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from proxy.broker.naming import KEY_HASH_RANGE, murmur3_32


class Selectable(Protocol):
    @property
    def priority_level(self) -> int: ...

    @property
    def consumer_name(self) -> str: ...


C = TypeVar("C", bound=Selectable)
T = TypeVar("T")


#: points each Failover consumer puts on the ring (Pulsar's CONSUMER_CONSISTENT_HASH_REPLICAS)
FAILOVER_RING_POINTS = 100


def failover_order(consumers: Sequence[C]) -> list[C]:
    """Consumers in Failover order: priority level, then name as Java's ``String.compareTo`` orders it."""
    return sorted(consumers, key=lambda c: (c.priority_level, c.consumer_name.encode("utf-16-be", "surrogatepass")))


def _ring_hash(text: str) -> int:
    return murmur3_32(text.encode("utf-8", "surrogatepass")) & 0x7FFFFFFF


def failover_active(consumers: Sequence[C], partition_index: int, topic_name: str) -> C | None:
    """The consumer Failover makes active for a topic (partition -1: not partitioned; full topic name)."""
    if not consumers:
        return None
    ordered = failover_order(consumers)
    best = ordered[0].priority_level
    top = [c for c in ordered if c.priority_level == best]
    if partition_index >= 0:
        return top[partition_index % len(top)]
    ring: dict[int, int] = {}
    for i, consumer in enumerate(top):
        for j in range(FAILOVER_RING_POINTS):
            ring[_ring_hash(f"{consumer.consumer_name}{j}")] = i
    points = sorted(ring)
    at = bisect.bisect_left(points, _ring_hash(topic_name))
    return top[ring[points[at % len(points)]]]


class ConflictingRange(Exception):
    """A STICKY consumer's ranges overlap another consumer's."""


class KeySharedSelector(Generic[T]):
    """Hash-range ownership for one Key_Shared subscription."""

    def __init__(self) -> None:
        # auto-split: sorted inclusive range ends and their owners
        self._ends: list[int] = []
        self._owners: list[T] = []
        # sticky: explicit (start, end, owner) ranges
        self._sticky: list[tuple[int, int, T]] = []

    def add_auto(self, consumer: T) -> None:
        if not self._ends:
            self._ends = [KEY_HASH_RANGE - 1]
            self._owners = [consumer]
            return
        biggest, biggest_size, low = 0, -1, -1
        for i, end in enumerate(self._ends):
            size = end - low
            if size > biggest_size:
                biggest, biggest_size = i, size
            low = end
        lower = self._ends[biggest - 1] if biggest > 0 else -1
        middle = lower + (self._ends[biggest] - lower) // 2
        self._ends.insert(biggest, middle)
        self._owners.insert(biggest, consumer)

    def add_sticky(self, consumer: T, ranges: Sequence[tuple[int, int]]) -> None:
        for start, end in ranges:
            for s, e, _ in self._sticky:
                if start <= e and s <= end:
                    raise ConflictingRange(f"range [{start}, {end}] overlaps [{s}, {e}]")
        for start, end in ranges:
            self._sticky.append((start, end, consumer))

    def remove(self, consumer: T) -> None:
        self._sticky = [r for r in self._sticky if r[2] is not consumer]
        while consumer in self._owners:
            i = self._owners.index(consumer)
            if len(self._owners) == 1:
                self._ends, self._owners = [], []
            elif i == len(self._owners) - 1:
                # the top range merges downwards: the lower neighbour now reaches the top
                del self._ends[i - 1]
                del self._owners[i]
            else:
                del self._ends[i]
                del self._owners[i]

    def select(self, key_hash: int) -> T | None:
        for start, end, owner in self._sticky:
            if start <= key_hash <= end:
                return owner
        if not self._ends:
            return None
        i = bisect.bisect_left(self._ends, key_hash)
        return self._owners[min(i, len(self._owners) - 1)]

    def ranges(self) -> list[tuple[int, int, T]]:
        """Every range as (start, end, owner), for statistics and tests."""
        out: list[tuple[int, int, T]] = []
        low = 0
        for end, owner in zip(self._ends, self._owners, strict=True):
            out.append((low, end, owner))
            low = end + 1
        return out + list(self._sticky)
