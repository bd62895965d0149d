"""Subscriptions and their consumers: dispatch, permits, acknowledgements, redelivery.

Pulsar semantics this module reproduces (``Consumer``, ``PersistentDispatcher*``):

- **Permits.** A consumer's FLOW adds message permits.  An entry is dispatched to a
  consumer that has any permit left and costs as many permits as it holds messages
  (a batch of 10 costs 10); permits may go negative, as on a real broker.
- **Exclusive / Failover** have one active consumer (Failover picks it by priority,
  then name and, on a non-partitioned topic, the topic name's hash; see
  :mod:`proxy.broker.selectors`); redelivery rewinds the cursor to
  the first unacknowledged entry.
- **Shared** dispatches round-robin over the consumers with permits, and stops a
  consumer at ``max_unacked_messages`` unacknowledged messages.
- **Key_Shared** sends every entry to the owner of its key's hash range; an entry
  whose owner cannot take it waits in the replay set, and that owner gets no newer
  entries before it, which keeps per-key order.  A consumer that joins late only
  gets entries older than the read position at its arrival until everything before
  that position is acknowledged (Pulsar's "recently joined consumers").
- **Redelivery** (REDELIVER_UNACKNOWLEDGED_MESSAGES, a consumer leaving with
  unacknowledged messages) puts entries back into the replay set and, for Shared and
  Key_Shared, counts ``redelivery_count`` per entry; Exclusive and Failover report 0, as
  Pulsar's single-active-consumer dispatchers track no redeliveries.
- **Markers** (entries with ``marker_type``) are never delivered: the dispatcher
  acknowledges them as it passes them and tells the topic (a replicated
  subscription keeps the snapshots it passes); the topic also hears whenever the
  mark-delete position moves (replicated subscriptions, see
  :mod:`proxy.broker.replicated_subscriptions`).

Nothing here does I/O: messages and notifications go to a :class:`ConsumerSink`,
implemented by the per-connection broker session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from proxy.broker.cursor import Cursor
from proxy.broker.ledger import Entry
from proxy.broker.naming import sticky_key_hash
from proxy.broker.selectors import ConflictingRange, KeySharedSelector, failover_active
from proxy.errors import BrokerError
from proxy.pb import PulsarApi_pb2 as api

if TYPE_CHECKING:
    from proxy.broker.topic import Topic

SubType = api.CommandSubscribe.SubType
EXCLUSIVE: Final = SubType.Exclusive
SHARED: Final = SubType.Shared
FAILOVER: Final = SubType.Failover
KEY_SHARED: Final = SubType.Key_Shared

#: Pulsar's maxUnackedMessagesPerConsumer default.
DEFAULT_MAX_UNACKED: Final = 50_000
#: Key_Shared: how many entries may wait for a busy key owner before reading pauses.
MAX_KEY_SHARED_REPLAY: Final = 1000
#: Pulsar's ``delayedDeliveryTickTimeMillis`` (its default): a delayed message due within it goes at once
DELAYED_DELIVERY_TICK_MS: Final = 1000
_NONE_KEY: Final = b"NONE_KEY"


class ConsumerSink(Protocol):
    """Where a subscription's output for one consumer goes (the consumer's connection)."""

    def send_message(self, consumer: Consumer, entry: Entry, redelivery_count: int,
                     ack_set: list[int] | None) -> None: ...

    def send_active_consumer_change(self, consumer: Consumer, is_active: bool) -> None: ...

    def send_reached_end_of_topic(self, consumer: Consumer) -> None: ...

    def send_close_consumer(self, consumer: Consumer) -> None: ...


@dataclass(eq=False)
class Consumer:
    """One consumer attached to a subscription."""

    consumer_id: int
    consumer_name: str
    priority_level: int
    sink: ConsumerSink
    connection_id: int = 0
    permits: int = 0
    #: entry id -> messages in it, for entries dispatched to this consumer and not acked
    pending: dict[int, int] = field(default_factory=dict)
    unacked_messages: int = 0
    is_active: bool | None = None
    #: Key_Shared: entries at or after this id are held back until earlier ones are acked
    join_position: int | None = None
    end_of_topic_sent: bool = False
    #: the client's consumer epoch (Exclusive/Failover); MESSAGEs carry it so the
    #: client can drop what was in flight before its last redeliver-all
    epoch: int | None = None
    messages_out: int = 0
    bytes_out: int = 0

    def can_take(self, max_unacked: int, shared: bool) -> bool:
        if self.permits <= 0:
            return False
        return not (shared and max_unacked > 0 and self.unacked_messages >= max_unacked)


class Subscription:
    """A named subscription on one topic (partition)."""

    def __init__(self, topic: Topic, name: str, sub_type: int, durable: bool, cursor: Cursor,
                 max_unacked: int = DEFAULT_MAX_UNACKED) -> None:
        self.topic = topic
        self.name = name
        self.sub_type = sub_type
        self.durable = durable
        self.cursor = cursor
        self.max_unacked = max_unacked
        self.consumers: list[Consumer] = []
        self.redelivery_counts: dict[int, int] = {}
        self._owner: dict[int, Consumer] = {}
        #: Shared and Key_Shared: entries read past because they are to be delivered later (see _held_back)
        self._delayed: set[int] = set()
        self._round_robin = 0
        self._selector: KeySharedSelector[Consumer] = KeySharedSelector()
        self._active: Consumer | None = None
        #: when the Failover subscription's active consumer may get messages (ms, the timers' clock)
        self._active_from_ms = 0
        self.messages_out = 0
        self.bytes_out = 0
        #: replicate_subscription_state: the mark-delete position follows to other clusters
        self.replicated = False

    @property
    def is_shared(self) -> bool:
        return self.sub_type in (SHARED, KEY_SHARED)

    # -- consumers --------------------------------------------------------------

    def add_consumer(self, consumer: Consumer, sub_type: int,
                     sticky_ranges: list[tuple[int, int]] | None = None) -> None:
        if sub_type != self.sub_type:
            if self.consumers:
                raise BrokerError("ConsumerBusy", "Subscription is of different type")
            self.sub_type = sub_type
        if self.sub_type == EXCLUSIVE and self.consumers:
            raise BrokerError("ConsumerBusy", "Exclusive consumer is already connected")
        if self.sub_type == KEY_SHARED:
            try:
                if sticky_ranges:
                    self._selector.add_sticky(consumer, sticky_ranges)
                else:
                    self._selector.add_auto(consumer)
            except ConflictingRange as exc:
                raise BrokerError("ConsumerAssignError", str(exc)) from None
            if self.consumers and self.cursor.read_position > self.cursor.mark_delete + 1:
                consumer.join_position = self.cursor.read_position
        self.consumers.append(consumer)
        if self.sub_type == FAILOVER:
            self._update_active()
        self.dispatch()

    def remove_consumer(self, consumer: Consumer) -> None:
        """A consumer closed or its connection went: its unacked entries go to the others."""
        if consumer not in self.consumers:
            return
        self.consumers.remove(consumer)
        if self.sub_type == KEY_SHARED:
            self._selector.remove(consumer)
        if self.is_shared:
            for entry_id in sorted(consumer.pending):
                self._owner.pop(entry_id, None)
                self._redeliver_entry(entry_id)
        elif consumer.pending:
            self._rewind()
        consumer.pending.clear()
        consumer.unacked_messages = 0
        if self._active is consumer:
            self._active = None
        if self.sub_type == FAILOVER:
            self._update_active()
        self.dispatch()

    def _update_active(self) -> None:
        active = failover_active(self.consumers, self.topic.partition_index, self.topic.name)
        previous = self._active
        self._active = active
        delay = self.topic.failover_delay_ms
        if active is not previous and active is not None and delay > 0:
            # Pulsar's single-active-consumer dispatcher reads for a newly active consumer (the first one
            # too) only after activeConsumerFailoverDelayTimeMillis
            timers = self.topic.timers
            self._active_from_ms = timers.clock() + delay
            timers.call_at(self._active_from_ms, self.dispatch)
        if active is not previous and previous is not None and previous.pending:
            for entry_id in previous.pending:
                self._owner.pop(entry_id, None)
            previous.pending.clear()
            previous.unacked_messages = 0
            self._rewind()
        # also when the active consumer stays: one that just joined (is_active None)
        # must hear that it is standing by, as a Pulsar broker tells it
        for consumer in self.consumers:
            is_active = consumer is active
            if consumer.is_active != is_active:
                consumer.is_active = is_active
                consumer.sink.send_active_consumer_change(consumer, is_active)

    def _rewind(self) -> None:
        # (no redelivery_count: Pulsar's single-active-consumer dispatchers count none)
        for consumer in self.consumers:
            for entry_id in consumer.pending:
                self._owner.pop(entry_id, None)
            consumer.pending.clear()
            consumer.unacked_messages = 0
        self.cursor.rewind()

    # -- flow, acknowledgements, redelivery ---------------------------------------

    def flow(self, consumer: Consumer, permits: int) -> None:
        consumer.permits += permits
        self.dispatch()

    def ack(self, consumer: Consumer, ack_type: int, message_ids: list[api.MessageIdData]) -> None:
        mark_delete = self.cursor.mark_delete
        try:
            self._ack(ack_type, message_ids)
        finally:
            if self.cursor.mark_delete != mark_delete:
                self.topic.mark_delete_moved(self)
        self.dispatch()

    def mark_delete_to(self, entry_id: int) -> None:
        """Acknowledge everything up to ``entry_id`` on the subscription's behalf (a replicated update)."""
        mark_delete = self.cursor.mark_delete
        for done in self.cursor.ack_cumulative(entry_id):
            self._forget(done)
        for owned in [e for e in self._owner if e <= entry_id]:
            self._forget(owned)
        if self.cursor.mark_delete != mark_delete:
            self.topic.mark_delete_moved(self)
        self.dispatch()

    def _ack(self, ack_type: int, message_ids: list[api.MessageIdData]) -> None:
        if ack_type == api.CommandAck.Cumulative:
            if self.is_shared:
                raise BrokerError("ActionNotAllowed", "Cumulative ack is not allowed for Shared subscriptions")
            for mid in message_ids[-1:]:
                entry_id = self._entry_of(mid)
                if entry_id is None:
                    continue
                entry = self.topic.ledger.get(entry_id)
                if mid.ack_set and entry is not None and entry.batched:
                    # a cumulative ack inside a batch acknowledges the batch's head only
                    self._ack_batch_part(entry_id, list(mid.ack_set), entry.num_messages)
                    entry_id -= 1
                for done in self.cursor.ack_cumulative(entry_id):
                    self._forget(done)
                for owned in [e for e in self._owner if e <= entry_id]:
                    self._forget(owned)
        else:
            for mid in message_ids:
                entry_id = self._entry_of(mid)
                if entry_id is None:
                    continue
                entry = self.topic.ledger.get(entry_id)
                if mid.ack_set and entry is not None and entry.batched:
                    self._ack_batch_part(entry_id, list(mid.ack_set), entry.num_messages)
                elif self.cursor.ack_individual(entry_id) or entry_id in self._owner:
                    self._forget(entry_id)

    def _entry_of(self, mid: api.MessageIdData) -> int | None:
        """The entry a client's message id names, or None when it names none of this topic's."""
        ledger = self.topic.ledger
        entry_id = mid.entryId - (1 << 64) if mid.entryId >= 1 << 63 else mid.entryId
        if mid.ledgerId != ledger.ledger_id or entry_id < 0 or entry_id > ledger.last_entry_id:
            return None
        return int(entry_id)

    def _ack_batch_part(self, entry_id: int, ack_set: list[int], batch_size: int) -> None:
        # ack_set is a java.util.BitSet as longs: a set bit is a message NOT yet acknowledged
        acked = {i for i in range(batch_size) if not (ack_set[i // 64] >> (i % 64)) & 1
                 } if len(ack_set) * 64 >= batch_size else set()
        if self.cursor.ack_batch_indexes(entry_id, acked, batch_size):
            self._forget(entry_id)

    def _forget(self, entry_id: int) -> None:
        owner = self._owner.pop(entry_id, None)
        if owner is not None:
            count = owner.pending.pop(entry_id, 0)
            owner.unacked_messages -= count
        self.redelivery_counts.pop(entry_id, None)

    def redeliver(self, consumer: Consumer, entry_ids: list[int] | None) -> None:
        """REDELIVER_UNACKNOWLEDGED_MESSAGES: all of the consumer's, or the listed entries (none on a
        non-persistent topic: nothing is kept to deliver again)."""
        if self.topic.non_persistent:
            return
        if not self.is_shared:
            # Exclusive and Failover always redeliver everything, by rewinding
            if self._active is None or consumer is self._active or self.sub_type == EXCLUSIVE:
                self._rewind()
        else:
            targets = sorted(consumer.pending) if entry_ids is None else sorted(set(entry_ids))
            for entry_id in targets:
                if self._owner.get(entry_id) is consumer:
                    self._owner.pop(entry_id)
                    consumer.unacked_messages -= consumer.pending.pop(entry_id, 0)
                    self._redeliver_entry(entry_id)
        self.dispatch()

    def _redeliver_entry(self, entry_id: int) -> None:
        if self.cursor.is_acked(entry_id):
            return
        self.redelivery_counts[entry_id] = self.redelivery_counts.get(entry_id, 0) + 1
        self.cursor.replay(entry_id)

    def seek(self, entry_id: int) -> None:
        """Reset the cursor; the consumers are disconnected and come back (as Pulsar does).

        On a non-persistent topic there is nothing to go back to: nothing happens (nobody is disconnected).
        """
        if self.topic.non_persistent:
            return
        for consumer in list(self.consumers):
            consumer.sink.send_close_consumer(consumer)
        for consumer in list(self.consumers):
            self.remove_consumer(consumer)
        self._owner.clear()
        self.redelivery_counts.clear()
        self._delayed.clear()  # (read again from the new position, and held again if still early)
        self.cursor.reset(entry_id)

    def drop_undelivered(self) -> None:
        """A non-persistent topic's: what the consumers could not take as it was published is gone."""
        self.cursor.ack_cumulative(self.topic.ledger.last_entry_id)
        self.cursor.replay_ids()  # (purges the acknowledged: a Key_Shared consumer's blocked ones)

    # -- dispatch ---------------------------------------------------------------

    def dispatch(self) -> None:
        """Send whatever the consumers' permits allow."""
        if not self.consumers:
            return
        if self.sub_type == SHARED:
            self._dispatch_shared()
        elif self.sub_type == KEY_SHARED:
            self._dispatch_key_shared()
        else:
            active = self._active if self.sub_type == FAILOVER else self.consumers[0]
            if active is not None and (self.sub_type != FAILOVER or self.topic.timers.clock() >= self._active_from_ms):
                self._dispatch_single(active)
        if self.topic.terminated:
            self._notify_end_of_topic()

    def _send(self, consumer: Consumer, entry_id: int) -> bool:
        entry = self.topic.ledger.get(entry_id)
        if entry is None:
            return False
        ack_set: list[int] | None = None
        partly = self.cursor.batch_acked.get(entry_id)
        if partly:
            words = [0] * ((entry.num_messages + 63) // 64)
            for i in range(entry.num_messages):
                if i not in partly:
                    words[i // 64] |= 1 << (i % 64)
            ack_set = [w - (1 << 64) if w >= 1 << 63 else w for w in words]
        consumer.permits -= entry.num_messages
        if self.topic.non_persistent:  # (sent is done with: nothing is kept to deliver again)
            self.cursor.ack_individual(entry_id)
        else:
            consumer.pending[entry_id] = entry.num_messages
            consumer.unacked_messages += entry.num_messages
            self._owner[entry_id] = consumer
        consumer.messages_out += entry.num_messages
        consumer.bytes_out += entry.size
        self.messages_out += entry.num_messages
        self.bytes_out += entry.size
        consumer.sink.send_message(consumer, entry, self.redelivery_counts.get(entry_id, 0), ack_set)
        return True

    def _next_new_entry(self) -> int | None:
        """The next never-dispatched entry, passing over markers (acknowledged, never delivered)."""
        while True:
            entry_id = self.cursor.next_new_entry()
            if entry_id is None:
                return None
            entry = self.topic.ledger.get(entry_id)
            if entry is None or not entry.marker_type:
                return entry_id
            self.cursor.read_position = entry_id + 1
            mark_delete = self.cursor.mark_delete
            self.cursor.ack_individual(entry_id)
            self.topic.marker_dispatched(self, entry)
            if self.cursor.mark_delete != mark_delete:
                self.topic.mark_delete_moved(self)

    def _next_replay(self) -> int | None:
        if not self.cursor.has_replay:
            return None
        ids = self.cursor.replay_ids()
        return ids[0] if ids else None

    def _dispatch_single(self, consumer: Consumer) -> None:
        while consumer.can_take(0, False):
            replay = self._next_replay()
            if replay is not None:
                self.cursor.take_replay(replay)
                self._send(consumer, replay)
                continue
            entry_id = self._next_new_entry()
            if entry_id is None:
                return
            self.cursor.read_position = entry_id + 1
            self._send(consumer, entry_id)

    def _next_shared_consumer(self) -> Consumer | None:
        count = len(self.consumers)
        for step in range(count):
            consumer = self.consumers[(self._round_robin + step) % count]
            if consumer.can_take(self.max_unacked, True):
                self._round_robin = (self._round_robin + step + 1) % count
                return consumer
        return None

    def _dispatch_shared(self) -> None:
        while True:
            consumer = self._next_shared_consumer()
            if consumer is None:
                return
            replay = self._next_replay()
            if replay is not None:
                self.cursor.take_replay(replay)
                self._send(consumer, replay)
                continue
            entry_id = self._next_new_entry()
            if entry_id is None or self._held_back(entry_id):
                # give the turn back so the next message starts with the same consumer
                self._round_robin = (self._round_robin - 1) % len(self.consumers)
                if entry_id is None:
                    return
                continue
            self.cursor.read_position = entry_id + 1
            self._send(consumer, entry_id)

    def _held_back(self, entry_id: int) -> bool:
        """Whether a new entry of a Shared or Key_Shared subscription is to be delivered later.

        As Pulsar's broker (its delayed-delivery tracker): the entry is read past, so what
        follows goes on, and comes back to be dispatched first once due.  Like the tracker
        by default (``isDelayedDeliveryDeliverAtTimeStrict=false``), an entry due within a
        tick is not held.  Exclusive and Failover subscriptions deliver it at once, as
        there; so does a non-persistent topic.
        """
        entry = self.topic.ledger.get(entry_id)
        if entry is None or not entry.deliver_at_ms or self.topic.non_persistent:
            return False
        timers = self.topic.timers
        if entry.deliver_at_ms <= timers.clock() + DELAYED_DELIVERY_TICK_MS:
            return False
        self.cursor.read_position = entry_id + 1
        self._delayed.add(entry_id)
        timers.call_at(entry.deliver_at_ms, lambda: self._delay_over(entry_id))
        return True

    def _delay_over(self, entry_id: int) -> None:
        if entry_id in self._delayed:  # (not when a seek has forgotten it)
            self._delayed.discard(entry_id)
            self.cursor.replay(entry_id)
            self.dispatch()

    def _key_owner(self, entry_id: int) -> Consumer | None:
        entry = self.topic.ledger.get(entry_id)
        if entry is None:
            return None
        return self._selector.select(sticky_key_hash(entry.sticky_key or _NONE_KEY))

    def _may_take(self, consumer: Consumer, entry_id: int) -> bool:
        if consumer.join_position is not None:
            if self.cursor.mark_delete >= consumer.join_position - 1:
                consumer.join_position = None
            elif entry_id >= consumer.join_position:
                return False
        return consumer.can_take(self.max_unacked, True)

    def _dispatch_key_shared(self) -> None:
        blocked: set[int] = set()
        if self.cursor.has_replay:
            for replay_id in self.cursor.replay_ids():
                owner = self._key_owner(replay_id)
                if owner is None:
                    self.cursor.take_replay(replay_id)
                    continue
                if id(owner) not in blocked and self._may_take(owner, replay_id):
                    self.cursor.take_replay(replay_id)
                    self._send(owner, replay_id)
                else:
                    blocked.add(id(owner))
        while True:
            if not any(c.can_take(self.max_unacked, True) and id(c) not in blocked for c in self.consumers):
                return
            new_id = self._next_new_entry()
            if new_id is None:
                return
            if self._held_back(new_id):
                continue
            owner = self._key_owner(new_id)
            self.cursor.read_position = new_id + 1
            if owner is None:
                continue
            if id(owner) not in blocked and self._may_take(owner, new_id):
                self._send(owner, new_id)
            else:
                blocked.add(id(owner))
                self.cursor.replay(new_id)
                if len(self.cursor.replay_ids()) >= MAX_KEY_SHARED_REPLAY:
                    return

    def _notify_end_of_topic(self) -> None:
        ledger = self.topic.ledger
        if self.cursor.has_replay or self.cursor.read_position < ledger.next_entry_id:
            return
        for consumer in self.consumers:
            if not consumer.end_of_topic_sent:
                consumer.end_of_topic_sent = True
                consumer.sink.send_reached_end_of_topic(consumer)

    # -- statistics ---------------------------------------------------------------

    def backlog(self) -> int:
        return self.cursor.backlog()

    def unacked(self) -> int:
        return sum(c.unacked_messages for c in self.consumers)
