"""A topic (or one partition of a partitioned topic) on the embedded broker.

A topic owns its ledger, its producers (with Pulsar's access modes), its
subscriptions, its schemas and its deduplication state; it is where a SEND
becomes an entry and where the subscriptions are told to dispatch.  Rules follow
``AbstractTopic``/``PersistentTopic``: a Shared producer is refused while an
exclusive one exists (ProducerBusy); an Exclusive producer is refused while any
other exists (ProducerFenced); WaitForExclusive is queued until the topic is
free; ExclusiveWithFencing closes every other producer; a producer name already
connected is refused (ProducerBusy).  A terminated topic takes no more messages
(TopicTerminatedError) and tells caught-up consumers REACHED_END_OF_TOPIC.
Markers the broker writes for itself (replicated subscriptions) are stored like
messages but never deduplicated; a geo-replicator's messages (producer
``pulsar.repl.*``) are deduplicated by their original producer name and sequence id.
A ``non-persistent://`` topic stores nothing, as Pulsar's ``NonPersistentTopic``: a
message goes to the consumers connected with permits as it is published and is
dropped for every subscription that has none; a new subscription (or a reader from
the earliest message) starts at the next message; its ids are 0:0.
Nothing here does I/O: producers are closed through a :class:`ProducerSink`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from proxy.broker.avro_compat import SchemaParseError, can_read, invalid_definition, parse
from proxy.broker.cursor import Cursor
from proxy.broker.ledger import Entry, Ledger
from proxy.broker.subscription import Subscription
from proxy.broker.timers import Timers
from proxy.errors import BrokerError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.markers import is_replicator

if TYPE_CHECKING:
    from proxy.broker.replication import TopicGeo

AccessMode = api.ProducerAccessMode
SHARED_ACCESS: Final = AccessMode.Shared
EXCLUSIVE_ACCESS: Final = AccessMode.Exclusive
WAIT_FOR_EXCLUSIVE: Final = AccessMode.WaitForExclusive
EXCLUSIVE_WITH_FENCING: Final = AccessMode.ExclusiveWithFencing

#: ledger id meaning "before every ledger" / "after every ledger" in a client's MessageIdData
_EARLIEST_LEDGER: Final = -1
NON_PERSISTENT: Final = "non-persistent://"
#: Schema.Type None (a Python keyword: no attribute of its own)
_NO_SCHEMA: Final = api.Schema.Type.Value("None")
_INT64_MAX: Final = (1 << 63) - 1


class ProducerSink(Protocol):
    """Where a topic's notifications for one producer go (the producer's connection)."""

    def send_close_producer(self, producer: Producer) -> None: ...

    def send_producer_ready(self, producer: Producer) -> None: ...


@dataclass(eq=False)
class Producer:
    producer_id: int
    producer_name: str
    access_mode: int
    sink: ProducerSink
    connection_id: int = 0
    request_id: int = 0
    ready: bool = True
    messages_in: int = 0
    bytes_in: int = 0


@dataclass
class SchemaVersion:
    version: int
    schema: api.Schema


@dataclass
class TopicStats:
    messages_in: int = 0
    bytes_in: int = 0
    #: (time_ns, messages_in) samples for the rate over the last seconds
    samples: list[tuple[int, int, int]] = field(default_factory=list)


def signed64(value: int) -> int:
    """A uint64 wire value as the int64 a Java broker sees."""
    return value - (1 << 64) if value >= 1 << 63 else value


class Topic:
    """One topic or partition: ledger, producers, subscriptions, schemas."""

    def __init__(self, name: str, partition_index: int, ledger_id: int, retention_bytes: int,
                 dedup: bool = False, timers: Timers | None = None, failover_delay_ms: int = 0,
                 schemas: list[SchemaVersion] | None = None) -> None:
        self.name = name
        #: a non-persistent topic stores nothing: a message goes to the consumers connected with permits
        #: when it is published, or nowhere (see :meth:`publish`)
        self.non_persistent = name.startswith(NON_PERSISTENT)
        self.partition_index = partition_index
        self.ledger = Ledger(ledger_id, retention_bytes)
        self.producers: list[Producer] = []
        self.waiting_exclusive: list[Producer] = []
        self.subscriptions: dict[str, Subscription] = {}
        #: the schema history, shared with the other partitions of the topic (the cluster's, by schema name)
        self.schemas: list[SchemaVersion] = [] if schemas is None else schemas
        self.dedup_enabled = dedup
        self.last_sequence: dict[str, int] = {}
        self.terminated = False
        self.exclusive_producer: str | None = None
        self.epoch = 0
        self.stats = TopicStats()
        #: the cluster's: when a delayed message is due (its Shared and Key_Shared subscriptions hold it until then)
        self.timers = timers or Timers()
        #: how long a Failover subscription's newly active consumer waits (the cluster's setting; see ClusterConfig)
        self.failover_delay_ms = failover_delay_ms
        #: geo-replication of this topic (None unless the cluster replicates; see proxy.broker.replication)
        self.geo: TopicGeo | None = None

    # -- producers ----------------------------------------------------------------

    def add_producer(self, producer: Producer) -> None:
        """Register a producer, enforcing access modes; may leave it waiting (not ready)."""
        if self.terminated:
            raise BrokerError("TopicTerminatedError", "Topic was already terminated")
        mode = producer.access_mode
        others = [p for p in self.producers if p is not producer]
        if mode == SHARED_ACCESS:
            if self.exclusive_producer is not None or self.waiting_exclusive:
                raise BrokerError("ProducerBusy",
                                  f"Topic has an existing exclusive producer: {self.exclusive_producer}")
        elif mode == EXCLUSIVE_ACCESS:
            if self.exclusive_producer is not None or self.waiting_exclusive:
                raise BrokerError("ProducerFenced",
                                  f"Topic has an existing exclusive producer: {self.exclusive_producer}")
            if others:
                raise BrokerError("ProducerFenced", "Topic has existing shared producers")
        elif mode == EXCLUSIVE_WITH_FENCING:
            for waiting in self.waiting_exclusive:
                waiting.sink.send_close_producer(waiting)
            self.waiting_exclusive.clear()
            for other in others:
                other.sink.send_close_producer(other)
                self.producers.remove(other)
        elif mode == WAIT_FOR_EXCLUSIVE:
            if self.exclusive_producer is not None or others:
                producer.ready = False
                self.waiting_exclusive.append(producer)
                return
        else:
            raise BrokerError("UnknownError", f"Invalid producer access mode: {mode}")
        self._check_name(producer)
        if mode != SHARED_ACCESS:
            self.exclusive_producer = producer.producer_name
            self.epoch += 1
        producer.ready = True
        self.producers.append(producer)

    def _check_name(self, producer: Producer) -> None:
        for other in self.producers:
            if other.producer_name == producer.producer_name and other is not producer:
                raise BrokerError("ProducerBusy", f"Producer with name '{producer.producer_name}' "
                                                  f"is already connected to topic '{self.name}'")

    def remove_producer(self, producer: Producer) -> None:
        if producer in self.waiting_exclusive:
            self.waiting_exclusive.remove(producer)
            return
        if producer not in self.producers:
            return
        self.producers.remove(producer)
        if self.exclusive_producer == producer.producer_name:
            self.exclusive_producer = None
        self._promote_waiting()

    def _promote_waiting(self) -> None:
        if self.producers or not self.waiting_exclusive:
            return
        nxt = self.waiting_exclusive.pop(0)
        self.exclusive_producer = nxt.producer_name
        self.epoch += 1
        nxt.ready = True
        self.producers.append(nxt)
        nxt.sink.send_producer_ready(nxt)

    def last_sequence_id(self, producer_name: str) -> int:
        return self.last_sequence.get(producer_name, -1) if self.dedup_enabled else -1

    # -- publishing ---------------------------------------------------------------

    def publish(self, producer: Producer, section: bytes, metadata: api.MessageMetadata,
                num_messages: int, now_ns: int) -> Entry | None:
        """Store a SEND's payload section; None when deduplication drops it as a repeat."""
        if self.terminated:
            raise BrokerError("TopicTerminatedError", "Topic was already terminated")
        if not producer.ready:
            raise BrokerError("ProducerBusy", "Producer is not ready to publish (waiting for exclusive access)")
        if self.dedup_enabled and not self.non_persistent and not metadata.HasField("marker_type"):
            # (markers are never deduplicated, nor are a non-persistent topic's messages)
            # a replicator's messages are deduplicated by their original producer name, as
            # Pulsar does for producers named pulsar.repl.* (its "replication dedup V1")
            name = metadata.producer_name if is_replicator(producer.producer_name) else producer.producer_name
            highest = metadata.highest_sequence_id if metadata.HasField("highest_sequence_id") else 0
            highest = max(highest, metadata.sequence_id)
            last = self.last_sequence.get(name, -1)
            if metadata.sequence_id <= last:
                return None
            self.last_sequence[name] = highest
        entry = self.ledger.append(section, metadata)
        producer.messages_in += entry.num_messages
        producer.bytes_in += entry.size
        self.stats.messages_in += entry.num_messages
        self.stats.bytes_in += entry.size
        self._sample(now_ns)
        self._appended(entry)
        if self.non_persistent:
            for subscription in self.subscriptions.values():
                subscription.drop_undelivered()
        return entry

    def publish_marker(self, section: bytes, metadata: api.MessageMetadata) -> Entry:
        """Store a marker the broker writes for itself (replicated subscriptions)."""
        if self.terminated:
            raise BrokerError("TopicTerminatedError", "Topic was already terminated")
        entry = self.ledger.append(section, metadata)
        self._appended(entry)
        return entry

    def _appended(self, entry: Entry) -> None:
        for subscription in list(self.subscriptions.values()):
            subscription.dispatch()
        if self.geo is not None:
            self.geo.appended(entry)

    # -- what subscriptions tell the topic (geo-replication listens) ---------------------

    def marker_dispatched(self, subscription: Subscription, entry: Entry) -> None:
        if self.geo is not None:
            self.geo.marker_dispatched(subscription, entry)

    def mark_delete_moved(self, subscription: Subscription) -> None:
        if self.geo is not None:
            self.geo.mark_delete_moved(subscription)

    def _sample(self, now_ns: int) -> None:
        samples = self.stats.samples
        if not samples or now_ns - samples[-1][0] >= 100_000_000:
            samples.append((now_ns, self.stats.messages_in, self.stats.bytes_in))
            while len(samples) > 2 and now_ns - samples[1][0] > 10_000_000_000:
                samples.pop(0)

    def rates(self, now_ns: int) -> tuple[float, float]:
        """Messages and bytes per second published over the last ~10 seconds."""
        samples = self.stats.samples
        if not samples:
            return 0.0, 0.0
        t0, m0, b0 = samples[0]
        elapsed = max((now_ns - t0) / 1e9, 1.0)
        return (self.stats.messages_in - m0) / elapsed, (self.stats.bytes_in - b0) / elapsed

    # -- subscriptions --------------------------------------------------------------

    def start_position(self, message_id: api.MessageIdData | None, initial_earliest: bool) -> int:
        """The entry id a new cursor reads next, from a start message id or an initial position.

        (A non-persistent topic has nothing to read from before: only what comes next.)
        """
        if self.non_persistent:
            return self.ledger.next_entry_id
        if message_id is None:
            return self.ledger.first_entry_id if initial_earliest else self.ledger.next_entry_id
        ledger_id = signed64(message_id.ledgerId)
        entry_id = signed64(message_id.entryId)
        if ledger_id < self.ledger.ledger_id or (ledger_id == _EARLIEST_LEDGER):
            return self.ledger.first_entry_id
        if ledger_id > self.ledger.ledger_id or entry_id == _INT64_MAX:
            return self.ledger.next_entry_id
        # As Pulsar's broker does (it takes every start id as a batch id and steps back one entry),
        # the start entry itself is delivered: the client drops the start message unless its
        # start is inclusive, and inside a batch the messages up to the given batch index.
        return max(entry_id, self.ledger.first_entry_id)

    def subscription(self, name: str, sub_type: int, durable: bool, start_entry: int) -> Subscription:
        existing = self.subscriptions.get(name)
        if existing is not None:
            return existing
        cursor = Cursor(self.ledger, start_entry - 1)
        sub = Subscription(self, name, sub_type, durable, cursor)
        self.subscriptions[name] = sub
        return sub

    def remove_subscription(self, name: str) -> None:
        self.subscriptions.pop(name, None)

    # -- lifecycle --------------------------------------------------------------------

    def unload(self) -> None:
        """Close every producer and consumer (they re-lookup and come back), as a bundle unload does."""
        for producer in self.producers + self.waiting_exclusive:
            producer.sink.send_close_producer(producer)
        self.producers.clear()
        self.waiting_exclusive.clear()
        self.exclusive_producer = None
        for name, sub in list(self.subscriptions.items()):
            for consumer in list(sub.consumers):
                consumer.sink.send_close_consumer(consumer)
                sub.remove_consumer(consumer)
            if not sub.durable:
                del self.subscriptions[name]

    def terminate(self) -> tuple[int, int]:
        """Refuse further messages; returns the last message id (ledger, entry)."""
        self.terminated = True
        for sub in self.subscriptions.values():
            sub.dispatch()
        return self.ledger.ledger_id, self.ledger.last_entry_id

    # -- schemas ----------------------------------------------------------------------

    def take_consumer_schema(self, schema: api.Schema) -> None:
        """A subscribing consumer's schema, as Pulsar's broker takes it: stored when the topic is idle (no
        schema, no message, nobody on it), checked against the latest otherwise (BACKWARD: the same type, and
        an AVRO or JSON definition that reads what the latest wrote, even when the consumer's equals an
        older version); a topic in use without a schema refuses one.  AUTO_CONSUME (the consumer takes
        the topic's) and none are not checked."""
        if schema.type in (api.Schema.Type.AutoConsume, _NO_SCHEMA):
            return
        if self.schemas:
            _check_compatible(self.schemas[-1].schema, schema, both_ways=False)
            return
        if self.ledger.next_entry_id > 0 or self.producers or any(sub.consumers for sub in
                                                                  self.subscriptions.values()):
            raise BrokerError("IncompatibleSchema", "Failed to add schema to an active topic with empty(BYTES) "
                                                    f"schema: new schema type {_type_name(schema.type)}")
        # stored unvalidated: the real broker takes a consumer's {"foo": 1} on an idle topic
        self.add_schema(schema, validate=False)

    def add_schema(self, schema: api.Schema, validate: bool = True) -> int:
        """Store a schema (or find an identical one) and return its version.

        A schema identical to any stored version gets that version.  Any other AVRO or JSON definition
        must be one the broker can store (``avro_compat.invalid_definition``), and is checked against the
        topic's latest as Pulsar's default strategy (FULL) checks it: the same type, and an AVRO or JSON
        definition that reads what the latest wrote and the other way round; else IncompatibleSchema.
        """
        for stored in self.schemas:
            if (stored.schema.type == schema.type and stored.schema.schema_data == schema.schema_data
                    and list(stored.schema.properties) == list(schema.properties)):
                return stored.version
        if validate and schema.type in _AVRO_CHECKED:
            problem = invalid_definition(_type_name(schema.type), bytes(schema.schema_data))
            if problem is not None:
                raise BrokerError("IncompatibleSchema", problem)
        if self.schemas:
            _check_compatible(self.schemas[-1].schema, schema, both_ways=True)
        version = len(self.schemas)
        copy = api.Schema()
        copy.CopyFrom(schema)
        self.schemas.append(SchemaVersion(version, copy))
        return version


