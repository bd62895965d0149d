"""The proxy test harness (its fixtures are re-exported by conftest.py): a proxy in its own thread, on loopback.

``proxy_factory(upstream_url, **config_fields)`` starts a
:class:`~proxy.server.threaded.ThreadedProxy` (``.service_url``, ``.server``,
``.call()``, ``.stop()``) in front of any service URL, so tests
can drive it with the blocking official client.  Every proxy started is stopped
at the end of the test.  ``tls_material`` makes a CA and a localhost certificate
with trustme.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl, TlsConfig
from proxy.server.app import ProxyServer
from proxy.server.threaded import ThreadedProxy

__all__ = ["ProxyFactory", "ThreadedProxy", "TlsMaterial", "make_config", "proxy_factory", "tls_material"]

ProxyFactory = Callable[..., ThreadedProxy]


def make_config(upstream: str, **fields: Any) -> ProxyConfig:
    limits = fields.pop("limits", None) or LimitsConfig(drain_seconds=0.5)
    listen = fields.pop("listen", HostPort("127.0.0.1", 0))
    return ProxyConfig(upstream=ServiceUrl.parse(upstream), listen=listen, limits=limits, **fields)


@pytest.fixture
def proxy_factory() -> Iterator[ProxyFactory]:
    started: list[ThreadedProxy] = []

    def start(upstream: str, *, server_options: dict[str, Any] | None = None, **fields: Any) -> ThreadedProxy:
        proxy = ThreadedProxy(ProxyServer(make_config(upstream, **fields), **(server_options or {})))
        started.append(proxy)
        return proxy.start()

    yield start
    for proxy in reversed(started):
        proxy.stop()


@dataclasses.dataclass(frozen=True)
class TlsMaterial:
    ca_file: str
    cert_file: str
    key_file: str

    def server_tls(self, upstream_ca: str | None = None) -> TlsConfig:
        return TlsConfig(cert=self.cert_file, key=self.key_file, upstream_ca=upstream_ca)


@pytest.fixture(scope="session")
def tls_material(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    import trustme

    directory: Path = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert_file = directory / "cert.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(cert_file), append=True)
    key_file = directory / "key.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    return TlsMaterial(str(ca_file), str(cert_file), str(key_file))
