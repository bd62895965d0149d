"""A whole proxy stack (``running_proxy``: server, rules, admin API, hot reload, recorder) in a thread.

The acceptance tests drive it with the blocking official client, so the proxy runs
on its own Trio loop in a daemon thread, on loopback ports chosen by the kernel.
``rules_proxy(broker, rules_text, **config_fields)`` writes the rule file into the
test's tmp directory, starts the stack and returns a :class:`ThreadedStack`
(``.service_url``, ``.admin``, an httpx client on the admin API, ``.engine``,
``.rule_file``); every stack is stopped when the test ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from proxy.config.proxy_config import AdminConfig, HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.rules.engine import RulesEngine
from proxy.server.stack import ProxyStack, running_proxy

StackFactory = Callable[..., "ThreadedStack"]


class ThreadedStack:
    """``running_proxy(config)`` on its own Trio loop in a daemon thread."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.stack: ProxyStack | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="pulsar-tap-stack", daemon=True)
        self.admin: httpx.Client | None = None

    @property
    def service_url(self) -> str:
        assert self.stack is not None
        return f"pulsar://{self.stack.address}"

    @property
    def engine(self) -> RulesEngine:
        assert self.stack is not None and self.stack.engine is not None
        return self.stack.engine

    @property
    def rule_file(self) -> Path:
        assert isinstance(self.config.rules, str)
        return Path(self.config.rules)

    def start(self, timeout: float = 15.0) -> ThreadedStack:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the proxy stack did not start in time")
        if self._error is not None or self.stack is None:
            raise RuntimeError(f"the proxy stack failed to start: {self._error!r}")
        if self.stack.admin_address is not None:
            self.admin = httpx.Client(base_url=f"http://{self.stack.admin_address}", timeout=5)
        return self

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with running_proxy(self.config) as stack:
                self.stack = stack
                self._ready.set()
                await self._stop.wait()
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

    def hits(self) -> dict[str, int]:
        """Rule hits as GET /rules reports them."""
        assert self.admin is not None
        response = self.admin.get("/rules")
        response.raise_for_status()
        return {rule["name"]: rule["hits"] for rule in response.json()["rules"]}

    def stop(self, timeout: float = 20.0) -> None:
        if self.admin is not None:
            self.admin.close()
        if self._token is not None and self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._stop.set)
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error


@pytest.fixture
def rules_proxy(tmp_path: Path) -> Iterator[StackFactory]:
    started: list[ThreadedStack] = []

    def start(upstream: str, rules: str = "rules: []\n", *, admin: bool = True, **fields: Any) -> ThreadedStack:
        rule_file = tmp_path / f"rules-{len(started)}.yaml"
        rule_file.write_text(rules, encoding="utf-8")
        config = ProxyConfig(
            upstream=ServiceUrl.parse(upstream), listen=HostPort("127.0.0.1", 0),
            limits=fields.pop("limits", None) or LimitsConfig(drain_seconds=0.5),
            admin=AdminConfig(HostPort("127.0.0.1", 0)) if admin else None,
            rules=str(rule_file), **fields)
        stack = ThreadedStack(config)
        started.append(stack)
        return stack.start()

    yield start
    for stack in reversed(started):
        stack.stop()
