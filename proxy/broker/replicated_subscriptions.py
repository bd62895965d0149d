"""Replicated subscriptions: consistent snapshots across clusters and the updates they allow.

Pulsar's ``ReplicatedSubscriptionsController``, ``ReplicatedSubscriptionsSnapshotBuilder``
and ``ReplicatedSubscriptionSnapshotCache``, for one topic of the embedded broker
(PulsarMarkers.proto; geo-replication seed 001).  The protocol runs entirely
through markers written into the topics themselves and carried by the replicators:

1. While data flows, the controller of cluster A writes a SNAPSHOT_REQUEST marker
   (snapshot id, source cluster A) into its topic at every period; it goes to every
   remote cluster with the data.
2. Cluster B's replicator *towards A* reads the request (it came from A) and B's
   controller answers with a SNAPSHOT_RESPONSE marker restricted to A
   (``replicate_to: [A]``) carrying B's own position of that request: everything
   before it on B came from A before the request, or was written on B before the
   response went back.
3. A's replicator towards B reads the response; when every remote cluster has
   answered (twice when there are more than two clusters, so messages exchanged
   between the others are caught too) A writes a SNAPSHOT marker restricted to A:
   "A's position of the last response ↔ each cluster's position".
4. Each replicated subscription on A reads the SNAPSHOT as its dispatcher passes it
   (markers are never delivered to consumers) and keeps it in a
   :class:`SnapshotCache`.  When the subscription's mark-delete position moves past a
   cached snapshot's A position, the controller writes a SUBSCRIPTION_UPDATE marker
   naming each cluster's position; on B it moves the same subscription's mark-delete
   to B's position (creating the subscription if B has none).

A snapshot is not attempted while a replicator is disconnected or when nothing was
published since the last completed snapshot started; a pending snapshot that gets
no answers within the timeout is dropped, and until the first snapshot completes
a new one waits for the pending one's timeout (a remote that never answers costs
one request per timeout, not one per period).  Everything here is sans-IO: time
comes in as ``now_ms`` and markers go out through a :class:`ControlledTopic`.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, Protocol

from google.protobuf.message import Message

from proxy.pb import PulsarMarkers_pb2 as pm
from proxy.protocol import markers

#: (ledger id, entry id), ordered as Pulsar orders positions
Position = tuple[int, int]

#: Pulsar's replicatedSubscriptionsSnapshotFrequencyMillis default
DEFAULT_PERIOD_MS: Final = 1000
#: replicatedSubscriptionsSnapshotTimeoutSeconds default, in ms
DEFAULT_TIMEOUT_MS: Final = 30_000
#: replicatedSubscriptionsSnapshotMaxCachedPerSubscription default
DEFAULT_CACHE_SIZE: Final = 10


@dataclass(frozen=True, slots=True)
class SnapshotSettings:
    """How often snapshots are taken, how long one may take, how many a subscription keeps."""

    period_ms: int = DEFAULT_PERIOD_MS
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    cache_size: int = DEFAULT_CACHE_SIZE

    def __post_init__(self) -> None:
        if self.period_ms <= 0 or self.timeout_ms <= 0:
            raise ValueError("the snapshot period and timeout must be positive")
        if self.cache_size < 3:
            raise ValueError("a snapshot cache keeps at least 3 snapshots")


def position_of(message_id: pm.MarkersMessageIdData) -> Position:
    return int(message_id.ledger_id), int(message_id.entry_id)


def message_id_of(position: Position) -> pm.MarkersMessageIdData:
    return pm.MarkersMessageIdData(ledger_id=position[0], entry_id=position[1])


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A completed snapshot as a subscription keeps it: the local position and each remote's."""

    snapshot_id: str
    local: Position
    clusters: tuple[tuple[str, Position], ...]

    @classmethod
    def from_marker(cls, body: pm.ReplicatedSubscriptionsSnapshot) -> Snapshot:
        return cls(body.snapshot_id, position_of(body.local_message_id),
                   tuple((c.cluster, position_of(c.message_id)) for c in body.clusters))


def entry_distance(older: Position, newer: Position) -> int:
    """Entries between two positions of one topic (a ledger change counts as far apart)."""
    if older[0] != newer[0]:
        return 1 << 40
    return max(0, newer[1] - older[1])


