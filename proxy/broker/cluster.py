"""The cluster: its brokers, topic ownership, partitioned metadata and the topic registry.

Stands in for what Pulsar keeps in its metadata store and load manager.  Every
broker of the embedded cluster shares one :class:`Cluster`; storage is shared as
BookKeeper is, so a topic can move between brokers without losing data.  A topic
is owned by one live broker, chosen by a stable hash of its name over the live
brokers when the topic is first looked up (or after an unload or a broker's
death); LOOKUP on any other broker answers Redirect to the owner, and producers
or consumers that reach a non-owner get ServiceNotReady so they look up again.
New topics are created on first use; with ``auto_partitions`` set, a topic first
seen through PARTITIONED_METADATA is created partitioned (Pulsar's
``allowAutoTopicCreationType=partitioned``).  A cluster that geo-replicates
(:attr:`ClusterConfig.geo`) gives every topic a :class:`~proxy.broker.replication.TopicGeo`
and tells :attr:`Cluster.topic_listeners` (the replication service) about each new topic.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from proxy.broker.naming import TopicName, stable_topic_hash
from proxy.broker.replication import GeoSettings, TopicGeo
from proxy.broker.timers import Timers
from proxy.broker.topic import SchemaVersion, Topic
from proxy.errors import BrokerError
from proxy.protocol.frame import DEFAULT_MAX_MESSAGE_SIZE

DEFAULT_RETENTION_MB: Final = 1024


@dataclass
class ClusterConfig:
    """Settings of an embedded cluster (the ``pulsar-tap broker`` flags)."""

    cluster_name: str = "standalone"
    host: str = "127.0.0.1"
    brokers: int = 1
    auto_partitions: int = 0
    topics: dict[str, int] = field(default_factory=dict)
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    retention_mb: int = DEFAULT_RETENTION_MB
    deduplication: bool = False
    auth_token: str | None = None
    keepalive_seconds: float = 30.0
    auto_create: bool = True
    #: how long a Failover subscription's newly active consumer waits for its first message, as Pulsar's
    #: ``activeConsumerFailoverDelayTimeMillis`` (1 s by default); 0 dispatches at once
    failover_delay_ms: int = 1000
    #: geo-replication to other clusters (None: this cluster replicates nothing)
    geo: GeoSettings | None = None
    #: the namespaces (``tenant/ns``) that exist, as on a real broker: a topic of another one is not found
    #: (lookups answer TopicNotFound "Namespace not found").  None: every namespace exists, so any topic
    #: name works without an admin step.  The namespaces of ``topics`` and those created through the admin
    #: API exist too.
    known_namespaces: frozenset[str] | None = None


@dataclass
class BrokerInfo:
    index: int
    host: str
    port: int
    alive: bool = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def service_url(self) -> str:
        return f"pulsar://{self.host}:{self.port}"


class Cluster:
    """Shared state of every broker of one embedded cluster."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.brokers: list[BrokerInfo] = []
        self.topics: dict[str, Topic] = {}
        #: each schema name's history (TopicName.schema_name): a partitioned topic's partitions share one
        self.schemas: dict[str, list[SchemaVersion]] = {}
        #: delayed deliveries of every topic (run by whoever runs the cluster: ClusterRunner)
        self.timers = Timers()
        #: partitioned topic name -> number of partitions
        self.partitioned: dict[str, int] = {}
        self.owners: dict[str, int] = {}
        self._ledger_ids = itertools.count(1)
        self._producer_names = itertools.count(0)
        self.geo: GeoSettings | None = None
        #: the namespaces that exist (None: all of them; see ClusterConfig.known_namespaces)
        self.namespaces: set[str] | None = None
        if config.known_namespaces is not None:
            self.namespaces = set(config.known_namespaces)
            self.namespaces.update(TopicName.parse(name).namespace_name for name in config.topics)
        #: called with every topic created (and, when replication starts, every existing one)
        self.topic_listeners: list[Callable[[Topic], None]] = []
        if config.geo is not None:
            self.start_geo(config.geo)
        for name, partitions in config.topics.items():
            self.create_topic(name, partitions)

    # -- brokers and ownership ------------------------------------------------------

    def add_broker(self, host: str, port: int) -> BrokerInfo:
        info = BrokerInfo(len(self.brokers), host, port)
        self.brokers.append(info)
        return info

    def live_brokers(self) -> list[BrokerInfo]:
        return [b for b in self.brokers if b.alive]

    def owner(self, topic: str) -> BrokerInfo:
        """The broker that owns a topic (partition), assigning one if nobody does."""
        index = self.owners.get(topic)
        if index is not None and self.brokers[index].alive:
            return self.brokers[index]
        live = self.live_brokers()
        if not live:
            raise BrokerError("ServiceNotReady", "no broker of the cluster is running")
        chosen = live[stable_topic_hash(topic) % len(live)]
        self.owners[topic] = chosen.index
        return chosen

    def check_owner(self, topic: str, broker_index: int) -> None:
        """A PRODUCER or SUBSCRIBE may go on here: this broker owns the topic, of a namespace that exists."""
        namespace = TopicName.parse(topic).namespace_name
        if not self.namespace_exists(namespace):
            # the real broker's words when nobody could have looked the topic up (its web address; ours)
            broker = self.brokers[broker_index]
            raise BrokerError("ServiceNotReady", f"Namespace bundle ({namespace}/0x00000000_0xffffffff) for topic "
                                                 f"({topic}) not served by this instance:{broker.address}. Please "
                                                 "redo the lookup.")
        if self.owner(topic).index != broker_index:
            raise BrokerError("ServiceNotReady", f"Namespace bundle for topic ({topic}) not served by this instance")

    # -- namespaces -----------------------------------------------------------------

    def namespace_exists(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces

    def check_namespace(self, topic: TopicName) -> None:
        """LOOKUP and PARTITIONED_METADATA of a topic of a namespace that does not exist: Pulsar's answer."""
        if not self.namespace_exists(topic.namespace_name):
            raise BrokerError("TopicNotFound", "Namespace not found")

    def create_namespace(self, namespace: str) -> bool:
        """Make ``tenant/ns`` exist; False if it already did (with every namespace known, always False)."""
        if self.namespaces is None or namespace in self.namespaces:
            return False
        self.namespaces.add(namespace)
        return True

    def broker_down(self, broker_index: int) -> None:
        self.brokers[broker_index].alive = False
        for topic, owner in list(self.owners.items()):
            if owner == broker_index:
                del self.owners[topic]

    def generate_producer_name(self, broker_index: int) -> str:
        return f"{self.config.cluster_name}-{broker_index}-{next(self._producer_names)}"

    # -- topics ---------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> str:
        """Create a topic (partitioned when partitions > 0); returns its full name."""
        topic = TopicName.parse(name)
        full = str(topic)
        if partitions > 0:
            if full in self.partitioned or full in self.topics:
                raise BrokerError("UnknownError", f"Topic {full} already exists")
            self.partitioned[full] = partitions
            for i in range(partitions):
                self.get_topic(str(topic.partition(i)))
        else:
            self.get_topic(full)
        return full

    def partitions_of(self, name: str, auto_create: bool = True) -> int:
        """PARTITIONED_METADATA: the partition count (0 for a non-partitioned topic)."""
        topic = TopicName.parse(name)
        self.check_namespace(topic)
        full = str(topic)
        if full in self.partitioned:
            return self.partitioned[full]
        self._check_partition(topic)
        if (auto_create and self.config.auto_create and self.config.auto_partitions > 0
                and topic.partition_index < 0 and full not in self.topics):
            self.create_topic(full, self.config.auto_partitions)
            return self.config.auto_partitions
        return 0

    def get_topic(self, name: str, create: bool = True) -> Topic:
        topic_name = TopicName.parse(name)
        full = str(topic_name)
        topic = self.topics.get(full)
        if topic is None:
            if full in self.partitioned:
                raise BrokerError("NotAllowedError", f"{full} is a partitioned topic; use its partitions")
            if not create or not self.config.auto_create:
                raise BrokerError("TopicNotFound", f"Topic {full} does not exist")
            self._check_partition(topic_name)
            topic = Topic(full, topic_name.partition_index, next(self._ledger_ids),
                          self.config.retention_mb * 1024 * 1024, dedup=self.config.deduplication,
                          timers=self.timers, failover_delay_ms=self.config.failover_delay_ms,
                          schemas=self.schemas.setdefault(topic_name.schema_name, []))
            self.topics[full] = topic
            self._topic_created(topic)
        return topic

    def _check_partition(self, topic: TopicName) -> None:
        """A partition past a partitioned topic's last does not exist (TopicNotFound, no message: Pulsar's words)."""
        index = topic.partition_index
        if index >= 0 and index >= self.partitioned.get(str(topic.base), index + 1):
            raise BrokerError("TopicNotFound", "")

    def _topic_created(self, topic: Topic) -> None:
        if self.geo is not None:
            topic.geo = TopicGeo(topic, self.geo, lambda: int(time.time() * 1000))
        for listener in self.topic_listeners:
            listener(topic)

    def start_geo(self, settings: GeoSettings) -> None:
        """Replicate every topic from now on (existing ones from their current end), as configured."""
        if self.geo is not None:
            raise BrokerError("NotAllowedError", "geo-replication is already configured")
        if settings.local_cluster != self.config.cluster_name:
            raise BrokerError("NotAllowedError", f"replication settings are for cluster {settings.local_cluster}, "
                                                 f"not {self.config.cluster_name}")
        self.geo = settings
        for topic in self.topics.values():
            self._topic_created(topic)

    def resolve(self, name: str) -> list[Topic]:
        """The topics a name stands for: the partitions of a partitioned topic, else itself."""
        full = str(TopicName.parse(name))
        if full in self.partitioned:
            base = TopicName.parse(full)
            return [self.get_topic(str(base.partition(i))) for i in range(self.partitioned[full])]
        topic = self.topics.get(full)
        if topic is None:
            raise BrokerError("TopicNotFound", f"Topic {full} does not exist")
        return [topic]

    def topics_of_namespace(self, namespace: str, persistent: bool = True, non_persistent: bool = False) -> list[str]:
        """Topic names in a namespace, partitions listed one by one (as Pulsar's broker lists them)."""
        names: set[str] = set()
        for full in self.topics:
            topic = TopicName.parse(full)
            if topic.namespace_name != namespace:
                continue
            if (topic.domain == "persistent" and persistent) or (topic.domain == "non-persistent" and non_persistent):
                names.add(full)
        return sorted(names)

    def partitioned_topics_of_namespace(self, namespace: str) -> list[str]:
        return sorted(n for n in self.partitioned if TopicName.parse(n).namespace_name == namespace)

    def unload(self, name: str) -> None:
        """Close the topic's producers and consumers and release its ownership."""
        for topic in self.resolve(name):
            topic.unload()
            self.owners.pop(topic.name, None)

    def terminate(self, name: str) -> tuple[int, int]:
        last = (-1, -1)
        for topic in self.resolve(name):
            last = topic.terminate()
        return last
