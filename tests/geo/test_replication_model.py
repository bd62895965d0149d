"""Geo-replication inside one broker, sans-IO: replicator cursors, markers in topics, deduplication.

Topics and subscriptions of the embedded broker are driven directly (no sockets):
what a replicator reads, skips, sends and confirms; that markers never reach a
consumer while a replicated subscription caches the snapshots it passes; that an
update from another cluster moves (or creates) the subscription; that a replicator's
resent messages are dropped by deduplication on their original producer name.
"""

from __future__ import annotations

import pytest
from broker_sinks import Clock, Sink

from proxy.broker.cluster import Cluster, ClusterConfig
from proxy.broker.ledger import Entry
from proxy.broker.replicated_subscriptions import SnapshotSettings
from proxy.broker.replication import GeoSettings, ReplicatorCursor, TopicGeo, Verdict, replication_verdict
from proxy.broker.subscription import Consumer
from proxy.broker.topic import Producer, Topic
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import PulsarMarkers_pb2 as pm
from proxy.protocol import markers
from proxy.protocol.frame import encode_payload_section

TOPIC = "persistent://public/default/geo"


def cluster(name: str, remotes: dict[str, str], *, dedup: bool = False, backlog_limit: int = 100_000) -> Cluster:
    geo = GeoSettings(name, remotes, SnapshotSettings(period_ms=100), backlog_limit=backlog_limit)
    return Cluster(ClusterConfig(cluster_name=name, deduplication=dedup, geo=geo))


def publish(topic: Topic, producer: Producer, sequence_id: int, *, replicated_from: str | None = None,
            replicate_to: tuple[str, ...] = (), original: str | None = None, batch: int = 0) -> Entry | None:
    metadata = api.MessageMetadata(producer_name=original or producer.producer_name, sequence_id=sequence_id,
                                   publish_time=1000 + sequence_id)
    if replicated_from is not None:
        metadata.replicated_from = replicated_from
    metadata.replicate_to.extend(replicate_to)
    if batch:
        metadata.num_messages_in_batch = batch
    return topic.publish(producer, encode_payload_section(metadata, b"m%d" % sequence_id), metadata,
                         max(batch, 1), 0)


def new_producer(topic: Topic, name: str, producer_id: int = 1) -> Producer:
    producer = Producer(producer_id, name, api.ProducerAccessMode.Shared, Sink())
    topic.add_producer(producer)
    return producer


def geo_of(topic: Topic) -> TopicGeo:
    assert topic.geo is not None
    return topic.geo


# -- what a replicator does with each entry --------------------------------------------------------------

@pytest.mark.parametrize(("fields", "verdict"), [
    ({}, Verdict.SEND),
    ({"replicate_to": ["B"]}, Verdict.SEND),
    ({"replicate_to": ["C"]}, Verdict.SKIP_NOT_FOR_REMOTE),
    ({"replicated_from": "C"}, Verdict.SKIP_REPLICATED),
    ({"replicated_from": "B", "marker_type": markers.SNAPSHOT_RESPONSE}, Verdict.SKIP_REPLICATED),
    ({"marker_type": markers.SNAPSHOT_REQUEST}, Verdict.SEND),
    ({"marker_type": markers.SNAPSHOT, "replicate_to": ["A"]}, Verdict.SKIP_NOT_FOR_REMOTE),
    ({"marker_type": 21}, Verdict.SKIP_TXN_MARKER),
])
def test_replication_verdicts_follow_pulsars_order(fields: dict[str, object], verdict: Verdict) -> None:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=0)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(metadata, name).extend(value)
        else:
            setattr(metadata, name, value)
    assert replication_verdict(metadata, "B") is verdict


def test_a_replicator_sends_local_entries_with_replicated_from_and_skips_the_rest() -> None:
    a = cluster("A", {"B": "pulsar://b:6650"})
    topic = a.get_topic(TOPIC)
    local = new_producer(topic, "app")
    remote = new_producer(topic, "pulsar.repl.B-->A", 2)
    publish(topic, local, 0)
    publish(topic, remote, 7, replicated_from="B", original="app-on-b")
    publish(topic, local, 1, replicate_to=("C",))
    publish(topic, local, 2, batch=3)
    replicator = geo_of(topic).replicators["B"]
    assert replicator.producer_name == "pulsar.repl.A-->B"
    assert replicator.backlog() == 6
    out = replicator.read(10, geo_of(topic))
    assert [o.entry_id for o in out] == [0, 3]
    assert all(o.metadata.replicated_from == "A" for o in out)
    assert out[1].num_messages == 3 and out[1].metadata.sequence_id == 2  # metadata kept as the producer wrote it
    assert replicator.stats.entries_skipped == 2 and replicator.backlog() == 4
    replicator.confirmed(out[0], now_ms=1500)
    assert replicator.stats.last_lag_ms == 500 and replicator.backlog() == 3
    replicator.rewind()  # entry 3 was never confirmed
    again = replicator.read(10, geo_of(topic))
    assert [o.entry_id for o in again] == [3]
    replicator.confirmed(again[0], now_ms=2000)
    assert replicator.backlog() == 0 and replicator.stats.messages_out == 4
    assert replicator.cursor.mark_delete == 3


