"""Geo-replication state of one topic: a cursor per remote cluster, and what each entry becomes.

Pulsar's ``PersistentReplicator`` / ``GeoPersistentReplicator`` (geo-replication
seed 001), sans-IO: :class:`ReplicatorCursor` is the durable cursor of one remote
cluster on a topic, and :func:`replication_verdict` is what the replicator does with
each entry it reads, in Pulsar's order:

1. a transaction marker is not replicated;
2. a replicated-subscription marker that came *from this replicator's remote
   cluster* is handed to the topic's :class:`ReplicatedSubscriptionsController`
   (that is how a cluster hears the requests, responses and updates of another);
3. an entry that was itself replicated (``replicated_from`` set) is not replicated
   again — this is what keeps two clusters replicating to each other from looping;
4. an entry whose ``replicate_to`` does not name the remote cluster is skipped
   (a snapshot response goes only to the cluster that asked, a completed snapshot
   stays home);
5. everything else — data, and the local snapshot requests and subscription
   updates — is sent with ``replicated_from`` set to the local cluster, by a producer
   named ``pulsar.repl.<local>--><remote>``, its metadata otherwise unchanged (original
   producer name, sequence id, publish time), so the remote broker's deduplication can
   recognise a resent entry by its original producer name and sequence id.

Skipped entries are acknowledged on the cursor at once; sent ones when the remote
confirms them.  After a failed send the cursor rewinds to its first unconfirmed entry.

**Backlog limit.** A replicator whose remote is slow or unreachable keeps its
backlog in the topic.  Past ``backlog_limit`` messages not yet replicated, the
oldest entries not yet sent are skipped (acknowledged unsent and counted as
``evicted``) — Pulsar's ``consumer_backlog_eviction`` quota policy applied to the
replication cursor: the local cluster keeps accepting messages and the lag stays
bounded, at the price of those messages never reaching the remote.  Entries the
topic's retention drops before they were sent count as evicted too.

:class:`TopicGeo` ties it together for one topic: its replicator cursors, its
controller (created when a replicated subscription appears, or when a marker
arrives from another cluster), and the hooks the topic and its subscriptions call.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from google.protobuf.message import Message

from proxy.broker.cursor import Cursor
from proxy.broker.ledger import Entry
from proxy.broker.replicated_subscriptions import Position, ReplicatedSubscriptionsController, SnapshotSettings
from proxy.errors import BrokerError, ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import PulsarMarkers_pb2 as pm
from proxy.protocol import markers
from proxy.protocol.frame import encode_payload_section, parse_payload_section

if TYPE_CHECKING:
    from proxy.broker.subscription import Subscription
    from proxy.broker.topic import Topic

#: unreplicated messages a replicator may fall behind by before the oldest are evicted
DEFAULT_BACKLOG_LIMIT: Final = 100_000
#: entries sent and not yet confirmed, per replicator (Pulsar's replicationProducerQueueSize)
DEFAULT_QUEUE_SIZE: Final = 1000
_TXN_MARKERS: Final = frozenset({20, 21, 22})
_SUBSCRIPTION_MARKERS: Final = frozenset({markers.SNAPSHOT_REQUEST, markers.SNAPSHOT_RESPONSE, markers.UPDATE})


@dataclass(frozen=True, slots=True)
class GeoSettings:
    """A cluster's geo-replication settings (the ``pulsar-tap broker`` replication flags)."""

    local_cluster: str
    #: remote cluster name -> its service URL
    remotes: dict[str, str]
    snapshots: SnapshotSettings = field(default_factory=SnapshotSettings)
    #: Pulsar's enableReplicatedSubscriptions
    replicated_subscriptions: bool = True
    backlog_limit: int = DEFAULT_BACKLOG_LIMIT
    queue_size: int = DEFAULT_QUEUE_SIZE


