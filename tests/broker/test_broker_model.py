"""The broker's sans-IO model: hashes, hash ranges, Failover choice, cursors, access modes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from proxy.broker.cursor import Cursor
from proxy.broker.ledger import Ledger
from proxy.broker.naming import TopicName, murmur3_32, sticky_key_hash
from proxy.broker.selectors import KeySharedSelector, failover_active
from proxy.broker.topic import Producer, Topic
from proxy.errors import BrokerError
from proxy.pb import PulsarApi_pb2 as api


def test_murmur3_matches_the_reference_vectors() -> None:
    assert murmur3_32(b"") == 0
    assert murmur3_32(b"hello") == 0x248BFA47
    assert murmur3_32(b"The quick brown fox jumps over the lazy dog") == 0x2E4FF723
    assert 0 <= sticky_key_hash(b"any key") < 65536


def test_topic_names_short_full_and_partitions() -> None:
    name = TopicName.parse("orders")
    assert str(name) == "persistent://public/default/orders"
    partition = name.partition(3)
    assert partition.partition_index == 3
    assert partition.base == name
    with pytest.raises(BrokerError):
        TopicName.parse("bogus://x")


@dataclass(eq=False)
class FakeConsumer:
    consumer_name: str
    priority_level: int = 0


def test_failover_picks_by_priority_then_name_and_spreads_partitions() -> None:
    a, b, c = FakeConsumer("b"), FakeConsumer("a"), FakeConsumer("z", priority_level=1)
    assert failover_active([a, b, c], 1, "persistent://public/default/t-partition-1") is a
    assert failover_active([a, b, c], 2, "persistent://public/default/t-partition-2") is b
    assert failover_active([c], 0, "persistent://public/default/t-partition-0") is c
    assert failover_active([], 0, "persistent://public/default/t-partition-0") is None


#: measured on the real 4.0.7 standalone (official Python client, Failover subscription, topics
#: persistent://public/default/<name>): the consumers, the active one, the one taking over when it closed
REAL_FAILOVER_CHOICES = [
    ("fo-p1-t-alpha-2", ["a", "b"], "a", "b"),
    ("fo-p1-orders-3", ["a", "b", "c"], "a", "b"),
    ("fo-p1-t-alpha-3", ["a", "b", "c"], "a", "c"),
    ("fo-p1-zz-3", ["a", "b", "c"], "b", "a"),
    ("fo-p1-t-alpha-2", ["x1", "x2"], "x1", "x2"),
    ("fo-p1-t-beta-2", ["x1", "x2"], "x2", "x1"),
    ("fo-p1-t-alpha-4", ["c1", "c2", "c3", "c4"], "c2", "c3"),
    ("fo-p1-t-beta-4", ["c1", "c2", "c3", "c4"], "c3", "c4"),
    ("fo-p1-t-gamma-4", ["c1", "c2", "c3", "c4"], "c4", "c2"),
    ("fo-p1-orders-4", ["c1", "c2", "c3", "c4"], "c1", "c4"),
]


@pytest.mark.parametrize(("topic", "names", "active", "next_active"), REAL_FAILOVER_CHOICES)
def test_failover_of_a_non_partitioned_topic_is_chosen_by_the_topic_name_as_the_real_broker(
        topic: str, names: list[str], active: str, next_active: str) -> None:
    full = f"persistent://public/default/{topic}"
    # joined in reverse order: the order of arrival does not matter
    consumers = [FakeConsumer(name) for name in reversed(names)]
    chosen = failover_active(consumers, -1, full)
    assert chosen is not None and chosen.consumer_name == active
    rest = [c for c in consumers if c is not chosen]
    after = failover_active(rest, -1, full)
    assert after is not None and after.consumer_name == next_active


def test_failover_ring_spans_only_the_best_priority_level() -> None:
    # on fo-p1-zz-3 the ring of a, b, c picks b; with a and c one level better, b never can
    full = "persistent://public/default/fo-p1-zz-3"
    a, b, c = FakeConsumer("a"), FakeConsumer("b", priority_level=1), FakeConsumer("c")
    assert failover_active([a, b, c], -1, full) in (a, c)
    assert failover_active([b], -1, full) is b


def test_key_shared_auto_split_halves_the_biggest_range_and_merges_on_leave() -> None:
    selector: KeySharedSelector[str] = KeySharedSelector()
    selector.add_auto("one")
    assert selector.ranges() == [(0, 65535, "one")]
    selector.add_auto("two")
    assert selector.ranges() == [(0, 32767, "two"), (32768, 65535, "one")]
    selector.add_auto("three")
    assert [owner for _, _, owner in selector.ranges()] == ["three", "two", "one"]
    assert selector.select(0) == "three"
    assert selector.select(65535) == "one"
    selector.remove("one")
    assert selector.ranges() == [(0, 16383, "three"), (16384, 65535, "two")]
    selector.remove("three")
    selector.remove("two")
    assert selector.select(5) is None


def test_cursor_individual_cumulative_and_batch_acks() -> None:
    ledger = Ledger(1, 1 << 30)
    meta = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    for _ in range(5):
        ledger.append(b"x", meta)
    cursor = Cursor(ledger, -1)
    assert cursor.ack_individual(1)
    assert cursor.mark_delete == -1
    assert cursor.ack_individual(0)
    assert cursor.mark_delete == 1
    assert cursor.ack_batch_indexes(2, {0, 1}, 3) is False
    assert cursor.ack_batch_indexes(2, {2}, 3) is True
    assert cursor.mark_delete == 2
    assert cursor.ack_cumulative(4) == [3, 4]
    assert cursor.backlog() == 0
    cursor.reset(1)
    assert cursor.backlog() == 4
    assert cursor.next_new_entry() == 1


class NullSink:
    def __init__(self) -> None:
        self.closed: list[Producer] = []
        self.ready: list[Producer] = []

    def send_close_producer(self, producer: Producer) -> None:
        self.closed.append(producer)

    def send_producer_ready(self, producer: Producer) -> None:
        self.ready.append(producer)


def test_access_modes_refuse_and_queue_as_pulsar_does() -> None:
    topic = Topic("persistent://public/default/t", -1, 1, 1 << 20)
    sink = NullSink()
    modes = api.ProducerAccessMode
    shared = Producer(1, "s", modes.Shared, sink)
    topic.add_producer(shared)
    with pytest.raises(BrokerError) as refused:
        topic.add_producer(Producer(2, "e", modes.Exclusive, sink))
    assert refused.value.server_error == "ProducerFenced"
    waiting = Producer(3, "w", modes.WaitForExclusive, sink)
    topic.add_producer(waiting)
    assert not waiting.ready
    with pytest.raises(BrokerError) as busy:
        topic.add_producer(Producer(4, "s2", modes.Shared, sink))
    assert busy.value.server_error == "ProducerBusy"
    topic.remove_producer(shared)
    assert waiting.ready and sink.ready == [waiting]
    fencing = Producer(5, "f", modes.ExclusiveWithFencing, sink)
    topic.add_producer(fencing)
    assert sink.closed == [waiting]
    assert topic.exclusive_producer == "f"


def test_retention_drops_oldest_entries_first() -> None:
    ledger = Ledger(1, retention_bytes=25)
    meta = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    for _ in range(5):
        ledger.append(b"0123456789", meta)
    assert ledger.first_entry_id == 3
    assert ledger.get(2) is None
    assert ledger.get(4) is not None