def test_a_replicator_opened_on_a_topic_starts_at_its_end() -> None:
    plain = Cluster(ClusterConfig(cluster_name="A"))
    topic = plain.get_topic(TOPIC)
    producer = new_producer(topic, "app")
    publish(topic, producer, 0)
    plain.start_geo(GeoSettings("A", {"B": "pulsar://b:6650"}))
    publish(topic, producer, 1)
    replicator = geo_of(topic).replicators["B"]
    assert [o.entry_id for o in replicator.read(10)] == [1]


def test_past_the_backlog_limit_the_oldest_unsent_messages_are_evicted() -> None:
    a = cluster("A", {"B": "pulsar://b:6650"}, backlog_limit=5)
    topic = a.get_topic(TOPIC)
    producer = new_producer(topic, "app")
    replicator = geo_of(topic).replicators["B"]
    publish(topic, producer, 0)
    in_flight = replicator.read(1)
    for sequence_id in range(1, 12):
        publish(topic, producer, sequence_id)
    # 12 messages: one in flight, the oldest unsent evicted until 5 are left
    assert replicator.backlog() == 5
    assert replicator.stats.messages_evicted == 7
    assert [o.entry_id for o in replicator.read(10)] == [8, 9, 10, 11]
    replicator.confirmed(in_flight[0], now_ms=0)
    assert replicator.backlog() == 4


def test_entries_retention_dropped_before_they_were_sent_count_as_evicted() -> None:
    a = Cluster(ClusterConfig(cluster_name="A", retention_mb=0, geo=GeoSettings("A", {"B": "pulsar://b:6650"})))
    topic = a.get_topic(TOPIC)
    topic.ledger.retention_bytes = 200
    producer = new_producer(topic, "app")
    for sequence_id in range(20):
        publish(topic, producer, sequence_id)
    replicator = geo_of(topic).replicators["B"]
    sent = replicator.read(100)
    assert sent[0].entry_id == topic.ledger.first_entry_id > 0
    assert replicator.stats.messages_evicted == topic.ledger.first_entry_id
    assert replicator.backlog() == len(sent)


def test_a_replicators_resends_are_deduplicated_by_the_original_producer_name() -> None:
    b = cluster("B", {"A": "pulsar://a:6650"}, dedup=True)
    topic = b.get_topic(TOPIC)
    replicator = new_producer(topic, "pulsar.repl.A-->B")
    assert publish(topic, replicator, 5, replicated_from="A", original="app-1") is not None
    assert publish(topic, replicator, 5, replicated_from="A", original="app-1") is None
    assert publish(topic, replicator, 5, replicated_from="A", original="app-2") is not None
    assert topic.last_sequence_id("pulsar.repl.A-->B") == -1  # the replicator's own name holds nothing
    # markers are never deduplicated (they all say sequence id 0)
    for _ in range(2):
        metadata = markers.marker_metadata(markers.SNAPSHOT_REQUEST, 5)
        metadata.replicated_from = "A"
        assert topic.publish(replicator, encode_payload_section(metadata, b""), metadata, 1, 0) is not None


# -- markers in a topic -----------------------------------------------------------------------------------

def subscribe(topic: Topic, name: str, sink: Sink, *, replicated: bool = False, permits: int = 100) -> Consumer:
    subscription = topic.subscription(name, api.CommandSubscribe.Exclusive, True, topic.ledger.next_entry_id)
    subscription.replicated = replicated
    if replicated:
        assert geo_of(topic).ensure_controller() is not None
    consumer = Consumer(1, "c", 0, sink)
    subscription.add_consumer(consumer, api.CommandSubscribe.Exclusive)
    subscription.flow(consumer, permits)
    return consumer


def ack(topic: Topic, name: str, consumer: Consumer, entry_id: int) -> None:
    topic.subscriptions[name].ack(consumer, api.CommandAck.Individual,
                                  [api.MessageIdData(ledgerId=topic.ledger.ledger_id, entryId=entry_id)])


def test_markers_are_never_delivered_and_do_not_hold_the_mark_delete_back() -> None:
    a = cluster("A", {"B": "pulsar://b:6650"})
    topic = a.get_topic(TOPIC)
    producer = new_producer(topic, "app")
    sink = Sink()
    consumer = subscribe(topic, "s", sink)
    publish(topic, producer, 0)
    geo_of(topic).write_marker(markers.SNAPSHOT_REQUEST,
                               pm.ReplicatedSubscriptionsSnapshotRequest(snapshot_id="x", source_cluster="A"), None)
    publish(topic, producer, 1)
    assert sink.entry_ids == [0, 2]
    assert consumer.permits == 98
    ack(topic, "s", consumer, 0)
    assert topic.subscriptions["s"].cursor.mark_delete == 1  # past the marker
    ack(topic, "s", consumer, 2)
    assert topic.subscriptions["s"].backlog() == 0


