"""Subscription types against the embedded broker, driven by the official client."""

from __future__ import annotations

import collections
import datetime
import threading
import time

import pulsar
import pytest

from proxy.broker import ThreadedCluster

TIMEOUT_MS = 10_000


@pytest.fixture
def client(broker: ThreadedCluster):  # type: ignore[no-untyped-def]
    c = pulsar.Client(broker.service_url, operation_timeout_seconds=10)
    yield c
    c.close()


#: more than a newly active Failover consumer waits for its first message (ClusterConfig.failover_delay_ms)
ACTIVATION_MS = 1500


def drain(consumer: pulsar.Consumer, idle_ms: int = 300, ack: bool = True) -> list[pulsar.Message]:
    out = []
    while True:
        try:
            msg = consumer.receive(idle_ms)
        except pulsar.Timeout:
            return out
        out.append(msg)
        if ack:
            consumer.acknowledge(msg)


def test_shared_spreads_messages_and_redelivers_a_closed_consumers_unacked(client: pulsar.Client) -> None:
    consumers = [client.subscribe("shared", "s", consumer_type=pulsar.ConsumerType.Shared, receiver_queue_size=10,
                                  consumer_name=f"c{i}") for i in range(3)]
    producer = client.create_producer("shared", batching_enabled=False)
    for i in range(60):
        producer.send(str(i).encode())
    # c0 receives but never acks, then closes: its messages must reach the others
    unacked = [consumers[0].receive(TIMEOUT_MS) for _ in range(5)]
    assert unacked
    got: dict[str, list[int]] = collections.defaultdict(list)
    for c in consumers[1:]:
        for m in drain(c, idle_ms=200):
            got[c.consumer_name()].append(int(m.data()))
    assert all(got[f"c{i}"] for i in (1, 2)), "messages should be spread"
    consumers[0].close()
    for c in consumers[1:]:
        for m in drain(c, idle_ms=500):
            got[c.consumer_name()].append(int(m.data()))
    received = sorted(v for values in got.values() for v in values)
    assert received == list(range(60))
    redelivered = {int(m.data()) for m in unacked}
    assert redelivered <= set(received)


def test_failover_active_consumer_changes_when_it_disconnects(client: pulsar.Client) -> None:
    # on persistent://public/default/failover the hash ring of names picks b over a (see selectors.py)
    first = client.subscribe("failover", "f", consumer_type=pulsar.ConsumerType.Failover, consumer_name="b")
    second = client.subscribe("failover", "f", consumer_type=pulsar.ConsumerType.Failover, consumer_name="a")
    producer = client.create_producer("failover", batching_enabled=False)
    for i in range(10):
        producer.send(str(i).encode())
    # a newly active consumer (the first one too) gets messages 1 s later, as Pulsar's broker
    assert [int(m.data()) for m in drain(first, idle_ms=ACTIVATION_MS)] == list(range(10))
    assert drain(second, idle_ms=200) == []
    first.close()
    for i in range(10, 20):
        producer.send(str(i).encode())
    assert [int(m.data()) for m in drain(second, idle_ms=ACTIVATION_MS)] == list(range(10, 20))


def test_key_shared_keeps_per_key_order_across_consumers(client: pulsar.Client) -> None:
    consumers = [client.subscribe("keyshared", "k", consumer_type=pulsar.ConsumerType.KeyShared,
                                  receiver_queue_size=50) for _ in range(3)]
    producer = client.create_producer("keyshared", batching_enabled=False)
    for i in range(300):
        producer.send_async(f"{i}".encode(), None, partition_key=f"key-{i % 10}")
    producer.flush()
    per_key: dict[str, list[int]] = collections.defaultdict(list)
    owner_of_key: dict[str, int] = {}
    lock = threading.Lock()

    def consume(index: int) -> None:
        for m in drain(consumers[index], idle_ms=500):
            with lock:
                per_key[m.partition_key()].append(int(m.data()))
                assert owner_of_key.setdefault(m.partition_key(), index) == index
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(len(v) for v in per_key.values()) == 300
    for values in per_key.values():
        assert values == sorted(values)
    assert len(set(owner_of_key.values())) > 1, "keys should be spread over consumers"


