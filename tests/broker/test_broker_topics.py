"""Topic lifecycle on the embedded cluster: unload, broker loss, termination, regex, schemas, auth."""

from __future__ import annotations

import re
import threading
import time

import _pulsar
import pulsar
import pytest

from proxy.broker import ThreadedCluster
from proxy.config.proxy_config import HostPort, ProxyConfig, ServiceUrl
from proxy.server.app import ProxyServer
from proxy.server.threaded import ThreadedProxy

TIMEOUT_MS = 10_000


def test_unload_while_producing_reconnects_and_loses_nothing(broker_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: ThreadedCluster = broker_cluster(brokers=3)
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=10)
    try:
        consumer = client.subscribe("unloaded", "s", consumer_type=pulsar.ConsumerType.Exclusive)
        producer = client.create_producer("unloaded", batching_enabled=False, send_timeout_millis=10_000)
        stop = threading.Event()

        def unloader() -> None:
            while not stop.is_set():
                time.sleep(0.05)
                cluster.unload_topic("unloaded")

        thread = threading.Thread(target=unloader)
        thread.start()
        try:
            for i in range(300):
                producer.send_async(str(i).encode(), None)
                if i % 50 == 0:
                    time.sleep(0.1)
            producer.flush()
        finally:
            stop.set()
            thread.join()
        seen = set()
        while len(seen) < 300:
            msg = consumer.receive(TIMEOUT_MS)
            seen.add(int(msg.data()))
            consumer.acknowledge(msg)
        assert seen == set(range(300))
    finally:
        client.close()


def test_killed_broker_topics_move_and_restart_rebinds(broker_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: ThreadedCluster = broker_cluster(brokers=2)
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=10)
    try:
        # find a topic owned by broker 1, so killing it leaves the service URL alive
        topic = next(f"moving-{i}" for i in range(100)
                     if cluster.call(cluster.cluster.owner, f"persistent://public/default/moving-{i}").index == 1)
        consumer = client.subscribe(topic, "s")
        producer = client.create_producer(topic, batching_enabled=False)
        producer.send(b"before")
        cluster.kill_broker(1)
        producer.send(b"after")
        assert [consumer.receive(TIMEOUT_MS).data() for _ in range(2)] == [b"before", b"after"]
        cluster.restart_broker(1)
        assert cluster.cluster.brokers[1].alive
        other = pulsar.Client(f"pulsar://{cluster.addresses[1]}", operation_timeout_seconds=5)
        try:
            other.create_producer(topic).send(b"via restarted broker")
        finally:
            other.close()
        assert consumer.receive(TIMEOUT_MS).data() == b"via restarted broker"
    finally:
        client.close()


def test_terminated_topic_refuses_sends_and_new_producers(broker: ThreadedCluster) -> None:
    """REACHED_END_OF_TOPIC is checked on the wire in test_broker_wire.py: the C++ client has
    no handler for that command and drops its connection when a broker (this one or Apache
    Pulsar's) sends it, so a caught-up official consumer cannot show it."""
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    try:
        producer = client.create_producer("ending", batching_enabled=False)
        producer.send(b"last")
        broker.terminate_topic("ending")
        with pytest.raises(pulsar.TopicTerminated):
            producer.send(b"too late")
        with pytest.raises(pulsar.TopicTerminated):
            client.create_producer("ending")
        assert len(broker.cluster.topics["persistent://public/default/ending"].ledger) == 1
    finally:
        client.close()


@pytest.fixture
def discovery_every_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """pulsar-client 3.13's Python wrapper accepts ``pattern_auto_discovery_period`` but never passes it
    on (the C++ core then polls every 60 s); set it on the configuration object the wrapper creates."""
    real_configuration = _pulsar.ConsumerConfiguration

    def configuration() -> _pulsar.ConsumerConfiguration:
        conf = real_configuration()
        conf.pattern_auto_discovery_period(1)
        return conf

    monkeypatch.setattr(_pulsar, "ConsumerConfiguration", configuration)


