"""Lookup rewriting: brokers the cluster names become proxy addresses, in both modes.

Pulsar binary protocol, "Topic lookup": a LOOKUP_RESPONSE of type Connect or
Redirect names a broker in ``brokerServiceUrl`` / ``brokerServiceUrlTls``; so does
TOPIC_MIGRATED.  The proxy never lets a real broker address reach a client:

- ``rewrite``: both URLs become the proxy listener for that broker
  (``pulsar://ADVERTISE:PORT`` and ``pulsar+ssl://ADVERTISE:PORT``).  Listeners are
  opened on first sight of a broker and stay for the life of the process, so a client
  that follows Redirects reaches the owner broker through the proxy at every hop.
- ``proxy-through``: a Connect answer also gets ``proxy_through_service_url = true``;
  the client reconnects to its service URL and names the broker in CONNECT's
  ``proxy_to_broker_url``, which for the client is the same per-broker proxy address
  (so it is still no real address, and a client that ignores the flag still reaches
  the broker).  The client never sees a Redirect: the proxy follows it itself
  (``redirects``), so clients dial only the service URL.

:class:`BrokerDirectory` maps brokers to listener addresses and back, and decides
which ``proxy_to_broker_url`` values may be routed: a broker seen in a lookup
answer, or one on the configured allow-list — never an arbitrary host a client
names.  It opens listeners through a callback the server provides; nothing else
here does I/O.

When the upstream is itself a proxy (Apache Pulsar's own: its Connect answers carry
``proxy_through_service_url = true``), the brokers it names are reachable only through
it: :meth:`BrokerDirectory.hop` then says to dial the upstream service URL and name
the broker in CONNECT's ``proxy_to_broker_url``, as a client of that proxy would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from proxy.config.proxy_config import HostPort, ServiceUrl
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.frame import Frame, encode_command

LookupType = api.CommandLookupTopicResponse.LookupType

#: frames that name a broker and are rewritten on their way to the client
BROKER_NAMING_TYPES: Final = frozenset({T.LOOKUP_RESPONSE, T.TOPIC_MIGRATED})


class UnroutableBroker(ProtocolError):
    """A CONNECT asked to be proxied to a broker the proxy may not route to."""

    server_error = "ServiceNotReady"


class BrokerDirectory:
    """Brokers the proxy knows, the listener serving each, and what may be routed."""

    def __init__(self, advertised_host: str, *, upstream_tls: bool,
                 open_listener: Callable[[ServiceUrl], int],
                 allowed: Iterable[HostPort] = (), upstream: ServiceUrl | None = None) -> None:
        self.advertised_host = advertised_host
        #: the service URL brokers behind an upstream proxy are reached through
        self.upstream = upstream
        self.upstream_tls = upstream_tls
        self._open_listener = open_listener
        self._allowed = set(allowed)
        self._listener_of: dict[ServiceUrl, HostPort] = {}
        self._broker_of_alias: dict[str, ServiceUrl] = {}
        self._broker_of_address: dict[HostPort, ServiceUrl] = {}
        self._behind_upstream: set[ServiceUrl] = set()

    @property
    def brokers(self) -> dict[ServiceUrl, HostPort]:
        return dict(self._listener_of)

    def listener_for(self, broker: ServiceUrl) -> HostPort:
        """The advertised address of the proxy listener for ``broker`` (opened on first sight)."""
        known = self._listener_of.get(broker)
        if known is not None:
            return known
        port = self._open_listener(broker)
        address = HostPort(self.advertised_host, port)
        self._listener_of[broker] = address
        self._broker_of_alias[str(address)] = broker
        self._broker_of_address[broker.address] = broker
        return address

    def behind_upstream(self, broker: ServiceUrl) -> None:
        """The upstream answered a lookup naming ``broker`` with ``proxy_through_service_url``: it is a proxy,
        and ``broker`` is reachable only through it."""
        if self.upstream is not None and broker.address != self.upstream.address:
            self._behind_upstream.add(broker)

    def hop(self, broker: ServiceUrl) -> tuple[ServiceUrl, str | None]:
        """Where to dial to reach ``broker``, and the ``proxy_to_broker_url`` its CONNECT must name there
        (None: the broker itself is dialled)."""
        if self.upstream is not None and broker in self._behind_upstream:
            return self.upstream, str(broker.address)
        return broker, None

    def route(self, proxy_to_broker_url: str) -> ServiceUrl:
        """The broker a CONNECT's ``proxy_to_broker_url`` names; UnroutableBroker if not allowed."""
        text = proxy_to_broker_url.strip()
        try:
            address = ServiceUrl.parse(text).address if "://" in text else HostPort.parse(text)
        except ValueError:
            raise UnroutableBroker(f"proxy_to_broker_url {proxy_to_broker_url!r} is not HOST:PORT") from None
        broker = self._broker_of_alias.get(str(address)) or self._broker_of_address.get(address)
        if broker is not None:
            return broker
        if address in self._allowed:
            return ServiceUrl(self.upstream_tls, address)
        raise UnroutableBroker(f"proxy_to_broker_url {proxy_to_broker_url!r} names a broker that was "
                               "neither seen in a lookup answer nor allowed by allowed_brokers")

    def broker_url(self, plain: str, tls: str) -> ServiceUrl | None:
        """The URL to dial for a broker announced as (plain, tls), matching the upstream's scheme."""
        chosen = (tls or plain) if self.upstream_tls else (plain or tls)
        if not chosen:
            return None
        try:
            url = ServiceUrl.parse(chosen)
        except ValueError:
            return None
        return ServiceUrl(self.upstream_tls, url.address) if url.tls != self.upstream_tls else url


