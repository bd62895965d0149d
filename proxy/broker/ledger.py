"""A topic's stored entries: the in-memory stand-in for a managed ledger.

Pulsar stores each SEND (one message, or one batch of messages) as one *entry*
and names it by ``(ledger_id, entry_id)``.  The embedded broker keeps one ledger
per topic in memory, as with infinite retention, bounded by a byte budget: when
it is exceeded the oldest entries are dropped first.  An entry keeps the payload
section exactly as the producer sent it (from the checksum magic on), so the
broker can dispatch it with its original checksum and never re-encodes it.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from proxy.pb import PulsarApi_pb2 as api

#: The position before the first entry of a ledger (as Pulsar's ``(ledger, -1)``).
BEFORE_FIRST: Final = -1


@dataclass(slots=True)
class Entry:
    """One stored entry."""

    entry_id: int
    #: the payload section, from the 0x0e01 magic to the end of the frame
    section: bytes
    #: messages in the entry (1, or the batch size)
    num_messages: int
    batched: bool
    publish_time: int
    #: the Key_Shared sticky key (ordering key, else partition key), b"" when none
    sticky_key: bytes
    #: the chunk metadata when this entry is one chunk of a large message
    chunk_uuid: str = ""
    #: MessageMetadata.marker_type (0: not a marker); markers are never dispatched to consumers
    marker_type: int = 0
    #: the cluster a geo-replicated entry came from ("" for one produced here)
    replicated_from: str = ""
    #: when the producer asked for it to be delivered (ms since the epoch; 0: at once)
    deliver_at_ms: int = 0
    size: int = field(default=0)

    def __post_init__(self) -> None:
        self.size = len(self.section)


def sticky_key_of(metadata: api.MessageMetadata) -> bytes:
    """The key Key_Shared dispatch hashes: ordering_key if set, else partition_key."""
    if metadata.HasField("ordering_key"):
        return bytes(metadata.ordering_key)
    if metadata.HasField("partition_key"):
        key: str = metadata.partition_key
        return key.encode()
    return b""


class Ledger:
    """The entries of one topic, addressable by entry id, with retention by size."""

    def __init__(self, ledger_id: int, retention_bytes: int) -> None:
        self.ledger_id = ledger_id
        self.retention_bytes = retention_bytes
        self._entries: deque[Entry] = deque()
        self._first_id = 0
        self._next_id = 0
        self.total_bytes = 0
        #: publish times, parallel to the entries, for seek-by-time
        self._times: deque[int] = deque()

    @property
    def first_entry_id(self) -> int:
        """The id of the oldest retained entry (== next_entry_id when empty)."""
        return self._first_id

    @property
    def next_entry_id(self) -> int:
        """The id the next appended entry will get."""
        return self._next_id

    @property
    def last_entry_id(self) -> int:
        return self._next_id - 1

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, section: bytes, metadata: api.MessageMetadata) -> Entry:
        batched = metadata.HasField("num_messages_in_batch")
        entry = Entry(
            entry_id=self._next_id,
            section=section,
            num_messages=max(1, metadata.num_messages_in_batch) if batched else 1,
            batched=batched,
            publish_time=metadata.publish_time,
            sticky_key=sticky_key_of(metadata),
            chunk_uuid=metadata.uuid if metadata.HasField("uuid") else "",
            marker_type=metadata.marker_type,
            replicated_from=metadata.replicated_from,
            deliver_at_ms=metadata.deliver_at_time,
        )
        self._next_id += 1
        self._entries.append(entry)
        self._times.append(entry.publish_time)
        self.total_bytes += entry.size
        while self.total_bytes > self.retention_bytes and len(self._entries) > 1:
            dropped = self._entries.popleft()
            self._times.popleft()
            self.total_bytes -= dropped.size
            self._first_id += 1
        return entry

    def get(self, entry_id: int) -> Entry | None:
        """The entry with this id, or None when it was dropped or does not exist yet."""
        index = entry_id - self._first_id
        if 0 <= index < len(self._entries):
            return self._entries[index]
        return None

    def first_at_or_after_time(self, publish_time_ms: int) -> int:
        """The id of the first entry published at or after a time (next_entry_id if none)."""
        # publish times are monotonic per producer but not across producers; a
        # real broker also searches by the ledger's order, so bisect is faithful.
        index = bisect.bisect_left(self._times, publish_time_ms)
        return self._first_id + index

    def count_between(self, after_id: int, upto_id: int) -> int:
        """Messages (not entries) in the entries with after_id < id <= upto_id."""
        total = 0
        for entry_id in range(max(after_id + 1, self._first_id), min(upto_id, self.last_entry_id) + 1):
            entry = self.get(entry_id)
            if entry is not None:
                total += entry.num_messages
        return total
