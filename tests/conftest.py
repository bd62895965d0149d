"""Fixtures every test directory may use, and the pytester plugin (the pytest plugin's own tests need it).

``broker_cluster`` is a factory: ``broker_cluster(brokers=3, partitions=4, admin=True)``
starts an embedded cluster in a background thread (its own Trio loop, so the
blocking official client can be used directly from the test) and returns a
:class:`~proxy.broker.embedded.ThreadedCluster` with ``.service_url``,
``.addresses``, ``.admin_url``, ``unload_topic(name)``, ``terminate_topic(name)``,
``create_topic(name, partitions)``, ``kill_broker(i)`` and ``restart_broker(i)``.
Other keyword arguments are :class:`~proxy.broker.cluster.ClusterConfig` fields
(``auth_token``, ``deduplication``, ``keepalive_seconds``, ``max_message_size``...).
Every cluster is stopped when the test ends.  ``broker`` is a ready one-broker cluster.

(They lived in ``proxy/broker/testing.py``; only the pytest plugin of the package
imports pytest now.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import BrokerClusterFactory, ThreadedCluster

pytest_plugins = ["pytester"]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """A pytest-xdist worker is done: write the lines its fixtures reported for the run's output (peers/conftest.py)."""
    lines = getattr(node, "workeroutput", {}).get("pulsar_tap_report_lines", [])
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line)


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
