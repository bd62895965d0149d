"""Consumer flow control: FLOW permits, refilled at half the receive queue (sans-IO).

Pulsar protocol, "Flow control": after SUBSCRIBE the consumer grants the broker
``receiver_queue_size`` permits with FLOW; the broker pushes at most that many
messages (a batch costs as many permits as it holds messages).  As the application
takes messages out of the receive queue, the consumer counts them and — as the
official clients do — sends one FLOW for the accumulated count once it reaches
half the queue size, so the broker never waits and the queue never overflows.
"""

from __future__ import annotations


class FlowControl:
    """Permit accounting for one consumer on one connection."""

    def __init__(self, receiver_queue_size: int) -> None:
        if receiver_queue_size < 1:
            raise ValueError("receiver_queue_size must be at least 1")
        self.receiver_queue_size = receiver_queue_size
        self.threshold = max(receiver_queue_size // 2, 1)
        self._available = 0

    def initial_permits(self) -> int:
        """The permits to grant right after (re)subscribing; resets the count."""
        self._available = 0
        return self.receiver_queue_size

    def consumed(self, count: int = 1) -> int:
        """The application took ``count`` messages; returns the permits to send now (0: none yet)."""
        self._available += count
        if self._available >= self.threshold:
            permits, self._available = self._available, 0
            return permits
        return 0
