"""Service URLs and topic names, as the Pulsar clients parse them.

A service URL is ``pulsar://host:port[,host:port...]`` or ``pulsar+ssl://...``
(ports default to 6650 and 6651).  Topic names are completed to
``persistent://tenant/namespace/topic``: ``orders`` means
``persistent://public/default/orders`` and ``tenant/ns/orders`` means
``persistent://tenant/ns/orders``.  Partition ``N`` of a partitioned topic is the
topic named ``<topic>-partition-N``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from proxy.errors import UsageError

PLAIN_SCHEME: Final = "pulsar"
TLS_SCHEME: Final = "pulsar+ssl"
DEFAULT_PORTS: Final = {PLAIN_SCHEME: 6650, TLS_SCHEME: 6651}
PARTITION_SUFFIX: Final = "-partition-"


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """One host:port a client can connect to; ``tls`` says whether to wrap it in TLS."""

    host: str
    port: int
    tls: bool = False

    @property
    def url(self) -> str:
        return f"{TLS_SCHEME if self.tls else PLAIN_SCHEME}://{self.host}:{self.port}"

    @property
    def host_port(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.url


def parse_service_url(url: str) -> list[BrokerAddress]:
    """The addresses of a service URL; raises UsageError for anything else."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme not in DEFAULT_PORTS:
        raise UsageError(f"bad service URL {url!r}: expected pulsar://HOST:PORT or pulsar+ssl://HOST:PORT")
    rest = rest.rstrip("/")
    if not rest or "/" in rest:
        raise UsageError(f"bad service URL {url!r}: expected pulsar://HOST:PORT")
    addresses = []
    for part in rest.split(","):
        host, _, port_text = part.rpartition(":") if ":" in part else (part, "", "")
        host = host.strip("[]")
        if not host:
            raise UsageError(f"bad service URL {url!r}: empty host")
        try:
            port = int(port_text) if port_text else DEFAULT_PORTS[scheme]
        except ValueError:
            raise UsageError(f"bad service URL {url!r}: port {port_text!r} is not a number") from None
        if not 0 < port < 65536:
            raise UsageError(f"bad service URL {url!r}: port {port} out of range")
        addresses.append(BrokerAddress(host, port, scheme == TLS_SCHEME))
    return addresses


def parse_broker_url(url: str) -> BrokerAddress:
    """A single broker URL as a LOOKUP response carries it."""
    addresses = parse_service_url(url)
    if len(addresses) != 1:
        raise UsageError(f"bad broker URL {url!r}: expected exactly one host")
    return addresses[0]


def complete_topic_name(topic: str) -> str:
    """The fully qualified form of a topic name."""
    if "://" in topic:
        domain, _, rest = topic.partition("://")
        if domain not in ("persistent", "non-persistent") or len(rest.split("/")) < 3:
            raise UsageError(f"bad topic name {topic!r}")
        return topic
    parts = topic.split("/")
    if len(parts) == 1 and parts[0]:
        return f"persistent://public/default/{topic}"
    if len(parts) == 3 and all(parts):
        return f"persistent://{topic}"
    raise UsageError(f"bad topic name {topic!r}: use TOPIC, TENANT/NAMESPACE/TOPIC or a full name")


def partition_name(topic: str, index: int) -> str:
    return f"{topic}{PARTITION_SUFFIX}{index}"


def partition_index(topic: str) -> int:
    """The partition index in a partition's name; -1 for a topic that is not a partition."""
    base, sep, index = topic.rpartition(PARTITION_SUFFIX)
    if sep and base and index.isdigit():
        return int(index)
    return -1
