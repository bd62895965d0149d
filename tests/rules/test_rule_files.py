"""Each shipped rule file (``rules/*.yaml``) keeps the promise written in its comments.

One test per file: the file is loaded unchanged into the whole running proxy stack
(what ``pulsar-tap run --rules FILE`` starts), and the official client drives a stream
of asynchronous sends (and consumers where the promise is about them) through it.
The topic names are the ones the files match on; each test runs on a fresh broker.
"""

from __future__ import annotations

import time
from pathlib import Path

import pulsar
from official import AsyncSends, clients, official, read_back
from rules_proxy import StackFactory

from proxy.broker.embedded import ThreadedCluster

__all__ = ["clients"]

RULES = Path(__file__).parents[2] / "rules"


def rule_file(name: str) -> str:
    return (RULES / name).read_text(encoding="utf-8")


# -- slow-broker.yaml --------------------------------------------------------------------------
def test_slow_broker_delays_every_receipt_and_answer_by_200ms_side_by_side_and_nothing_fails(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    """Every SEND_RECEIPT and creation answer ~200 ms (±50) late; send latency grows; nothing fails.

    The delay is each frame's own: ten sends in flight at once all come back ~200 ms late
    (not 200, 400, 600 ...), and a stream of sends is not capped at one per delay.
    """
    stack = rules_proxy(broker.service_url, rule_file("slow-broker.yaml"))
    client = official(stack.service_url, clients)
    started = time.monotonic()
    producer = client.create_producer("persistent://public/default/slow", batching_enabled=False,
                                      send_timeout_millis=30_000)
    # partitioned metadata, lookup and PRODUCER_SUCCESS: three answers, each 200 ms late
    assert time.monotonic() - started >= 0.55
    burst = AsyncSends(producer)
    burst.send(10)
    burst.wait(10)
    latencies = sorted(burst.latencies.values())
    assert all(result == pulsar.Result.Ok for result in burst.results.values())
    assert latencies[0] >= 0.145  # 200 ms - 50 ms of jitter (and a little clock slack)
    # side by side: the last receipt is late by one delay, not by ten (the old behaviour: 2 s)
    assert latencies[-1] - latencies[0] < 0.5, latencies
    stream = AsyncSends(producer)
    started = time.monotonic()
    stream.send(200)
    stream.wait(200)
    elapsed = time.monotonic() - started
    assert all(result == pulsar.Result.Ok for result in stream.results.values())
    # one receipt per 200 ms would take 40 s; in flight side by side it takes about one delay
    assert elapsed < 10, elapsed
    assert min(stream.latencies.values()) >= 0.145


def stack_for(broker: ThreadedCluster, rules_proxy: StackFactory, name: str):  # type: ignore[no-untyped-def]
    return rules_proxy(broker.service_url, rule_file(name))


# -- broken-lookups.yaml -----------------------------------------------------------------------
def test_broken_lookups_fail_three_times_then_answer_late_and_the_client_gets_through(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    """Three lookups fail (MetadataError), partition metadata fails one time in three, successful
    lookups come 500 ms late; the client retries until it gets through, and then sends as usual."""
    stack = stack_for(broker, rules_proxy, "broken-lookups.yaml")
    client = official(stack.service_url, clients)
    producers = []
    for index in range(4):
        started = time.monotonic()
        producers.append(client.create_producer(f"persistent://public/default/lookups-{index}",
                                                batching_enabled=False))
        assert time.monotonic() - started >= 0.45  # its lookup answer was held 500 ms
    hits = stack.hits()
    assert hits["lookup-metadata-error"] == 3
    assert hits["partitions-not-ready"] >= 1 and hits["slow-lookups"] >= 4
    for producer in producers:
        sends = AsyncSends(producer)
        sends.send(50)
        sends.wait()


# -- consumer-throttling.yaml ------------------------------------------------------------------
def _consume(consumer: pulsar.Consumer, count: int) -> float:
    """Seconds to receive (and acknowledge) ``count`` messages."""
    started = time.monotonic()
    for _ in range(count):
        consumer.acknowledge(consumer.receive(timeout_millis=20_000))
    return time.monotonic() - started


def test_consumer_throttling_paces_orders_consumers_at_50_per_second_and_not_producers(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    stack = stack_for(broker, rules_proxy, "consumer-throttling.yaml")
    client = official(stack.service_url, clients)
    count = 150
    elapsed: dict[str, float] = {}
    for name in ("orders-east", "payments"):
        topic = f"persistent://public/default/{name}"
        consumer = client.subscribe(topic, "s", receiver_queue_size=1000)
        sends = AsyncSends(client.create_producer(topic, batching_enabled=False))
        started = time.monotonic()
        sends.send(count)
        sends.wait()
        elapsed[f"produce {name}"] = time.monotonic() - started
        elapsed[f"consume {name}"] = _consume(consumer, count)
    # 150 messages at most 50 per second each take ~3 s; the rule's burst lets a few through at once
    assert elapsed["consume orders-east"] >= 2.0, elapsed
    assert elapsed["consume payments"] < elapsed["consume orders-east"] / 2, elapsed  # not an orders topic
    assert elapsed["produce orders-east"] < elapsed["consume orders-east"] / 2, elapsed  # producers not slowed
    assert stack.hits()["slow-dispatch"] >= 1


# -- demo.yaml ---------------------------------------------------------------------------------
def test_demo_rules_disturb_the_client_and_lose_nothing(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    """One creation refused, a few receipts 10 ms late, one unload after 400 SENDs, lookups marked:
    the client retries, re-creates and resends, and the traffic completes without loss."""
    stack = stack_for(broker, rules_proxy, "demo.yaml")
    topic = "persistent://public/default/demo-orders"
    producer = official(stack.service_url, clients).create_producer(topic, batching_enabled=False,
                                                                    send_timeout_millis=30_000)
    sends = AsyncSends(producer)
    for burst in range(10):
        sends.send(100, start=100 * burst)
    sends.wait()
    hits = stack.hits()
    assert hits["flaky-producer-creation"] == 1 and hits["one-unload"] == 1
    assert hits["slow-receipts"] >= 10 and hits["mark-lookups"] >= 1
    assert read_back(broker.service_url, topic, len(sends.sent), clients) == sends.sent


# -- flaky-producer-creation.yaml --------------------------------------------------------------
def test_flaky_producer_creation_refuses_twice_then_sometimes_and_every_creation_succeeds(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    stack = stack_for(broker, rules_proxy, "flaky-producer-creation.yaml")
    client = official(stack.service_url, clients)
    producers = [client.create_producer(f"persistent://public/default/flaky-{i}", batching_enabled=False)
                 for i in range(8)]
    hits = stack.hits()
    assert hits["not-ready-twice"] == 2 and hits["sometimes-not-ready"] >= 1
    for producer in producers:
        sends = AsyncSends(producer)
        sends.send(20)
        sends.wait()


# -- lossy-topic.yaml --------------------------------------------------------------------------
def test_lossy_topic_loses_and_doubles_receipts_and_damages_deliveries_of_telemetry_only(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    """5% of telemetry's receipts lost (the message is sent again), 2% doubled, a few MESSAGEs with a
    bad checksum; another topic is not touched."""
    stack = stack_for(broker, rules_proxy, "lossy-topic.yaml")
    client = official(stack.service_url, clients)
    telemetry = "persistent://public/default/telemetry"
    consumer = client.subscribe(telemetry, "readings", receiver_queue_size=50)
    producer = client.create_producer(telemetry, batching_enabled=False, send_timeout_millis=3_000)
    sends = AsyncSends(producer)
    sends.send(200)
    # A lost receipt the client notices at the next one: it reconnects and resends by itself.  The
    # last receipts have no next one: their sends time out, and the application sends them again.
    for index in sends.wait(all_ok=False):
        for attempt in range(5):
            try:
                producer.send(sends.sent[index])
                break
            except pulsar.Timeout:
                assert attempt < 4, "a message never got through"
    hits = stack.hits()
    assert hits["lost-receipts"] >= 3 and hits["duplicated-receipts"] >= 1
    stored = read_back(broker.service_url, telemetry, len(sends.sent), clients)
    assert set(stored) == set(sends.sent)  # at least once each (a resent message may be stored twice)
    received: set[bytes] = set()
    try:
        while True:
            message = consumer.receive(timeout_millis=1_000)
            received.add(message.data())
            consumer.acknowledge(message)
    except pulsar.Timeout:
        pass
    damaged = stack.hits()["corrupted-deliveries"]
    assert damaged >= 1  # the client noticed the bad checksums and dropped those deliveries
    assert len(received) >= len(sends.sent) - damaged  # (the comment: "up to that many messages never reach ...")
    other = AsyncSends(client.create_producer("persistent://public/default/metrics", batching_enabled=False))
    before = stack.hits()
    other.send(100)
    other.wait()
    assert stack.hits() == before


# -- topic-unload-storm.yaml -------------------------------------------------------------------
def test_topic_unload_storm_closes_producers_and_consumers_and_no_message_is_lost_or_reordered(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    stack = stack_for(broker, rules_proxy, "topic-unload-storm.yaml")
    client = official(stack.service_url, clients)
    topic = "persistent://public/default/storm"
    consumer = client.subscribe(topic, "s", receiver_queue_size=20)  # small: many FLOWs
    sends = AsyncSends(client.create_producer(topic, batching_enabled=False, send_timeout_millis=30_000))
    for burst in range(6):
        sends.send(100, start=100 * burst)
    first_seen: list[bytes] = []
    seen: set[bytes] = set()
    while len(seen) < len(sends.sent):
        message = consumer.receive(timeout_millis=20_000)
        consumer.acknowledge(message)
        if message.data() not in seen:  # an unloaded consumer gets what it had not acknowledged again
            seen.add(message.data())
            first_seen.append(message.data())
    sends.wait()
    hits = stack.hits()
    assert hits["unload-producers"] >= 3 and hits["unload-consumers"] >= 3
    assert first_seen == sends.sent  # nothing lost, nothing out of order
    assert read_back(broker.service_url, topic, len(sends.sent), clients) == sends.sent  # stored once each


def test_topic_unload_storm_gives_an_unloaded_consumer_what_it_had_not_acknowledged_again(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list[pulsar.Client]) -> None:
    stack = stack_for(broker, rules_proxy, "topic-unload-storm.yaml")
    client = official(stack.service_url, clients)
    topic = "persistent://public/default/storm-unacked"
    consumer = client.subscribe(topic, "s", receiver_queue_size=4)  # a FLOW every two messages
    producer = client.create_producer(topic, batching_enabled=False, send_timeout_millis=30_000)
    for index in range(100):
        producer.send(f"{index}".encode())
    received: list[int] = []
    while received.count(0) < 2 and len(received) < 300:  # nothing acknowledged: an unload brings #0 back
        received.append(int(consumer.receive(timeout_millis=20_000).data()))
    assert stack.hits()["unload-consumers"] >= 1
    assert received.count(0) == 2, received
    assert received[:received.index(0, 1)] == list(range(received.index(0, 1)))  # in order up to the unload
