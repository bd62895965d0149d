"""Dispatch under load with the official client: batched, LZ4-compressed ~1 KB messages.

A report said a consumer intermittently missed messages (19 942 of 20 000) with
20 000 ``send_async`` calls, batches of up to 500 and a receive queue of 1000.  The
broker was not losing them: with ``block_if_queue_full`` off (the client's default)
and ``max_pending_messages`` at its default of 1000, ``send_async`` fails the
messages that find the producer's queue full with ``ProducerQueueIsFull`` and they
never reach the broker.  These tests pin that down (every message the client says
it sent is delivered exactly once, and nothing else) and check the dispatch paths
the report suspected: batches larger than the consumer's remaining permits (permits
go negative), FLOWs racing with new entries, and a backlog served only by FLOWs,
on Exclusive, Failover and Shared subscriptions.  One real difference turned up on
the way: a Failover consumer that joined without changing the active one was never
told it stands by (Pulsar sends it ACTIVE_CONSUMER_CHANGE is_active=false).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pulsar
import pytest

from proxy.broker import ThreadedCluster
from proxy.broker.ledger import Entry
from proxy.broker.subscription import FAILOVER, Consumer, Subscription
from proxy.broker.topic import Topic

#: the reported scenario's size; the dispatch matrix uses half, to stay quick
MESSAGES = 20_000
MATRIX_MESSAGES = 10_000
PAYLOAD_BYTES = 1024
RECEIVE_TIMEOUT_MS = 5_000
#: how long a drained subscription must stay silent for "nothing else arrives"
QUIET_MS = 200


def _producer(client: pulsar.Client, topic: str, *, block: bool) -> pulsar.Producer:
    return client.create_producer(topic, batching_enabled=True, batching_max_messages=500,
                                  compression_type=pulsar.CompressionType.LZ4, block_if_queue_full=block)


def _send_all(producer: pulsar.Producer, count: int) -> list[pulsar.Result]:
    """Send ``count`` numbered messages with ``send_async``; the result of each, in completion order."""
    results: list[pulsar.Result] = []
    lock = threading.Lock()

    def record(result: pulsar.Result, _message_id: Any) -> None:
        with lock:
            results.append(result)

    padding = b"x" * (PAYLOAD_BYTES - 8)
    for i in range(count):
        producer.send_async(i.to_bytes(8, "big") + padding, record)
    producer.flush()
    return results


def _receive(consumers: list[pulsar.Consumer], expected: int) -> dict[int, int]:
    """Receive and acknowledge until ``expected`` messages came or none came for a while: number -> times.

    Each consumer is drained until it has nothing for a moment, so an idle one (Failover's
    inactive consumer) costs one short wait per round, not one per message.
    """
    seen: dict[int, int] = {}
    received = 0
    deadline = time.monotonic() + RECEIVE_TIMEOUT_MS / 1000
    per_try_ms = RECEIVE_TIMEOUT_MS if len(consumers) == 1 else 20
    while received < expected and time.monotonic() < deadline:
        for consumer in consumers:
            while received < expected:
                try:
                    message = consumer.receive(per_try_ms)
                except pulsar.Timeout:
                    break
                number = int.from_bytes(message.data()[:8], "big")
                seen[number] = seen.get(number, 0) + 1
                received += 1
                consumer.acknowledge(message)
                deadline = time.monotonic() + RECEIVE_TIMEOUT_MS / 1000
    return seen


def _assert_quiet(consumers: list[pulsar.Consumer]) -> None:
    for consumer in consumers:
        with pytest.raises(pulsar.Timeout):
            consumer.receive(QUIET_MS)


def _messages_in_and_out(subscription: Subscription) -> tuple[int, int]:
    return subscription.topic.stats.messages_in, subscription.messages_out


def _subscription(broker: ThreadedCluster, topic: str, name: str) -> Subscription:
    return broker.call(lambda: broker.cluster.get_topic(f"persistent://public/default/{topic}",
                                                        create=False).subscriptions[name])


def test_every_message_the_client_reports_sent_arrives_even_when_its_queue_overflows(
        broker: ThreadedCluster) -> None:
    """The reported scenario: what goes missing is exactly what ``send_async`` failed with ProducerQueueIsFull."""
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=30)
    try:
        for run in range(2):
            topic = f"overflow-{run}"
            consumer = client.subscribe(topic, "bench", receiver_queue_size=1000)
            results = _send_all(_producer(client, topic, block=False), MESSAGES)
            assert len(results) == MESSAGES
            assert set(results) <= {pulsar.Result.Ok, pulsar.Result.ProducerQueueIsFull}
            sent = results.count(pulsar.Result.Ok)
            seen = _receive([consumer], sent)
            assert len(seen) == sent, f"run {run}: {len(seen)} of the {sent} sent messages arrived"
            assert set(seen.values()) == {1}
            _assert_quiet([consumer])
            assert broker.call(_messages_in_and_out, _subscription(broker, topic, "bench")) == (sent, sent)
    finally:
        client.close()


@pytest.mark.parametrize(("sub_type", "consumer_count"), [
    (pulsar.ConsumerType.Exclusive, 1),
    (pulsar.ConsumerType.Failover, 2),
    (pulsar.ConsumerType.Shared, 2),
], ids=["exclusive", "failover", "shared"])
@pytest.mark.parametrize("receiver_queue_size", [1000, 10], ids=["queue1000", "queue10"])
@pytest.mark.parametrize("subscribe_first", [True, False], ids=["live", "backlog"])
def test_batched_lz4_messages_arrive_once_whatever_the_permits(
        broker: ThreadedCluster, sub_type: pulsar.ConsumerType, consumer_count: int,
        receiver_queue_size: int, subscribe_first: bool) -> None:
    """10 000 messages in batches bigger than a receive queue of 10, or not; live or from a backlog."""
    topic = f"load-{sub_type}-{receiver_queue_size}-{subscribe_first}".lower().replace(".", "-")
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=30)
    try:
        def subscribe() -> list[pulsar.Consumer]:
            return [client.subscribe(topic, "load", consumer_type=sub_type, receiver_queue_size=receiver_queue_size,
                                     consumer_name=f"c{i}", initial_position=pulsar.InitialPosition.Earliest)
                    for i in range(consumer_count)]

        consumers = subscribe() if subscribe_first else []
        results = _send_all(_producer(client, topic, block=True), MATRIX_MESSAGES)
        assert results == [pulsar.Result.Ok] * MATRIX_MESSAGES
        if not subscribe_first:
            consumers = subscribe()
        seen = _receive(consumers, MATRIX_MESSAGES)
        assert len(seen) == MATRIX_MESSAGES, f"{len(seen)} of {MATRIX_MESSAGES} arrived"
        assert sorted(seen) == list(range(MATRIX_MESSAGES))
        assert set(seen.values()) == {1}
        _assert_quiet(consumers)
        subscription = _subscription(broker, topic, "load")
        assert broker.call(lambda: subscription.messages_out) == MATRIX_MESSAGES
        assert _backlog_settles_to_zero(broker, subscription)
    finally:
        client.close()


def _backlog_settles_to_zero(broker: ThreadedCluster, subscription: Subscription) -> bool:
    """Acknowledgements are grouped by the client (100 ms): wait for the last group to land."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        if broker.call(subscription.backlog) == 0:
            return True
        time.sleep(0.05)
    return False


