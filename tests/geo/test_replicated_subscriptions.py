"""The replicated-subscription protocol, sans-IO: snapshot caches and the per-topic controller.

Two or three controllers are wired by hand — a marker one writes is handed to
another as its replicator would — so each step of seed 001's protocol is checked
without sockets or clocks.
"""

from __future__ import annotations

import itertools

import pytest
from google.protobuf.message import Message

from proxy.broker.replicated_subscriptions import (
    Position,
    ReplicatedSubscriptionsController,
    Snapshot,
    SnapshotCache,
    SnapshotSettings,
)
from proxy.pb import PulsarMarkers_pb2 as pm
from proxy.protocol import markers


class FakeTopic:
    """A topic that numbers the markers written to it and remembers subscription moves."""

    def __init__(self, ledger_id: int) -> None:
        self.ledger_id = ledger_id
        self.next_entry = 0
        self.written: list[tuple[Position, int, Message, str | None]] = []
        self.moved: list[tuple[str, Position]] = []

    def append_data(self, count: int) -> None:
        self.next_entry += count

    def write_marker(self, marker_type: int, body: Message, replicate_to: str | None) -> Position:
        position = (self.ledger_id, self.next_entry)
        self.next_entry += 1
        self.written.append((position, marker_type, body, replicate_to))
        return position

    def move_subscription(self, name: str, position: Position) -> None:
        self.moved.append((name, position))

    def last(self, marker_type: int) -> tuple[Position, Message, str | None]:
        for position, kind, body, replicate_to in reversed(self.written):
            if kind == marker_type:
                return position, body, replicate_to
        raise AssertionError(f"no {markers.marker_name(marker_type)} written")


def controller(name: str, topic: FakeTopic, period_ms: int = 1000) -> ReplicatedSubscriptionsController:
    ids = itertools.count(1)
    return ReplicatedSubscriptionsController(topic, name, SnapshotSettings(period_ms=period_ms, timeout_ms=5000),
                                             new_id=lambda: f"{name}-snap-{next(ids)}")


def snap(local: int, remote: int, snapshot_id: str = "s") -> Snapshot:
    return Snapshot(snapshot_id, (1, local), (("B", (2, remote)),))


# -- the cache -------------------------------------------------------------------------------------

def test_cache_gives_the_newest_snapshot_at_or_before_the_mark_delete_and_drops_older_ones() -> None:
    cache = SnapshotCache(5)
    for local in (10, 20, 30):
        cache.add(snap(local, local * 10))
    assert cache.advanced_mark_delete((1, 9)) is None
    assert cache.advanced_mark_delete((1, 25)) == snap(20, 200)
    assert [s.local for s in cache.snapshots] == [(1, 30)]
    assert cache.advanced_mark_delete((1, 30)) == snap(30, 300)
    assert len(cache) == 0


def test_cache_bounded_keeps_oldest_and_newest_and_drops_the_one_leaving_the_smallest_gap() -> None:
    cache = SnapshotCache(4)
    for local in (0, 100, 110, 200, 300):
        cache.add(snap(local, local))
    # 110 sits 10 after 100: removing 100 (gap 100+10) or 110 (10+90) leaves the smallest hole
    assert [s.local[1] for s in cache.snapshots] == [0, 100, 200, 300]


def test_cache_starts_over_when_a_snapshot_is_not_newer_than_the_last_one() -> None:
    cache = SnapshotCache(5)
    cache.add(snap(50, 1))
    cache.add(snap(60, 2))
    cache.add(snap(40, 3))  # the subscription was reset
    assert [s.local[1] for s in cache.snapshots] == [40]


def test_cache_needs_room_for_three() -> None:
    with pytest.raises(ValueError):
        SnapshotCache(2)


# -- one snapshot round, two clusters -----------------------------------------------------------------

def deliver(sender: FakeTopic, receiver: ReplicatedSubscriptionsController, at: FakeTopic, marker_type: int,
            now_ms: int = 0) -> Position:
    """Replicate the last marker of a type from ``sender`` into ``at`` and let ``receiver`` read it."""
    _, body, _ = sender.last(marker_type)
    position = (at.ledger_id, at.next_entry)
    at.append_data(1)
    receiver.received_marker(position, marker_type, body, now_ms)
    return position


