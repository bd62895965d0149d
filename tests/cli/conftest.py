"""Fixtures for the command-line tests: embedded brokers in the test process."""

from proxy.broker.testing import broker, broker_cluster

__all__ = ["broker", "broker_cluster"]