class Verdict(enum.Enum):
    SEND = "send"
    SKIP_TXN_MARKER = "txn-marker"
    SKIP_REPLICATED = "already-replicated"
    SKIP_NOT_FOR_REMOTE = "replicate_to-excludes-remote"


def replication_verdict(metadata: api.MessageMetadata, remote_cluster: str) -> Verdict:
    """What a replicator towards ``remote_cluster`` does with an entry (rules 1, 3, 4, 5 above)."""
    if metadata.HasField("marker_type") and metadata.marker_type in _TXN_MARKERS:
        return Verdict.SKIP_TXN_MARKER
    if metadata.HasField("replicated_from"):
        return Verdict.SKIP_REPLICATED
    if len(metadata.replicate_to) and remote_cluster not in metadata.replicate_to:
        return Verdict.SKIP_NOT_FOR_REMOTE
    return Verdict.SEND


def is_marker_from(metadata: api.MessageMetadata, remote_cluster: str) -> bool:
    """Rule 2: a replicated-subscription marker this replicator's remote cluster wrote."""
    return (metadata.HasField("marker_type") and metadata.marker_type in _SUBSCRIPTION_MARKERS
            and metadata.replicated_from == remote_cluster)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """An entry on its way to the remote cluster."""

    entry_id: int
    metadata: api.MessageMetadata
    payload: bytes
    num_messages: int
    publish_time_ms: int


@dataclass
class ReplicatorStats:
    """What Pulsar's replicator stats report, plus what pulsar-tap's lag table needs."""

    messages_out: int = 0
    bytes_out: int = 0
    entries_skipped: int = 0
    #: messages dropped unsent by the backlog limit or by retention
    messages_evicted: int = 0
    markers_out: int = 0
    send_failures: int = 0
    #: publish-to-confirm time of the last confirmed entry, ms
    last_lag_ms: int | None = None