def test_a_snapshot_round_trip_between_two_clusters() -> None:
    topic_a, topic_b = FakeTopic(1), FakeTopic(2)
    a, b = controller("A", topic_a), controller("B", topic_b)
    topic_a.append_data(10)
    a.tick(now_ms=1000, remote_clusters=["B"], all_connected=True, last_data_ms=900)
    request_position, request, replicate_to = topic_a.last(markers.SNAPSHOT_REQUEST)
    assert request == pm.ReplicatedSubscriptionsSnapshotRequest(snapshot_id="A-snap-1", source_cluster="A")
    assert replicate_to is None and request_position == (1, 10)

    topic_b.append_data(5)
    request_on_b = deliver(topic_a, b, topic_b, markers.SNAPSHOT_REQUEST)
    _, response, reply_to = topic_b.last(markers.SNAPSHOT_RESPONSE)
    # B answers with the position of the request itself in its own topic, only to A
    assert reply_to == "A"
    assert response == pm.ReplicatedSubscriptionsSnapshotResponse(
        snapshot_id="A-snap-1", cluster=pm.ClusterMessageId(cluster="B", message_id=pm.MarkersMessageIdData(
            ledger_id=2, entry_id=request_on_b[1])))

    topic_a.append_data(3)
    response_on_a = deliver(topic_b, a, topic_a, markers.SNAPSHOT_RESPONSE, now_ms=1250)
    _, snapshot, stays = topic_a.last(markers.SNAPSHOT)
    assert stays == "A"  # a completed snapshot is not replicated
    assert isinstance(snapshot, pm.ReplicatedSubscriptionsSnapshot)
    assert Snapshot.from_marker(snapshot) == Snapshot("A-snap-1", response_on_a, (("B", request_on_b),))
    assert a.pending == {} and a.stats.completed == 1 and list(a.stats.durations_ms) == [250]

    # a replicated subscription passes the snapshot, then acknowledges past it
    a.snapshot_read("orders-sub", snapshot)
    a.mark_delete_advanced("orders-sub", (1, response_on_a[1] - 1))
    assert not any(kind == markers.UPDATE for _, kind, _, _ in topic_a.written)
    a.mark_delete_advanced("orders-sub", response_on_a)
    _, update, everywhere = topic_a.last(markers.UPDATE)
    assert everywhere is None
    assert update == pm.ReplicatedSubscriptionsUpdate(subscription_name="orders-sub", clusters=[
        pm.ClusterMessageId(cluster="B", message_id=pm.MarkersMessageIdData(ledger_id=2, entry_id=request_on_b[1]))])

    deliver(topic_a, b, topic_b, markers.UPDATE)
    assert topic_b.moved == [("orders-sub", request_on_b)]
    assert b.stats.updates_applied == 1


def test_an_update_for_other_clusters_only_moves_nothing_here() -> None:
    topic_c = FakeTopic(3)
    c = controller("C", topic_c)
    update = pm.ReplicatedSubscriptionsUpdate(subscription_name="s", clusters=[
        pm.ClusterMessageId(cluster="B", message_id=pm.MarkersMessageIdData(ledger_id=2, entry_id=7))])
    c.received_marker((3, 0), markers.UPDATE, update, 0)
    assert topic_c.moved == []


def test_no_snapshot_without_new_data_or_with_a_replicator_down() -> None:
    topic = FakeTopic(1)
    a = controller("A", topic)
    a.tick(1000, ["B"], all_connected=True, last_data_ms=0)
    a.tick(2000, ["B"], all_connected=False, last_data_ms=1500)
    a.tick(3000, [], all_connected=True, last_data_ms=2500)
    assert topic.written == []
    a.tick(4000, ["B"], all_connected=True, last_data_ms=3500)
    assert len(topic.written) == 1


def test_until_one_snapshot_completes_a_new_request_waits_for_the_pending_one_to_time_out() -> None:
    topic = FakeTopic(1)
    a = controller("A", topic)  # timeout 5 s
    for now in range(1000, 6001, 1000):
        a.tick(now, ["B"], True, last_data_ms=now - 1)
    assert len(topic.written) == 1  # a silent remote costs one request per timeout
    a.tick(6001, ["B"], True, last_data_ms=6000)
    assert a.stats.timed_out == 1 and len(topic.written) == 2
    late = pm.ReplicatedSubscriptionsSnapshotResponse(snapshot_id="A-snap-1", cluster=pm.ClusterMessageId(
        cluster="B", message_id=pm.MarkersMessageIdData(ledger_id=2, entry_id=0)))
    a.received_marker((1, 50), markers.SNAPSHOT_RESPONSE, late, 6500)  # a late answer to the timed-out one
    assert a.stats.completed == 0


