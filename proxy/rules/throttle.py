"""Token buckets for the ``throttle`` action, and how FLOW permits are rationed.

A :class:`TokenBucket` fills at ``rate`` tokens per second up to ``burst``.  A
reservation may take more tokens than are there: the bucket goes into debt and
the reservation is told how long to wait until its tokens would have arrived,
so successive reservations queue up behind each other (pacing at exactly
``rate`` with burst 1).  Time comes in as ``now_ns``.

Producers are slowed by holding each SEND until its messages (or bytes) are
paid for.  Consumers are slowed the way the consumer protocol allows: a FLOW
grants the broker permits to push messages, so the proxy passes the permits the
bucket can pay for now and holds the rest, passing them on in small grants as
the tokens arrive — the broker itself then delivers at the rate.

A bucket shared by several consumers (a rule without ``per:``, or ``per: topic``
or ``per: connection``) must not be taken by the first FLOW: a consumer's FLOW
grants its whole receiver queue, mostly permits it may never use, and paced out
first come first served they would hold every later consumer behind them for as
long as they take.  :class:`FairShare` therefore decides late: the permits waiting
in the bucket are paid for as tokens arrive and split round robin between the
lanes (consumers) that wait, each lane's share sent when its poll comes round
(:data:`~proxy.core.holding.Poll`, every :data:`GRANT_INTERVAL_S`), so two
consumers waiting get half the rate each, and one waiting alone the whole rate.
Every FLOW throttle works this way, ``per: consumer`` too (one lane per bucket).
A poll costs in proportion to the lanes it pays, never to those waiting: the lanes
that still owe permits wait in their own round-robin queue.

When the rules change, a share whose rule was replaced by a FLOW throttle of the same
``per`` is paced by the new one (:meth:`FairShare.retune`); one whose rule is gone, or
no longer throttles FLOW so, lets its permits go at each lane's next poll
(:meth:`FairShare.release_all`), which the relays then ask at once
(``RulesEngine.permits_repaced``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final

#: a deferred grant at most this often per lane (seconds); fewer, larger FLOWs beyond it
GRANT_INTERVAL_S: Final = 0.1


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


@dataclass(eq=False, slots=True)
class Waiting:
    """One lane's permits in a :class:`FairShare`."""

    #: granted by the client, not paid for yet
    owed: int = 0
    #: paid for, not sent yet (its poll sends them)
    paid: int = 0


class FairShare:
    """FLOW permits waiting for one shared bucket, paid for round robin between their lanes.

    A lane is in :attr:`lanes` from its first FLOW until everything it was granted has
    been sent (or it is dropped); while it is there, exactly one poll of it is held on
    its connection (:meth:`request` says when to start one), which sends what
    :meth:`poll` hands it.  The lanes that still owe permits wait in ``_hungry``, in
    round-robin order: a lane served goes to the back.
    """

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket = bucket
        self.lanes: dict[Hashable, Waiting] = {}
        #: the lanes with permits not paid for yet, the next to be served first
        self._hungry: OrderedDict[Hashable, Waiting] = OrderedDict()
        #: seconds between two polls of a lane: a grant at most this often, or one per token
        self.interval_s = max(GRANT_INTERVAL_S, 1 / bucket.rate)

    def request(self, lane: Hashable, permits: int, now_ns: int) -> tuple[int, Waiting | None]:
        """A FLOW of ``permits`` for ``lane``: (permits to pass now, the lane to start a poll for, if any)."""
        self._pay(now_ns)
        waiting = self.lanes.get(lane)
        new = waiting is None
        if waiting is None:
            waiting = self.lanes[lane] = Waiting()
        waiting.owed += max(0, permits)
        if waiting.owed and lane not in self._hungry:
            self._hungry[lane] = waiting
        self._pay(now_ns)
        now_permits = self._take(lane, waiting)
        return now_permits, waiting if new and lane in self.lanes else None

    def poll(self, lane: Hashable, waiting: Waiting, now_ns: int) -> tuple[int, bool]:
        """(permits to send now, whether to poll again) for the poll of ``waiting``."""
        if self.lanes.get(lane) is not waiting:
            return 0, False  # dropped meanwhile
        self._pay(now_ns)
        permits = self._take(lane, waiting)
        return permits, lane in self.lanes

    def drop(self, lane: Hashable) -> None:
        """Forget ``lane``: what it waits for is never sent (its consumer is gone)."""
        self.lanes.pop(lane, None)
        self._hungry.pop(lane, None)

    def retune(self, rate: float, burst: float) -> None:
        """Pace what waits, and what comes, at ``rate`` from now on (its rule was replaced by one at that rate)."""
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        bucket = self.bucket
        bucket.rate, bucket.burst = rate, burst
        bucket.tokens = min(bucket.tokens, burst)
        self.interval_s = max(GRANT_INTERVAL_S, 1 / rate)

    def release_all(self) -> None:
        """Pay for every waiting permit at once: each lane's next poll sends all it was granted (its rule is gone)."""
        for waiting in self._hungry.values():
            waiting.paid += waiting.owed
            waiting.owed = 0
        self._hungry.clear()

    def _take(self, lane: Hashable, waiting: Waiting) -> int:
        permits, waiting.paid = waiting.paid, 0
        if not waiting.owed:
            del self.lanes[lane]
        return permits

    def _pay(self, now_ns: int) -> None:
        """Pay for waiting permits with the tokens arrived since the last call, round robin.

        Each lane served is paid at least one token, so a call costs in proportion to what it pays.
        """
        bucket = self.bucket
        hungry = self._hungry
        if not hungry:
            bucket.available(now_ns)  # an idle bucket saves up to ``burst``
            return
        if now_ns > bucket.updated_ns:
            # while permits wait, every token goes to them as it arrives (``burst`` caps only
            # what an idle bucket saves up): they are merely handed out at the next call
            bucket.tokens += bucket.rate * (now_ns - bucket.updated_ns) / 1e9
            bucket.updated_ns = now_ns
        available = math.floor(bucket.tokens)
        while available > 0 and hungry:
            share = max(1, available // len(hungry))
            for _ in range(len(hungry)):  # one round: each lane waiting now served once, from the front
                lane, waiting = hungry.popitem(last=False)
                given = min(waiting.owed, share, available)
                waiting.owed -= given
                waiting.paid += given
                bucket.tokens -= given
                available -= given
                if waiting.owed:
                    hungry[lane] = waiting  # served: to the back of the round
                if available <= 0:
                    break
        bucket.tokens = min(bucket.tokens, bucket.burst)