def test_regex_subscription_finds_topics_created_later(broker: ThreadedCluster, discovery_every_second: None) -> None:
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    try:
        client.create_producer("regex-a").send(b"a")
        consumer = client.subscribe(re.compile("persistent://public/default/regex-.*"), "r",
                                    initial_position=pulsar.InitialPosition.Earliest,
                                    pattern_auto_discovery_period=1)
        assert consumer.receive(TIMEOUT_MS).data() == b"a"
        client.create_producer("regex-b").send(b"b")
        assert consumer.receive(TIMEOUT_MS).data() == b"b"
    finally:
        client.close()


@pytest.mark.parametrize("via", ["broker", "proxy"])
def test_a_pattern_consumer_receives_a_topic_created_after_it_subscribed(
        broker_cluster, discovery_every_second: None, via: str) -> None:  # type: ignore[no-untyped-def]
    """The issue's trial: subscribe to prefix.*, then a producer creates prefix+'later' and sends 5."""
    cluster: ThreadedCluster = broker_cluster(brokers=2)
    config = ProxyConfig(upstream=ServiceUrl.parse(cluster.service_url), listen=HostPort("127.0.0.1", 0))
    proxy = ThreadedProxy(ProxyServer(config)).start() if via == "proxy" else None
    url = proxy.service_url if proxy is not None else cluster.service_url
    client = pulsar.Client(url, operation_timeout_seconds=10)
    prefix = f"persistent://public/default/pattern-{via}-"
    try:
        client.create_producer(prefix + "first").send(b"first")
        consumer = client.subscribe(re.compile(prefix + ".*"), "rx", pattern_auto_discovery_period=1,
                                    initial_position=pulsar.InitialPosition.Earliest)
        assert consumer.receive(TIMEOUT_MS).data() == b"first"
        producer = client.create_producer(prefix + "later", batching_enabled=False)
        for i in range(5):
            producer.send_async(b"later %d" % i, None)
        producer.flush()
        got = [consumer.receive(TIMEOUT_MS).data() for _ in range(5)]
        assert got == [b"later %d" % i for i in range(5)]
    finally:
        client.close()
        if proxy is not None:
            proxy.stop()


def test_schema_is_stored_versioned_and_checked_by_consumers(broker: ThreadedCluster) -> None:
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    try:
        producer = client.create_producer("typed", schema=pulsar.schema.StringSchema())
        consumer = client.subscribe("typed", "s", schema=pulsar.schema.StringSchema(),
                                    initial_position=pulsar.InitialPosition.Earliest)
        producer.send("hello")
        msg = consumer.receive(TIMEOUT_MS)
        assert msg.value() == "hello"
        topic = broker.cluster.topics["persistent://public/default/typed"]
        assert topic.schemas[0].schema.type == pulsar.schema.StringSchema().schema_info().schema_type()
    finally:
        client.close()


def test_a_producer_with_a_schema_of_another_type_is_refused_as_incompatible(broker: ThreadedCluster) -> None:
    """As the real broker answers (FIDELITY.md): a JSON topic refuses a STRING producer."""

    class Order(pulsar.schema.Record):
        item = pulsar.schema.String()

    client = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    try:
        client.create_producer("typed-json", schema=pulsar.schema.JsonSchema(Order)).send(Order(item="book"))
        with pytest.raises(pulsar.PulsarException, match="IncompatibleSchema"):
            client.create_producer("typed-json", schema=pulsar.schema.StringSchema())
        client.create_producer("typed-json").close()  # no schema (bytes) is still accepted
        # and so are consumers, as the real broker checks them (the fidelity tour): not of another type,
        # and not with a schema on a topic in use without one; without a schema, any
        with pytest.raises(pulsar.PulsarException, match="IncompatibleSchema"):
            client.subscribe("typed-json", "strings", schema=pulsar.schema.StringSchema())
        client.subscribe("typed-json", "bytes").close()
        untyped = client.create_producer("untyped")
        untyped.send(b"raw")
        with pytest.raises(pulsar.PulsarException, match="IncompatibleSchema"):
            client.subscribe("untyped", "typed", schema=pulsar.schema.JsonSchema(Order))
        # (a topic never written to: its last message id is -1:-1, as there)
        assert str(client.subscribe("never-written", "s").get_last_message_id()) == "(-1,-1,-1,-1)"
    finally:
        client.close()


