"""The part of ASGI both admin APIs share: the application's types and every scope but HTTP.

ASGI 3.0 (asgi.readthedocs.io, "Lifespan Protocol"): the server sends
``lifespan.startup`` and, on the way out, ``lifespan.shutdown``; the application
answers each with ``.complete``.  Neither admin API holds resources over its life,
so both answer at once; scopes of other types (websocket) are ignored.  Imports
no framework, no sockets.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def answered_outside_http(scope: Scope, receive: Receive, send: Send) -> bool:
    """Serve a scope that is not an HTTP request and return True; return False for an HTTP request."""
    scope_type: str = scope["type"]
    if scope_type == "lifespan":
        await _answer_lifespan(receive, send)
        return True
    return scope_type != "http"


async def _answer_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown; returns once shutdown is acknowledged."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
