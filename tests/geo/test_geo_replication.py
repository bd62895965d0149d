"""Geo-replication between two embedded clusters, broker to broker through pulsar-tap, with the official client.

Each test runs clusters A and B replicating to each other with a pulsar-tap proxy on
each link (:func:`proxy.cli.demo_geo.open_geo_pair`) in the test's Trio loop; the
blocking official client runs in a worker thread.  Counts and positions are read from
the clusters between the client's steps (from the Trio side, never while they move).
"""

from __future__ import annotations

import socket
from collections import Counter
from typing import Any

import pulsar
import trio
from geo_traffic import SUB, TOPIC, consume_then_leave, resume_on_b

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ClusterRunner, open_cluster
from proxy.broker.replication import GeoSettings
from proxy.cli.demo_geo import GeoPair, caught_up, open_geo_pair, replicator_of, wait_caught_up


def entries_replicated_from(cluster: ClusterRunner, origin: str, topic: str = TOPIC) -> Counter[str]:
    """Entries of a topic that came from ``origin``, by kind ("data" or the marker type)."""
    ledger = cluster.cluster.topics[topic].ledger
    kinds: Counter[str] = Counter()
    for entry_id in range(ledger.first_entry_id, ledger.next_entry_id):
        entry = ledger.get(entry_id)
        assert entry is not None
        if entry.replicated_from == origin:
            kinds["marker" if entry.marker_type else "data"] += entry.num_messages
    return kinds


async def settle(pair: GeoPair) -> None:
    """Wait (up to a minute) until both replicators have nothing left to send."""
    with trio.fail_after(60):
        await wait_caught_up(pair.a, "B")
        await wait_caught_up(pair.b, "A")


def consume(client: pulsar.Client, subscription: str, count: int, **options: Any) -> list[str]:
    consumer = client.subscribe(TOPIC, subscription, initial_position=pulsar.InitialPosition.Earliest, **options)
    got = []
    try:
        while len(got) < count:
            message = consumer.receive(30_000)
            got.append(message.data().decode())
            consumer.acknowledge(message)
        try:  # nothing more may come
            extra = consumer.receive(500)
            got.append(extra.data().decode())
        except pulsar.Timeout:
            pass
    finally:
        consumer.close()
    return got


# -- messages ----------------------------------------------------------------------------------------------

REPLICATOR_SENDS = [{"name": "replicator-sends", "match": {"command": ["SEND"], "producer_name": "pulsar.repl.*"},
                     "action": {"mark": {}}}]


def produce_both_ways(url_a: str, url_b: str, count: int) -> tuple[list[str], list[str]]:
    client_a, client_b = pulsar.Client(url_a), pulsar.Client(url_b)
    try:
        # subscribed first, so every message is there for them
        for client in (client_a, client_b):
            client.subscribe(TOPIC, "check", initial_position=pulsar.InitialPosition.Earliest).close()
        producers = [client.create_producer(TOPIC, block_if_queue_full=True, batching_max_publish_delay_ms=2)
                     for client in (client_a, client_b)]
        for index in range(count):
            for origin, producer in zip("AB", producers, strict=True):
                producer.send_async(f"{origin}{index}".encode(), None)
        for producer in producers:
            producer.flush()
        return consume(client_a, "check", 2 * count), consume(client_b, "check", 2 * count)
    finally:
        client_a.close()
        client_b.close()


async def test_ten_thousand_messages_each_way_arrive_once_in_order_and_never_come_back() -> None:
    count = 10_000
    with trio.fail_after(240):
        async with open_geo_pair(rules=REPLICATOR_SENDS, snapshot_period_ms=200) as pair:
            on_a, on_b = await trio.to_thread.run_sync(produce_both_ways, pair.url_a, pair.url_b, count)
            await settle(pair)
            for got in (on_a, on_b):
                assert len(got) == 2 * count == len(set(got))
                for origin in "AB":
                    assert [m for m in got if m[0] == origin] == [f"{origin}{i}" for i in range(count)]
            # no loops: each cluster holds its own messages and the other's, once
            assert entries_replicated_from(pair.a, "B")["data"] == count
            assert entries_replicated_from(pair.b, "A")["data"] == count
            assert entries_replicated_from(pair.a, "A") == Counter() == entries_replicated_from(pair.b, "B")
            for cluster, remote in ((pair.a, "B"), (pair.b, "A")):
                replicator = replicator_of(cluster, remote)
                assert replicator is not None and replicator.stats.messages_out == count
            # the proxies saw the replicators by name, SEND by SEND (producer ids only on the wire)
            assert pair.link_ab is not None and pair.link_ab.engine is not None
            sends_ab = pair.link_ab.engine.hits()["replicator-sends"]
            entries_from_a = pair.b.cluster.topics[TOPIC].ledger
            stored = sum(1 for i in range(entries_from_a.next_entry_id)
                         if (e := entries_from_a.get(i)) is not None and e.replicated_from == "A")
            assert sends_ab == stored > 0


# -- replicated subscriptions ----------------------------------------------------------------------------

