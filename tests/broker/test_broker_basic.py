"""The official client produces to and consumes from a single embedded broker."""

from __future__ import annotations

import pulsar

from proxy.broker import ThreadedCluster

TIMEOUT_MS = 10_000


def client_for(cluster: ThreadedCluster) -> pulsar.Client:
    return pulsar.Client(cluster.service_url, operation_timeout_seconds=10, connection_timeout_ms=5000)


def test_produce_then_consume_in_order_with_ids(broker: ThreadedCluster) -> None:
    client = client_for(broker)
    try:
        consumer = client.subscribe("basic", "sub", consumer_type=pulsar.ConsumerType.Exclusive)
        producer = client.create_producer("basic", batching_enabled=False)
        ids = [producer.send(f"m{i}".encode(), properties={"i": str(i)}) for i in range(20)]
        assert [mid.entry_id() for mid in ids] == list(range(20))
        for i in range(20):
            msg = consumer.receive(TIMEOUT_MS)
            assert msg.data() == f"m{i}".encode()
            assert msg.properties() == {"i": str(i)}
            assert msg.message_id().entry_id() == i
            consumer.acknowledge(msg)
        producer.close()
        consumer.close()
    finally:
        client.close()
