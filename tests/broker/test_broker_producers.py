"""Producers against the embedded broker: names, access modes, chunking, deduplication."""

from __future__ import annotations

import contextlib
import os
import threading

import pulsar
import pytest

from proxy.broker import ThreadedCluster

TIMEOUT_MS = 10_000


@pytest.fixture
def client(broker: ThreadedCluster):  # type: ignore[no-untyped-def]
    c = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    yield c
    c.close()


def test_generated_producer_names_are_unique_and_a_taken_name_is_refused(client: pulsar.Client) -> None:
    first = client.create_producer("names")
    second = client.create_producer("names")
    assert first.producer_name() != second.producer_name()
    client.create_producer("names", producer_name="fixed")
    with pytest.raises(pulsar.ProducerBusy):
        client.create_producer("names", producer_name="fixed")


def test_exclusive_access_mode_fails_as_the_client_expects(client: pulsar.Client) -> None:
    shared = client.create_producer("excl")
    with pytest.raises(pulsar.ProducerFenced):
        client.create_producer("excl", access_mode=pulsar.ProducerAccessMode.Exclusive)
    shared.close()
    exclusive = client.create_producer("excl", access_mode=pulsar.ProducerAccessMode.Exclusive)
    with pytest.raises(pulsar.ProducerBusy):
        client.create_producer("excl")
    with pytest.raises(pulsar.ProducerFenced):
        client.create_producer("excl", access_mode=pulsar.ProducerAccessMode.Exclusive)
    exclusive.send(b"still mine")


def test_exclusive_with_fencing_takes_over(client: pulsar.Client) -> None:
    old = client.create_producer("fence", access_mode=pulsar.ProducerAccessMode.Exclusive)
    new = client.create_producer("fence", access_mode=pulsar.ProducerAccessMode.ExclusiveWithFencing)
    new.send(b"new one")
    with pytest.raises(pulsar.PulsarException):
        old.send(b"fenced")
    # the client marks a fenced producer closed; closing it again reports AlreadyClosed
    with contextlib.suppress(pulsar.AlreadyClosed):
        old.close()


def test_wait_for_exclusive_gets_the_topic_when_the_holder_leaves(client: pulsar.Client) -> None:
    holder = client.create_producer("waitex", access_mode=pulsar.ProducerAccessMode.Exclusive)
    box: dict[str, pulsar.Producer] = {}
    t = threading.Thread(target=lambda: box.setdefault("p", client.create_producer(
        "waitex", access_mode=pulsar.ProducerAccessMode.WaitForExclusive)))
    t.start()
    t.join(0.5)
    assert "p" not in box
    holder.close()
    t.join(10)
    assert "p" in box
    box["p"].send(b"finally")


def test_chunked_message_larger_than_max_message_size_reassembles(client: pulsar.Client) -> None:
    consumer = client.subscribe("chunky", "c")
    producer = client.create_producer("chunky", batching_enabled=False, chunking_enabled=True)
    payload = os.urandom(12 * 1024 * 1024)
    producer.send(payload)
    msg = consumer.receive(TIMEOUT_MS)
    assert msg.data() == payload
    consumer.acknowledge(msg)


def test_deduplication_drops_repeated_sequence_ids(broker_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = broker_cluster(deduplication=True)
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=5)
    try:
        producer = client.create_producer("dedup", producer_name="p1", batching_enabled=False)
        for i in range(3):
            producer.send(str(i).encode(), sequence_id=i)
        producer.close()
        again = client.create_producer("dedup", producer_name="p1", batching_enabled=False)
        assert again.last_sequence_id() == 2
        again.send(b"dup", sequence_id=1)
        again.send(b"3", sequence_id=3)
        reader = client.create_reader("dedup", pulsar.MessageId.earliest)
        values = []
        while reader.has_message_available():
            values.append(reader.read_next(TIMEOUT_MS).data())
        assert values == [b"0", b"1", b"2", b"3"]
    finally:
        client.close()
