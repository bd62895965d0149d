"""An embedded cluster as one object: start it in Trio, or in a thread of its own.

:class:`ClusterRunner` owns the nodes of a cluster inside a Trio nursery and
offers the operations tests and tools need: unload or terminate a topic, kill a
broker (its connections drop as on a crash; its topics move to the live brokers
at the next lookup) and restart it on the same port, replicate to other clusters
(:class:`~proxy.broker.replicator.ReplicationService`, from the start when the
config says so, or from :meth:`ClusterRunner.start_replication` on); :func:`open_cluster` runs
one in the caller's Trio loop for an ``async with``.  :class:`ThreadedCluster`
runs a runner on its own Trio loop in a background thread, so a blocking client
(the official ``pulsar`` client) can be used from the caller's thread; its
methods are thread-safe and block until the broker thread has done the work.
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from proxy.broker.cluster import Cluster, ClusterConfig
from proxy.broker.replication import GeoSettings
from proxy.broker.replicator import ReplicationService
from proxy.broker.server import BrokerNode
from proxy.errors import PulsarTapError

R = TypeVar("R")


class ClusterRunner:
    """The nodes of one cluster, run inside a Trio nursery."""

    def __init__(self, config: ClusterConfig, ports: list[int], admin: tuple[str, int] | None = None) -> None:
        if len(ports) != config.brokers:
            raise ValueError("one port per broker")
        self.config = config
        self.admin = admin
        #: HOST:PORT of the admin API once it listens (None when not served)
        self.admin_address: str | None = None
        self.cluster = Cluster(config)
        self.nodes = [BrokerNode(self.cluster, self.cluster.add_broker(config.host, port)) for port in ports]
        self._nursery: trio.Nursery | None = None
        #: geo-replication, once started (proxy.broker.replicator.ReplicationService)
        self.replication: ReplicationService | None = None

    @property
    def addresses(self) -> list[str]:
        return [node.info.address for node in self.nodes]

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve every broker until cancelled; reports the HOST:PORT addresses once all listen."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._run_timers)
            for node in self.nodes:
                await nursery.start(node.serve)
            if self.admin is not None:
                from proxy.broker.admin import serve_admin
                self.admin_address = await nursery.start(serve_admin, self.cluster, *self.admin)
            if self.config.geo is not None:
                await self.start_replication(self.config.geo)
            task_status.started(self.addresses)
            await trio.sleep_forever()

    async def _run_timers(self) -> None:
        """Make the cluster's timed calls (delayed deliveries) when they are due."""
        timers = self.cluster.timers
        while True:
            earlier = trio.Event()
            timers.changed = earlier.set
            due = timers.next_due()
            wait = math.inf if due is None else max(0.0, (due - timers.clock()) / 1000)
            with trio.move_on_after(wait):
                await earlier.wait()
            timers.run_due()

    async def start_replication(self, settings: GeoSettings) -> None:
        """Replicate every topic to the remote clusters of ``settings`` from now on."""
        if self._nursery is None:
            raise PulsarTapError("the cluster is not running")
        if self.replication is not None:
            raise PulsarTapError("replication is already running")
        self.replication = ReplicationService(self.cluster, settings)
        await self._nursery.start(self.replication.run)

    def kill_broker(self, index: int) -> None:
        self.nodes[index].kill()

    async def restart_broker(self, index: int) -> None:
        node = self.nodes[index]
        await node.stopped.wait()
        if self._nursery is None:
            raise PulsarTapError("the cluster is not running")
        await self._nursery.start(node.serve)


@asynccontextmanager
async def open_cluster(config: ClusterConfig, ports: list[int] | None = None,
                       admin: tuple[str, int] | None = None) -> AsyncIterator[ClusterRunner]:
    """Run a cluster in the current Trio loop for the duration of an ``async with``."""
    runner = ClusterRunner(config, ports or [0] * config.brokers, admin=admin)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        try:
            yield runner
        finally:
            nursery.cancel_scope.cancel()