def rewrite_broker_urls(frame: Frame, directory: BrokerDirectory, mode: str) -> bytes | None:
    """The bytes of ``frame`` with every broker address replaced; None if nothing to change.

    A frame naming a broker URL the proxy cannot use becomes a Failed lookup
    (ServiceNotReady) rather than leak the address.
    """
    cmd = api.BaseCommand()
    cmd.CopyFrom(frame.command)
    if frame.type == T.LOOKUP_RESPONSE:
        sub = cmd.lookupTopicResponse
        if not sub.HasField("response") or sub.response == LookupType.Failed:
            return None
    elif frame.type == T.TOPIC_MIGRATED:
        sub = cmd.topicMigrated
    else:
        return None
    if not sub.brokerServiceUrl and not sub.brokerServiceUrlTls:
        return None
    broker = directory.broker_url(sub.brokerServiceUrl, sub.brokerServiceUrlTls)
    if broker is None:
        if frame.type != T.LOOKUP_RESPONSE:
            sub.ClearField("brokerServiceUrl")
            sub.ClearField("brokerServiceUrlTls")
            return encode_command(cmd)
        failed = api.CommandLookupTopicResponse(
            request_id=cmd.lookupTopicResponse.request_id, response=LookupType.Failed,
            error=api.ServerError.ServiceNotReady,
            message="the broker named by the lookup answer cannot be proxied")
        return encode_command(failed)
    if frame.type == T.LOOKUP_RESPONSE and sub.proxy_through_service_url:
        directory.behind_upstream(broker)
    listener = directory.listener_for(broker)
    sub.brokerServiceUrl = f"pulsar://{listener}"
    sub.brokerServiceUrlTls = f"pulsar+ssl://{listener}"
    if (frame.type == T.LOOKUP_RESPONSE and mode == "proxy-through"
            and cmd.lookupTopicResponse.response == LookupType.Connect):
        cmd.lookupTopicResponse.proxy_through_service_url = True
    return encode_command(cmd)


@dataclass(frozen=True, slots=True)
class Redirected:
    """A client's LOOKUP that a broker answered with Redirect: what to ask whom next."""

    lookup: api.CommandLookupTopic
    broker: ServiceUrl
    authoritative: bool


def failed_answer(request_id: int, message: str) -> bytes:
    """The Failed LOOKUP_RESPONSE (ServiceNotReady) the client gets when following fails."""
    return encode_command(api.CommandLookupTopicResponse(
        request_id=request_id, response=LookupType.Failed, error=api.ServerError.ServiceNotReady, message=message))


