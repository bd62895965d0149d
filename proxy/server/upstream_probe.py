"""Is the upstream there?  A probe at start and then periodically, for the log and ``/healthz``.

``pulsar-tap run`` serves clients even when its upstream is down (the broker may
come later), but says so: :func:`probe_upstream` opens a connection to the
upstream service URL as the relay would (TCP, and the TLS handshake for
``pulsar+ssl://``), closes it, and records the answer in an
:class:`UpstreamHealth`.  The first failure is one clear warning log line; the
return is logged too.  A TLS handshake that fails (e.g. ``pulsar+ssl://`` aimed
at a plaintext port) is reported as such.  The probe repeats every
:data:`DOWN_INTERVAL_S` while the upstream is unreachable and every
:data:`UP_INTERVAL_S` while it is reachable.  ``/healthz`` reports
``{"status": "ok", "upstream": "reachable" | "unreachable" | "unknown", ...}``.
"""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from typing import Any, Final

import structlog
import trio

from proxy.config.proxy_config import ServiceUrl
from proxy.server.upstream import UpstreamUnavailable, open_upstream

log = structlog.get_logger("pulsar_tap.proxy")

DOWN_INTERVAL_S: Final = 2.0
UP_INTERVAL_S: Final = 10.0
PROBE_TIMEOUT_S: Final = 5.0


@dataclass(slots=True)
class UpstreamHealth:
    """The last probe's answer."""

    url: str
    state: str = "unknown"
    reason: str | None = None
    #: Unix epoch ns of the last probe, and of the last change of state
    checked_ns: int | None = None
    since_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"upstream": self.state, "upstream_url": self.url}
        if self.reason is not None:
            body["upstream_error"] = self.reason
        if self.since_ns is not None:
            body["upstream_since_ns"] = self.since_ns
        return body


async def check_upstream(url: ServiceUrl, context: ssl.SSLContext | None) -> str | None:
    """None when ``url`` answers (TCP, and TLS for pulsar+ssl://); else why not."""
    with trio.move_on_after(PROBE_TIMEOUT_S):
        try:
            transport = await open_upstream(url, context)
        except UpstreamUnavailable as exc:
            reason = str(exc)
            if url.tls and "TLS" in reason:
                reason += (" (is it a TLS port? pulsar+ssl:// needs the broker's TLS listener, "
                           "6651 by default)")
            return reason
        await transport.aclose()
        return None
    return f"no answer from {url.address} within {PROBE_TIMEOUT_S:g}s" + (
        " (a TLS handshake with a plaintext port can hang like this)" if url.tls else "")


async def probe_upstream(url: ServiceUrl, context: ssl.SSLContext | None, health: UpstreamHealth,
                         answered: trio.Event | None = None) -> None:
    """Probe until cancelled, logging each change; ``answered`` is set after the first answer."""
    while True:
        reason = await check_upstream(url, context)
        now = time.time_ns()
        state = "reachable" if reason is None else "unreachable"
        if state != health.state:
            if state == "unreachable":
                log.warning("upstream unreachable: serving anyway; clients' connections will be closed until "
                            "it answers", upstream=str(url), error=reason)
            elif health.state == "unreachable":
                log.info("upstream reachable again", upstream=str(url))
            else:
                log.info("upstream reachable", upstream=str(url))
            health.since_ns = now
        health.state, health.reason, health.checked_ns = state, reason, now
        if answered is not None:
            answered.set()
        await trio.sleep(UP_INTERVAL_S if reason is None else DOWN_INTERVAL_S)


__all__ = ["UpstreamHealth", "check_upstream", "probe_upstream"]
