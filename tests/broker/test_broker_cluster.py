"""A 3-broker cluster with 4-partition topics: lookups redirect, every message arrives once."""

from __future__ import annotations

import collections

import pulsar
import pytest

from proxy.broker import ThreadedCluster
from proxy.broker.embedded import BrokerClusterFactory

TIMEOUT_MS = 10_000
COMPRESSIONS = ["NONE", "LZ4", "ZLib", "ZSTD", "SNAPPY"]


@pytest.fixture
def cluster3(broker_cluster: BrokerClusterFactory) -> ThreadedCluster:
    return broker_cluster(brokers=3, partitions=4)


def test_partitions_are_spread_over_brokers_with_redirects(cluster3: ThreadedCluster) -> None:
    client = pulsar.Client(cluster3.service_url, operation_timeout_seconds=10)
    try:
        producer = client.create_producer("spread", batching_enabled=False)
        partitions = client.get_topic_partitions("persistent://public/default/spread")
        assert len(partitions) == 4
        producer.send(b"x")
        owners = {cluster3.cluster.owners[p] for p in partitions}
        assert len(owners) > 1, "partitions should land on more than one broker"
    finally:
        client.close()


@pytest.mark.parametrize("count", [10_000])
def test_every_compression_type_with_batching_delivers_each_message_once_in_partition_order(
        cluster3: ThreadedCluster, count: int) -> None:
    client = pulsar.Client(cluster3.service_url, operation_timeout_seconds=20)
    try:
        for compression in COMPRESSIONS:
            topic = f"compressed-{compression.lower()}"
            consumer = client.subscribe(topic, "sub", consumer_type=pulsar.ConsumerType.Failover,
                                        receiver_queue_size=1000)
            producer = client.create_producer(
                topic, batching_enabled=True, batching_max_messages=500, batching_max_publish_delay_ms=5,
                block_if_queue_full=True,
                compression_type=getattr(pulsar.CompressionType, compression),
                message_routing_mode=pulsar.PartitionsRoutingMode.RoundRobinDistribution)
            results: list[pulsar.Result] = []
            record = results.append
            for i in range(count):
                producer.send_async(f"{i}".encode() * 3, lambda result, _msg, record=record: record(result),
                                    partition_key=f"k{i % 17}")
            producer.flush()
            assert results == [pulsar.Result.Ok] * count
            seen: dict[int, int] = {}
            last_per_partition: dict[str, int] = collections.defaultdict(lambda: -1)
            while len(seen) < count:
                msg = consumer.receive(TIMEOUT_MS)
                value = int(msg.data()[: len(msg.data()) // 3])
                seen[value] = seen.get(value, 0) + 1
                part = msg.topic_name()
                assert value > last_per_partition[part], f"{compression}: out of order on {part}"
                last_per_partition[part] = value
                consumer.acknowledge(msg)
            assert sorted(seen) == list(range(count))
            assert set(seen.values()) == {1}
            with pytest.raises(pulsar.Timeout):
                consumer.receive(200)
            producer.close()
            consumer.close()
    finally:
        client.close()