class SnapshotCache:
    """The last snapshots one replicated subscription has read, oldest first.

    Bounded: past ``max_snapshots`` the snapshot whose removal leaves the smallest gap
    (its distance to the previous plus to the next) goes, never the oldest or the
    newest, so the kept snapshots stay spread over the backlog (Pulsar's cache since
    4.1).  A snapshot at or before the newest one means the subscription was reset:
    the cache starts over.
    """

    def __init__(self, max_snapshots: int = DEFAULT_CACHE_SIZE,
                 distance: Callable[[Position, Position], int] = entry_distance) -> None:
        if max_snapshots < 3:
            raise ValueError("a snapshot cache keeps at least 3 snapshots")
        self.max_snapshots = max_snapshots
        self._distance = distance
        self._snapshots: list[Snapshot] = []

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def snapshots(self) -> tuple[Snapshot, ...]:
        return tuple(self._snapshots)

    def add(self, snapshot: Snapshot) -> None:
        if self._snapshots and snapshot.local <= self._snapshots[-1].local:
            self._snapshots.clear()
        self._snapshots.append(snapshot)
        if len(self._snapshots) > self.max_snapshots:
            self._prune()

    def _prune(self) -> None:
        kept = self._snapshots
        gaps = [self._distance(kept[i - 1].local, kept[i].local) + self._distance(kept[i].local, kept[i + 1].local)
                for i in range(1, len(kept) - 1)]
        del kept[1 + gaps.index(min(gaps))]

    def advanced_mark_delete(self, mark_delete: Position) -> Snapshot | None:
        """The newest snapshot at or before the mark-delete position (it and older ones are dropped)."""
        usable = None
        while self._snapshots and self._snapshots[0].local <= mark_delete:
            usable = self._snapshots.pop(0)
        return usable


@dataclass
class SnapshotBuilder:
    """One snapshot in the making: the request sent, the responses still missing."""

    snapshot_id: str
    remote_clusters: frozenset[str]
    started_ms: int
    timeout_ms: int
    missing: set[str] = field(default_factory=set)
    responses: dict[str, Position] = field(default_factory=dict)
    first_round_complete: bool = False

    def __post_init__(self) -> None:
        self.missing = set(self.remote_clusters)

    @property
    def needs_two_rounds(self) -> bool:
        # with more than one remote, a second round catches what the others exchanged meanwhile
        return len(self.remote_clusters) > 1

    def timed_out(self, now_ms: int) -> bool:
        return self.started_ms + self.timeout_ms < now_ms


class ControlledTopic(Protocol):
    """What the controller needs from its topic."""

    def write_marker(self, marker_type: int, body: Message, replicate_to: str | None) -> Position:
        """Append a marker to the topic now; its position."""
        ...

    def move_subscription(self, name: str, position: Position) -> None:
        """Move a subscription's mark-delete to ``position`` (creating it, replicated, if missing)."""
        ...


@dataclass
class ControllerStats:
    started: int = 0
    completed: int = 0
    timed_out: int = 0
    requests_answered: int = 0
    updates_written: int = 0
    updates_applied: int = 0
    #: how long the last completed snapshots took (request written to snapshot written), ms
    durations_ms: deque[int] = field(default_factory=lambda: deque(maxlen=100))

    @property
    def last_duration_ms(self) -> int | None:
        return self.durations_ms[-1] if self.durations_ms else None


