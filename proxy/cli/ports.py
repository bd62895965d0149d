"""Listen addresses checked before a server starts, so a busy port is one line naming it."""

from __future__ import annotations

import contextlib
import socket

from proxy.errors import UsageError


def check_can_listen(host: str, port: int, flag: str) -> None:
    """UsageError ``cannot listen on HOST:PORT (FLAG): Address already in use`` (or the OS's reason).

    Port 0 (an ephemeral port) always can.  The probe binds with SO_REUSEADDR, as the
    servers do, and closes at once: a port in TIME_WAIT is free, one with a listener is not.
    """
    if port == 0:
        return
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise UsageError(f"cannot listen on {shown} ({flag}): cannot resolve {host}: {exc.strerror or exc}") from None
    family, type_, proto, _, address = infos[0]
    with contextlib.closing(socket.socket(family, type_, proto)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(f"cannot listen on {shown} ({flag}): {exc.strerror or exc}") from None


__all__ = ["check_can_listen"]
