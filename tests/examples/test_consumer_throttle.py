"""A consumer under a throttle: every message still arrives, in order, paced by the broker-facing permits."""

from __future__ import annotations

import time

import pulsar

from proxy.testing import Tap, throttle

TOPIC = "example-shipments"
MESSAGES = 30
RATE = 20.0  # messages per second


def test_consumer_gets_every_message_in_order_under_a_throttle(pulsar_tap: Tap) -> None:
    client = pulsar.Client(pulsar_tap.service_url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(TOPIC, batching_enabled=False)
        for i in range(MESSAGES):
            producer.send(f"shipment-{i}".encode())
        with pulsar_tap.inject(throttle(messages_per_second=RATE).topic(TOPIC)) as slow, \
                pulsar_tap.recording() as rec:
            consumer = client.subscribe(TOPIC, "warehouse", initial_position=pulsar.InitialPosition.Earliest)
            received = []
            for _ in range(MESSAGES):
                message = consumer.receive(timeout_millis=30_000)
                received.append(message.data())
                consumer.acknowledge(message)
        assert received == [f"shipment-{i}".encode() for i in range(MESSAGES)]
        assert slow.hits > 0
        # The throttle holds the consumer's permits back: the broker can deliver no faster than the rate
        # (a lower bound, which a slow machine cannot break).
        deliveries = rec.frames("MESSAGE", topic=TOPIC)
        assert len(deliveries) == MESSAGES
        spread_s = (deliveries[-1].ts_ns - deliveries[0].ts_ns) / 1e9
        assert spread_s >= (MESSAGES - 1) / RATE * 0.9
    finally:
        client.close()


def test_a_throttle_removed_mid_stream_lets_the_consumer_have_the_rest_at_once(pulsar_tap: Tap) -> None:
    """At 1 msg/s the throttle grants a permit a second; removed, the permits it holds back go at once, not at
    its next grant (nor paced on at the old rate)."""
    topic = "example-throttle-lifted"
    client = pulsar.Client(pulsar_tap.service_url, operation_timeout_seconds=30)
    try:
        producer = client.create_producer(topic, batching_enabled=False)
        for i in range(MESSAGES):
            producer.send(f"parcel-{i}".encode())
        with pulsar_tap.inject(throttle(messages_per_second=1.0).topic(topic)) as slow:
            consumer = client.subscribe(topic, "lifted", initial_position=pulsar.InitialPosition.Earliest)
            first = consumer.receive(timeout_millis=30_000)  # the one token the bucket starts with
            assert slow.hits > 0
        lifted = time.monotonic()
        received = [first.data()] + [consumer.receive(timeout_millis=5_000).data() for _ in range(MESSAGES - 1)]
        took_s = time.monotonic() - lifted
        assert received == [f"parcel-{i}".encode() for i in range(MESSAGES)]
        assert took_s < 0.6, f"the rest took {took_s:.2f} s after the throttle was removed"
    finally:
        client.close()
