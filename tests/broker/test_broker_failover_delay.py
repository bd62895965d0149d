"""A Failover subscription's newly active consumer waits ``failover_delay_ms`` (Pulsar's
``activeConsumerFailoverDelayTimeMillis``, 1 s) before its first message, as the real broker does
(FIDELITY.md): the first consumer, one taking over from a closed one, one that joins and becomes active;
not one that joins while another stays active, and not Exclusive."""

from __future__ import annotations

from broker_sinks import Clock, Sink

from proxy.broker.subscription import Consumer, Subscription
from proxy.broker.timers import Timers
from proxy.broker.topic import Producer, Topic
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_payload_section

FAILOVER = api.CommandSubscribe.Failover


def setup(sub_type: int = FAILOVER) -> tuple[Topic, Subscription, Sink, Clock]:
    clock = Clock()
    topic = Topic("persistent://public/default/fo", -1, 1, 1 << 20, timers=Timers(clock), failover_delay_ms=1000)
    producer = Producer(1, "p", api.ProducerAccessMode.Shared, Sink())
    topic.add_producer(producer)
    return topic, topic.subscription("s", sub_type, True, 0), Sink(), clock


def publish(topic: Topic, sequence_id: int) -> None:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1)
    topic.publish(topic.producers[0], encode_payload_section(metadata, b"m"), metadata, 1, 0)


def join(sub: Subscription, sink: Sink, consumer_id: int, name: str, sub_type: int = FAILOVER) -> Consumer:
    consumer = Consumer(consumer_id, name, 0, sink)
    sub.add_consumer(consumer, sub_type)
    sub.flow(consumer, 100)
    return consumer


def advance(topic: Topic, clock: Clock, ms: int) -> None:
    clock.ms += ms
    topic.timers.run_due()


def test_the_first_consumer_and_one_taking_over_wait_a_second() -> None:
    topic, sub, sink, clock = setup()
    b = join(sub, sink, 1, "b")
    publish(topic, 0)
    assert sink.messages == []
    advance(topic, clock, 999)
    assert sink.messages == []
    advance(topic, clock, 1)
    assert sink.messages == [("b", 0)]
    join(sub, sink, 2, "a")  # b stays active (on .../fo the hash ring of names picks b over a): no wait
    publish(topic, 1)
    assert sink.messages[-1] == ("b", 1)
    sub.remove_consumer(b)
    publish(topic, 2)
    assert sink.messages[-1] == ("b", 1)
    advance(topic, clock, 1000)
    assert sink.messages[-1] == ("a", 2)


def test_a_consumer_that_joins_and_becomes_active_waits_too() -> None:
    topic, sub, sink, clock = setup()
    join(sub, sink, 1, "a")
    advance(topic, clock, 1000)
    join(sub, sink, 2, "b")  # the ring picks b over a: takes over
    publish(topic, 0)
    assert sink.messages == []
    advance(topic, clock, 1000)
    assert sink.messages == [("b", 0)]


def test_exclusive_does_not_wait() -> None:
    topic, sub, sink, _ = setup(api.CommandSubscribe.Exclusive)
    join(sub, sink, 1, "a", api.CommandSubscribe.Exclusive)
    publish(topic, 0)
    assert sink.messages == [("a", 0)]
