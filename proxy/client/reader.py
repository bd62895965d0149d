"""The reader (C++ ``ReaderImpl``): a non-durable, exclusive consumer positioned by message id.

A reader subscribes with ``durable = false`` and ``start_message_id``; the broker
keeps no cursor for it, so after a reconnection the reader asks again from the
last message it handed out.  Messages up to the start id (inside a batch, too) are
skipped on the client unless ``inclusive`` is set, as the official clients do.
"""

from __future__ import annotations

from proxy.client.consumer import Consumer
from proxy.client.message import Message, MessageId


class Reader:
    """Read a topic (not partitioned, or one partition) from a position onwards."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer

    @property
    def topic(self) -> str:
        return self._consumer.topic

    @property
    def last_message_id(self) -> MessageId | None:
        return self._consumer.last_dequeued

    async def read_next(self) -> Message:
        """The next message after the last one read (wrap in ``trio.fail_after`` to bound the wait)."""
        return await self._consumer.receive()

    def has_reached_end_of_topic(self) -> bool:
        return self._consumer.reached_end_of_topic

    async def close(self) -> None:
        await self._consumer.close()
