"""Keeping a producer or consumer registered on its topic's broker, across broken connections.

Pulsar protocol, "Producer" and "Consumer": a producer (PRODUCER) or consumer
(SUBSCRIBE) lives on one connection.  When that connection breaks, or the broker
closes it (CLOSE_PRODUCER / CLOSE_CONSUMER on a topic unload), the client looks the
topic up again and registers anew, with backoff (100 ms doubling to 60 s) — the
first attempt too, as the official clients wait a backoff delay before reconnecting,
so a connection that keeps breaking right after registering costs a reconnection
every ~100 ms, not a busy loop.  The
first registration gives up after the operation timeout, or at once on an error
retrying cannot help; later ones keep trying until closed.

:class:`ReconnectingHandle` is that loop, written once for
:class:`~proxy.client.producer.Producer` and :class:`~proxy.client.consumer.Consumer`;
each says how it registers, which broker errors are final, and which timers run
beside it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, ClassVar, Self

import trio

from proxy.client.backoff import Backoff
from proxy.client.connection import ClientConnection
from proxy.errors import BrokerError, ClientClosed, ConnectionFailed, RequestTimeout

if TYPE_CHECKING:
    from proxy.client.client import PulsarClient


class ReconnectingHandle(ABC):
    """A producer or consumer that keeps itself registered on the broker until closed."""

    #: broker errors after which retrying cannot help (the official clients give up on these)
    NON_RETRYABLE: ClassVar[frozenset[str]]
    #: what the log says is about to happen again, e.g. "reconnecting"
    RETRY_ACTION: ClassVar[str]

    def __init__(self, client: PulsarClient) -> None:
        self.client = client
        self._connection: ClientConnection | None = None
        self._ready = False
        self._disconnected = trio.Event()
        self._state_changed = trio.Event()
        self._closing = False
        self._cancel = trio.CancelScope()
        self._backoff = Backoff()
        self.reconnects = 0
        #: while not connected, why: the lost connection's reason, then each failed attempt's error (None: connected
        #: or never lost)
        self.problem: str | None = None

    @property
    def is_connected(self) -> bool:
        return self._ready

    @abstractmethod
    async def _register(self) -> None:
        """Register on the broker that owns the topic (connection and request); raise if that fails."""

    @abstractmethod
    def _timers(self) -> Iterable[Callable[[], Awaitable[None]]]:
        """The background tasks that run while the handle is open."""

    @abstractmethod
    def _unregister(self, connection: ClientConnection) -> None:
        """Stop taking ``connection``'s frames for this producer or consumer (it is being forgotten)."""

    def _lose_connection(self, reason: str) -> None:
        """Forget the current connection and wake :meth:`run` to register again."""
        if self._connection is not None:
            self._unregister(self._connection)
        self._connection = None
        if self._ready or not self._disconnected.is_set():
            logging.getLogger(type(self).__module__).info("%r disconnected: %s", self, reason)
        self.problem = reason
        self._ready = False
        self._disconnected.set()
        self._notify_state()

    def _gave_up_retrying(self, error: BrokerError | ConnectionFailed | RequestTimeout) -> None:  # noqa: B027
        """Called when a re-registration failed with an error retrying cannot help; the loop goes on."""

    async def run(self, *, task_status: trio.TaskStatus[Self] = trio.TASK_STATUS_IGNORED) -> None:
        """Register, report started, then stay registered until closed."""
        with self._cancel:
            await self._keep_trying(first=True)
            async with trio.open_nursery() as nursery:
                for timer in self._timers():
                    nursery.start_soon(timer)
                task_status.started(self)
                while not self._closing:
                    await self._disconnected.wait()
                    if self._closing:
                        break
                    self.reconnects += 1
                    self._notify_state()
                    await trio.sleep(self._backoff.next())
                    await self._keep_trying(first=False)
                nursery.cancel_scope.cancel()

    async def _keep_trying(self, *, first: bool) -> None:
        """(Re)register with backoff; the first attempt gives up after the operation timeout."""
        deadline = trio.current_time() + self.client.config.operation_timeout
        while not self._closing:
            try:
                await self._register()
            except (ConnectionFailed, BrokerError, RequestTimeout) as exc:
                self.problem = str(exc)
                retryable = not (isinstance(exc, BrokerError) and exc.server_error in self.NON_RETRYABLE)
                delay = self._backoff.next()
                if first and (not retryable or trio.current_time() + delay > deadline):
                    raise
                if not retryable:
                    self._gave_up_retrying(exc)
                # Logged under the producer's or consumer's own logger, which is where users filter for it.
                logging.getLogger(type(self).__module__).info(
                    "%r: %s in %.2f s after: %s", self, self.RETRY_ACTION, delay, exc)
                await trio.sleep(delay)
                continue
            self._backoff.reset()
            self.problem = None
            return

    def _notify_state(self) -> None:
        self._state_changed.set()
        self._state_changed = trio.Event()

    def _stop_reconnecting(self) -> None:
        """On close: drop the connection, wake every waiter, and end :meth:`run`."""
        self._connection = None
        self._ready = False
        self._disconnected.set()
        self._notify_state()
        self._cancel.cancel()

    async def wait_connected(self, min_reconnects: int = 0) -> None:
        """Wait until connected after at least ``min_reconnects`` reconnections."""
        while self.reconnects < min_reconnects or not self._ready:
            if self._closing:
                raise ClientClosed(f"{self!r} is closed")
            await self._state_changed.wait()

    # -- FrameHandler ----------------------------------------------------------------------

    def connection_closed(self, connection: ClientConnection) -> None:
        if connection is self._connection:
            self._lose_connection(f"connection closed: {connection.close_reason}")
