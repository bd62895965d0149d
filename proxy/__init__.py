"""pulsar-tap: a protocol-aware TCP proxy and traffic recorder for Apache Pulsar."""

__version__ = "0.1.0"