def schema_version(schemas: list[SchemaVersion], version: int | None) -> SchemaVersion | None:
    """``version`` of a schema history (None: the latest), or None when it has no such version."""
    if version is None:
        return schemas[-1] if schemas else None
    return next((stored for stored in schemas if stored.version == version), None)


#: the types whose definitions Pulsar checks with Avro's resolution rules (a JSON schema carries an Avro definition)
_AVRO_CHECKED: Final = frozenset({api.Schema.Type.Avro, api.Schema.Type.Json})


def _check_compatible(latest: api.Schema, new: api.Schema, both_ways: bool) -> None:
    """Refuse ``new`` with IncompatibleSchema unless it is compatible with ``latest``: FULL (``both_ways``,
    a producer's) or BACKWARD (a consumer's: ``new`` reads what ``latest`` wrote), in Pulsar's words."""
    if latest.type != new.type:
        raise BrokerError("IncompatibleSchema", f"Incompatible schema: exists schema type {_type_name(latest.type)}"
                                                f", new schema type {_type_name(new.type)}")
    if new.type not in _AVRO_CHECKED:
        return
    strategy = "FULL" if both_ways else "BACKWARD"
    prefix = ("org.apache.pulsar.broker.service.schema.exceptions.IncompatibleSchemaException: Error during schema "
              f"compatibility check with strategy {strategy}: ")
    try:
        old, fresh = parse(latest.schema_data), parse(new.schema_data)
    except SchemaParseError as exc:
        raise BrokerError("IncompatibleSchema", f"{prefix}org.apache.avro.SchemaParseException: {exc}") from exc
    directions = [(fresh, old, new, latest)] + ([(old, fresh, latest, new)] if both_ways else [])
    for reader, writer, reader_text, writer_text in directions:
        if can_read(reader, writer) is not None:
            raise BrokerError("IncompatibleSchema", f"{prefix}org.apache.avro.SchemaValidationException: Unable to "
                                                    f"read schema: \n{_definition(writer_text)}\nusing schema:\n"
                                                    f"{_definition(reader_text)}")


def _definition(schema: api.Schema) -> str:
    return bytes(schema.schema_data).decode("utf-8", "replace")


def _type_name(value: int) -> str:
    """A schema type as Pulsar's broker names it in its errors (JSON, STRING, ...)."""
    return str(api.Schema.Type.Name(value)).upper()
