"""Traffic the geo-replication tests share: a producer at a steady rate and a replicated subscription."""

from __future__ import annotations

import threading
import time

import pulsar

TOPIC = "persistent://public/default/geo-orders"
SUB = "orders-sub"


def consume_then_leave(url_a: str, rate: int, total: int, stop_after: int, topic: str = TOPIC) -> None:
    """Produce ``total`` at ``rate`` on A while a replicated subscription consumes ``stop_after`` and leaves."""
    client = pulsar.Client(url_a)
    try:
        consumer = client.subscribe(topic, SUB, initial_position=pulsar.InitialPosition.Earliest,
                                    replicate_subscription_state_enabled=True)
        producer = client.create_producer(topic, batching_enabled=False, block_if_queue_full=True)

        def send_all() -> None:
            started = time.monotonic()
            for index in range(total):
                producer.send_async(str(index).encode(), None)
                time.sleep(max(0.0, started + (index + 1) / rate - time.monotonic()))
            producer.flush()

        sender = threading.Thread(target=send_all, name="geo-producer")
        sender.start()
        try:
            for expected in range(stop_after):
                message = consumer.receive(30_000)
                assert int(message.data()) == expected
                consumer.acknowledge(message)
            consumer.close()
        finally:
            sender.join(120)
    finally:
        client.close()


def resume_on_b(url_b: str, count: int, topic: str = TOPIC) -> list[tuple[int, int]]:
    """The failed-over consumer on B: (index, publish time) of the messages it is given."""
    client = pulsar.Client(url_b)
    try:
        consumer = client.subscribe(topic, SUB, initial_position=pulsar.InitialPosition.Earliest,
                                    replicate_subscription_state_enabled=True)
        got = []
        while len(got) < count:
            try:
                message = consumer.receive(5000)
            except pulsar.Timeout:
                break
            got.append((int(message.data()), message.publish_timestamp()))
            consumer.acknowledge(message)
        return got
    finally:
        client.close()
