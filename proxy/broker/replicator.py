"""Geo-replication on Trio: every topic's entries copied to every remote cluster.

:class:`ReplicationService` runs beside a cluster's brokers (in the same nursery).
It keeps one built-in :class:`~proxy.client.client.PulsarClient` per remote cluster
(Pulsar's replication clients) and one :class:`Replicator` task per topic and remote
cluster, started as topics appear; and it ticks the replicated-subscription
controllers every snapshot period.  What each entry becomes is decided sans-IO in
:mod:`proxy.broker.replication`; this module only moves entries and waits.

A replicator creates its producer on the remote topic (named
``pulsar.repl.<local>--><remote>``, no batching, no send timeout, at most
``queue_size`` entries in flight, as Pulsar's replicator producer), then reads
entries from its cursor and sends them as they come; each confirmation acknowledges
its entry on the cursor.  The producer rides out broken connections and topic
unloads by itself (reconnecting with backoff and resending what is pending, in
order).  When a send fails for good, or the producer cannot be created, the
replicator closes it, rewinds its cursor to the first unconfirmed entry and starts
again after a backoff (0.1 s doubling to 60 s): nothing is lost, and what is sent
twice is dropped by the remote's deduplication when it is enabled.
"""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial
from typing import Final

import trio

from proxy.broker.cluster import Cluster
from proxy.broker.replication import GeoSettings, Outgoing, ReplicatorCursor, TopicGeo
from proxy.broker.topic import Topic
from proxy.client.backoff import Backoff
from proxy.client.client import PulsarClient
from proxy.client.producer import Producer
from proxy.client.receipt import Receipt
from proxy.errors import ClientError, PulsarTapError

log = logging.getLogger("pulsar_tap.broker.replicator")

#: entries read from the cursor at a time
READ_BATCH: Final = 100
#: how long creating the remote producer may take before the replicator backs off and retries
CREATE_TIMEOUT: Final = 10.0
#: how long closing a failed producer may take
CLOSE_TIMEOUT: Final = 2.0


class ReplicationBroken(PulsarTapError):
    """A send to the remote failed for good; the replicator starts over from its cursor."""


def _now_ms() -> int:
    return int(time.time() * 1000)


class Replicator:
    """Copies one topic to one remote cluster."""

    def __init__(self, geo: TopicGeo, state: ReplicatorCursor, client: PulsarClient, queue_size: int) -> None:
        self.geo = geo
        self.state = state
        self.client = client
        self.queue_size = queue_size
        #: where the replicator waits for new entries (or a failed send); woken from sync code, and
        #: nothing can happen between finding nothing to read and parking (no checkpoint between)
        self._idle = trio.lowlevel.ParkingLot()
        self._failure: str | None = None
        self._backoff = Backoff()
        geo.wakeups.append(self._idle.unpark_all)

    def __repr__(self) -> str:
        return f"<Replicator {self.geo.topic.name} -> {self.state.remote_cluster}>"

    async def run(self) -> None:
        while True:
            producer = await self._create_producer()
            try:
                await self._replicate(producer)
            except (ReplicationBroken, ClientError) as exc:
                log.warning("%r: %s; rewinding to the first unconfirmed entry", self, exc)
            except Exception:
                # a bug in one replicator must cost that replicator a restart, not the cluster
                log.exception("%r: internal error; rewinding to the first unconfirmed entry", self)
            finally:
                self.state.connected = lambda: False
                self.state.rewind()
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                    await producer.close()
            await trio.sleep(self._backoff.next())

    async def _create_producer(self) -> Producer:
        while True:
            try:
                with trio.fail_after(CREATE_TIMEOUT):
                    created = await self.client.create_producer(
                        self.geo.topic.name, producer_name=self.state.producer_name, batching=False,
                        send_timeout=0, max_pending_messages=self.queue_size, block_if_queue_full=True)
            except (ClientError, trio.TooSlowError) as exc:
                delay = self._backoff.next()
                log.info("%r: cannot create the remote producer (%s); retrying in %.1f s", self,
                         str(exc) or "timed out", delay)
                await trio.sleep(delay)
                continue
            if isinstance(created, Producer):
                return created
            # as Pulsar's replicator: a non-partitioned topic (or one partition) replicates
            # only to the same non-partitioned topic
            await created.close()
            delay = self._backoff.next()
            log.warning("%r: the remote topic is partitioned here but not there; retrying in %.1f s", self, delay)
            await trio.sleep(delay)

    async def _replicate(self, producer: Producer) -> None:
        self.state.connected = lambda: producer.is_connected
        self._failure = None
        log.info("%r: replicating as %s", self, self.state.producer_name)
        while True:
            if self._failure is not None:
                raise ReplicationBroken(self._failure)
            batch = self.state.read(READ_BATCH, self.geo)
            if not batch:
                await self._idle.park()
                continue
            for outgoing in batch:
                receipt = await producer.send_entry(outgoing.metadata, outgoing.payload, outgoing.num_messages)
                receipt.add_done_callback(partial(self._done, outgoing))
                if self._failure is not None:
                    raise ReplicationBroken(self._failure)
            self._backoff.reset()

    def _done(self, outgoing: Outgoing, receipt: Receipt) -> None:
        if receipt.error is None:
            self.state.confirmed(outgoing, _now_ms())
            return
        if self._failure is None:
            self._failure = f"sending entry {outgoing.entry_id} failed: {receipt.error}"
            self._idle.unpark_all()


class ReplicationService:
    """The replicators and snapshot timer of one cluster."""

    def __init__(self, cluster: Cluster, settings: GeoSettings, *, operation_timeout: float = 30.0) -> None:
        self.cluster = cluster
        self.settings = settings
        self.operation_timeout = operation_timeout
        self.clients: dict[str, PulsarClient] = {}
        self.replicators: list[Replicator] = []
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Replicate until cancelled; reports started once every existing topic has its replicators."""
        async with contextlib.AsyncExitStack() as stack:
            for remote, url in self.settings.remotes.items():
                client = PulsarClient(url, operation_timeout=self.operation_timeout, connection_timeout=5.0)
                self.clients[remote] = await stack.enter_async_context(client)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.cluster.topic_listeners.append(self._topic_added)
                if self.cluster.geo is None:
                    self.cluster.start_geo(self.settings)  # tells _topic_added of every existing topic
                else:
                    for topic in list(self.cluster.topics.values()):
                        self._topic_added(topic)
                nursery.start_soon(self._snapshot_timer)
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    self.cluster.topic_listeners.remove(self._topic_added)
                    nursery.cancel_scope.cancel()

    def _topic_added(self, topic: Topic) -> None:
        geo = topic.geo
        if geo is None or self._nursery is None:
            return
        for remote, state in geo.replicators.items():
            replicator = Replicator(geo, state, self.clients[remote], self.settings.queue_size)
            self.replicators.append(replicator)
            self._nursery.start_soon(replicator.run)

    async def _snapshot_timer(self) -> None:
        period = self.settings.snapshots.period_ms / 1000
        while True:
            await trio.sleep(period)
            for topic in list(self.cluster.topics.values()):
                if topic.geo is None:
                    continue
                try:
                    topic.geo.tick()
                except Exception:
                    log.exception("snapshot timer of %s failed; the next period tries again", topic.name)


__all__ = ["ReplicationService", "Replicator"]
