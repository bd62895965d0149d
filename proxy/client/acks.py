"""Consumer acknowledgement bookkeeping, sans-IO.

- :class:`BatchAckTracker`: a batch is stored as one entry, and a broker without
  batch-index acknowledgement only understands acks of whole entries.  As the
  official clients do, an individual ack of a message inside a batch is held back
  until every message of that batch has been acknowledged; then the entry is acked.
  A cumulative ack of a message inside a batch acks up to the *previous* entry
  unless the message is the batch's last.
- :class:`AckGroup`: as the official clients do (``ackGroupingTime`` 100 ms,
  ``ackGroupingMaxSize`` 1000), acknowledgements are collected and sent together —
  one ACK naming many entries, and of cumulative acks only the furthest — when
  the group is full or the grouping time has passed.
- :class:`NegativeAckTracker`: a negatively acknowledged message is redelivered
  after ``delay`` seconds with REDELIVER_UNACKNOWLEDGED_MESSAGES naming its entry.
"""

from __future__ import annotations

from proxy.client.message import MessageId


class BatchAckTracker:
    """Which messages of partially acknowledged batches are still outstanding."""

    def __init__(self) -> None:
        self._outstanding: dict[MessageId, set[int]] = {}

    def __len__(self) -> int:
        return len(self._outstanding)

    def individual(self, message_id: MessageId) -> MessageId | None:
        """Record an individual ack; returns the entry to ack now, or None to wait."""
        if message_id.batch_index < 0 or message_id.batch_size <= 1:
            return message_id.entry
        entry = message_id.entry
        left = self._outstanding.get(entry)
        if left is None:
            left = set(range(message_id.batch_size))
            self._outstanding[entry] = left
        left.discard(message_id.batch_index)
        if left:
            return None
        del self._outstanding[entry]
        return entry

    def cumulative(self, message_id: MessageId) -> MessageId | None:
        """The entry a cumulative ack up to ``message_id`` acknowledges (None: nothing yet)."""
        if message_id.batch_index < 0 or message_id.batch_index >= message_id.batch_size - 1:
            entry = message_id.entry
        elif message_id.entry_id > 0:
            entry = MessageId(message_id.ledger_id, message_id.entry_id - 1, -1, message_id.partition)
        else:
            return None
        for tracked in [e for e in self._outstanding if e <= entry]:
            del self._outstanding[tracked]
        return entry

    def clear(self) -> None:
        self._outstanding.clear()


class AckGroup:
    """Acknowledgements waiting to be sent together."""

    def __init__(self, max_size: int = 1000) -> None:
        self.max_size = max_size
        self._individual: dict[MessageId, None] = {}
        self.cumulative: MessageId | None = None

    def __len__(self) -> int:
        return len(self._individual) + (self.cumulative is not None)

    def add_individual(self, entry: MessageId) -> bool:
        """Queue an individual ack; True when the group is full and must be sent now."""
        self._individual[entry] = None
        return len(self._individual) >= self.max_size

    def add_cumulative(self, entry: MessageId) -> None:
        if self.cumulative is None or entry > self.cumulative:
            self.cumulative = entry

    def take(self) -> tuple[list[MessageId], MessageId | None]:
        """Everything queued: the individual entries in ack order, and the cumulative position."""
        individual, cumulative = list(self._individual), self.cumulative
        self._individual.clear()
        self.cumulative = None
        return individual, cumulative


class NegativeAckTracker:
    """Entries to redeliver, each with the time it becomes due."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._due: dict[MessageId, float] = {}

    def __len__(self) -> int:
        return len(self._due)

    def add(self, message_id: MessageId, now: float) -> None:
        self._due[message_id.entry] = now + self.delay

    def pop_due(self, now: float) -> list[MessageId]:
        """Entries whose delay has passed, oldest id first; they leave the tracker."""
        due = sorted(entry for entry, when in self._due.items() if when <= now)
        for entry in due:
            del self._due[entry]
        return due

    def next_due(self) -> float | None:
        return min(self._due.values(), default=None)

    def clear(self) -> None:
        self._due.clear()