def test_exclusive_redelivery_reports_no_redelivery_count_as_pulsar_does(client: pulsar.Client) -> None:
    """Pulsar's single-active-consumer dispatchers track no redeliveries: a nacked message on an
    Exclusive subscription comes back with redelivery_count 0 (seen with the real broker, FIDELITY.md)."""
    consumer = client.subscribe("nack-exclusive", "n", negative_ack_redelivery_delay_ms=100)
    producer = client.create_producer("nack-exclusive", batching_enabled=False)
    producer.send(b"retry-me")
    consumer.negative_acknowledge(consumer.receive(TIMEOUT_MS))
    again = consumer.receive(TIMEOUT_MS)
    assert again.data() == b"retry-me"
    assert again.redelivery_count() == 0
    consumer.acknowledge(again)


def test_negative_ack_redelivers_after_the_delay_with_redelivery_count(client: pulsar.Client) -> None:
    consumer = client.subscribe("nack", "n", consumer_type=pulsar.ConsumerType.Shared,
                                negative_ack_redelivery_delay_ms=300)
    producer = client.create_producer("nack", batching_enabled=False)
    producer.send(b"retry-me")
    msg = consumer.receive(TIMEOUT_MS)
    started = time.monotonic()
    consumer.negative_acknowledge(msg)
    again = consumer.receive(TIMEOUT_MS)
    assert again.data() == b"retry-me"
    assert time.monotonic() - started >= 0.25
    assert again.redelivery_count() == 1
    consumer.acknowledge(again)


def test_reader_from_earliest_from_a_message_id_and_from_latest(client: pulsar.Client) -> None:
    producer = client.create_producer("readers", batching_enabled=False)
    ids = [producer.send(f"{i}".encode()) for i in range(10)]
    earliest = client.create_reader("readers", pulsar.MessageId.earliest)
    assert [int(earliest.read_next(TIMEOUT_MS).data()) for _ in range(10)] == list(range(10))
    assert not earliest.has_message_available()
    from_id = client.create_reader("readers", ids[4])
    assert [int(from_id.read_next(TIMEOUT_MS).data()) for _ in range(5)] == list(range(5, 10))
    latest = client.create_reader("readers", pulsar.MessageId.latest)
    assert not latest.has_message_available()
    producer.send(b"10")
    assert latest.has_message_available()
    assert latest.read_next(TIMEOUT_MS).data() == b"10"


@pytest.mark.parametrize("batching", [False, True], ids=["single", "batched"])
def test_reader_with_an_inclusive_start_begins_at_that_message(client: pulsar.Client, batching: bool) -> None:
    """As the real broker does, the start entry itself is delivered; the client drops it only if exclusive."""
    topic = f"readers-inclusive-{batching}"
    producer = client.create_producer(topic, batching_enabled=batching, batching_max_messages=4,
                                      batching_max_publish_delay_ms=50)
    receipts: list[pulsar.MessageId] = []
    for i in range(12):
        producer.send_async(f"{i}".encode(), lambda _, msg_id: receipts.append(msg_id))
    producer.flush()
    ids = sorted(receipts, key=lambda m: (m.ledger_id(), m.entry_id(), m.batch_index()))
    inclusive = client.create_reader(topic, ids[5], start_message_id_inclusive=True)
    assert [int(inclusive.read_next(TIMEOUT_MS).data()) for _ in range(7)] == list(range(5, 12))
    exclusive = client.create_reader(topic, ids[5])
    assert [int(exclusive.read_next(TIMEOUT_MS).data()) for _ in range(6)] == list(range(6, 12))
    first = client.create_reader(topic, ids[0], start_message_id_inclusive=True)
    assert first.read_next(TIMEOUT_MS).data() == b"0"


