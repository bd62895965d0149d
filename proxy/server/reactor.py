"""The fast path's event loop: one task serving every plain-socket relay direction.

A relay direction that would otherwise wake its own Trio task for each chunk (one
task switch, one EPOLLONESHOT re-arm per hop) registers its socket here once,
edge-triggered.  When sockets become readable the reactor calls their handlers
synchronously, in one batch per wake-up: a handler reads, runs the sans-IO
pipeline and writes, as long as nothing has to wait.  The moment something must
wait (a partial write, connecting upstream, a rule's delay, a close, an error),
the handler hands the work to its direction's own task and stands aside until that
task has finished it — so ordering and backpressure are exactly the async path's.

Fairness: a handler reads at most a few chunks per call and asks to be called again;
the reactor yields to Trio between rounds.  Handlers never raise into the reactor.
"""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import Callable
from typing import Final

import trio

#: a handler gets the epoll flags (0 when called again) and returns True when it stopped
#: early and wants another call
Handler = Callable[[int], bool]

_EVENTS: Final = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET


class Reactor:
    """An edge-triggered epoll of relay sockets, polled by one task; see the module docstring."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._handlers: dict[int, Handler] = {}
        self._again: list[int] = []
        self.rounds = 0
        self._scope = trio.CancelScope()

    def stop(self) -> None:
        self._scope.cancel()

    def register(self, sock: socket.socket, handler: Handler) -> None:
        fd = sock.fileno()
        if self._epoll.closed:
            raise trio.ClosedResourceError("the proxy is shutting down")
        self._handlers[fd] = handler
        self._epoll.register(fd, _EVENTS)

    def unregister(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if fd < 0:
            return
        if self._handlers.pop(fd, None) is not None:
            with contextlib.suppress(OSError, ValueError):  # ValueError: the reactor already stopped
                self._epoll.unregister(fd)

    async def run(self) -> None:
        try:
            with self._scope:
                await self._loop()
        finally:
            self._epoll.close()

    async def _loop(self) -> None:
        while True:
            if self._again:
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
            ready = [(fd, 0) for fd in self._again]
            self._again = []
            ready.extend(self._epoll.poll(0))
            self.rounds += 1
            handlers = self._handlers
            for fd, flags in ready:
                handler = handlers.get(fd)
                if handler is not None and handler(flags):
                    self._again.append(fd)
