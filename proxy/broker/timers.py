"""What the embedded broker does later, at a time of the wall clock: a delayed message's delivery.

A producer may ask for a message to be delivered at a time (``deliver_at_time``, epoch
milliseconds); Shared and Key_Shared subscriptions hold it until then, as Pulsar's
broker does.  :class:`Timers` keeps the calls due, sans-IO: whoever runs the cluster
(:class:`~proxy.broker.embedded.ClusterRunner`) sleeps until :meth:`Timers.next_due`
and calls :meth:`Timers.run_due`, and is woken through ``changed`` when an earlier call
is added.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable


def wall_ms() -> int:
    """Milliseconds since the epoch (what a producer's ``deliver_at_time`` counts)."""
    return int(time.time() * 1000)


class Timers:
    """Calls due at a wall-clock time, in the order they are due (see the module docstring)."""

    def __init__(self, clock: Callable[[], int] = wall_ms) -> None:
        self.clock = clock
        self._due: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count()
        #: called when a call due earlier than every other is added (the runner's wake-up)
        self.changed: Callable[[], None] = lambda: None

    def call_at(self, at_ms: int, call: Callable[[], None]) -> None:
        earliest = self._due[0][0] if self._due else None
        heapq.heappush(self._due, (at_ms, next(self._order), call))
        if earliest is None or at_ms < earliest:
            self.changed()

    def next_due(self) -> int | None:
        """When the next call is due (ms since the epoch), None when none is waiting."""
        return self._due[0][0] if self._due else None

    def run_due(self) -> None:
        """Make every call that is due now."""
        now = self.clock()
        while self._due and self._due[0][0] <= now:
            heapq.heappop(self._due)[2]()