def test_a_first_schema_that_is_not_a_valid_definition_is_refused_as_the_real_broker_does(
        broker: ThreadedCluster) -> None:
    """FIDELITY.md: the real broker validates a producer's AVRO/JSON definition before storing it; a consumer's
    on an idle topic is taken as it is."""

    class Defined:
        @classmethod
        def schema(cls) -> dict[str, object]:
            return {"foo": 1}

    client = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    try:
        with pytest.raises(pulsar.PulsarException, match="IncompatibleSchema"):
            client.create_producer("not-avro", schema=pulsar.schema.JsonSchema(Defined))
        assert broker.cluster.topics["persistent://public/default/not-avro"].schemas == []
        client.subscribe("not-avro-consumed", "s", schema=pulsar.schema.JsonSchema(Defined)).close()
    finally:
        client.close()


def test_token_authentication_accepts_the_token_and_refuses_others(broker_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: ThreadedCluster = broker_cluster(auth_token="secret-token")
    good = pulsar.Client(cluster.service_url, authentication=pulsar.AuthenticationToken("secret-token"),
                         operation_timeout_seconds=5)
    bad = pulsar.Client(cluster.service_url, authentication=pulsar.AuthenticationToken("wrong"),
                        operation_timeout_seconds=3)
    try:
        good.create_producer("authed").send(b"ok")
        with pytest.raises(pulsar.PulsarException):
            bad.create_producer("authed")
    finally:
        good.close()
        bad.close()


def test_a_partition_past_a_partitioned_topics_last_does_not_exist(broker: ThreadedCluster) -> None:
    """As the real broker answers (the fidelity tour): TopicNotFound, not a topic created on the spot."""
    broker.cluster.create_topic("persistent://public/default/three", 3)
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    try:
        client.create_producer("persistent://public/default/three-partition-2").close()
        with pytest.raises(pulsar.TopicNotFound):
            client.create_producer("persistent://public/default/three-partition-7")
        with pytest.raises(pulsar.TopicNotFound):
            client.subscribe("persistent://public/default/three-partition-3", "s")
        assert "persistent://public/default/three-partition-7" not in broker.cluster.topics
    finally:
        client.close()


def test_schema_evolution_is_checked_as_the_real_broker_checks_it(broker: ThreadedCluster) -> None:
    """As the real 4.0.7 standalone answers (FIDELITY.md): producers FULL against the latest version, consumers
    BACKWARD against the latest; a compatible definition gets the next version, an identical one its own."""

    def schema(fields: list[dict[str, object]]) -> pulsar.schema.JsonSchema:
        definition = {"type": "record", "name": "Order", "fields": fields}

        class Definition:
            @classmethod
            def schema(cls) -> dict[str, object]:
                return definition

        return pulsar.schema.JsonSchema(Definition)

    a = {"name": "a", "type": "int"}
    a_or_zero = {"name": "a", "type": "int", "default": 0}
    b_or_empty = {"name": "b", "type": "string", "default": ""}
    client = pulsar.Client(broker.service_url, operation_timeout_seconds=5)
    try:
        for fields in ([a], [a_or_zero], [b_or_empty], [a]):  # the last: identical to version 0
            client.create_producer("evolving", schema=schema(fields)).close()
        topic = broker.cluster.topics["persistent://public/default/evolving"]
        assert [stored.version for stored in topic.schemas] == [0, 1, 2]  # [b_or_empty] checked with the latest only
        with pytest.raises(pulsar.PulsarException, match="IncompatibleSchema"):
            client.create_producer("evolving", schema=schema([b_or_empty, {"name": "c", "type": "string"}]))
        with pytest.raises(pulsar.PulsarException, match="IncompatibleSchema"):  # a long cannot read the latest string
            client.create_producer("evolving", schema=schema([{"name": "b", "type": "long"}]))
        with pytest.raises(pulsar.PulsarException, match="IncompatibleSchema"):  # version 0: cannot read the latest
            client.subscribe("evolving", "old", schema=schema([a]))
        client.subscribe("evolving", "new", schema=schema([{"name": "b", "type": "string"}])).close()
        assert len(topic.schemas) == 3  # a consumer's schema adds no version
    finally:
        client.close()