def test_after_a_completed_snapshot_one_is_started_every_period_while_data_flows() -> None:
    topic_a, topic_b = FakeTopic(1), FakeTopic(2)
    a, b = controller("A", topic_a), controller("B", topic_b)
    a.tick(1000, ["B"], True, last_data_ms=999)
    deliver(topic_a, b, topic_b, markers.SNAPSHOT_REQUEST)
    deliver(topic_b, a, topic_a, markers.SNAPSHOT_RESPONSE, now_ms=1100)
    a.tick(2000, ["B"], True, last_data_ms=1999)
    a.tick(3000, ["B"], True, last_data_ms=2999)
    assert a.stats.started == 3 and len(a.pending) == 2  # rounds overlap when the link is slow
    b_answers_all(topic_a, topic_b, a, b)
    a.tick(4000, ["B"], True, last_data_ms=2999)
    assert a.stats.started == 3  # nothing was published since the last completed snapshot started (3000)


def b_answers_all(topic_a: FakeTopic, topic_b: FakeTopic, a: ReplicatedSubscriptionsController,
                  b: ReplicatedSubscriptionsController) -> None:
    requests = [body for _, kind, body, _ in topic_a.written if kind == markers.SNAPSHOT_REQUEST]
    for request in requests:
        b.received_marker((2, topic_b.next_entry), markers.SNAPSHOT_REQUEST, request, 0)
        topic_b.append_data(1)
        _, response, _ = topic_b.last(markers.SNAPSHOT_RESPONSE)
        a.received_marker((1, topic_a.next_entry), markers.SNAPSHOT_RESPONSE, response, 3500)
        topic_a.append_data(1)


def test_three_clusters_need_two_rounds_of_responses() -> None:
    topic_a, topic_b, topic_c = FakeTopic(1), FakeTopic(2), FakeTopic(3)
    a, b, c = controller("A", topic_a), controller("B", topic_b), controller("C", topic_c)
    a.tick(1000, ["B", "C"], True, last_data_ms=999)
    for remote, remote_topic in ((b, topic_b), (c, topic_c)):
        deliver(topic_a, remote, remote_topic, markers.SNAPSHOT_REQUEST)
    deliver(topic_b, a, topic_a, markers.SNAPSHOT_RESPONSE)
    deliver(topic_c, a, topic_a, markers.SNAPSHOT_RESPONSE)
    # every cluster answered once: a second request goes out instead of a snapshot
    assert [kind for _, kind, _, _ in topic_a.written].count(markers.SNAPSHOT_REQUEST) == 2
    assert a.stats.completed == 0
    for remote, remote_topic in ((b, topic_b), (c, topic_c)):
        deliver(topic_a, remote, remote_topic, markers.SNAPSHOT_REQUEST)
    deliver(topic_b, a, topic_a, markers.SNAPSHOT_RESPONSE)
    last = deliver(topic_c, a, topic_a, markers.SNAPSHOT_RESPONSE)
    _, snapshot, _ = topic_a.last(markers.SNAPSHOT)
    assert isinstance(snapshot, pm.ReplicatedSubscriptionsSnapshot)
    result = Snapshot.from_marker(snapshot)
    # the local position is the last response's; each cluster keeps its first answer
    assert result.local == last
    assert result.clusters[0] == ("B", position_of_first_answer(topic_b))
    assert [name for name, _ in result.clusters] == ["B", "C"] and a.stats.completed == 1


def position_of_first_answer(topic: FakeTopic) -> Position:
    response = next(body for _, kind, body, _ in topic.written if kind == markers.SNAPSHOT_RESPONSE)
    assert isinstance(response, pm.ReplicatedSubscriptionsSnapshotResponse)
    return response.cluster.message_id.ledger_id, response.cluster.message_id.entry_id


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        SnapshotSettings(period_ms=0)
    with pytest.raises(ValueError):
        SnapshotSettings(cache_size=2)