def test_a_replicated_subscription_updates_the_other_clusters_once_acks_pass_a_snapshot() -> None:
    clock = Clock()
    a = cluster("A", {"B": "pulsar://b:6650"})
    topic = a.get_topic(TOPIC)
    geo = geo_of(topic)
    geo.wall_ms = clock
    producer = new_producer(topic, "app")
    sink = Sink()
    consumer = subscribe(topic, "orders", sink, replicated=True)
    for sequence_id in range(3):
        publish(topic, producer, sequence_id)
    geo.replicators["B"].connected = lambda: True
    geo.tick()  # the snapshot request goes in at entry 3
    request = geo.replicators["B"].read(10, geo)[-1]
    assert request.metadata.marker_type == markers.SNAPSHOT_REQUEST
    body = pm.ReplicatedSubscriptionsSnapshotRequest.FromString(request.payload)
    # B's response, as B's replicator would write it here (replicated from B, only for A)
    response = pm.ReplicatedSubscriptionsSnapshotResponse(snapshot_id=body.snapshot_id, cluster=pm.ClusterMessageId(
        cluster="B", message_id=pm.MarkersMessageIdData(ledger_id=9, entry_id=41)))
    remote = new_producer(topic, "pulsar.repl.B-->A", 2)
    metadata = markers.marker_metadata(markers.SNAPSHOT_RESPONSE, 0, "A")
    metadata.replicated_from = "B"
    topic.publish(remote, encode_payload_section(metadata, response.SerializeToString()), metadata, 1, 0)
    geo.replicators["B"].read(10, geo)  # A's replicator towards B reads it: the snapshot completes
    assert geo.controller is not None and geo.controller.stats.completed == 1
    assert sink.entry_ids == [0, 1, 2]  # request, response and snapshot were passed, not delivered
    assert len(geo.controller.caches["orders"]) == 1
    ack(topic, "orders", consumer, 0)
    ack(topic, "orders", consumer, 1)
    assert geo.controller.stats.updates_written == 0  # the snapshot sits at the response (entry 4)
    ack(topic, "orders", consumer, 2)
    update = geo.replicators["B"].read(10, geo)[-1]
    assert update.metadata.marker_type == markers.UPDATE
    assert pm.ReplicatedSubscriptionsUpdate.FromString(update.payload) == pm.ReplicatedSubscriptionsUpdate(
        subscription_name="orders", clusters=[response.cluster])


def test_an_update_from_another_cluster_creates_or_moves_the_subscription_here() -> None:
    b = cluster("B", {"A": "pulsar://a:6650"})
    topic = b.get_topic(TOPIC)
    producer = new_producer(topic, "app")
    for sequence_id in range(10):
        publish(topic, producer, sequence_id)
    update = pm.ReplicatedSubscriptionsUpdate(subscription_name="orders", clusters=[pm.ClusterMessageId(
        cluster="B", message_id=pm.MarkersMessageIdData(ledger_id=topic.ledger.ledger_id, entry_id=6))])
    replicator = new_producer(topic, "pulsar.repl.A-->B", 2)
    metadata = markers.marker_metadata(markers.UPDATE, 0)
    metadata.replicated_from = "A"
    topic.publish(replicator, encode_payload_section(metadata, update.SerializeToString()), metadata, 1, 0)
    geo_of(topic).replicators["A"].read(100, geo_of(topic))
    subscription = topic.subscriptions["orders"]
    assert subscription.replicated and subscription.cursor.mark_delete == 6
    # a consumer arriving now starts right after the update's position
    sink = Sink()
    subscription.add_consumer(Consumer(1, "c", 0, sink), api.CommandSubscribe.Exclusive)
    subscription.flow(subscription.consumers[0], 100)
    assert sink.entry_ids == [7, 8, 9]


def test_a_cursor_per_remote_cluster() -> None:
    a = cluster("A", {"B": "pulsar://b:6650", "C": "pulsar://c:6650"})
    topic = a.get_topic(TOPIC)
    producer = new_producer(topic, "app")
    publish(topic, producer, 0, replicate_to=("C",))
    cursors: dict[str, ReplicatorCursor] = geo_of(topic).replicators
    assert [o.entry_id for o in cursors["C"].read(10)] == [0]
    assert cursors["B"].read(10) == []
    assert cursors["B"].backlog() == 0 and cursors["C"].backlog() == 1


def test_a_terminated_topic_takes_no_markers_and_the_snapshot_simply_never_completes() -> None:
    a = cluster("A", {"B": "pulsar://b:6650"})
    topic = a.get_topic(TOPIC)
    publish(topic, new_producer(topic, "app"), 0)
    subscribe(topic, "s", Sink(), replicated=True)
    topic.terminate()
    geo = geo_of(topic)
    geo.replicators["B"].connected = lambda: True
    geo.tick()
    assert geo.controller is not None and geo.controller.stats.started == 1
    assert topic.ledger.next_entry_id == 1
