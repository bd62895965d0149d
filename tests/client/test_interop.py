"""Interop with the official client (pulsar-client) through the embedded broker, both ways."""

from __future__ import annotations

import pulsar
import pytest
import trio

from proxy.broker import ThreadedCluster
from proxy.client import PulsarClient

COMPRESSIONS = ["NONE", "LZ4", "ZLIB", "ZSTD", "SNAPPY"]
OFFICIAL_COMPRESSION = {
    "NONE": pulsar.CompressionType.NONE, "LZ4": pulsar.CompressionType.LZ4, "ZLIB": pulsar.CompressionType.ZLib,
    "ZSTD": pulsar.CompressionType.ZSTD, "SNAPPY": pulsar.CompressionType.SNAPPY,
}


def official_client(url: str) -> pulsar.Client:
    return pulsar.Client(url, operation_timeout_seconds=10, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("batching", [True, False], ids=["batched", "single"])
async def test_official_consumer_reads_what_the_builtin_producer_sent(
        cluster: ThreadedCluster, compression: str, batching: bool) -> None:
    topic = f"persistent://public/default/to-official-{compression}-{batching}"
    official = official_client(cluster.service_url)
    try:
        consumer = await trio.to_thread.run_sync(lambda: official.subscribe(
            topic, "sub", initial_position=pulsar.InitialPosition.Earliest))
        with trio.fail_after(20):
            async with PulsarClient(cluster.service_url) as client:
                producer = await client.create_producer(topic, compression=compression, batching=batching,
                                                        batching_max_messages=10)
                receipts = [await producer.send_async(b"payload-%d" % i * 50, key=f"key-{i}",
                                                      properties={"n": str(i), "kind": "builtin"})
                            for i in range(25)]
                await producer.flush()
                ids = [await r.wait() for r in receipts]
                if batching:
                    assert max(i.batch_size for i in ids) == 10
                else:
                    assert all(i.batch_index == -1 for i in ids)

        def consume() -> list[pulsar.Message]:
            messages = []
            for _ in range(25):
                msg = consumer.receive(timeout_millis=5000)
                consumer.acknowledge(msg)
                messages.append(msg)
            return messages

        messages = await trio.to_thread.run_sync(consume)
        assert [m.data() for m in messages] == [b"payload-%d" % i * 50 for i in range(25)]
        assert [m.partition_key() for m in messages] == [f"key-{i}" for i in range(25)]
        assert [m.properties() for m in messages] == [{"n": str(i), "kind": "builtin"} for i in range(25)]
    finally:
        await trio.to_thread.run_sync(official.close)


@pytest.mark.parametrize("compression", COMPRESSIONS)
async def test_builtin_consumer_reads_what_the_official_producer_sent(
        cluster: ThreadedCluster, compression: str) -> None:
    topic = f"persistent://public/default/from-official-{compression}"
    official = official_client(cluster.service_url)
    try:
        with trio.fail_after(30):
            async with PulsarClient(cluster.service_url) as client:
                consumer = await client.subscribe(topic, "sub", subscription_type="Shared")

                def produce() -> None:
                    producer = official.create_producer(
                        topic, compression_type=OFFICIAL_COMPRESSION[compression], batching_enabled=True,
                        batching_max_messages=7, batching_max_publish_delay_ms=50)
                    for i in range(30):
                        producer.send_async(b"official-%d" % i * 40, None, partition_key=f"k{i}",
                                            properties={"n": str(i)})
                    producer.flush()
                    producer.send(b"single", properties={"last": "yes"})
                    producer.close()

                await trio.to_thread.run_sync(produce)
                received = []
                for _ in range(31):
                    msg = await consumer.receive()
                    consumer.acknowledge(msg)
                    received.append(msg)
        assert [m.payload for m in received[:30]] == [b"official-%d" % i * 40 for i in range(30)]
        assert [m.key for m in received[:30]] == [f"k{i}" for i in range(30)]
        assert [m.properties for m in received[:30]] == [{"n": str(i)} for i in range(30)]
        assert any(m.message_id.batch_size > 1 for m in received)
        assert received[30].payload == b"single" and received[30].properties == {"last": "yes"}
    finally:
        await trio.to_thread.run_sync(official.close)
