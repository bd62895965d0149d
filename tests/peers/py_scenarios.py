"""A tour of the broker's behaviour with the official Python client, for the fidelity report (FIDELITY.md).

Each step drives one feature whose answer a client can tell apart (a refused second
exclusive consumer, a producer name already in use, an incompatible schema, a namespace
that does not exist, redelivery after a negative ack, ...) and notes its outcome.  The
same script runs through a recording pulsar-tap proxy against the real broker and
against the embedded broker; the tests compare the outcomes step by step and replay the
real broker's recording into a fresh embedded broker (``pulsar-tap replay``).

    python tests/peers/py_scenarios.py --url pulsar://127.0.0.1:6650 --prefix fid-1

prints ONE JSON line: ``{"steps": {"step name": "outcome", ...}}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pulsar
from pulsar.schema import Integer, JsonSchema, Record, String, StringSchema

OPERATION_TIMEOUT_S = 10


class Order(Record):
    item = String()


def defined_json_schema(definition: dict[str, Any]) -> JsonSchema:
    """A JSON schema of this Avro definition (the Python client builds one from a Record class only)."""

    class Defined:
        @classmethod
        def schema(cls) -> dict[str, Any]:
            return definition

    return JsonSchema(Defined)


def outcome(step: Callable[[], Any]) -> str:
    """``ok`` / ``ok:DETAIL`` or ``error:EXCEPTION_NAME`` (the client's own classification of the answer)."""
    try:
        detail = step()
    except Exception as exc:  # the classification is the point: every client-visible error is an outcome
        return f"error:{type(exc).__name__}"
    return "ok" if detail is None else f"ok:{detail}"


def receive_all(consumer: pulsar.Consumer, count: int, timeout_ms: int = 5000, ack: bool = True) -> list[bytes]:
    received = []
    while len(received) < count:
        try:
            message = consumer.receive(timeout_millis=timeout_ms)
        except pulsar.Timeout:
            break
        received.append(message.data())
        if ack:
            consumer.acknowledge(message)
    return received


def receive_between(consumers: tuple[pulsar.Consumer, ...], count: int, quiet_s: float = 3.0) -> list[bytes]:
    """What the consumers of one subscription receive between them (acknowledged), read by turns until ``count``
    or ``quiet_s`` without a message.  Read one after the other, each until a pause, a consumer left behind on a
    loaded machine missed what the broker dispatched to it once its turn was over."""
    received: list[bytes] = []
    last = time.monotonic()
    while len(received) < count and time.monotonic() - last < quiet_s:
        for consumer in consumers:
            try:
                message = consumer.receive(timeout_millis=10)
            except pulsar.Timeout:
                continue
            received.append(message.data())
            consumer.acknowledge(message)
            last = time.monotonic()
    return received


def run(client: pulsar.Client, prefix: str) -> dict[str, str]:
    topic = f"persistent://public/default/{prefix}-tour"
    steps: dict[str, str] = {}
    holder: dict[str, Any] = {}

    def produce_and_consume() -> str:
        consumer = client.subscribe(topic, "exclusive", initial_position=pulsar.InitialPosition.Earliest)
        holder["consumer"] = consumer
        producer = client.create_producer(topic, producer_name=f"{prefix}-named", batching_enabled=False)
        holder["producer"] = producer
        for i in range(20):
            producer.send(f"m{i}".encode())
        return f"{len(receive_all(consumer, 20))} received"

    steps["produce 20, consume 20 (Exclusive)"] = outcome(produce_and_consume)
    steps["second consumer on the Exclusive subscription"] = outcome(
        lambda: client.subscribe(topic, "exclusive").close())
    steps["second producer with the same name"] = outcome(
        lambda: client.create_producer(topic, producer_name=f"{prefix}-named").close())

    def reader_from_earliest() -> str:
        reader = client.create_reader(topic, pulsar.MessageId.earliest)
        got = [reader.read_next(timeout_millis=5000).data() for _ in range(5)]
        reader.close()
        return ",".join(g.decode() for g in got)

    steps["reader from earliest reads the first 5"] = outcome(reader_from_earliest)

    def last_message_id() -> str:
        return "known" if holder["consumer"].get_last_message_id() is not None else "none"

    steps["last message id"] = outcome(last_message_id)

    def unsubscribe() -> None:
        holder["consumer"].unsubscribe()

    steps["unsubscribe"] = outcome(unsubscribe)

    def pair_shares(label: str, consumer_type: Any, keyed: bool) -> str:
        """Two consumers of one subscription of ``consumer_type`` receive 20 messages between them."""
        shared = f"{topic}-{label}"
        a = client.subscribe(shared, label, consumer_type=consumer_type, receiver_queue_size=5)
        b = client.subscribe(shared, label, consumer_type=consumer_type, receiver_queue_size=5)
        producer = client.create_producer(shared, batching_enabled=False)
        for i in range(20):
            producer.send(f"{label}{i}".encode(), partition_key=f"key-{i % 4}" if keyed else None)
        got = receive_between((a, b), 20)
        for closing in (producer, a, b):
            closing.close()
        return f"{len(set(got))} distinct of 20"

    steps["two Shared consumers share 20"] = outcome(lambda: pair_shares("shared", pulsar.ConsumerType.Shared, False))

    def unsubscribe_shared_pair() -> None:
        first, second = (client.subscribe(f"{topic}-pair", "pair", consumer_type=pulsar.ConsumerType.Shared)
                         for _ in range(2))
        try:
            first.unsubscribe()
        finally:
            first.close()
            second.close()

    steps["unsubscribe a Shared subscription another consumer is on"] = outcome(unsubscribe_shared_pair)
    steps["subscribe with an empty subscription name"] = outcome(lambda: client.subscribe(topic, "").close())

    def negative_ack() -> str:
        nacked = f"{topic}-nack"
        consumer = client.subscribe(nacked, "nack", negative_ack_redelivery_delay_ms=200,
                                    initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(nacked)
        producer.send(b"again")
        first = consumer.receive(timeout_millis=5000)
        consumer.negative_acknowledge(first)
        second = consumer.receive(timeout_millis=5000)
        consumer.acknowledge(second)
        count = second.redelivery_count()
        producer.close()
        consumer.close()
        return f"redelivered, redelivery_count={count}"

    steps["negative ack is redelivered"] = outcome(negative_ack)

    steps["two Key_Shared consumers share 20"] = outcome(
        lambda: pair_shares("keyed", pulsar.ConsumerType.KeyShared, True))

    def schema_then_incompatible() -> str:
        typed = f"{topic}-schema"
        producer = client.create_producer(typed, schema=JsonSchema(Order))
        producer.send(Order(item="book"))
        producer.close()
        holder["schema_topic"] = typed
        return "json schema accepted"

    steps["JSON schema producer"] = outcome(schema_then_incompatible)
    steps["producer with an incompatible schema"] = outcome(
        lambda: client.create_producer(holder["schema_topic"], schema=StringSchema()).close())
    steps["consumer with a STRING schema on the JSON topic"] = outcome(
        lambda: client.subscribe(holder["schema_topic"], "strings", schema=StringSchema()).close())

    def schema_on_a_topic_in_use() -> None:
        untyped = f"{topic}-untyped"
        producer = client.create_producer(untyped)
        producer.send(b"raw")
        try:
            client.subscribe(untyped, "typed", schema=JsonSchema(Order)).close()
        finally:
            producer.close()

    steps["consumer with a JSON schema on a topic in use without one"] = outcome(schema_on_a_topic_in_use)

    def evolve(fields: list[dict[str, Any]], subscription: str | None = None) -> Callable[[], None]:
        """A producer (or a consumer of ``subscription``) of the JSON topic ``-evolving`` with these fields."""
        evolving = f"{topic}-evolving"
        schema = defined_json_schema({"type": "record", "name": "Order", "fields": fields})
        if subscription is None:
            return lambda: client.create_producer(evolving, schema=schema).close()
        return lambda: client.subscribe(evolving, subscription, schema=schema).close()

    item = {"name": "item", "type": ["null", "string"]}
    qty_or_one = {"name": "qty", "type": "int", "default": 1}
    steps["schema evolution: Order{item} (the Python client's Record)"] = outcome(evolve([item]))
    steps["schema evolution: a field added without a default"] = outcome(evolve([item, {"name": "qty", "type": "int"}]))
    steps["schema evolution: a field added with a default"] = outcome(evolve([item, qty_or_one]))
    steps["schema evolution: item dropped (the latest reads it, no default)"] = outcome(evolve([qty_or_one]))
    steps["schema evolution: an int widened to long (the latest cannot read it)"] = outcome(
        evolve([{"name": "qty", "type": "long", "default": 1}]))
    steps["schema evolution: consumer of the first version"] = outcome(evolve([item], "first"))
    steps["schema evolution: consumer reading the latest, never registered"] = outcome(
        evolve([{"name": "qty", "type": "long"}], "promoting"))

    steps["a first JSON schema that is no definition ({\"foo\": 1})"] = outcome(
        lambda: client.create_producer(f"{topic}-not-avro", schema=defined_json_schema({"foo": 1})).close())
    steps["a first JSON schema naming a field twice"] = outcome(lambda: client.create_producer(
        f"{topic}-twice", schema=defined_json_schema({"type": "record", "name": "R", "fields": [
            {"name": "x", "type": "int"}, {"name": "x", "type": "int"}]})).close())
    steps["a consumer's first JSON schema that is no definition"] = outcome(
        lambda: client.subscribe(f"{topic}-not-avro-consumed", "s", schema=defined_json_schema({"foo": 1})).close())

    def identical_schema_version() -> str:
        """A producer's schema identical to the first version: its messages carry that version."""
        evolving = f"{topic}-evolving"
        consumer = client.subscribe(evolving, "versions")  # no schema: not checked
        producer = client.create_producer(evolving, schema=JsonSchema(Order))
        producer.send(Order(item="book"))
        message = consumer.receive(timeout_millis=5000)
        producer.close()
        consumer.close()
        return f"schema_version={message.schema_version()!r}"

    steps["schema evolution: the first version again, a message's schema version"] = outcome(identical_schema_version)

    def failover_activation() -> str:
        """When a Failover subscription's first consumer, then the one taking over from it, gets a message sent at
        once (which consumer is active: the next step)."""
        failover = f"{topic}-failover"
        producer = client.create_producer(failover, batching_enabled=False)

        def first_to_receive(consumers: dict[str, pulsar.Consumer], changed: float | None = None) -> tuple[str, str]:
            """The consumer the message goes to, and how long after ``changed`` (when the client asked for the
            change of consumers: the broker's delay runs from its handling of that request, so it cannot end
            sooner; from the send, a slow answer to the request would eat into it) or after the send."""
            start = time.monotonic()
            producer.send(b"fo")
            since = start if changed is None else changed
            while time.monotonic() - start < 5:
                for name, consumer in consumers.items():
                    try:
                        consumer.acknowledge(consumer.receive(timeout_millis=10))
                    except pulsar.Timeout:
                        continue
                    return name, "after ~1 s" if time.monotonic() - since > 0.8 else "at once"
            return "", "never"

        subscribing = time.monotonic()
        consumers = {"a": client.subscribe(failover, "fo", consumer_type=pulsar.ConsumerType.Failover,
                                           consumer_name="a")}
        _, first = first_to_receive(consumers, subscribing)
        consumers["b"] = client.subscribe(failover, "fo", consumer_type=pulsar.ConsumerType.Failover,
                                          consumer_name="b")
        time.sleep(1.5)
        active, _ = first_to_receive(consumers)
        # the broker reads on for the active consumer once its message is written (on its own executor): closed
        # before that read is waiting, the real broker's read goes to the consumer taking over at once, without its
        # delay (a race of a loaded machine); closed once it waits, the delay applies -- the case asked here
        time.sleep(0.5)
        closing_active = time.monotonic()
        consumers.pop(active).close()
        _, taking_over = first_to_receive(consumers, closing_active)
        for closing in (producer, *consumers.values()):
            closing.close()
        return f"first consumer {first}, the one taking over {taking_over}"

    steps["Failover: the newly active consumer's first message"] = outcome(failover_activation)

    def failover_choice() -> str:
        """Which of the Failover consumers a, b, c of two non-partitioned topics is active, and which takes over when
        it closes (the real broker's hash ring of consumer names against the topic name picks it)."""
        names = ("a", "b", "c")
        chosen: list[str] = []
        for ring in ("ring-1", "ring-2"):
            ringed = f"{topic}-{ring}"
            consumers = {name: client.subscribe(ringed, "ring", consumer_type=pulsar.ConsumerType.Failover,
                                                consumer_name=name) for name in names}
            producer = client.create_producer(ringed, batching_enabled=False)
            order = []
            for _ in range(2):
                producer.send(b"ring")
                got = ""
                deadline = time.monotonic() + 5
                while not got and time.monotonic() < deadline:
                    for name, consumer in consumers.items():
                        try:
                            consumer.acknowledge(consumer.receive(timeout_millis=10))
                        except pulsar.Timeout:
                            continue
                        got = name
                        break
                order.append(got)
                if got:
                    consumers.pop(got).close()
            for closing in (producer, *consumers.values()):
                closing.close()
            chosen.append(f"{ring}: {' then '.join(order)}")
        return ", ".join(chosen)

    steps["Failover: which of a, b, c is active, and which next"] = outcome(failover_choice)

    def last_id_of_a_topic_never_written() -> str:
        consumer = client.subscribe(f"{topic}-never-written", "empty")
        try:
            return str(consumer.get_last_message_id())
        finally:
            consumer.close()

    steps["last message id of a topic never written to"] = outcome(last_id_of_a_topic_never_written)
    steps["producer in a namespace that does not exist"] = outcome(
        lambda: client.create_producer(f"persistent://public/{prefix}-no-such-ns/t").close())
    steps["partitions of a partitioned topic"] = outcome(
        lambda: len(client.get_topic_partitions(f"persistent://public/default/{prefix}-p3")))
    steps["producer on a partition past the last"] = outcome(
        lambda: client.create_producer(f"persistent://public/default/{prefix}-p3-partition-7").close())

    def sibling_partition_schema_version() -> str:
        """A partitioned topic's partitions share one schema history: partition 0's producer adds Order{item}, then
        on partition 2 one adding a field with a default: which version its message carries."""
        partitioned = f"persistent://public/default/{prefix}-p3"

        class Order(Record):  # (named as the first: a record's name is part of its definition)
            item = String()
            qty = Integer(required_default=True)

        client.create_producer(f"{partitioned}-partition-0", schema=JsonSchema(globals()["Order"])).close()
        consumer = client.subscribe(f"{partitioned}-partition-2", "versions")  # no schema: not checked
        producer = client.create_producer(f"{partitioned}-partition-2", schema=JsonSchema(Order))
        producer.send(Order(item="book"))
        message = consumer.receive(timeout_millis=5000)
        producer.close()
        consumer.close()
        return f"schema_version={message.schema_version()!r}"

    steps["a partition's schema after its sibling's: its message's schema version"] = outcome(
        sibling_partition_schema_version)
    item_as_int = defined_json_schema({"type": "record", "name": "Order", "fields": [{"name": "item", "type": "int"}]})
    steps["a partition's producer of a schema that cannot read its sibling's latest"] = outcome(
        lambda: client.create_producer(f"persistent://public/default/{prefix}-p3-partition-1",
                                       schema=item_as_int).close())

    def batched_zstd() -> str:
        batched = f"{topic}-zstd"
        consumer = client.subscribe(batched, "zstd", initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(batched, compression_type=pulsar.CompressionType.ZSTD,
                                          batching_enabled=True, batching_max_messages=10)
        for i in range(30):
            producer.send_async(f"z{i}".encode(), None)
        producer.flush()
        got = receive_all(consumer, 30)
        producer.close()
        consumer.close()
        return f"{len(got)} received"

    steps["batched ZSTD 30"] = outcome(batched_zstd)

    def delayed(label: str, consumer_type: Any) -> str:
        """A message to be delivered in 2 s, then one at once: the order they come in, and whether the first
        came at once (within 1 s: Pulsar's broker may deliver up to its tick, 1 s, before the time)."""
        target = f"{topic}-delayed-{label}"
        consumer = client.subscribe(target, label, consumer_type=consumer_type)
        producer = client.create_producer(target, batching_enabled=False)
        sent = time.monotonic()
        producer.send(b"later", deliver_after=datetime.timedelta(seconds=2))
        producer.send(b"now")
        got = []
        for message in (consumer.receive(timeout_millis=5000) for _ in range(2)):
            consumer.acknowledge(message)
            held = "" if message.data() != b"later" else " (held)" if time.monotonic() - sent >= 1.0 else " (at once)"
            got.append(message.data().decode() + held)
        producer.close()
        consumer.close()
        return ",".join(got)

    steps["a delayed message on a Shared subscription"] = outcome(lambda: delayed("shared", pulsar.ConsumerType.Shared))
    steps["a delayed message on an Exclusive subscription"] = outcome(
        lambda: delayed("exclusive", pulsar.ConsumerType.Exclusive))

    # A non-persistent topic stores nothing: messages go to the consumers connected with permits, or nowhere.
    volatile = f"non-persistent://public/default/{prefix}-volatile"

    def volatile_send_ids() -> str:
        producer = client.create_producer(volatile)
        ids = {str(producer.send(f"v{i}".encode())) for i in range(3)}
        producer.close()
        return ",".join(sorted(ids))

    steps["non-persistent: message ids of sends nobody receives"] = outcome(volatile_send_ids)

    def volatile_late_subscriber() -> str:
        consumer = client.subscribe(volatile, "late", initial_position=pulsar.InitialPosition.Earliest)
        holder["volatile"] = consumer
        return f"{len(receive_all(consumer, 3, timeout_ms=500))} received"

    steps["non-persistent: a subscriber from earliest after the sends"] = outcome(volatile_late_subscriber)
    steps["non-persistent: last message id"] = outcome(lambda: str(holder["volatile"].get_last_message_id()))

    def volatile_without_permits() -> str:
        slow = client.subscribe(f"{volatile}-slow", "slow", receiver_queue_size=1)
        producer = client.create_producer(f"{volatile}-slow", batching_enabled=False)
        for i in range(10):
            producer.send(f"s{i}".encode())
        got = receive_all(slow, 10, timeout_ms=500)
        producer.close()
        slow.close()
        return ",".join(g.decode() for g in got)

    steps["non-persistent: a consumer with one permit, 10 sent before it reads"] = outcome(volatile_without_permits)

    def volatile_negative_ack() -> str:
        consumer = client.subscribe(f"{volatile}-nack", "nack", negative_ack_redelivery_delay_ms=100)
        producer = client.create_producer(f"{volatile}-nack")
        producer.send(b"once")
        consumer.negative_acknowledge(consumer.receive(timeout_millis=5000))
        again = receive_all(consumer, 1, timeout_ms=700)
        producer.close()
        consumer.close()
        return f"{len(again)} redelivered"

    steps["non-persistent: a negative ack"] = outcome(volatile_negative_ack)
    steps["non-persistent: seek to the earliest"] = outcome(lambda: holder["volatile"].seek(pulsar.MessageId.earliest))
    steps["close the named producer"] = outcome(lambda: holder["producer"].close())
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="py_scenarios", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True, help="topic names start with this (a partitioned topic "
                                                         "PREFIX-p3 of 3 partitions must exist)")
    args = parser.parse_args(argv)
    logger = logging.getLogger("pulsar")
    logger.setLevel(logging.ERROR)
    client = pulsar.Client(args.url, operation_timeout_seconds=OPERATION_TIMEOUT_S, logger=logger)
    started = time.monotonic()
    try:
        steps = run(client, args.prefix)
    finally:
        client.close()
    print(json.dumps({"steps": steps, "elapsed_seconds": round(time.monotonic() - started, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stderr.flush()
    os._exit(status)  # as py_client.py: the C++ core's threads may abort a normal exit
