"""The fast path's event loop: one epoll serving every plain-socket relay direction.

A relay direction that would otherwise wake its own Trio task for each chunk (one
task switch, one EPOLLONESHOT re-arm per hop) registers its socket here once,
edge-triggered.  When sockets become readable the reactor calls their handlers
synchronously, in one batch per wake-up: a handler reads, runs the sans-IO
pipeline and writes, as long as nothing has to wait.  The moment something must
wait (a partial write, connecting upstream, a rule's delay, a close, an error),
the handler hands the work to its direction's own task and stands aside until that
task has finished it — so ordering and backpressure are exactly the async path's.

Where the reactor waits.  A Trio wake-up per hop costs a round of Trio's scheduler
and a re-arm of the reactor's epoll in Trio's (~10 us of CPU per hop on a slow
machine, more than the proxy's own work on a one-frame read).  So the reactor waits
*in Trio's place*: a Trio instrument's ``before_io_wait`` (called when Trio is about
to block in its epoll) blocks in the reactor's epoll instead — which holds Trio's
epoll too, level-triggered — for no longer than Trio would have slept.  Relay
sockets that become readable meanwhile are served right there, hop after hop:
epoll_wait, recv, sendmsg, and no task switched (that loop and the handlers it calls
are :mod:`proxy.server.hop`, compiled).  The wait ends as soon as Trio has
something to do: its epoll is readable (I/O for a task, a signal, a thread's
``run_sync_soon``; Trio's own wait then returns at once), or a handler made a task
runnable, or Trio's next deadline came (in these two cases Trio's wait is woken, so
Trio runs on exactly as if it had slept itself).  Trio's epoll and run queue are
reached through its runner, which is not public API: trio is pinned, and
:class:`LoopWait` declines a runner it does not recognise.  The reactor then — and
under a clock other than Trio's own (virtual time in tests), and for every reactor
but the first of a run — is a task that waits for its epoll through Trio.

Fairness: a handler reads at most a few chunks per call and asks to be called again;
such a round is served without waiting, and Trio runs between rounds whenever it
has anything to do.  Handlers never raise into the reactor.
"""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import Callable
from typing import Any, Final

import structlog
import trio

from proxy.server.hop import ReactorPump, serve_in_trios_place
from proxy.server.plain_socket import ReceiveScratch

_EVENTS: Final = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET

log = structlog.get_logger("pulsar_tap.proxy")

#: the reactor waiting in Trio's place in this run (one per run: its epoll holds Trio's)
_WAITING_IN_TRIOS_PLACE: trio.lowlevel.RunVar[Reactor | None] = trio.lowlevel.RunVar("reactor_in_trios_place",
                                                                                      default=None)


class Reactor:
    """An edge-triggered epoll of relay sockets; see the module docstring."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        #: each socket's handler: its pump's ``on_readable`` gets the epoll flags (0 when called
        #: again) and returns True when it stopped early and wants another call (a pump, not a
        #: bound method: the compiled loop calls it as a C call)
        self._handlers: dict[int, ReactorPump] = {}
        self._again: list[int] = []
        self.rounds = 0
        #: what its handlers' transports read into (see PlainSocket.try_receive)
        self.scratch = ReceiveScratch()
        self._scope = trio.CancelScope()
        #: while the reactor waits in Trio's place: the instrument doing it
        self.loop_wait: LoopWait | None = None

    def stop(self) -> None:
        self._scope.cancel()

    def register(self, sock: socket.socket, handler: ReactorPump) -> None:
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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`stop`; ``task_status.started`` once it knows where it waits."""
        try:
            with self._scope:
                if _WAITING_IN_TRIOS_PLACE.get() is None:
                    self.loop_wait = LoopWait.install(self)
                task_status.started()
                if self.loop_wait is not None:
                    _WAITING_IN_TRIOS_PLACE.set(self)
                    try:
                        await self.loop_wait.failed.wait()
                    finally:
                        _WAITING_IN_TRIOS_PLACE.set(None)
                        self.loop_wait.remove()
                        self.loop_wait = None
                    # the failed wait may have taken events it did not serve: every handler looks once
                    self._again[:] = self._handlers
                await self._loop()
        finally:
            self._epoll.close()

    async def _loop(self) -> None:
        """The reactor as a task: wait for its epoll through Trio."""
        while True:
            if self._again:
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
            self.serve(self._epoll.poll(0))

    def serve(self, events: list[tuple[int, int]]) -> None:
        """One round: call the handlers of those that asked to be called again, and of ``events``."""
        self.rounds += 1
        if self._again:
            ready = [(fd, 0) for fd in self._again]
            self._again.clear()  # (the same list throughout: the wait loop holds it)
            ready.extend(events)
            events = ready
        handlers = self._handlers
        for fd, flags in events:
            handler = handlers.get(fd)
            if handler is not None and handler.on_readable(flags):
                self._again.append(fd)

    def wait_in_trios_place(self, timeout: float, loop: LoopWait) -> None:
        """Trio is about to sleep up to ``timeout`` s: serve the relay sockets until it has something to do."""
        serve_in_trios_place(self, self._epoll, self._handlers, self._again, timeout, loop)


class LoopWait(trio.abc.Instrument):
    """The instrument through which a reactor waits in the place of Trio's epoll wait (module docstring)."""

    def __init__(self, reactor: Reactor, runner: Any) -> None:
        # (what is read of Trio's runner: each is mutated in place, never replaced, for the whole run)
        self.reactor = reactor
        #: Trio's run queue: a task is ready to run while it is not empty
        self.runq: Any = runner.runq
        self._waiting_for_idle = runner.waiting_for_idle
        self.wake: Callable[[], None] = runner.io_manager.force_wakeup
        """Make Trio's wait, which comes next, return at once."""
        self.epoll_fd: int = runner.io_manager._epoll.fileno()
        #: set when waiting in Trio's place failed (a bug): the reactor goes on as a task
        self.failed = trio.Event()

    @classmethod
    def install(cls, reactor: Reactor) -> LoopWait | None:
        """Hook into the current Trio run; None if its loop is not one this knows how to wait for."""
        try:
            from trio._core._run import GLOBAL_RUN_CONTEXT, SystemClock

            runner = GLOBAL_RUN_CONTEXT.runner
            if type(runner.clock) is not SystemClock or runner.is_guest:
                return None
            loop_wait = cls(reactor, runner)
        except (ImportError, AttributeError):
            return None
        reactor._epoll.register(loop_wait.epoll_fd, select.EPOLLIN)
        trio.lowlevel.add_instrument(loop_wait)
        return loop_wait

    def remove(self) -> None:
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(self)
        with contextlib.suppress(OSError, ValueError):
            self.reactor._epoll.unregister(self.epoll_fd)

    def before_io_wait(self, timeout: float) -> None:
        if self._waiting_for_idle:
            timeout = 0.0  # a test's wait_all_tasks_blocked: Trio's wait must end as idle as it began
        try:
            self.reactor.wait_in_trios_place(timeout, self)
        except BaseException as exc:
            # (Trio would drop the instrument and the relay sockets would wait forever)
            log.error("the reactor failed waiting in Trio's place; it goes on as a task", error=repr(exc))
            self.remove()
            self.failed.set()
            self.wake()
