"""Readers, pattern consumers and topic-list polls: the embedded broker answers as the real one.

The same official-client (and raw protocol) steps run against the real Apache Pulsar
standalone and the embedded broker:

- a reader with an inclusive start begins at its message, an exclusive one after it
  (the broker delivers from the start entry; the client drops the start unless inclusive);
- a pattern consumer receives a topic created after it subscribed;
- GET_TOPICS_OF_NAMESPACE carries ``topics_hash`` as Pulsar's ``TopicList.calculateHash``
  computes it, and answers ``changed = false`` with no topics when the client holds the list.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import _pulsar
import pulsar
import pytest
import trio
from peers_rig import Upstream

from proxy.broker.connection import topic_list_hash
from proxy.client.connection import ClientConnection, ConnectionConfig
from proxy.client.names import parse_service_url
from proxy.pb import PulsarApi_pb2 as api

UPSTREAMS = pytest.mark.parametrize("upstream", ["real", "embedded"], indirect=True)
TIMEOUT_MS = 10_000


@pytest.fixture
def client(upstream: Upstream) -> Iterator[pulsar.Client]:
    made = pulsar.Client(upstream.service_url, operation_timeout_seconds=30,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    yield made
    made.close()


@UPSTREAMS
def test_a_reader_with_an_inclusive_start_begins_at_its_message(client: pulsar.Client) -> None:
    topic = f"persistent://public/default/peers-reader-{uuid.uuid4().hex[:8]}"
    producer = client.create_producer(topic, batching_enabled=False)
    ids = [producer.send(f"{i}".encode()) for i in range(8)]
    inclusive = client.create_reader(topic, ids[3], start_message_id_inclusive=True)
    assert [inclusive.read_next(TIMEOUT_MS).data() for _ in range(5)] == [b"3", b"4", b"5", b"6", b"7"]
    exclusive = client.create_reader(topic, ids[3])
    assert exclusive.read_next(TIMEOUT_MS).data() == b"4"


@UPSTREAMS
def test_a_pattern_consumer_receives_a_topic_created_after_it_subscribed(
        client: pulsar.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    # pulsar-client 3.13's Python wrapper never passes pattern_auto_discovery_period on (the C++
    # core then polls every 60 s): set it on the configuration object the wrapper creates
    real_configuration = _pulsar.ConsumerConfiguration

    def configuration() -> Any:
        conf = real_configuration()
        conf.pattern_auto_discovery_period(1)
        return conf

    monkeypatch.setattr(_pulsar, "ConsumerConfiguration", configuration)
    prefix = f"persistent://public/default/peers-pattern-{uuid.uuid4().hex[:8]}-"
    client.create_producer(prefix + "first").send(b"first")
    consumer = client.subscribe(re.compile(prefix + ".*"), "rx", pattern_auto_discovery_period=1,
                                initial_position=pulsar.InitialPosition.Earliest)
    assert consumer.receive(TIMEOUT_MS).data() == b"first"
    producer = client.create_producer(prefix + "later", batching_enabled=False)
    for i in range(5):
        producer.send(b"later %d" % i)
    assert [consumer.receive(TIMEOUT_MS).data() for _ in range(5)] == [b"later %d" % i for i in range(5)]


@UPSTREAMS
def test_topic_list_polls_carry_pulsars_hash_and_say_unchanged_when_the_client_holds_the_list(
        upstream: Upstream, client: pulsar.Client) -> None:
    client.create_producer(f"persistent://public/default/peers-listed-{uuid.uuid4().hex[:8]}").send(b"x")

    async def poll() -> tuple[Any, Any]:
        address = parse_service_url(upstream.service_url)[0]
        connection = ClientConnection(address, address, ConnectionConfig(operation_timeout=10))
        async with trio.open_nursery() as nursery:
            await nursery.start(connection.serve)
            ask = api.CommandGetTopicsOfNamespace(namespace="public/default", request_id=connection.new_request_id())
            first = (await connection.request(ask)).command.getTopicsOfNamespaceResponse
            ask.request_id, ask.topics_hash = connection.new_request_id(), first.topics_hash
            again = (await connection.request(ask)).command.getTopicsOfNamespaceResponse
            connection.close()
        return first, again

    first, again = trio.run(poll)
    assert first.topics and first.changed
    assert first.topics_hash == topic_list_hash(list(first.topics))  # TopicList.calculateHash
    assert not again.changed and list(again.topics) == []
