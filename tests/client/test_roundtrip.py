"""The built-in client against the embedded broker: produce, consume, acks, readers."""

from __future__ import annotations

import trio

from proxy.broker import ThreadedCluster
from proxy.client import PulsarClient


async def test_messages_sent_are_received_in_order_with_keys_and_properties(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            consumer = await client.subscribe("basic", "sub", initial_position="Earliest")
            producer = await client.create_producer("basic", batching=False)
            ids = [await producer.send(f"m{i}".encode(), key=f"k{i}", properties={"i": str(i)})
                   for i in range(5)]
            assert ids == sorted(ids)
            received = []
            for _ in range(5):
                msg = await consumer.receive()
                consumer.acknowledge(msg)
                received.append(msg)
            assert [m.payload for m in received] == [f"m{i}".encode() for i in range(5)]
            assert [m.key for m in received] == [f"k{i}" for i in range(5)]
            assert [m.properties for m in received] == [{"i": str(i)} for i in range(5)]
            assert [m.message_id for m in received] == ids
            assert [m.sequence_id for m in received] == [0, 1, 2, 3, 4]
