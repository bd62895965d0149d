"""SIGINT and SIGTERM for every ``pulsar-tap`` command: stop the work, print what there is, no traceback.

SPEC.md ("Interrupts"): the first SIGINT or SIGTERM stops the work and the command
prints what it has so far; exit status 0 when what it printed or wrote is a
complete result (a proxy or broker stopped, a load test cut short with its
figures), 130 when the work is left incomplete and a script must know (a replay's
comparison, an export that wrote nothing).  A second signal during shutdown never
shows a traceback: it may only hurry the shutdown along.

Two halves:

- :func:`handling_signals` (``pulsar-tap``'s ``main`` wraps every command in it)
  makes SIGTERM behave as SIGINT: the first one raises ``KeyboardInterrupt`` in
  synchronous code (``show``, ``export``, ``rules check``), and every later one is
  only counted, so shutdown code and summaries are never cut by a traceback.
- :func:`on_signals` (inside ``trio.run``) delivers the signals to a callback
  instead, with the count so far (1 for the first, 2 for the next, ...), for the
  whole time it is open; commands on Trio open it first thing and keep it open
  until their shutdown is complete.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Final

#: exit status of a command the user interrupted before it had a complete result (128 + SIGINT, as shells do)
EXIT_INTERRUPTED: Final = 130
SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)

_received: list[int] = []


def received() -> int:
    """How many SIGINT/SIGTERM this command has received so far."""
    return len(_received)


def _handler(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    if len(_received) == 1:
        raise KeyboardInterrupt
    # shutdown is under way: a further signal is counted, nothing is raised into the cleanup


@contextlib.contextmanager
def handling_signals(*, restore: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt once, then are only counted (main thread only).

    ``restore=False`` (the program itself, about to exit) leaves them ignored
    afterwards: the interpreter resets Python-level handlers to the default while
    it finalises, so a signal arriving then (10 ms after the first, as ``timeout``
    may send it) would kill a process that was exiting cleanly; an ignored signal
    is left ignored.  Otherwise (a caller in the same process, e.g. a test) the
    previous handlers come back.
    """
    _received.clear()
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum in SIGNALS:
        signal.signal(signum, _handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if not restore:
                signal.signal(signum, signal.SIG_IGN)
            else:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def on_signals(callback: Callable[[int], None]) -> Iterator[None]:
    """Inside ``trio.run``: call ``callback(count)`` on the Trio loop for every SIGINT/SIGTERM.

    A plain context manager (no task, no nursery, so no exception is wrapped in a
    group); the callback runs as a Trio ``run_sync_soon`` callback and may cancel
    scopes and set events.  On leaving, the previous handlers come back.
    """
    import trio

    token = trio.lowlevel.current_trio_token()

    def handler(signum: int, frame: FrameType | None) -> None:
        _received.append(signum)
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(callback, len(_received))

    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def stop_requests() -> Iterator[Callable[[], bool]]:
    """SIGINT/SIGTERM only ask to stop; the work polls the callable it gets and stops at a point of its choosing.

    For work that must not be cut between two steps (``export`` renaming its
    finished file into place): a signal after the last check changes nothing.
    """
    before = len(_received)

    def handler(signum: int, frame: FrameType | None) -> None:
        _received.append(signum)

    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield lambda: len(_received) > before
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


def signal_name(count: int = 1) -> str:
    """The name of the ``count``-th signal received (``SIGINT``), for log lines."""
    if 0 < count <= len(_received):
        return signal.Signals(_received[count - 1]).name
    return "signal"


__all__ = ["EXIT_INTERRUPTED", "SIGNALS", "handling_signals", "on_signals", "received", "signal_name",
           "stop_requests"]
