"""Client features against the embedded broker: partitions, redirects, acks, readers, chunks, auth."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pulsar
import pytest
import trio

from proxy.broker import ThreadedCluster
from proxy.client import EARLIEST, MultiTopicConsumer, PartitionedProducer, PulsarClient
from proxy.client.connection import ClientConnection, ConnectionConfig
from proxy.client.names import BrokerAddress
from proxy.errors import BrokerError, ClientError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_command

ClusterFactory = Callable[..., ThreadedCluster]


async def test_partitioned_topic_spreads_over_partitions_and_brokers_via_redirects(
        cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(brokers=3, partitions=4)
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            assert await client.get_partitions("parts") == [
                f"persistent://public/default/parts-partition-{i}" for i in range(4)]
            consumer = await client.subscribe("parts", "sub", initial_position="Earliest")
            producer = await client.create_producer("parts", batching=False)
            assert isinstance(producer, PartitionedProducer) and isinstance(consumer, MultiTopicConsumer)
            ids = [await producer.send(b"%d" % i) for i in range(40)]
            assert sorted({i.partition for i in ids}) == [0, 1, 2, 3]
            keyed = {await producer.send(b"k", key="same-key") for _ in range(5)}
            assert len({i.partition for i in keyed}) == 1
            got = set()
            for _ in range(45):
                msg = await consumer.receive()
                consumer.acknowledge(msg)
                got.add(msg.message_id)
            assert got == set(ids) | keyed
            # lookups were redirected to the owners: one connection per broker
            assert {c.logical.port for c in client._pool.connections} == {  # type: ignore[union-attr]
                int(a.rsplit(":", 1)[1]) for a in cluster.addresses}


async def test_negative_ack_redelivers_after_the_delay_with_a_redelivery_count(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            consumer = await client.subscribe("nack", "sub", subscription_type="Shared",
                                              negative_ack_redelivery_delay=0.2)
            producer = await client.create_producer("nack", batching=False)
            for i in range(3):
                await producer.send(b"%d" % i)
            first = [await consumer.receive() for _ in range(3)]
            consumer.acknowledge(first[0])
            consumer.acknowledge(first[2])
            consumer.negative_acknowledge(first[1])
            again = await consumer.receive()
            assert again.payload == b"1" and again.redelivery_count == 1
            assert again.message_id == first[1].message_id
            consumer.acknowledge(again)
            with trio.move_on_after(0.5):
                extra = await consumer.receive()
                pytest.fail(f"unexpected redelivery of {extra}")


async def test_cumulative_ack_and_resubscribe_resumes_after_the_acked_position(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            producer = await client.create_producer("cumulative", batching_max_messages=4, batching_max_delay=60)
            consumer = await client.subscribe("cumulative", "sub", subscription_type="Failover")
            receipts = [await producer.send_async(b"%d" % i) for i in range(12)]
            await producer.flush()
            assert receipts[-1].result().batch_size == 4
            messages = [await consumer.receive() for _ in range(12)]
            consumer.acknowledge_cumulative(messages[7])  # the last of the second batch
            await consumer.close()
            consumer = await client.subscribe("cumulative", "sub", subscription_type="Failover")
            rest = [await consumer.receive() for _ in range(4)]
            assert [m.payload for m in rest] == [b"%d" % i for i in range(8, 12)]
            shared = await client.subscribe("cumulative", "shared", subscription_type="Shared")
            with pytest.raises(ClientError):
                shared.acknowledge_cumulative(rest[0])


async def test_reader_reads_from_earliest_and_after_a_message_id_inside_a_batch(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            producer = await client.create_producer("reader", batching_max_messages=5, batching_max_delay=60)
            receipts = [await producer.send_async(b"%d" % i) for i in range(10)]
            await producer.flush()
            ids = [r.result() for r in receipts]
            reader = await client.create_reader("reader", EARLIEST)
            assert [(await reader.read_next()).payload for _ in range(10)] == [b"%d" % i for i in range(10)]
            await reader.close()
            reader = await client.create_reader("reader", ids[6])
            assert (await reader.read_next()).payload == b"7"
            inclusive = await client.create_reader("reader", ids[6], inclusive=True)
            assert (await inclusive.read_next()).payload == b"6"
            # survives an unload: resumes after the last message read
            await trio.to_thread.run_sync(cluster.unload_topic, "reader")
            assert [(await reader.read_next()).payload for _ in range(2)] == [b"8", b"9"]


async def test_large_message_is_chunked_and_reassembled_by_both_clients(cluster: ThreadedCluster) -> None:
    big = bytes(range(256)) * (24 * 1024)  # 6 MiB, over the 5 MiB limit
    topic = "persistent://public/default/chunks"
    official = pulsar.Client(cluster.service_url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        official_consumer = await trio.to_thread.run_sync(lambda: official.subscribe(topic, "official"))
        with trio.fail_after(30):
            async with PulsarClient(cluster.service_url) as client:
                consumer = await client.subscribe(topic, "builtin")
                producer = await client.create_producer(topic, batching=False, chunking=True)
                unchunked = await client.create_producer(topic, batching=False)
                with pytest.raises(BrokerError, match="MessageTooBig"):
                    await unchunked.send(big)
                await producer.send(big, key="big", properties={"size": str(len(big))})
                msg = await consumer.receive()
                assert msg.payload == big and msg.key == "big" and msg.properties == {"size": str(len(big))}
                consumer.acknowledge(msg)  # acknowledges every chunk's entry
                await trio.sleep(0.3)
                await trio.to_thread.run_sync(cluster.unload_topic, topic)
                await consumer.wait_connected(min_reconnects=1)  # type: ignore[union-attr]
                with trio.move_on_after(0.5):
                    again = await consumer.receive()
                    pytest.fail(f"chunks redelivered after the ack: {len(again.payload)} bytes")
                backlog = await trio.to_thread.run_sync(cluster.call, lambda: cluster.cluster.get_topic(
                    topic).subscriptions["builtin"].backlog())
                assert backlog == 0  # every chunk's entry was acknowledged
        received = await trio.to_thread.run_sync(lambda: official_consumer.receive(timeout_millis=10_000))
        assert received.data() == big
    finally:
        await trio.to_thread.run_sync(official.close)


async def test_consumer_resubscribes_after_unload_without_losing_messages(cluster: ThreadedCluster) -> None:
    with trio.fail_after(30):
        async with PulsarClient(cluster.service_url) as client:
            consumer = await client.subscribe("unload-consumer", "sub", receiver_queue_size=50)
            producer = await client.create_producer("unload-consumer")
            for i in range(500):
                await producer.send_async(b"%d" % i)
            await producer.flush()
            seen: set[bytes] = set()
            unload_at = [300, 100]
            while len(seen) < 500:
                msg = await consumer.receive()
                consumer.acknowledge(msg)
                seen.add(msg.payload)
                if unload_at and len(seen) >= unload_at[-1]:
                    unload_at.pop()
                    await trio.to_thread.run_sync(cluster.unload_topic, "unload-consumer")
            assert consumer.reconnects >= 1  # type: ignore[union-attr]
            assert seen == {b"%d" % i for i in range(500)}


async def test_token_auth_is_sent_and_a_wrong_token_is_refused(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(auth_token="s3cret")
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url, token="s3cret") as client:
            producer = await client.create_producer("auth")
            await producer.send(b"ok")
        with pytest.raises(ClientError):
            async with PulsarClient(cluster.service_url, token="wrong", operation_timeout=2) as client:
                await client.create_producer("auth")


async def test_a_full_pending_queue_blocks_or_fails_as_configured(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            producer = await client.create_producer("full", max_pending_messages=5, block_if_queue_full=False,
                                                    batching_max_delay=60, batching_max_messages=100)
            for _ in range(5):
                await producer.send_async(b"x")
            with pytest.raises(BrokerError, match="ProducerQueueIsFull"):
                await producer.send_async(b"x")
            await producer.flush()
            blocking = await client.create_producer("full", max_pending_messages=2, batching=False)
            receipts = [await blocking.send_async(b"y") for _ in range(20)]  # waits for room, never fails
            await blocking.flush()
            assert all(r.done and r.error is None for r in receipts)


async def test_keepalive_pings_keep_an_idle_connection_open(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url, keepalive_interval=0.1) as client:
            producer = await client.create_producer("idle")
            [connection] = client._pool.connections  # type: ignore[union-attr]
            await trio.sleep(0.6)
            assert connection.is_open and connection.frames_received >= 4  # PONGs
            await producer.send(b"still here")


async def test_keepalive_pings_a_silent_broker_and_closes_the_connection_when_nothing_answers() -> None:
    """The shared keepalive policy, client side: PING after a silent interval, dead an interval later."""
    received: list[int] = []

    async def mute_broker(stream: trio.SocketStream) -> None:
        decoder = FrameDecoder()
        while data := await stream.receive_some(65536):
            for frame in decoder.receive(data):
                received.append(frame.type)
                if frame.type == api.BaseCommand.CONNECT:
                    await stream.send_all(encode_command(api.CommandConnected(server_version="mute",
                                                                              protocol_version=21)))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(partial(trio.serve_tcp, mute_broker, 0, host="127.0.0.1"))
            address = BrokerAddress("127.0.0.1", listener.socket.getsockname()[1])
            connection = ClientConnection(address, address, ConnectionConfig(keepalive_interval=0.2))
            await nursery.start(connection.serve)
            started = trio.current_time()
            await connection.closed.wait()
            assert trio.current_time() - started >= 0.4  # one silent interval, then one after the PING
            assert "no PONG" in connection.close_reason
            assert received == [api.BaseCommand.CONNECT, api.BaseCommand.PING]
            nursery.cancel_scope.cancel()


async def test_initial_sequence_id_continues_from_the_brokers_last_sequence_id(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(deduplication=True)
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            producer = await client.create_producer("seq", producer_name="p1")
            for _ in range(3):
                await producer.send(b"x")
            await producer.close()
            again = await client.create_producer("seq", producer_name="p1")
            assert again.last_sequence_id_published == 2
            await again.send(b"y")
            consumer = await client.subscribe("seq", "s", initial_position="Earliest")
            sequence_ids = [(await consumer.receive()).sequence_id for _ in range(4)]
            assert sequence_ids == [0, 1, 2, 3]


async def test_exclusive_producer_and_consumer_refuse_a_second_one_with_the_brokers_error(
        cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            await client.create_producer("exclusive", access_mode="Exclusive")
            with pytest.raises(BrokerError) as refused:
                await client.create_producer("exclusive", access_mode="Exclusive")
            assert refused.value.server_error in ("ProducerBusy", "ProducerFenced")
            await client.subscribe("exclusive", "only-one")
            with pytest.raises(BrokerError, match="ConsumerBusy"):
                await client.subscribe("exclusive", "only-one")


async def test_every_subscription_type_receives(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            producer = await client.create_producer("types")
            await producer.send(b"first", key="k")
            for sub_type in ("Exclusive", "Shared", "Failover", "Key_Shared"):
                consumer = await client.subscribe("types", sub_type.lower(), subscription_type=sub_type,
                                                  initial_position="Earliest")
                msg = await consumer.receive()
                assert (msg.payload, msg.key) == (b"first", "k")
                consumer.acknowledge(msg)


async def test_messages_without_receipt_fail_after_the_send_timeout(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url, operation_timeout=2) as client:
            producer = await client.create_producer("timeout", send_timeout=0.5, batching=False)
            await producer.send(b"ok")
            await trio.to_thread.run_sync(cluster.kill_broker, 0)
            receipts = [await producer.send_async(b"lost") for _ in range(3)]
            for receipt in receipts:
                with pytest.raises(ClientError, match=r"no receipt within 0\.5 s"):
                    await receipt.wait()


async def test_grouped_acks_reach_the_broker_so_acked_messages_are_not_redelivered(cluster: ThreadedCluster) -> None:
    with trio.fail_after(20):
        async with PulsarClient(cluster.service_url) as client:
            producer = await client.create_producer("grouped-acks", batching=False)
            consumer = await client.subscribe("grouped-acks", "sub", ack_group_time=0.05)
            for i in range(6):
                await producer.send(b"%d" % i)
            for _ in range(3):
                consumer.acknowledge(await consumer.receive())
            await trio.sleep(0.3)  # the group is flushed by its timer, not by close()
            await trio.to_thread.run_sync(cluster.unload_topic, "grouped-acks")
            await consumer.wait_connected(min_reconnects=1)  # type: ignore[union-attr]
            rest = set()
            while len(rest) < 3:
                rest.add((await consumer.receive()).payload)
            assert rest == {b"3", b"4", b"5"}
            with trio.move_on_after(0.3):
                again = await consumer.receive()
                pytest.fail(f"acknowledged message redelivered: {again.payload!r}")
