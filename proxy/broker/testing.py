"""Pytest fixtures that start in-process embedded broker clusters on free loopback ports.

Reuse them from any conftest with::

    from proxy.broker.testing import broker, broker_cluster  # noqa: F401

``broker_cluster`` is a factory: ``broker_cluster(brokers=3, partitions=4, admin=True)``
starts a cluster in a background thread (its own Trio loop, so the blocking
official client can be used directly from the test) and returns a
:class:`~proxy.broker.embedded.ThreadedCluster` with ``.service_url``,
``.addresses``, ``.admin_url``, ``unload_topic(name)``, ``terminate_topic(name)``,
``create_topic(name, partitions)``, ``kill_broker(i)`` and ``restart_broker(i)``.
Other keyword arguments are :class:`~proxy.broker.cluster.ClusterConfig` fields
(``auth_token``, ``deduplication``, ``keepalive_seconds``, ``max_message_size``...).
Every cluster is stopped when the test ends.  ``broker`` is a ready one-broker cluster.
This module imports pytest, so only tests import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster

BrokerClusterFactory = Callable[..., ThreadedCluster]


@pytest.fixture
def broker_cluster() -> Iterator[BrokerClusterFactory]:
    started: list[ThreadedCluster] = []

    def start(brokers: int = 1, partitions: int | None = None, *, admin: bool = False,
              **options: Any) -> ThreadedCluster:
        config = ClusterConfig(brokers=brokers, auto_partitions=partitions or 0, **options)
        cluster = ThreadedCluster(config, admin=admin)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture
def broker(broker_cluster: BrokerClusterFactory) -> ThreadedCluster:
    return broker_cluster()
