"""A server on its own Trio loop in a daemon thread, for tests, benchmarks and scripts.

The official client blocks, so whatever it talks to (a proxy, a whole proxy stack,
a recording proxy, a replay server) runs on a Trio loop of its own in a daemon
thread, on loopback ports chosen by the kernel.  :class:`LoopThread` is that
thread: ``start()`` returns once the server listens (or raises why it could not),
``call(fn)`` runs a function in the loop's thread, ``stop()`` asks the server to
shut down and raises whatever it failed with.  :class:`ThreadedProxy` runs one
:class:`~proxy.server.app.ProxyServer` so; :class:`ThreadedStack` runs the whole
proxy process (:func:`~proxy.server.stack.running_proxy`: rules, admin API,
recorder) with extra observers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, Self

import trio

from proxy.config.proxy_config import HostPort, ProxyConfig
from proxy.core.hooks import Observer
from proxy.errors import PulsarTapError
from proxy.server.app import ProxyServer
from proxy.server.stack import ProxyStack, running_proxy


class LoopThread:
    """Runs one async ``serve(ready)`` on a Trio loop in a daemon thread."""

    def __init__(self, name: str) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    async def serve(self, ready: threading.Event) -> None:
        """Serve until :meth:`shutdown`; set ``ready`` once listening."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Ask :meth:`serve` to return (called in the loop's thread)."""
        raise NotImplementedError

    def start(self, timeout: float = 15.0) -> Self:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise PulsarTapError(f"{self._thread.name} did not start in time")
        if self._error is not None:
            raise PulsarTapError(f"{self._thread.name} failed to start: {self._error!r}")
        return self

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            await self.serve(self._ready)

        try:
            trio.run(main)
        except BaseException as exc:  # reported by start() or stop()
            self._error = exc
        finally:
            self._ready.set()

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` in the loop's thread and return its result."""
        if self._token is None:
            raise PulsarTapError(f"{self._thread.name} is not running")
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
        if not done.wait(timeout):
            raise PulsarTapError(f"{self._thread.name} did not answer in time")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self, timeout: float = 20.0) -> None:
        if self._token is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self.shutdown)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise PulsarTapError(f"{self._thread.name} did not stop in time")
        if self._error is not None:
            raise PulsarTapError(f"{self._thread.name} failed: {self._error!r}")


async def serve_until_shutdown(server: Any, ready: threading.Event) -> None:
    """Run ``server.run`` (started like a nursery task) until it returns; ``ready`` is set once it listens."""
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        ready.set()


class ThreadedProxy(LoopThread):
    """A :class:`~proxy.server.app.ProxyServer` on its own Trio loop in a daemon thread."""

    def __init__(self, server: ProxyServer, name: str = "pulsar-tap-proxy") -> None:
        super().__init__(name)
        self.server = server

    @property
    def config(self) -> ProxyConfig:
        return self.server.config

    @property
    def address(self) -> HostPort:
        return self.server.main_address

    @property
    def service_url(self) -> str:
        scheme = "pulsar+ssl" if self.config.tls.serves_tls else "pulsar"
        return f"{scheme}://{self.address}"

    async def serve(self, ready: threading.Event) -> None:
        await serve_until_shutdown(self.server, ready)

    def shutdown(self) -> None:
        self.server.request_shutdown()


class ThreadedStack(LoopThread):
    """``running_proxy(config)`` on its own Trio loop in a daemon thread, with ``observers`` added."""

    def __init__(self, config: ProxyConfig, *, observers: list[Observer] | None = None,
                 name: str = "pulsar-tap-stack") -> None:
        super().__init__(name)
        self.config = config
        self.observers = list(observers or [])
        self.stack: ProxyStack | None = None
        self._stop: trio.Event | None = None

    @property
    def service_url(self) -> str:
        assert self.stack is not None
        scheme = "pulsar+ssl" if self.config.tls.serves_tls else "pulsar"
        return f"{scheme}://{self.stack.address}"

    async def serve(self, ready: threading.Event) -> None:
        self._stop = trio.Event()
        server = ProxyServer(self.config, observers=self.observers) if self.observers else None
        async with running_proxy(self.config, server=server) as stack:
            self.stack = stack
            ready.set()
            await self._stop.wait()

    def shutdown(self) -> None:
        if self._stop is not None:
            self._stop.set()
