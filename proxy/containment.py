"""What one connection's failure may cost: that connection, never the server around it.

Every server of pulsar-tap (the proxy, the embedded broker, ``replay --serve``) and the
built-in client run each connection in a nursery of its own, inside the server's (or
the client's) long-lived nursery.  A peer that resets, half-closes or cuts its socket
makes Trio raise ``BrokenResourceError`` / ``ClosedResourceError`` (or a bare
``OSError`` from a raw socket call) in whichever task of the connection touches the
socket next — and since Trio's nurseries group what their children raise in an
``ExceptionGroup``, a plain ``except BrokenResourceError`` around the nursery does not
catch it: the group travels on and tears down every other connection and the listener.

:func:`contained` is the one place that stops it.  Wrapped around a connection's
handler, it absorbs peer loss (in a group or not) with one debug line, absorbs any other
``Exception`` (a bug: one error line with the traceback), and lets cancellation and
``KeyboardInterrupt`` through, so shutdown still works.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Final

import trio

#: what a peer's reset, half-close or cut surfaces as
PEER_LOSS: Final = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@contextlib.contextmanager
def contained(log: Any, what: str, **fields: object) -> Iterator[None]:
    """Run one connection's work; whatever it raises ends that connection only.

    ``log`` is a structlog logger or a stdlib one; ``what`` names the connection in the
    log line ("broker connection", "replay connection", ...), ``fields`` add context.
    """
    structured = not isinstance(log, logging.Logger)
    try:
        yield
    except* PEER_LOSS as group:
        if structured:
            log.debug(f"{what} lost", error=_first_message(group), **fields)
        else:
            log.debug("%s lost: %s", what, _first_message(group))
    except* Exception as group:
        if structured:
            log.error(f"{what} failed; closed", exc_info=group, **fields)
        else:
            log.error("%s failed; closed", what, exc_info=group)


def _first_message(group: BaseExceptionGroup[BaseException]) -> str:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__


__all__ = ["PEER_LOSS", "contained"]
