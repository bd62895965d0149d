"""A one-shot result that Trio tasks can await: the receipt of one sent message.

Trio has no futures; a producer completes a :class:`Receipt` from the connection's
reader task when SEND_RECEIPT (or a failure) arrives, and any number of tasks may
``await receipt.wait()`` for the MessageId.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from proxy.client.message import MessageId
from proxy.errors import ClientError


class Receipt:
    """The outcome of sending one message: a MessageId or the error that ended it."""

    __slots__ = ("_event", "_message_id", "_error", "_callbacks", "created")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._message_id: MessageId | None = None
        self._error: ClientError | None = None
        self._callbacks: list[Callable[[Receipt], None]] = []
        self.created = trio.current_time()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, message_id: MessageId) -> None:
        if not self._event.is_set():
            self._message_id = message_id
            self._finish()

    def set_error(self, error: ClientError) -> None:
        if not self._event.is_set():
            self._error = error
            self._finish()

    def add_done_callback(self, callback: Callable[[Receipt], None]) -> None:
        """Call ``callback(receipt)`` once it completes (at once if it already has)."""
        if self._event.is_set():
            callback(self)
        else:
            self._callbacks.append(callback)

    def _finish(self) -> None:
        self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def result(self) -> MessageId:
        """The MessageId of a completed receipt; raises its error."""
        if self._error is not None:
            raise self._error
        if self._message_id is None:
            raise ClientError("the message has not been receipted yet")
        return self._message_id

    @property
    def error(self) -> ClientError | None:
        return self._error

    async def wait_done(self) -> None:
        """Wait until the receipt completes, successfully or not."""
        await self._event.wait()

    async def wait(self) -> MessageId:
        await self._event.wait()
        return self.result()
