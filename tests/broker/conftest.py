"""The embedded-broker fixtures (defined in proxy.broker.testing so other suites can reuse them)."""

from proxy.broker.testing import broker, broker_cluster

__all__ = ["broker", "broker_cluster"]
