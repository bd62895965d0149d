"""``lookup: proxy-through``: the proxy follows a lookup's Redirects itself.

In this mode (how Apache Pulsar's own proxy works, its ``LookupProxyHandler``) a
client only ever dials the service URL.  When the broker answers a client's LOOKUP
with Redirect, the proxy does not pass the Redirect on: it looks the topic up again
at the broker the Redirect names — with the Redirect's ``authoritative`` flag, as a
client would — and again at every further Redirect, at most :data:`MAX_REDIRECTS`
times.  The owner's Connect (or its Failed answer) then goes to the client, which
reconnects to the service URL naming that broker in ``proxy_to_broker_url``.
Following fails with ServiceNotReady (as Pulsar's proxy answers) when the hops run
out or a broker cannot be reached.

:class:`LookupLinks` holds the proxy's own connections for this, per client
connection, one per broker asked (opened on first use, kept until the client
connection ends).  Each opens with the client's own CONNECT (what the proxy sent
upstream for it), so the broker authenticates the lookup as it does the client's.
Lookups on one link are asked one at a time.  The request ids are the proxy's own;
the answer handed back carries the client's.
"""

from __future__ import annotations

import itertools
import ssl
from collections.abc import Callable
from typing import Final

import structlog
import trio

from proxy.config.proxy_config import ServiceUrl
from proxy.core.lookup import Redirected, failed_answer
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import FrameDecoder, encode_command
from proxy.protocol.keepalive import PONG_FRAME
from proxy.server.transport import Transport
from proxy.server.upstream import UpstreamUnavailable, open_upstream

log = structlog.get_logger("pulsar_tap.proxy")

LookupType = api.CommandLookupTopicResponse.LookupType

#: Redirects followed for one lookup before it fails (Pulsar's proxy allows 10)
MAX_REDIRECTS: Final = 10
#: how long one hop (connect, CONNECTED, LOOKUP answer) may take
HOP_TIMEOUT_S: Final = 30.0


class LookupFailed(Exception):
    """Following a Redirect failed; the message goes to the client in a Failed answer."""


class _Link:
    """The proxy's own connection to one broker, for lookups (opened by the first lookup that needs it)."""

    def __init__(self) -> None:
        self.transport: Transport | None = None
        self.decoder = FrameDecoder()
        self.lock = trio.Lock()

    async def ask(self, request: bytes, request_id: int) -> api.CommandLookupTopicResponse:
        transport = self.transport
        assert transport is not None
        await transport.send([request])
        while True:
            data = await transport.receive()
            if not data:
                raise LookupFailed(f"{transport.peer} closed the connection")
            for frame in self.decoder.receive(data):
                if frame.type == T.PING:
                    await transport.send([PONG_FRAME])
                elif frame.type == T.LOOKUP_RESPONSE and frame.command.lookupTopicResponse.request_id == request_id:
                    return frame.command.lookupTopicResponse

    async def aclose(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            await transport.aclose()


class LookupLinks:
    """One client connection's lookup connections to brokers; see the module docstring."""

    def __init__(self, connect: bytes, tls_context: ssl.SSLContext | None,
                 broker_url: Callable[[str, str], ServiceUrl | None]) -> None:
        #: the CONNECT the proxy sent upstream for the client (its auth, its versions)
        self._connect = connect
        self._tls_context = tls_context
        #: (plain, tls) -> the URL to dial, as the broker directory decides (matches the upstream's scheme)
        self._broker_url = broker_url
        self._links: dict[ServiceUrl, _Link] = {}
        self._request_ids = itertools.count(1)

    async def follow(self, redirected: Redirected) -> bytes:
        """The final answer to ``redirected.lookup``, with the client's request id (raises LookupFailed)."""
        lookup = redirected.lookup
        broker, authoritative = redirected.broker, redirected.authoritative
        for _ in range(MAX_REDIRECTS):
            request_id = next(self._request_ids)
            request = api.CommandLookupTopic()
            request.CopyFrom(lookup)
            request.request_id = request_id
            request.authoritative = authoritative
            with trio.move_on_after(HOP_TIMEOUT_S) as hop:
                answer = await self._ask(broker, request, request_id)
            if hop.cancelled_caught:
                raise LookupFailed(f"no lookup answer from {broker.address} within {HOP_TIMEOUT_S:g}s")
            if answer.response != LookupType.Redirect:
                final = api.CommandLookupTopicResponse()
                final.CopyFrom(answer)
                final.request_id = lookup.request_id
                return encode_command(final)
            log.debug("proxy-through: following a Redirect", topic=lookup.topic, to=answer.brokerServiceUrl)
            target = self._broker_url(answer.brokerServiceUrl, answer.brokerServiceUrlTls)
            if target is None:
                raise LookupFailed("a Redirect named no broker the proxy can reach")
            broker, authoritative = target, answer.authoritative
        raise LookupFailed("Reached max number of redirections")

    async def _ask(self, broker: ServiceUrl, request: api.CommandLookupTopic,
                   request_id: int) -> api.CommandLookupTopicResponse:
        link = self._links.get(broker)
        if link is None:
            link = self._links[broker] = _Link()
        async with link.lock:
            try:
                if link.transport is None:
                    link.transport = await self._open(broker)
                return await link.ask(encode_command(request), request_id)
            except (UpstreamUnavailable, ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if self._links.get(broker) is link:
                    del self._links[broker]
                await link.aclose()
                raise LookupFailed(f"lookup at {broker.address} failed: {exc}") from None

    async def _open(self, broker: ServiceUrl) -> Transport:
        transport = await open_upstream(broker, self._tls_context)
        decoder = FrameDecoder()
        try:
            await transport.send([self._connect])
            while True:
                data = await transport.receive()
                if not data:
                    raise LookupFailed(f"{broker.address} closed the connection before CONNECTED")
                for frame in decoder.receive(data):
                    if frame.type == T.CONNECTED:
                        return transport
                    if frame.type == T.ERROR:
                        raise LookupFailed(f"{broker.address} refused the connection: "
                                           f"{frame.command.error.message}")
                    if frame.type == T.AUTH_CHALLENGE:
                        raise LookupFailed(f"{broker.address} asked for authentication the proxy cannot answer")
        except BaseException:
            await transport.aclose()
            raise

    @property
    def local_addresses(self) -> list[str]:
        """The proxy's own addresses on its lookup connections (what those brokers see as peer)."""
        return [link.transport.local_address for link in self._links.values() if link.transport is not None]

    async def aclose(self) -> None:
        links, self._links = self._links, {}
        for link in links.values():
            await link.aclose()


__all__ = ["MAX_REDIRECTS", "LookupFailed", "LookupLinks", "Redirected", "failed_answer"]
