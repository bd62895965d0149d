"""Fixtures for the client tests: an embedded broker cluster on free loopback ports.

The cluster runs on its own Trio loop in a background thread (proxy.broker's
ThreadedCluster), so the built-in client runs in the test's Trio loop and the
official client, which blocks, runs in worker threads.  The fixtures are
tests/conftest.py's, under the names these tests use.
"""

from __future__ import annotations

import pytest

from proxy.broker import ThreadedCluster
from proxy.broker.embedded import BrokerClusterFactory

__all__ = ["ClusterFactory", "cluster", "cluster_factory"]

ClusterFactory = BrokerClusterFactory


@pytest.fixture
def cluster_factory(broker_cluster: BrokerClusterFactory) -> BrokerClusterFactory:
    return broker_cluster


@pytest.fixture
def cluster(broker: ThreadedCluster) -> ThreadedCluster:
    return broker