class ReplicatorCursor:
    """One remote cluster's durable cursor on a topic, with what is in flight."""

    def __init__(self, topic: Topic, remote_cluster: str, local_cluster: str, backlog_limit: int) -> None:
        self.topic = topic
        self.remote_cluster = remote_cluster
        self.local_cluster = local_cluster
        self.backlog_limit = backlog_limit
        ledger = topic.ledger
        # as Pulsar opens a replication cursor: at the end of what the topic holds
        self.cursor = Cursor(ledger, ledger.last_entry_id)
        #: messages appended since the cursor opened and not yet replicated, skipped or evicted
        self.unreplicated = 0
        #: entry id -> publish time (ms) of entries sent and not yet confirmed
        self.in_flight: dict[int, int] = {}
        self.stats = ReplicatorStats()
        #: whether the replicator's producer is connected to the remote (kept by the Trio side)
        self.connected: Callable[[], bool] = lambda: False

    @property
    def producer_name(self) -> str:
        return markers.replicator_name(self.local_cluster, self.remote_cluster)

    # -- reading ---------------------------------------------------------------------------

    def appended(self, entry: Entry) -> None:
        """A new entry in the topic: count it, and keep the backlog under its limit."""
        if entry.entry_id > self.cursor.mark_delete:
            self.unreplicated += entry.num_messages
        if self.unreplicated > self.backlog_limit:
            self._evict_over_limit()

    def has_unread(self) -> bool:
        return self.cursor.read_position < self.topic.ledger.next_entry_id

    def read(self, max_entries: int, geo: TopicGeo | None = None) -> list[Outgoing]:
        """The next entries to send; skipped ones are acknowledged, remote markers handed to ``geo``."""
        ledger = self.topic.ledger
        if self.cursor.read_position < ledger.first_entry_id:
            # retention dropped entries this replicator never read: they are lost to the remote
            self.stats.messages_evicted += ledger.first_entry_id - self.cursor.read_position
            self.cursor.read_position = ledger.first_entry_id
            self.unreplicated = self.cursor.backlog()
        out: list[Outgoing] = []
        while len(out) < max_entries:
            entry_id = self.cursor.next_new_entry()
            if entry_id is None:
                break
            self.cursor.read_position = entry_id + 1
            entry = ledger.get(entry_id)
            if entry is None:
                continue
            try:
                section = parse_payload_section(entry.section, 0)
                metadata = section.metadata
            except ProtocolError:
                self._acknowledge(entry)  # as Pulsar: an entry that does not parse is not replicated
                self.stats.entries_skipped += 1
                continue
            if geo is not None and is_marker_from(metadata, self.remote_cluster):
                geo.marker_from_remote((ledger.ledger_id, entry_id), metadata, section.payload)
            if replication_verdict(metadata, self.remote_cluster) is not Verdict.SEND:
                self._acknowledge(entry)
                self.stats.entries_skipped += 1
                continue
            forwarded = api.MessageMetadata()
            forwarded.CopyFrom(metadata)
            forwarded.replicated_from = self.local_cluster
            self.in_flight[entry_id] = metadata.publish_time
            out.append(Outgoing(entry_id, forwarded, section.payload, entry.num_messages, metadata.publish_time))
        return out

    def _acknowledge(self, entry: Entry) -> None:
        if self.cursor.ack_individual(entry.entry_id):
            self.unreplicated = max(0, self.unreplicated - entry.num_messages)

    def _evict_over_limit(self) -> None:
        """Skip the oldest entries not yet sent until the backlog is within its limit."""
        ledger = self.topic.ledger
        while self.unreplicated > self.backlog_limit:
            entry_id = self.cursor.next_new_entry()
            if entry_id is None:
                return  # everything left is in flight
            self.cursor.read_position = entry_id + 1
            entry = ledger.get(entry_id)
            if entry is not None:
                self.stats.messages_evicted += entry.num_messages
                self._acknowledge(entry)

    # -- outcomes ----------------------------------------------------------------------------

    def confirmed(self, outgoing: Outgoing, now_ms: int) -> None:
        """The remote stored an entry (or recognised it as a duplicate)."""
        self.in_flight.pop(outgoing.entry_id, None)
        entry = self.topic.ledger.get(outgoing.entry_id)
        if entry is not None:
            self._acknowledge(entry)
        else:
            self.cursor.ack_individual(outgoing.entry_id)
        if outgoing.metadata.HasField("marker_type"):
            self.stats.markers_out += 1
        else:
            self.stats.messages_out += outgoing.num_messages
        self.stats.bytes_out += len(outgoing.payload)
        self.stats.last_lag_ms = max(0, now_ms - outgoing.publish_time_ms)

    def rewind(self) -> None:
        """A send failed or the producer went away: read again from the first unconfirmed entry."""
        if self.in_flight:
            self.stats.send_failures += 1
        self.in_flight.clear()
        self.cursor.rewind()

    # -- statistics ---------------------------------------------------------------------------

    def backlog(self) -> int:
        """Messages not yet replicated (Pulsar's replicationBacklog)."""
        return self.unreplicated

    def delay_ms(self, now_ms: int) -> int:
        """Age of the oldest message not yet replicated (Pulsar's replicationDelayInSeconds, in ms)."""
        ledger = self.topic.ledger
        entry_id = max(self.cursor.mark_delete + 1, ledger.first_entry_id)
        while entry_id <= ledger.last_entry_id:
            if not self.cursor.is_acked(entry_id):
                entry = ledger.get(entry_id)
                return max(0, now_ms - entry.publish_time) if entry is not None else 0
            entry_id += 1
        return 0


