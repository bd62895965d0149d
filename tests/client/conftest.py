"""Fixtures for the client tests: an embedded broker cluster on free loopback ports.

The cluster runs on its own Trio loop in a background thread (proxy.broker's
ThreadedCluster), so the built-in client runs in the test's Trio loop and the
official client, which blocks, runs in worker threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from proxy.broker import ClusterConfig, ThreadedCluster

ClusterFactory = Callable[..., ThreadedCluster]


@pytest.fixture
def cluster_factory() -> Iterator[ClusterFactory]:
    started: list[ThreadedCluster] = []

    def start(brokers: int = 1, partitions: int | None = None, **options: object) -> ThreadedCluster:
        config = ClusterConfig(brokers=brokers, auto_partitions=partitions or 0, **options)  # type: ignore[arg-type]
        cluster = ThreadedCluster(config)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture
def cluster(cluster_factory: ClusterFactory) -> ThreadedCluster:
    return cluster_factory()
