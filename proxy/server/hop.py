"""The reactor's hop: one plain-socket relay direction read, decided and written without waiting.

While Trio would sleep, the :class:`~proxy.server.reactor.Reactor` waits in its place
(:func:`serve_in_trios_place`).  When a relay socket becomes readable it calls its
direction's :meth:`ReactorPump.on_readable`: it receives, runs the sans-IO pipeline and writes
at once — the usual read as it came (:meth:`~proxy.core.pipeline.ConnectionPipeline.relay_read`
says so), any other the pipeline's Sends — as long as nothing has to wait.  The moment something must
wait (a partial write, connecting upstream, a rule's delay, a close, an error, draining),
it hands the work to the direction's own task (``Relay._serve_with_reactor``) and stands
aside until that task has finished it — so ordering and backpressure are exactly the async
path's.  With observers, the events of a read reach them after its write (the hub defers them
around it), off the request's latency.  This runs once per relayed read, so ``scripts/setup.sh``
compiles this module with mypyc, in the relay's lane (one extension with the socket calls, the pipeline
and the scanner: its calls to them are C calls; see :mod:`proxy.compiled`); the task's side, which awaits,
stays in ``relay``.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import trio

from proxy.core.pipeline import TO_BROKER, Action, Send
from proxy.protocol.session import Direction
from proxy.server.plain_socket import RECV_SIZE, PlainSocket, ReceiveScratch
from proxy.server.transport import READY_STREAK, SocketTransport

if TYPE_CHECKING:
    from proxy.core.pipeline import ConnectionPipeline
    from proxy.server.observer_hub import ObserverHub
    from proxy.server.reactor import LoopWait, Reactor
    from proxy.server.relay import Relay

_HANGUP: Final = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR


class Stop(Exception):
    """Handed from the reactor to a pump task: stop reading (``finished``: the peer sent EOF)."""

    def __init__(self, finished: bool = False) -> None:
        super().__init__("stop")
        self.finished = finished


class ReactorPump:
    """One relay direction served by the reactor until something has to wait.

    ``busy`` says who owns the direction: False, the reactor's handler reads and writes
    synchronously; True, the direction's task is carrying out handed-over work (``work``;
    it will read on until the socket is empty before giving the direction back).
    """

    def __init__(self, relay: Relay, direction: Direction, source: SocketTransport, reactor: Reactor) -> None:
        self.relay = relay
        self.direction = direction
        self.source = source
        self.reactor = reactor
        self.from_client = direction is TO_BROKER
        # (read on every hop: each held here, one attribute away)
        self.pipeline: ConnectionPipeline = relay.pipeline
        self.scratch: ReceiveScratch = reactor.scratch
        # (the clock's two parts, fixed for its life: now is base_ns + elapsed_ns())
        self.base_ns: int = relay.clock.base_ns
        self.elapsed_ns: Callable[[], int] = relay.clock.elapsed_ns
        self.source_plain: PlainSocket = source.plain
        #: the observers' hub when the relay publishes events (None: it publishes none)
        self.hub: ObserverHub | None = relay.server.observers if relay.pipeline.publish is not None else None
        self.busy = True
        self.work: list[Action] | BaseException | None = None
        #: the direction's task, and whether it sleeps until work is handed over (set by it)
        self.task: trio.lowlevel.Task | None = None
        self.parked = False
        self.peer_hung_up = False

    def abort(self, _: object) -> trio.lowlevel.Abort:
        """The parked task was cancelled."""
        self.parked = False
        return trio.lowlevel.Abort.SUCCEEDED

    def hand_over(self, work: list[Action] | BaseException) -> None:
        """Give the direction to its task with ``work`` to carry out (waking it if it sleeps)."""
        self.busy = True
        self.work = work
        if self.parked:
            self.parked = False
            assert self.task is not None
            trio.lowlevel.reschedule(self.task)

    def on_readable(self, flags: int = 0) -> bool:
        """Called by the reactor (and by the task): serve what is readable without waiting.

        True: stopped early with data left (call again).
        """
        if flags & _HANGUP:
            # The peer closed: its FIN may already sit behind the data, so a short read no
            # longer proves the socket empty (no further edge will come).
            self.peer_hung_up = True
        if self.busy:
            return False
        relay, pipeline, direction, hub = self.relay, self.pipeline, self.direction, self.hub
        try:
            for _ in range(READY_STREAK):
                if self.from_client and relay.draining and pipeline.scanners[TO_BROKER].at_frame_boundary:
                    self.hand_over(Stop())
                    return False
                data = self.source_plain.try_receive(self.scratch)
                if not data:
                    if data is None:
                        return False
                    pipeline.peer_closed(direction)
                    self.hand_over(Stop(finished=True))
                    return False
                if hub is None:
                    if not self._relay(data):
                        return False
                else:
                    # (the observers' work on this read after its write, before the next read reuses the buffer)
                    hub.defer()
                    try:
                        relayed = self._relay(data)
                    finally:
                        hub.flush()
                    if not relayed:
                        return False
                if len(data) < RECV_SIZE and not self.peer_hung_up:
                    # A short read emptied the socket; anything newer raises a fresh edge.
                    return False
            return True
        except Exception as exc:  # raised again in the pump task, which knows how to end the connection
            self.hand_over(exc)
            return False

    def _relay(self, data: bytes | memoryview) -> bool:
        """One read through the pipeline and written without waiting; False: the rest was handed to the task."""
        relay, direction = self.relay, self.direction
        actions = self.pipeline.relay_read(direction, data, self.base_ns + self.elapsed_ns())
        if actions is None:  # (the usual read: it goes on as it is, one write, at once)
            target = relay.upstream if self.from_client else relay.client
            left = target.plain.try_send([data]) if type(target) is SocketTransport else None
            if left is None:
                self.hand_over(relay.queue_writes([Send(direction, [data])]))
                return False
            if left:  # (the transport owes the rest)
                self.hand_over([Send(direction, [])])
                return False
        else:
            rest = self._write_now(actions)
            if rest:
                self.hand_over(rest)
                return False
        return True

    def _write_now(self, actions: list[Action]) -> list[Action] | None:
        """Carry out the leading writes that need no wait; the rest goes to the task (its writes queued now)."""
        relay = self.relay
        for index, action in enumerate(actions):
            if type(action) is not Send or action.slice_bytes:
                return actions[index:]
            target = relay.upstream if action.direction is TO_BROKER else relay.client
            left = target.plain.try_send(action.data) if type(target) is SocketTransport else None
            if left is None:
                return relay.queue_writes(actions[index:])
            if left:  # (the transport owes the rest; what follows queues behind it)
                return [Send(action.direction, []), *relay.queue_writes(actions[index + 1:])]
        return None


def serve_in_trios_place(reactor: Reactor, epoll: select.epoll, handlers: dict[int, ReactorPump],
                         again: list[int], timeout: float, loop: LoopWait) -> None:
    """``reactor`` (``epoll``, its sockets' ``handlers``, the sockets to call ``again``) waits in the place
    of Trio, which is about to sleep up to ``timeout`` s: serve the relay sockets until Trio has something to do.

    (See :mod:`proxy.server.reactor`; a round with nobody to call again is served right here, as
    ``Reactor.serve`` serves it, a call level less.)
    """
    poll, loop_fd, runq, clock = epoll.poll, loop.epoll_fd, loop.runq, time.perf_counter
    until = clock() + timeout
    wait = 0.0 if again else timeout
    while True:
        events = poll(wait)
        loop_ready = False
        if again:
            for index, (fd, _) in enumerate(events):
                if fd == loop_fd:
                    loop_ready = True
                    del events[index]
                    break
            reactor.serve(events)
        elif events:
            for fd, flags in events:
                handler = handlers.get(fd)
                if handler is None:  # Trio's epoll, or a socket unregistered meanwhile
                    loop_ready = loop_ready or fd == loop_fd
                elif handler.on_readable(flags):  # (handlers never raise)
                    again.append(fd)
            reactor.rounds += 1  # (counted after the hop's write, not before it)
        if loop_ready or timeout <= 0:
            return  # Trio's own wait returns at once (or does not block)
        left = until - clock()
        if runq or left <= 0:
            # a handler made a task runnable, or the deadline Trio would have woken for came
            loop.wake()
            return
        wait = 0.0 if again else left
