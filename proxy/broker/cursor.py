"""A subscription's cursor: what is acknowledged and where reading continues.

As in Pulsar's ``ManagedCursor``, a cursor has a *mark-delete position* (every
entry at or before it is acknowledged), the set of entries acknowledged
individually beyond it, the batch indexes acknowledged inside partly-acknowledged
batches, a *read position* (the next entry never dispatched yet), and a *replay
set* of entries to dispatch again (redeliveries), which is always served first,
lowest entry id first.  Positions are entry ids within the topic's ledger.
"""

from __future__ import annotations

from proxy.broker.ledger import Ledger


class Cursor:
    """Acknowledgement state and read position of one subscription on one topic."""

    def __init__(self, ledger: Ledger, start_after: int) -> None:
        self.ledger = ledger
        #: every entry id <= mark_delete is acknowledged
        self.mark_delete = start_after
        self.read_position = start_after + 1
        self.acked: set[int] = set()
        #: entry id -> batch indexes acknowledged so far (partly-acked batches only)
        self.batch_acked: dict[int, set[int]] = {}
        self._replay_set: set[int] = set()

    # -- acknowledgements -------------------------------------------------------

    def is_acked(self, entry_id: int) -> bool:
        return entry_id <= self.mark_delete or entry_id in self.acked

    def ack_individual(self, entry_id: int) -> bool:
        """Acknowledge one entry; True when it was not acknowledged before."""
        if self.is_acked(entry_id):
            return False
        self.acked.add(entry_id)
        self.batch_acked.pop(entry_id, None)
        self._advance_mark_delete()
        return True

    def ack_batch_indexes(self, entry_id: int, indexes: set[int], batch_size: int) -> bool:
        """Acknowledge some messages of a batch; True when that completes the entry."""
        if self.is_acked(entry_id):
            return False
        done = self.batch_acked.setdefault(entry_id, set())
        done |= indexes
        if len(done) >= batch_size:
            return self.ack_individual(entry_id)
        return False

    def ack_cumulative(self, entry_id: int) -> list[int]:
        """Acknowledge everything up to an entry; returns the entries newly acknowledged."""
        if entry_id <= self.mark_delete:
            return []
        newly = [e for e in range(self.mark_delete + 1, entry_id + 1) if e not in self.acked]
        self.mark_delete = entry_id
        self.acked = {e for e in self.acked if e > entry_id}
        for e in [e for e in self.batch_acked if e <= entry_id]:
            del self.batch_acked[e]
        self._advance_mark_delete()
        self.read_position = max(self.read_position, self.mark_delete + 1)
        return newly

    def _advance_mark_delete(self) -> None:
        while self.mark_delete + 1 in self.acked:
            self.mark_delete += 1
            self.acked.discard(self.mark_delete)
        # entries dropped by retention count as gone, not as a hole in the acks
        first = self.ledger.first_entry_id
        if self.mark_delete < first - 1:
            self.mark_delete = first - 1
            self.acked = {e for e in self.acked if e > self.mark_delete}
            self._advance_mark_delete()

    # -- reading ----------------------------------------------------------------

    def replay(self, entry_id: int) -> None:
        """Schedule an already-dispatched entry for redelivery."""
        if entry_id not in self._replay_set and not self.is_acked(entry_id):
            self._replay_set.add(entry_id)

    def replay_ids(self) -> list[int]:
        """Entries waiting for redelivery, lowest first (acked ones are purged)."""
        live = sorted(e for e in self._replay_set if not self.is_acked(e))
        self._replay_set = set(live)
        return live

    def take_replay(self, entry_id: int) -> None:
        """An entry of the replay set has been dispatched."""
        self._replay_set.discard(entry_id)

    @property
    def has_replay(self) -> bool:
        return bool(self._replay_set)

    def next_new_entry(self) -> int | None:
        """The next never-dispatched, unacknowledged entry id, or None at the end."""
        position = max(self.read_position, self.ledger.first_entry_id, self.mark_delete + 1)
        while position < self.ledger.next_entry_id and position in self.acked:
            position += 1
        self.read_position = position
        if position >= self.ledger.next_entry_id:
            return None
        return position

    def rewind(self) -> None:
        """Read again from the first unacknowledged entry (what Exclusive/Failover redelivery does)."""
        self.read_position = self.mark_delete + 1
        self._replay_set.clear()

    def reset(self, entry_id: int) -> None:
        """Seek: everything before ``entry_id`` is acknowledged, everything after is not."""
        self.mark_delete = entry_id - 1
        self.read_position = entry_id
        self.acked.clear()
        self.batch_acked.clear()
        self._replay_set.clear()

    # -- statistics ---------------------------------------------------------------

    def backlog(self) -> int:
        """Messages not yet acknowledged (partly-acked batches count their rest)."""
        total = self.ledger.count_between(self.mark_delete, self.ledger.last_entry_id)
        for entry_id in self.acked:
            entry = self.ledger.get(entry_id)
            if entry is not None:
                total -= entry.num_messages
        for entry_id, indexes in self.batch_acked.items():
            if entry_id > self.mark_delete and entry_id not in self.acked:
                total -= len(indexes)
        return max(0, total)