class ReplicatedSubscriptionsController:
    """The replicated-subscription side of one topic in one cluster."""

    def __init__(self, topic: ControlledTopic, local_cluster: str, settings: SnapshotSettings | None = None,
                 new_id: Callable[[], str] = lambda: str(uuid.uuid4())) -> None:
        self.topic = topic
        self.local_cluster = local_cluster
        self.settings = settings or SnapshotSettings()
        self._new_id = new_id
        self.pending: dict[str, SnapshotBuilder] = {}
        self.last_completed_start_ms = 0
        self.last_completed_id: str | None = None
        self.caches: dict[str, SnapshotCache] = {}
        self.stats = ControllerStats()

    # -- taking snapshots -----------------------------------------------------------------

    def tick(self, now_ms: int, remote_clusters: Iterable[str], all_connected: bool, last_data_ms: int) -> None:
        """The periodic timer: drop timed-out snapshots, maybe start a new one."""
        for snapshot_id in [i for i, b in self.pending.items() if b.timed_out(now_ms)]:
            del self.pending[snapshot_id]
            self.stats.timed_out += 1
        if self.last_completed_start_ms == 0 and self.pending:
            return  # nobody has answered yet: ask again only after the pending request times out
        if last_data_ms == 0 or last_data_ms < self.last_completed_start_ms:
            return  # nothing new since the last snapshot
        remotes = frozenset(remote_clusters)
        if not remotes or not all_connected:
            return  # a cluster that cannot be reached cannot answer
        builder = SnapshotBuilder(self._new_id(), remotes, now_ms, self.settings.timeout_ms)
        self.pending[builder.snapshot_id] = builder
        self.stats.started += 1
        self._request(builder)

    def _request(self, builder: SnapshotBuilder) -> None:
        body = pm.ReplicatedSubscriptionsSnapshotRequest(snapshot_id=builder.snapshot_id,
                                                         source_cluster=self.local_cluster)
        self.topic.write_marker(markers.SNAPSHOT_REQUEST, body, None)

    # -- markers from other clusters (read by the replicator towards the cluster they came from) --

    def received_marker(self, position: Position, marker_type: int, body: Message | None, now_ms: int) -> None:
        if marker_type == markers.SNAPSHOT_REQUEST and isinstance(body, pm.ReplicatedSubscriptionsSnapshotRequest):
            self._answer(position, body)
        elif marker_type == markers.SNAPSHOT_RESPONSE and isinstance(body, pm.ReplicatedSubscriptionsSnapshotResponse):
            self._response(position, body, now_ms)
        elif marker_type == markers.UPDATE and isinstance(body, pm.ReplicatedSubscriptionsUpdate):
            self._update(body)

    def _answer(self, position: Position, request: pm.ReplicatedSubscriptionsSnapshotRequest) -> None:
        # the position of the request itself: everything before it here came from the
        # requester before its request, or was written here before this answer
        response = pm.ReplicatedSubscriptionsSnapshotResponse(
            snapshot_id=request.snapshot_id,
            cluster=pm.ClusterMessageId(cluster=self.local_cluster, message_id=message_id_of(position)))
        self.topic.write_marker(markers.SNAPSHOT_RESPONSE, response, request.source_cluster)
        self.stats.requests_answered += 1

    def _response(self, position: Position, response: pm.ReplicatedSubscriptionsSnapshotResponse,
                  now_ms: int) -> None:
        builder = self.pending.get(response.snapshot_id)
        if builder is None:
            return  # a late answer to a snapshot that timed out
        cluster = response.cluster.cluster
        builder.responses.setdefault(cluster, position_of(response.cluster.message_id))
        builder.missing.discard(cluster)
        if builder.missing:
            return
        if builder.needs_two_rounds and not builder.first_round_complete:
            builder.first_round_complete = True
            builder.missing = set(builder.remote_clusters)
            self._request(builder)
            return
        snapshot = pm.ReplicatedSubscriptionsSnapshot(snapshot_id=builder.snapshot_id,
                                                      local_message_id=message_id_of(position))
        for name, cluster_position in sorted(builder.responses.items()):
            snapshot.clusters.add(cluster=name, message_id=message_id_of(cluster_position))
        self.topic.write_marker(markers.SNAPSHOT, snapshot, self.local_cluster)
        del self.pending[builder.snapshot_id]
        self.last_completed_id = builder.snapshot_id
        self.last_completed_start_ms = builder.started_ms
        self.stats.completed += 1
        self.stats.durations_ms.append(now_ms - builder.started_ms)

    def _update(self, update: pm.ReplicatedSubscriptionsUpdate) -> None:
        for entry in update.clusters:
            if entry.cluster == self.local_cluster:
                self.topic.move_subscription(update.subscription_name, position_of(entry.message_id))
                self.stats.updates_applied += 1
                return

    # -- the local replicated subscriptions --------------------------------------------------

    def cache(self, subscription: str) -> SnapshotCache:
        found = self.caches.get(subscription)
        if found is None:
            found = self.caches[subscription] = SnapshotCache(self.settings.cache_size)
        return found

    def snapshot_read(self, subscription: str, body: pm.ReplicatedSubscriptionsSnapshot) -> None:
        """A replicated subscription's dispatcher passed a SNAPSHOT marker."""
        self.cache(subscription).add(Snapshot.from_marker(body))

    def mark_delete_advanced(self, subscription: str, mark_delete: Position) -> None:
        """A replicated subscription's mark-delete moved: tell the other clusters if a snapshot allows."""
        cache = self.caches.get(subscription)
        if cache is None:
            return
        snapshot = cache.advanced_mark_delete(mark_delete)
        if snapshot is None:
            return
        update = pm.ReplicatedSubscriptionsUpdate(subscription_name=subscription)
        for name, position in sorted(snapshot.clusters):
            update.clusters.add(cluster=name, message_id=message_id_of(position))
        self.topic.write_marker(markers.UPDATE, update, None)
        self.stats.updates_written += 1

    def forget(self, subscription: str) -> None:
        self.caches.pop(subscription, None)


__all__ = ["ControlledTopic", "ControllerStats", "Position", "ReplicatedSubscriptionsController", "Snapshot",
           "SnapshotBuilder", "SnapshotCache", "SnapshotSettings", "entry_distance"]
