"""The producer's batch container (C++ ``BatchMessageContainer``), sans-IO.

Messages wait here until the batch is full — ``max_messages`` messages or
``max_bytes`` payload bytes — or the publish delay expires (the caller's timer).
A message that would push a non-empty batch over ``max_bytes`` flushes the batch
first, so a batch never exceeds the limit unless it holds a single message.
"""

from __future__ import annotations

from typing import Final, Generic, TypeVar

from proxy.client.outgoing import OutgoingMessage

R = TypeVar("R")

#: Official client defaults: 1000 messages, 128 KiB, 10 ms.
DEFAULT_MAX_MESSAGES: Final = 1000
DEFAULT_MAX_BYTES: Final = 128 * 1024
DEFAULT_MAX_DELAY: Final = 0.010


class BatchContainer(Generic[R]):
    """Messages collected for the next batch, in send order."""

    def __init__(self, max_messages: int = DEFAULT_MAX_MESSAGES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("a batch must allow at least one message and one byte")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._messages: list[OutgoingMessage[R]] = []
        self.size_bytes = 0

    def __len__(self) -> int:
        return len(self._messages)

    def has_space_for(self, msg: OutgoingMessage[R]) -> bool:
        """Whether ``msg`` fits without flushing first (an empty batch always takes one)."""
        if not self._messages:
            return True
        return len(self._messages) < self.max_messages and self.size_bytes + msg.size <= self.max_bytes

    def add(self, msg: OutgoingMessage[R]) -> bool:
        """Add ``msg``; returns True when the batch is now full and must be flushed."""
        if not self.has_space_for(msg):
            raise ValueError("batch has no space for this message; flush first")
        self._messages.append(msg)
        self.size_bytes += msg.size
        return self.is_full

    @property
    def is_full(self) -> bool:
        return len(self._messages) >= self.max_messages or self.size_bytes >= self.max_bytes

    def drain(self) -> list[OutgoingMessage[R]]:
        """Take every message out (the batch to send now)."""
        messages, self._messages, self.size_bytes = self._messages, [], 0
        return messages
