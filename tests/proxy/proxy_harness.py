"""The proxy test harness (its fixtures are re-exported by conftest.py): a proxy in its own thread, on loopback.

``proxy_factory(upstream_url, **config_fields)`` starts a :class:`ThreadedProxy`
(``.service_url``, ``.server``, ``.stop()``) in front of any service URL, so tests
can drive it with the blocking official client.  Every proxy started is stopped
at the end of the test.  ``tls_material`` makes a CA and a localhost certificate
with trustme.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl, TlsConfig
from proxy.server.app import ProxyServer

ProxyFactory = Callable[..., "ThreadedProxy"]


class ThreadedProxy:
    """A ProxyServer on its own Trio loop in a daemon thread."""

    def __init__(self, config: ProxyConfig, **server_options: Any) -> None:
        self.server = ProxyServer(config, **server_options)
        self.config = config
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="pulsar-tap-proxy", daemon=True)

    @property
    def address(self) -> HostPort:
        return self.server.main_address

    @property
    def service_url(self) -> str:
        scheme = "pulsar+ssl" if self.config.tls.serves_tls else "pulsar"
        return f"{scheme}://{self.address}"

    def start(self, timeout: float = 10.0) -> ThreadedProxy:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the proxy did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the proxy failed to start: {self._error!r}")
        return self

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.server.run)
                self._ready.set()
        try:
            trio.run(main)
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` in the proxy's loop thread and return its result."""
        assert self._token is not None
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:
                box["error"] = exc
            finally:
                done.set()

        self._token.run_sync_soon(run)
        assert done.wait(timeout), "the proxy loop did not answer"
        if "error" in box:
            raise box["error"]
        return box["result"]

    def stop(self, timeout: float = 15.0) -> None:
        if self._token is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self.server.request_shutdown)
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error


def make_config(upstream: str, **fields: Any) -> ProxyConfig:
    limits = fields.pop("limits", None) or LimitsConfig(drain_seconds=0.5)
    listen = fields.pop("listen", HostPort("127.0.0.1", 0))
    return ProxyConfig(upstream=ServiceUrl.parse(upstream), listen=listen, limits=limits, **fields)


@pytest.fixture
def proxy_factory() -> Iterator[ProxyFactory]:
    started: list[ThreadedProxy] = []

    def start(upstream: str, *, server_options: dict[str, Any] | None = None, **fields: Any) -> ThreadedProxy:
        proxy = ThreadedProxy(make_config(upstream, **fields), **(server_options or {}))
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