def test_reader_with_batches_has_message_available(client: pulsar.Client) -> None:
    producer = client.create_producer("readers-batch", batching_enabled=True, batching_max_publish_delay_ms=50)
    for i in range(20):
        producer.send_async(f"{i}".encode(), None)
    producer.flush()
    reader = client.create_reader("readers-batch", pulsar.MessageId.earliest)
    values = []
    while reader.has_message_available():
        values.append(int(reader.read_next(TIMEOUT_MS).data()))
    assert values == list(range(20))


def test_seek_by_time_and_by_message_id(client: pulsar.Client) -> None:
    producer = client.create_producer("seek", batching_enabled=False)
    consumer = client.subscribe("seek", "s", initial_position=pulsar.InitialPosition.Earliest)
    ids = [producer.send(f"{i}".encode()) for i in range(5)]
    time.sleep(0.05)
    middle = int(time.time() * 1000)
    time.sleep(0.05)
    for i in range(5, 10):
        producer.send(f"{i}".encode())
    assert [int(m.data()) for m in drain(consumer)] == list(range(10))
    consumer.seek(middle)
    assert [int(m.data()) for m in drain(consumer, idle_ms=1000)] == list(range(5, 10))
    consumer.seek(ids[2])
    # the broker resets the cursor to entry 2 exactly; the C++ client then skips the
    # seek id itself (it treats it as an exclusive start), so 3.. is what arrives
    assert [int(m.data()) for m in drain(consumer, idle_ms=1000)] == list(range(3, 10))


def test_exclusive_refuses_a_second_consumer_and_types_must_match(client: pulsar.Client) -> None:
    client.subscribe("only-one", "x", consumer_type=pulsar.ConsumerType.Exclusive)
    with pytest.raises(pulsar.ConsumerBusy):
        client.subscribe("only-one", "x", consumer_type=pulsar.ConsumerType.Exclusive)
    with pytest.raises(pulsar.ConsumerBusy):
        client.subscribe("only-one", "x", consumer_type=pulsar.ConsumerType.Shared)


def test_unsubscribe_deletes_the_subscription_and_its_backlog(client: pulsar.Client, broker: ThreadedCluster) -> None:
    consumer = client.subscribe("unsub", "gone")
    producer = client.create_producer("unsub")
    producer.send(b"1")
    consumer.unsubscribe()
    assert "gone" not in broker.cluster.topics["persistent://public/default/unsub"].subscriptions
    again = client.subscribe("unsub", "gone")
    producer.send(b"2")
    assert again.receive(TIMEOUT_MS).data() == b"2"


def test_reader_on_an_empty_topic_has_nothing_available(client: pulsar.Client) -> None:
    reader = client.create_reader("empty-topic", pulsar.MessageId.earliest)
    assert not reader.has_message_available()
    client.create_producer("empty-topic").send(b"first")
    assert reader.has_message_available()
    assert reader.read_next(TIMEOUT_MS).data() == b"first"


def test_exclusive_redelivery_after_negative_ack_rewinds(client: pulsar.Client) -> None:
    consumer = client.subscribe("rewind", "r", negative_ack_redelivery_delay_ms=100)
    producer = client.create_producer("rewind", batching_enabled=False)
    for i in range(3):
        producer.send(str(i).encode())
    first = consumer.receive(TIMEOUT_MS)
    consumer.negative_acknowledge(first)
    values = []
    deadline = time.monotonic() + 10
    while sorted(set(values)) != [0, 1, 2]:
        assert time.monotonic() < deadline, values
        msg = consumer.receive(TIMEOUT_MS)
        values.append(int(msg.data()))
        consumer.acknowledge(msg)
    assert 0 in values, "the negatively acked message is delivered again"


def test_batch_index_acks_survive_a_reconnect(client: pulsar.Client) -> None:
    producer = client.create_producer("batch-acks", batching_enabled=True, batching_max_publish_delay_ms=50)
    for i in range(6):
        producer.send_async(str(i).encode(), None)
    producer.flush()
    consumer = client.subscribe("batch-acks", "b", initial_position=pulsar.InitialPosition.Earliest,
                                batch_index_ack_enabled=True, consumer_type=pulsar.ConsumerType.Shared)
    messages = [consumer.receive(TIMEOUT_MS) for _ in range(6)]
    assert len({m.message_id().entry_id() for m in messages}) == 1, "one batch"
    for m in messages[:4]:
        consumer.acknowledge(m)
    time.sleep(0.3)  # the ack grouping tracker flushes every 100 ms
    consumer.close()
    again = client.subscribe("batch-acks", "b", batch_index_ack_enabled=True,
                             consumer_type=pulsar.ConsumerType.Shared)
    assert sorted(int(m.data()) for m in drain(again)) == [4, 5]