class TopicGeo:
    """Geo-replication of one topic: replicator cursors, the controller, the topic's hooks.

    ``wall_ms`` gives the publish time of markers (Unix ms) and the controller's clock.
    """

    def __init__(self, topic: Topic, settings: GeoSettings, wall_ms: Callable[[], int]) -> None:
        self.topic = topic
        self.settings = settings
        self.wall_ms = wall_ms
        self.replicators = {remote: ReplicatorCursor(topic, remote, settings.local_cluster, settings.backlog_limit)
                            for remote in settings.remotes}
        self.controller: ReplicatedSubscriptionsController | None = None
        #: Unix ms of the last data (non-marker) message published here
        self.last_data_ms = 0
        #: called after every append (the Trio replicators wait on it)
        self.wakeups: list[Callable[[], object]] = []

    # -- the topic's hooks ----------------------------------------------------------------------

    def appended(self, entry: Entry) -> None:
        if not entry.marker_type:
            self.last_data_ms = self.wall_ms()
        for replicator in self.replicators.values():
            replicator.appended(entry)
        for wake in self.wakeups:
            wake()

    def ensure_controller(self) -> ReplicatedSubscriptionsController | None:
        """The topic's controller, created on first need (None when replicated subscriptions are off)."""
        if self.controller is None and self.settings.replicated_subscriptions:
            self.controller = ReplicatedSubscriptionsController(self, self.settings.local_cluster,
                                                                self.settings.snapshots)
        return self.controller

    def marker_dispatched(self, subscription: Subscription, entry: Entry) -> None:
        """A subscription's dispatcher passed a marker: a replicated one caches a SNAPSHOT."""
        if entry.marker_type != markers.SNAPSHOT or not subscription.replicated or self.controller is None:
            return
        try:
            section = parse_payload_section(entry.section, 0)
            body = markers.decode_marker(section.metadata, section.payload).body
        except ProtocolError:
            return
        if isinstance(body, pm.ReplicatedSubscriptionsSnapshot):
            self.controller.snapshot_read(subscription.name, body)

    def mark_delete_moved(self, subscription: Subscription) -> None:
        if subscription.replicated and self.controller is not None:
            self.controller.mark_delete_advanced(subscription.name,
                                                 (self.topic.ledger.ledger_id, subscription.cursor.mark_delete))

    def marker_from_remote(self, position: Position, metadata: api.MessageMetadata, payload: bytes) -> None:
        controller = self.ensure_controller()
        if controller is None:
            return
        try:
            body = markers.decode_marker(metadata, payload).body
        except ProtocolError:
            return
        controller.received_marker(position, metadata.marker_type, body, self.wall_ms())

    def tick(self) -> None:
        """The snapshot timer (every snapshot period)."""
        if self.controller is None:
            return
        connected = all(replicator.connected() for replicator in self.replicators.values())
        self.controller.tick(self.wall_ms(), self.replicators, connected, self.last_data_ms)

    # -- ControlledTopic (what the controller does to the topic) ----------------------------------

    def write_marker(self, marker_type: int, body: Message, replicate_to: str | None) -> Position:
        metadata = markers.marker_metadata(marker_type, self.wall_ms(), replicate_to)
        section = encode_payload_section(metadata, body.SerializeToString())
        ledger = self.topic.ledger
        try:
            entry = self.topic.publish_marker(section, metadata)
        except BrokerError:
            # a terminated topic takes no markers either; as in Pulsar, the snapshot just never completes
            return ledger.ledger_id, ledger.last_entry_id
        return ledger.ledger_id, entry.entry_id

    def move_subscription(self, name: str, position: Position) -> None:
        ledger = self.topic.ledger
        if position[0] != ledger.ledger_id:
            return  # a position of a ledger this topic no longer has
        subscription = self.topic.subscriptions.get(name)
        if subscription is None:
            # as Pulsar: an update for a subscription this cluster lacks creates it (at the start)
            subscription = self.topic.subscription(name, api.CommandSubscribe.Exclusive, True, ledger.first_entry_id)
            subscription.replicated = True
        subscription.mark_delete_to(min(position[1], ledger.last_entry_id))


__all__ = ["DEFAULT_BACKLOG_LIMIT", "DEFAULT_QUEUE_SIZE", "GeoSettings", "Outgoing", "ReplicatorCursor",
           "ReplicatorStats", "TopicGeo", "Verdict", "is_marker_from", "replication_verdict"]