class ActivityRecorder:
    """A ConsumerSink that keeps the ACTIVE_CONSUMER_CHANGE notices, (consumer name, is_active)."""

    def __init__(self) -> None:
        self.notices: list[tuple[str, bool]] = []

    def send_message(self, consumer: Consumer, entry: Entry, redelivery_count: int,
                     ack_set: list[int] | None) -> None:
        return

    def send_active_consumer_change(self, consumer: Consumer, is_active: bool) -> None:
        self.notices.append((consumer.consumer_name, is_active))

    def send_reached_end_of_topic(self, consumer: Consumer) -> None:
        return

    def send_close_consumer(self, consumer: Consumer) -> None:
        return


def test_a_failover_consumer_joining_behind_the_active_one_is_told_it_is_inactive() -> None:
    topic = Topic("persistent://public/default/standby", -1, 1, 1 << 20)
    subscription = topic.subscription("sub", FAILOVER, True, 0)
    sink = ActivityRecorder()
    first, second = Consumer(1, "b", 0, sink), Consumer(2, "a", 0, sink)
    # on .../standby the hash ring of names picks b over a (see selectors.py)
    subscription.add_consumer(first, FAILOVER)
    subscription.add_consumer(second, FAILOVER)
    assert sink.notices == [("b", True), ("a", False)]
    subscription.remove_consumer(first)
    assert sink.notices[-1] == ("a", True)
