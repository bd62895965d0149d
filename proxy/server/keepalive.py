"""One keepalive timer for every relay of a server, in place of a task per connection.

Every fraction of the keepalive interval (a quarter, between 10 ms and 1 s) the wheel asks each
open relay's pipeline for its keepalive and handshake deadlines (:meth:`Relay.keepalive_tick`): a
PING is due, a silent peer is dead, no CONNECT came.  That is a few attribute reads per relay, so
one task serves them all; what a tick must write (a PING) or end (a close) is carried out by a task
of that relay's own, started only then, so a slow socket holds up no other relay's timer.  A relay
is registered while it runs (:meth:`Relay.run`): connections that come and go cost a set insert
and removal, not a task with its own timer.

A deadline is passed by at most one period, as with a timer per connection (whose ticks were
timed from its accept, these from the wheel's start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from proxy.server.relay import Relay


class KeepaliveWheel:
    """The server's keepalive timer: :meth:`run` it in the server's nursery; relays :meth:`add` themselves."""

    def __init__(self, keepalive_ns: int) -> None:
        interval_s = keepalive_ns / 1e9
        #: seconds between two ticks
        self.period = min(max(interval_s / 4, 0.01), 1.0)
        self.relays: set[Relay] = set()
        self.running = False
        self._scope: trio.CancelScope | None = None

    def add(self, relay: Relay) -> None:
        self.relays.add(relay)

    def discard(self, relay: Relay) -> None:
        self.relays.discard(relay)

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick until :meth:`stop` (or cancelled)."""
        self.running = True
        try:
            with trio.CancelScope() as self._scope:
                task_status.started()
                while True:
                    await trio.sleep(self.period)
                    for relay in list(self.relays):  # (a tick may end a relay: it leaves the set later)
                        relay.keepalive_tick()
        finally:
            self.running = False
            self._scope = None
