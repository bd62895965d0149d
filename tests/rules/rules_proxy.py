"""A whole proxy stack (``running_proxy``: server, rules, admin API, hot reload, recorder) in a thread.

The acceptance tests drive it with the blocking official client, so the proxy runs
on its own Trio loop in a daemon thread (a :class:`~proxy.server.threaded.LoopThread`),
on loopback ports chosen by the kernel.
``rules_proxy(broker, rules_text, **config_fields)`` writes the rule file into the
test's tmp directory, starts the stack and returns a :class:`ThreadedStack`
(``.service_url``, ``.admin``, an httpx client on the admin API, ``.engine``,
``.rule_file``); every stack is stopped when the test ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config.proxy_config import AdminConfig, HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.rules.engine import RulesEngine
from proxy.server.threaded import ThreadedStack as ProductThreadedStack

StackFactory = Callable[..., "ThreadedStack"]


class ThreadedStack(ProductThreadedStack):
    """The product's threaded stack, with an httpx client on its admin API."""

    def __init__(self, config: ProxyConfig) -> None:
        super().__init__(config)
        self.admin: httpx.Client | None = None

    @property
    def engine(self) -> RulesEngine:
        assert self.stack is not None and self.stack.engine is not None
        return self.stack.engine

    @property
    def rule_file(self) -> Path:
        assert isinstance(self.config.rules, str)
        return Path(self.config.rules)

    def start(self, timeout: float = 15.0) -> ThreadedStack:
        super().start(timeout)
        assert self.stack is not None
        if self.stack.admin_address is not None:
            self.admin = httpx.Client(base_url=f"http://{self.stack.admin_address}", timeout=5)
        return self

    def hits(self) -> dict[str, int]:
        """Rule hits as GET /rules reports them."""
        assert self.admin is not None
        response = self.admin.get("/rules")
        response.raise_for_status()
        return {rule["name"]: rule["hits"] for rule in response.json()["rules"]}

    def stop(self, timeout: float = 20.0) -> None:
        if self.admin is not None:
            self.admin.close()
        super().stop(timeout)


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
