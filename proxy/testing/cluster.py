"""An embedded broker cluster for tests and scripts: ``with EmbeddedCluster(brokers=2) as cluster:``.

The in-memory brokers of ``pulsar-tap broker`` (:mod:`proxy.broker`), on free
loopback ports, on their own Trio loop in a daemon thread, so the blocking official
client can be used from the caller's thread and an async client from any loop.
It offers ``.service_url``, ``.addresses``, ``.admin_url`` (the subset of Pulsar's
admin REST API v2 the embedded broker serves), and the operations tests need:
``create_topic``, ``unload_topic``, ``terminate_topic``, ``kill_broker``,
``restart_broker``.
"""

from __future__ import annotations

from typing import Any, Self

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster


class EmbeddedCluster(ThreadedCluster):
    """``brokers`` in-memory brokers; ``partitions`` > 0 auto-creates topics partitioned so.

    Other keyword arguments are :class:`~proxy.broker.cluster.ClusterConfig` fields
    (``auth_token``, ``deduplication``, ``max_message_size``, ``topics``...).
    """

    def __init__(self, brokers: int = 1, *, partitions: int = 0, admin: bool = True, host: str = "127.0.0.1",
                 **options: Any) -> None:
        super().__init__(ClusterConfig(brokers=brokers, auto_partitions=partitions, host=host, **options),
                         admin=admin)
        self.brokers = brokers

    def start(self, timeout: float = 10.0) -> Self:
        super().start(timeout)
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __repr__(self) -> str:
        return f"<EmbeddedCluster of {self.brokers} broker(s) at {', '.join(self.addresses)}>"


__all__ = ["EmbeddedCluster"]