async def test_a_replicated_subscription_resumes_on_b_within_one_snapshot_period_of_where_it_left_a() -> None:
    period_ms, total, stop_after = 500, 10_000, 5_000
    with trio.fail_after(240):
        async with open_geo_pair(snapshot_period_ms=period_ms) as pair:
            await trio.to_thread.run_sync(consume_then_leave, pair.url_a, 1000, total, stop_after)
            await settle(pair)
            controller = pair.a.cluster.topics[TOPIC].geo.controller  # type: ignore[union-attr]
            assert controller is not None and controller.stats.completed > 0
            round_trip_ms = max(controller.stats.durations_ms)
            assert pair.b.cluster.topics[TOPIC].subscriptions[SUB].replicated
            got = await trio.to_thread.run_sync(resume_on_b, pair.url_b, total)
    first, first_published = got[0]
    published = dict(got)
    # never past message 5 001 (index 5000: nothing lost); before it by at most one snapshot
    # period, plus the snapshot's round trip (the time its request needs to come back)
    assert first <= stop_after, got[:3]
    assert published[stop_after] - first_published <= period_ms + round_trip_ms + 100, \
        (first, published[stop_after] - first_published, round_trip_ms)
    assert [index for index, _ in got] == list(range(first, total))


# -- a remote that is down --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def produce(url: str, count: int) -> None:
    client = pulsar.Client(url)
    try:
        producer = client.create_producer(TOPIC, batching_enabled=False, block_if_queue_full=True)
        for index in range(count):
            producer.send_async(str(index).encode(), None)
        producer.flush()
    finally:
        client.close()


def read_all(url: str, expected: int) -> list[str]:
    client = pulsar.Client(url)
    try:
        return consume(client, "late-reader", expected)
    finally:
        client.close()


async def test_a_remote_that_is_down_gets_everything_once_it_is_up() -> None:
    port = free_port()
    with trio.fail_after(120):
        async with open_cluster(ClusterConfig(cluster_name="A")) as a:
            await a.start_replication(GeoSettings("A", {"B": f"pulsar://127.0.0.1:{port}"}))
            await trio.to_thread.run_sync(produce, f"pulsar://{a.addresses[0]}", 500)
            replicator = replicator_of(a, "B")
            assert replicator is not None and not replicator.connected() and replicator.backlog() == 500
            async with open_cluster(ClusterConfig(cluster_name="B"), ports=[port]) as b:
                with trio.fail_after(60):
                    await wait_caught_up(a, "B")
                got = await trio.to_thread.run_sync(read_all, f"pulsar://{b.addresses[0]}", 500)
    assert got == [str(i) for i in range(500)]


async def test_past_the_backlog_limit_a_remote_that_is_down_misses_the_oldest_messages() -> None:
    port = free_port()
    with trio.fail_after(120):
        async with open_cluster(ClusterConfig(cluster_name="A")) as a:
            await a.start_replication(GeoSettings("A", {"B": f"pulsar://127.0.0.1:{port}"}, backlog_limit=100))
            await trio.to_thread.run_sync(produce, f"pulsar://{a.addresses[0]}", 300)
            replicator = replicator_of(a, "B")
            assert replicator is not None
            assert replicator.backlog() == 100 and replicator.stats.messages_evicted == 200
            async with open_cluster(ClusterConfig(cluster_name="B"), ports=[port]) as b:
                with trio.fail_after(60):
                    await wait_caught_up(a, "B")
                got = await trio.to_thread.run_sync(read_all, f"pulsar://{b.addresses[0]}", 100)
    assert got == [str(i) for i in range(200, 300)]


async def test_without_the_proxy_too() -> None:
    """The rig without proxies: the replicators talk to the other cluster directly."""
    with trio.fail_after(120):
        async with open_geo_pair(proxied=False) as pair:
            assert pair.link_ab is None
            await trio.to_thread.run_sync(produce, pair.url_a, 200)
            with trio.fail_after(30):
                await wait_caught_up(pair.a, "B")
            assert caught_up(pair.b, "A")
            assert entries_replicated_from(pair.b, "A")["data"] == 200


def produce_and_read_partitioned(url_a: str, url_b: str, topic: str, count: int) -> list[str]:
    client_a, client_b = pulsar.Client(url_a), pulsar.Client(url_b)
    try:
        consumer = client_b.subscribe(topic, "s", initial_position=pulsar.InitialPosition.Earliest)
        producer = client_a.create_producer(topic, block_if_queue_full=True)
        for index in range(count):
            producer.send_async(str(index).encode(), None, partition_key=str(index))
        producer.flush()
        got = []
        while len(got) < count:
            message = consumer.receive(30_000)
            got.append(message.data().decode())
            consumer.acknowledge(message)
        return got
    finally:
        client_a.close()
        client_b.close()


async def test_each_partition_replicates_to_the_same_partition_of_a_cluster_partitioned_alike() -> None:
    topic = "persistent://public/default/geo-partitioned"
    with trio.fail_after(120):
        async with open_cluster(ClusterConfig(cluster_name="A", auto_partitions=3)) as a, \
                open_cluster(ClusterConfig(cluster_name="B", auto_partitions=3)) as b:
            await a.start_replication(GeoSettings("A", {"B": f"pulsar://{b.addresses[0]}"}))
            await b.start_replication(GeoSettings("B", {"A": f"pulsar://{a.addresses[0]}"}))
            got = await trio.to_thread.run_sync(produce_and_read_partitioned, f"pulsar://{a.addresses[0]}",
                                                f"pulsar://{b.addresses[0]}", topic, 300)
            assert sorted(got, key=int) == [str(i) for i in range(300)]
            assert b.cluster.partitions_of(topic) == 3
            for index in range(3):
                partition = f"{topic}-partition-{index}"
                assert (a.cluster.topics[partition].stats.messages_in
                        == entries_replicated_from(b, "A", partition)["data"] > 0)
