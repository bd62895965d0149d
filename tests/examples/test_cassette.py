"""A test recorded once against a broker and replayed from its cassette ever after: no broker needed.

The cassette ``cassettes/orders-roundtrip/`` was recorded against the real Apache Pulsar
4.0.7 standalone (``python tests/peers/real_pulsar.py standalone``) with
``.venv/bin/python -m pytest tests/examples/test_cassette.py --pulsar-url URL --pulsar-record-mode=all``
(see README.md here); CI replays it.
"""

from __future__ import annotations

import pulsar
import pytest

from proxy.testing import Tap, error
from proxy.testing.cassette import CassetteSession

TOPIC = "example-orders"
ORDERS = [f"order-{i}".encode() for i in range(10)]


@pytest.mark.pulsar_cassette("orders-roundtrip", record_mode="none")  # never a broker here: replay only
def test_orders_round_trip_from_a_cassette(pulsar_tap: Tap, pulsar_cassette: CassetteSession) -> None:
    client = pulsar.Client(pulsar_tap.service_url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(TOPIC, "billing", initial_position=pulsar.InitialPosition.Earliest)
        # Rules work on a replayed test as on a live one: the tap stands in front of the cassette.
        with pulsar_tap.inject(error("ServiceNotReady").on("PRODUCER").once()) as refusal:
            producer = client.create_producer(TOPIC, batching_enabled=False)
        for order in ORDERS:
            producer.send(order)
        received = []
        for _ in ORDERS:
            message = consumer.receive(timeout_millis=30_000)
            received.append(message.data())
            consumer.acknowledge(message)
    finally:
        client.close()
    assert received == ORDERS
    assert refusal.hits == 1
    assert pulsar_cassette.plan in ("record", "replay")  # record: only when re-recorded on purpose
