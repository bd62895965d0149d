"""Reconnection backoff, as the official clients do it (C++ ``Backoff``, Java ``Backoff``).

Each failed attempt doubles the delay, from ``initial`` (100 ms) up to ``maximum``
(60 s); each delay handed out is reduced by a random amount of up to 10 % so that
many clients cut off together do not reconnect in lockstep.  A successful
connection calls :meth:`Backoff.reset`.  Sans-IO: randomness comes from the
``random.Random`` it is given, and the caller does the sleeping.
"""

from __future__ import annotations

import random
from typing import Final

DEFAULT_INITIAL: Final = 0.1
DEFAULT_MAXIMUM: Final = 60.0
#: The largest share of a delay removed at random.
JITTER: Final = 0.1


class Backoff:
    """Exponential backoff with jitter; delays are in seconds."""

    def __init__(self, initial: float = DEFAULT_INITIAL, maximum: float = DEFAULT_MAXIMUM,
                 rng: random.Random | None = None) -> None:
        if not 0 < initial <= maximum:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self._rng = rng if rng is not None else random.Random()
        self._next = initial
        self.attempts = 0

    def next(self) -> float:
        """The delay before the next attempt; doubles the one after it."""
        current = self._next
        self._next = min(self._next * 2, self.maximum)
        self.attempts += 1
        return current - current * JITTER * self._rng.random()

    def reset(self) -> None:
        """Forget past failures: the next delay is ``initial`` again."""
        self._next = self.initial
        self.attempts = 0