class ThreadedCluster:
    """A :class:`ClusterRunner` on its own Trio loop in a daemon thread."""

    def __init__(self, config: ClusterConfig, ports: list[int] | None = None, *, admin: bool = False) -> None:
        self.runner = ClusterRunner(config, ports or [0] * config.brokers,
                                    admin=(config.host, 0) if admin else None)
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._cancel: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._main, name="pulsar-tap-broker", daemon=True)

    @property
    def cluster(self) -> Cluster:
        return self.runner.cluster

    @property
    def addresses(self) -> list[str]:
        return self.runner.addresses

    @property
    def service_url(self) -> str:
        """The first broker's URL (any broker answers lookups for every topic)."""
        return f"pulsar://{self.addresses[0]}"

    @property
    def admin_url(self) -> str | None:
        """``http://HOST:PORT`` of the admin REST API, None unless started with ``admin=True``."""
        address = self.runner.admin_address
        return None if address is None else f"http://{address}"

    @property
    def service_url_all(self) -> str:
        """A multi-host service URL naming every broker."""
        return "pulsar://" + ",".join(self.addresses)

    def start(self, timeout: float = 10.0) -> ThreadedCluster:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise PulsarTapError("the embedded broker did not start in time")
        if self._error is not None:
            raise PulsarTapError(f"the embedded broker failed to start: {self._error}")
        return self

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._cancel = scope
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.runner.run)
                    self._ready.set()
        try:
            trio.run(main)
        except BaseException as exc:  # reported to start(); the thread ends either way
            self._error = exc
        finally:
            self._ready.set()

    def stop(self, timeout: float = 10.0) -> None:
        if self._token is not None and self._thread.is_alive():
            scope = self._cancel
            if scope is not None:
                self._token.run_sync_soon(scope.cancel)
        self._thread.join(timeout)

    def call(self, fn: Callable[..., R], *args: Any, timeout: float = 10.0) -> R:
        """Run a sync function in the broker's thread and return its result."""
        if self._token is None:
            raise PulsarTapError("the cluster is not running")
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = fn(*args)
            except BaseException as exc:
                box["error"] = exc
            finally:
                done.set()

        self._token.run_sync_soon(run)
        if not done.wait(timeout):
            raise PulsarTapError("the embedded broker did not answer in time")
        if "error" in box:
            raise box["error"]
        result: R = box["result"]
        return result

    def call_async(self, afn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> None:
        """Run an async function as a task in the broker's loop and wait until it ends."""
        nursery_box: dict[str, Any] = {}
        done = threading.Event()

        async def wrapper() -> None:
            try:
                await afn(*args)
            except BaseException as exc:
                nursery_box["error"] = exc
            finally:
                done.set()

        def spawn() -> None:
            nursery = self.runner._nursery
            if nursery is None:
                nursery_box["error"] = PulsarTapError("the cluster is not running")
                done.set()
                return
            nursery.start_soon(wrapper)

        if self._token is None:
            raise PulsarTapError("the cluster is not running")
        self._token.run_sync_soon(spawn)
        if not done.wait(timeout):
            raise PulsarTapError("the embedded broker did not answer in time")
        if "error" in nursery_box:
            raise nursery_box["error"]

    # -- operations tests use ---------------------------------------------------------

    def create_topic(self, name: str, partitions: int = 0) -> str:
        return self.call(self.cluster.create_topic, name, partitions)

    def unload_topic(self, name: str) -> None:
        self.call(self.cluster.unload, name)

    def terminate_topic(self, name: str) -> tuple[int, int]:
        return self.call(self.cluster.terminate, name)

    def kill_broker(self, index: int) -> None:
        self.call(self.runner.kill_broker, index)
        self.call_async(self.runner.nodes[index].stopped.wait)

    def restart_broker(self, index: int) -> None:
        self.call_async(self.runner.restart_broker, index)

    def start_replication(self, settings: GeoSettings) -> None:
        self.call_async(self.runner.start_replication, settings)

    def __enter__(self) -> ThreadedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: ``broker_cluster(brokers=1, partitions=None, *, admin=False, **ClusterConfig fields)`` (the tests' fixture)
BrokerClusterFactory = Callable[..., ThreadedCluster]
