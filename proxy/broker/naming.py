"""Topic names as a Pulsar broker reads them, and the stable hashes built on them.

A full name is ``{persistent|non-persistent}://tenant/namespace/local`` and a
partition of a partitioned topic is ``...local-partition-N`` (Pulsar's
``TopicName``).  Short names (``orders``) mean ``persistent://public/default/orders``.
This module also holds Murmur3_32 (the Key_Shared sticky-key hash, taken mod 65536)
and the stable hash that spreads topics over the brokers of a cluster.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Final

from proxy.errors import BrokerError

PARTITION_SUFFIX: Final = "-partition-"
DEFAULT_TENANT: Final = "public"
DEFAULT_NAMESPACE: Final = "default"
#: Key_Shared hash space: sticky-key hashes are taken mod this (Pulsar's DEFAULT_RANGE_SIZE).
KEY_HASH_RANGE: Final = 65536

_PARTITION_RE = re.compile(r"^(?P<base>.+)-partition-(?P<index>\d+)$")


def invalid_topic_name(name: str) -> BrokerError:
    return BrokerError("InvalidTopicName", f"Invalid topic name: {name!r}")


@dataclass(frozen=True)
class TopicName:
    """A parsed topic name."""

    domain: str
    tenant: str
    namespace: str
    local: str

    @classmethod
    def parse(cls, name: str) -> TopicName:
        """Parse a full or short topic name; raises BrokerError(InvalidTopicName)."""
        if "://" not in name:
            parts = name.split("/")
            if len(parts) == 1 and parts[0]:
                return cls("persistent", DEFAULT_TENANT, DEFAULT_NAMESPACE, parts[0])
            if len(parts) == 3 and all(parts):
                return cls("persistent", parts[0], parts[1], parts[2])
            raise invalid_topic_name(name)
        domain, rest = name.split("://", 1)
        parts = rest.split("/", 2)
        if domain not in ("persistent", "non-persistent") or len(parts) != 3 or not all(parts):
            raise invalid_topic_name(name)
        return cls(domain, parts[0], parts[1], parts[2])

    def __str__(self) -> str:
        return f"{self.domain}://{self.tenant}/{self.namespace}/{self.local}"

    @property
    def namespace_name(self) -> str:
        return f"{self.tenant}/{self.namespace}"

    @property
    def partition_index(self) -> int:
        """The partition number of a partition's name, -1 for any other topic."""
        match = _PARTITION_RE.match(self.local)
        return int(match["index"]) if match else -1

    @property
    def base(self) -> TopicName:
        """The partitioned topic this partition belongs to (itself when not a partition)."""
        match = _PARTITION_RE.match(self.local)
        if not match:
            return self
        return TopicName(self.domain, self.tenant, self.namespace, match["base"])

    @property
    def schema_name(self) -> str:
        """Where the topic's schemas are kept (Pulsar's ``getSchemaName``): ``tenant/namespace/local`` of the
        partitioned topic, in either domain -- a topic's partitions, persistent or not, share one schema history."""
        return f"{self.tenant}/{self.namespace}/{self.base.local}"

    def partition(self, index: int) -> TopicName:
        return TopicName(self.domain, self.tenant, self.namespace, f"{self.local}{PARTITION_SUFFIX}{index}")


def full_name(name: str) -> str:
    """The full ``persistent://tenant/ns/local`` form of a full or short topic name."""
    return str(TopicName.parse(name))


def murmur3_32(data: bytes, seed: int = 0) -> int:
    """Murmur3 x86 32-bit hash (unsigned), as Pulsar's ``Murmur3_32Hash`` computes it."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed & 0xFFFFFFFF
    length = len(data)
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * c1) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * c2) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    tail = data[whole:]
    if tail:
        k = int.from_bytes(tail, "little")
        k = (k * c1) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * c2) & 0xFFFFFFFF
        h ^= k
    h ^= length
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def sticky_key_hash(key: bytes) -> int:
    """The Key_Shared hash of a sticky key: Murmur3_32 mod 65536."""
    return murmur3_32(key) % KEY_HASH_RANGE


def stable_topic_hash(topic: str) -> int:
    """A hash of a topic name that is the same in every process (spreads topics over brokers)."""
    return zlib.crc32(topic.encode())
