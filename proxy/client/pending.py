"""The producer's queue of sent-but-unreceipted SENDs (C++ ``pendingMessagesQueue_``), sans-IO.

Every SEND waits here, in send order, until its SEND_RECEIPT arrives.  Receipts come
back in order, so a receipt is matched against the head of the queue only
(C++ ``ProducerImpl::ackReceived``):

- its sequence id equals the head's: the head is done;
- it is lower: a duplicate of a receipt already handled (after a resend), ignored;
- it is higher: a receipt for a message we think is still ahead of others — the
  stream is out of step, and the caller must reconnect and resend.

After a reconnection every pending SEND is written again, in order, with its
original sequence id, so the broker's deduplication drops what it already has.
A SEND whose deadline passes fails, as the send timeout says.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")


@dataclass(slots=True)
class PendingSend(Generic[R]):
    """One SEND frame in flight and the receipts it completes."""

    sequence_id: int
    highest_sequence_id: int
    frame: bytes
    num_messages: int
    deadline: float
    #: receipts to complete, one per user message (empty for every chunk but the last)
    receipts: list[R] = field(default_factory=list)
    #: whether the frame is a batch (its messages' ids carry batch indexes)
    batch: bool = False
    #: the connection epoch this frame was last written on (-1: not yet written)
    written_epoch: int = -1


class ReceiptMatch(enum.Enum):
    MATCHED = "matched"
    DUPLICATE = "duplicate"
    UNEXPECTED = "unexpected"


class PendingQueue(Generic[R]):
    """SENDs awaiting receipts, oldest first."""

    def __init__(self) -> None:
        self._queue: deque[PendingSend[R]] = deque()
        self.messages = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[PendingSend[R]]:
        return iter(self._queue)

    def append(self, send: PendingSend[R]) -> None:
        self._queue.append(send)
        self.messages += send.num_messages

    def match_receipt(self, sequence_id: int) -> tuple[ReceiptMatch, PendingSend[R] | None]:
        """Match a SEND_RECEIPT's sequence id against the head; pops the head when it matches."""
        if not self._queue:
            return ReceiptMatch.DUPLICATE, None
        head = self._queue[0]
        if sequence_id < head.sequence_id:
            return ReceiptMatch.DUPLICATE, None
        if sequence_id > head.sequence_id:
            return ReceiptMatch.UNEXPECTED, head
        self._queue.popleft()
        self.messages -= head.num_messages
        return ReceiptMatch.MATCHED, head

    def expire(self, now: float) -> list[PendingSend[R]]:
        """Remove and return the SENDs whose deadline has passed (they are at the head)."""
        expired = []
        while self._queue and self._queue[0].deadline <= now:
            send = self._queue.popleft()
            self.messages -= send.num_messages
            expired.append(send)
        return expired

    def next_deadline(self) -> float | None:
        return self._queue[0].deadline if self._queue else None

    def unwritten(self, epoch: int) -> Iterator[PendingSend[R]]:
        """SENDs not yet written on connection ``epoch``, in order (for resending)."""
        return (send for send in self._queue if send.written_epoch != epoch)

    def clear(self) -> list[PendingSend[R]]:
        sends = list(self._queue)
        self._queue.clear()
        self.messages = 0
        return sends