def test_failover_on_a_partitioned_topic_spreads_partitions_over_consumers(broker_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: ThreadedCluster = broker_cluster(partitions=4)
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=10)
    try:
        a = client.subscribe("fo-parts", "f", consumer_type=pulsar.ConsumerType.Failover, consumer_name="a")
        b = client.subscribe("fo-parts", "f", consumer_type=pulsar.ConsumerType.Failover, consumer_name="b")
        producer = client.create_producer("fo-parts", batching_enabled=False,
                                          message_routing_mode=pulsar.PartitionsRoutingMode.RoundRobinDistribution)
        for i in range(40):
            producer.send(str(i).encode())
        got_a, got_b = drain(a, idle_ms=ACTIVATION_MS), drain(b)
        assert len(got_a) + len(got_b) == 40
        assert {m.topic_name() for m in got_a}.isdisjoint({m.topic_name() for m in got_b})
        assert got_a and got_b
    finally:
        client.close()


def test_key_shared_keeps_per_key_order_when_consumers_join_and_leave(client: pulsar.Client) -> None:
    producer = client.create_producer("ks-churn", batching_enabled=False)
    per_key: dict[str, list[int]] = collections.defaultdict(list)
    lock = threading.Lock()

    def consume(consumer: pulsar.Consumer, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                msg = consumer.receive(50)
            except pulsar.Timeout:
                continue
            with lock:
                per_key[msg.partition_key()].append(int(msg.data()))
            consumer.acknowledge(msg)

    def start() -> tuple[pulsar.Consumer, threading.Event, threading.Thread]:
        consumer = client.subscribe("ks-churn", "k", consumer_type=pulsar.ConsumerType.KeyShared,
                                    receiver_queue_size=20)
        stop = threading.Event()
        thread = threading.Thread(target=consume, args=(consumer, stop))
        thread.start()
        return consumer, stop, thread

    def publish(values: range) -> None:
        for i in values:
            producer.send_async(str(i).encode(), None, partition_key=f"key-{i % 8}")

    first, stop_first, thread_first = start()
    publish(range(200))
    _second, stop_second, thread_second = start()
    publish(range(200, 400))
    producer.flush()
    # the first consumer leaves with whatever it has not acknowledged: it goes to the second
    stop_first.set()
    thread_first.join(5)
    first.close()
    publish(range(400, 500))
    producer.flush()
    deadline = time.monotonic() + 20
    while sum(len(v) for v in per_key.values()) < 500 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_second.set()
    thread_second.join(5)
    received = sorted(v for values in per_key.values() for v in values)
    assert set(received) == set(range(500))
    for values in per_key.values():
        # a message the first consumer held unacked when it left comes again; order is kept
        deduplicated = list(dict.fromkeys(values))
        assert deduplicated == sorted(deduplicated)


def test_a_non_persistent_topic_delivers_to_consumers_with_permits_and_keeps_nothing(client: pulsar.Client) -> None:
    """As Pulsar's NonPersistentTopic (the real broker's answers, tests/peers/FIDELITY.md's tour): ids 0:0,
    nothing stored for a later subscriber or a reader, a message for a consumer without permits dropped,
    no redelivery, no last message id, a seek that changes nothing; a Shared pair splits what comes."""
    topic = "non-persistent://public/default/volatile"
    producer = client.create_producer(topic, batching_enabled=False)
    assert {str(producer.send(b"before %d" % i)) for i in range(3)} == {"(0,0,-1,-1)"}
    late = client.subscribe(topic, "late", initial_position=pulsar.InitialPosition.Earliest, receiver_queue_size=1)
    reader = client.create_reader(topic, pulsar.MessageId.earliest)
    assert drain(late) == []
    with pytest.raises(pulsar.PulsarException):  # (UnknownError, word for word the real broker's)
        late.get_last_message_id()
    for i in range(10):  # the late consumer granted one permit: the first goes to it, the rest nowhere
        producer.send(b"now %d" % i)
    assert [m.data() for m in drain(late, ack=False)] == [b"now 0"]
    assert [reader.read_next(TIMEOUT_MS).data() for _ in range(10)] == [b"now %d" % i for i in range(10)]
    late.seek(pulsar.MessageId.earliest)
    producer.send(b"after the seek")
    (message,) = drain(late, idle_ms=1000, ack=False)
    assert message.data() == b"after the seek" and str(message.message_id()) == "(0,0,-1,-1)"
    late.negative_acknowledge(message)
    time.sleep(1.5)  # (the client's default negative-ack delay is 1 s: nothing comes back)
    assert drain(late) == []
    pair = [client.subscribe(topic, "pair", consumer_type=pulsar.ConsumerType.Shared, receiver_queue_size=20)
            for _ in range(2)]
    for i in range(20):
        producer.send(b"shared %d" % i)
    got = [drain(consumer) for consumer in pair]
    assert sorted(len(g) for g in got) == [10, 10]
    assert sorted(m.data() for g in got for m in g) == sorted(b"shared %d" % i for i in range(20))


@pytest.mark.parametrize("consumer_type", [pulsar.ConsumerType.Shared, pulsar.ConsumerType.KeyShared,
                                           pulsar.ConsumerType.Exclusive])
def test_a_delayed_message_waits_on_shared_subscriptions_and_not_on_exclusive_ones(
        client: pulsar.Client, consumer_type: pulsar.ConsumerType) -> None:
    """As Pulsar's broker (the fidelity tour): Shared and Key_Shared subscriptions hold a message until its
    deliver_at_time while what follows goes on; one due within the tracker's tick (1 s) goes at once, and so
    does every message of an Exclusive subscription."""
    topic = f"delayed-{consumer_type}"
    consumer = client.subscribe(topic, "s", consumer_type=consumer_type)
    producer = client.create_producer(topic, batching_enabled=False)
    sent = time.monotonic()
    producer.send(b"in 1.6 s", deliver_after=datetime.timedelta(seconds=1.6), partition_key="k")
    producer.send(b"in 0.5 s", deliver_after=datetime.timedelta(seconds=0.5), partition_key="k")
    producer.send(b"now", partition_key="k")
    arrived = {}
    for _ in range(3):
        message = consumer.receive(TIMEOUT_MS)
        consumer.acknowledge(message)
        arrived[message.data()] = time.monotonic() - sent
    assert list(arrived)[-1 if consumer_type != pulsar.ConsumerType.Exclusive else 0] == b"in 1.6 s"
    if consumer_type == pulsar.ConsumerType.Exclusive:
        assert max(arrived.values()) < 1.0
    else:
        assert arrived[b"in 0.5 s"] < 1.0 and arrived[b"now"] < 1.0
        assert 1.6 <= arrived[b"in 1.6 s"] < 3.0


def test_unsubscribe_with_another_consumer_on_and_an_empty_subscription_name_are_refused_as_pulsar_does(
        client: pulsar.Client) -> None:
    """The real broker's codes (the fidelity tour): MetadataError "Unconnected or shared consumer attempting to
    unsubscribe" (the client's BrokerMetadataError) and ProducerBusy "Empty subscription name" (which the client
    reports as InvalidConfiguration)."""
    first, second = (client.subscribe("pair", "pair", consumer_type=pulsar.ConsumerType.Shared) for _ in range(2))
    with pytest.raises(pulsar.BrokerMetadataError):
        first.unsubscribe()
    second.close()
    first.unsubscribe()  # (alone now)
    with pytest.raises(pulsar.InvalidConfiguration):
        client.subscribe("pair", "")
