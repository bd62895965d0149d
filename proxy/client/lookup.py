"""Topic discovery over the binary protocol (C++ ``BinaryProtoLookupService``).

Pulsar protocol, "Service discovery": PARTITIONED_METADATA tells how many
partitions a topic has (0: not partitioned); LOOKUP tells which broker owns a
topic.  A LOOKUP answer is ``Connect`` (this broker), ``Redirect`` (ask that
broker, with ``authoritative`` as the response says) or ``Failed``.  With
``proxy_through_service_url`` the client keeps connecting to the service URL but
names the owning broker in CONNECT's ``proxy_to_broker_url`` (how Pulsar's own
proxy routes), which the connection pool expresses as logical != physical address.
Lookups go to the service URL's hosts in turn.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Final

from proxy.client.connection import ClientConnection, ConnectionPool
from proxy.client.names import BrokerAddress, parse_broker_url
from proxy.errors import BrokerError, ClientError, UsageError
from proxy.pb import PulsarApi_pb2 as api

#: As the official clients: give up after this many Redirect answers in a row.
MAX_REDIRECTS: Final = 20

_LookupType = api.CommandLookupTopicResponse.LookupType


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Where to reach the broker that owns a topic."""

    logical: BrokerAddress
    physical: BrokerAddress


class LookupService:
    """Partitioned metadata and topic lookups through a connection pool."""

    def __init__(self, pool: ConnectionPool, service: list[BrokerAddress]) -> None:
        if not service:
            raise UsageError("a service URL needs at least one host")
        self.pool = pool
        self.service = service
        self._next_host = itertools.cycle(service)
        self.use_tls = service[0].tls

    async def service_connection(self) -> ClientConnection:
        address = next(self._next_host)
        return await self.pool.get(address)

    async def partitioned_metadata(self, topic: str) -> int:
        """The number of partitions of ``topic`` (0 for a topic that is not partitioned)."""
        connection = await self.service_connection()
        frame = await connection.request(api.CommandPartitionedTopicMetadata(
            topic=topic, request_id=connection.new_request_id()))
        sub: Any = frame.sub
        if sub.HasField("response") and sub.response == api.CommandPartitionedTopicMetadataResponse.Failed:
            raise BrokerError(api.ServerError.Name(sub.error), sub.message)
        return int(sub.partitions)

    async def lookup(self, topic: str) -> LookupResult:
        """Follow LOOKUP answers until a broker says it owns ``topic``."""
        connection = await self.service_connection()
        authoritative = False
        for _ in range(MAX_REDIRECTS + 1):
            frame = await connection.request(api.CommandLookupTopic(
                topic=topic, request_id=connection.new_request_id(), authoritative=authoritative))
            sub: Any = frame.sub
            if sub.response == _LookupType.Failed:
                raise BrokerError(api.ServerError.Name(sub.error), sub.message)
            broker = self._broker_address(sub)
            through_service = bool(sub.proxy_through_service_url)
            physical = connection.physical if through_service else broker
            if sub.response == _LookupType.Connect:
                return LookupResult(broker, physical)
            authoritative = bool(sub.authoritative)
            connection = await self.pool.get(broker, physical)
        raise ClientError(f"lookup of {topic} was redirected more than {MAX_REDIRECTS} times")

    def _broker_address(self, sub: Any) -> BrokerAddress:
        url = sub.brokerServiceUrlTls if self.use_tls and sub.brokerServiceUrlTls else sub.brokerServiceUrl
        if not url:
            raise ClientError("lookup answer names no broker URL")
        return parse_broker_url(url)
