"""A producer that must survive what brokers do to it: refusals while it is created, an unload mid-stream.

The official client against ``pulsar_tap`` (an embedded cluster behind a pulsar-tap proxy;
``--pulsar-url`` points it at another broker).
"""

from __future__ import annotations

from collections.abc import Iterator

import pulsar
import pytest

from proxy.testing import Tap, error, unload

TOPIC = "example-payments"


@pytest.fixture
def client(pulsar_tap: Tap) -> Iterator[pulsar.Client]:
    client = pulsar.Client(pulsar_tap.service_url, operation_timeout_seconds=30)
    yield client
    client.close()


def test_producer_survives_two_service_not_ready_errors(pulsar_tap: Tap, client: pulsar.Client) -> None:
    """The broker refuses the producer twice with ServiceNotReady; the client retries and the third try works."""
    with pulsar_tap.inject(error("ServiceNotReady").on("PRODUCER").times(2)) as refusals:
        producer = client.create_producer(TOPIC)
        producer.send(b"paid")
    assert refusals.hits == 2
    assert pulsar_tap.rules() == []  # the block removed its rule


def test_producer_stream_survives_an_unload(pulsar_tap: Tap, client: pulsar.Client) -> None:
    """200 sends in flight while the topic is unloaded under the producer: every one is acknowledged, and
    a consumer gets every message (at least once: without broker deduplication, what was stored but not
    yet acknowledged when the producer was closed is sent again, as with Apache Pulsar)."""
    consumer = client.subscribe(TOPIC + "-stream", "audit", initial_position=pulsar.InitialPosition.Earliest)
    producer = client.create_producer(TOPIC + "-stream", batching_enabled=False, block_if_queue_full=True)
    results: list[pulsar.Result] = []
    with pulsar_tap.inject(unload(TOPIC + "-stream").on("SEND").after(50)) as unloaded:
        for i in range(200):
            producer.send_async(f"payment-{i}".encode(), lambda result, _id: results.append(result))
        producer.flush()
    assert unloaded.hits == 1
    assert results == [pulsar.Result.Ok] * 200
    expected = {f"payment-{i}".encode() for i in range(200)}
    received: set[bytes] = set()
    while received != expected:
        message = consumer.receive(timeout_millis=30_000)  # raises on a timeout: a message was lost
        received.add(message.data())
        consumer.acknowledge(message)
