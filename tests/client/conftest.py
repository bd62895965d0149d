"""Fixtures for the client tests: an embedded broker cluster on free loopback ports, and ``pulsar-tap run``.

The cluster runs on its own Trio loop in a background thread (proxy.broker's
ThreadedCluster), so the built-in client runs in the test's Trio loop and the
official client, which blocks, runs in worker threads.  The fixtures are
tests/conftest.py's, under the names these tests use.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.broker import ThreadedCluster
from proxy.broker.embedded import BrokerClusterFactory

__all__ = ["ClusterFactory", "ProxyFactory", "cluster", "cluster_factory", "proxy_process"]

ClusterFactory = BrokerClusterFactory
#: starts ``pulsar-tap run`` in front of an upstream (extra flags after it); its listen address HOST:PORT
ProxyFactory = Callable[..., str]


@pytest.fixture
def cluster_factory(broker_cluster: BrokerClusterFactory) -> BrokerClusterFactory:
    return broker_cluster


@pytest.fixture
def cluster(broker: ThreadedCluster) -> ThreadedCluster:
    return broker


@pytest.fixture
def proxy_process(tmp_path: Path) -> Iterator[ProxyFactory]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(upstream: str, *extra: str) -> str:
        ready = tmp_path / f"ready-{len(procs)}.json"
        proc = subprocess.Popen([sys.executable, "-m", "proxy", "run", "--listen", "127.0.0.1:0", "--upstream",
                                 upstream, "--ready-file", str(ready), "--log-level", "error", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if ready.exists() and ready.stat().st_size:
                return str(json.loads(ready.read_text())["listen"][0])
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("the proxy did not start")

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
