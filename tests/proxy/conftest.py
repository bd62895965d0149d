"""Fixtures of the proxy tests; they live in proxy_harness.py so test modules can import its types."""

from proxy_harness import proxy_factory, tls_material

__all__ = ["proxy_factory", "tls_material"]
