"""The consumer, on Trio (C++ ``ConsumerImpl`` and ``MultiTopicsConsumerImpl``).

Pulsar protocol, "Consumer": SUBSCRIBE (subscription type, initial position,
durable or not, a start message id for readers) is answered by SUCCESS; the
consumer then grants FLOW permits and the broker pushes MESSAGE frames.  Each
MESSAGE is checked (CRC32C), reassembled if chunked, decompressed and split into
its batch's messages (:mod:`proxy.protocol.message`), and queued in the
:class:`ReceiveQueue`.  Taking messages out refills permits at half the queue
(:class:`~proxy.client.flow.FlowControl`).  Acknowledgements go out as ACK
(batches once wholly acked, see :mod:`proxy.client.acks`); negative acks become
REDELIVER_UNACKNOWLEDGED_MESSAGES after the redelivery delay.

Reconnection: after a broken connection or CLOSE_CONSUMER (topic unload) the
consumer looks the topic up again and re-subscribes with backoff.  Messages still
in the receive queue from before are dropped — the broker redelivers everything
not acknowledged — and permits start afresh.  A non-durable consumer (a reader)
re-subscribes from the last message it handed out, so it neither loses nor repeats
messages.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import trio

from proxy.client.acks import AckGroup, BatchAckTracker, NegativeAckTracker
from proxy.client.connection import ClientConnection
from proxy.client.flow import FlowControl
from proxy.client.message import EARLIEST, LATEST, Message, MessageId
from proxy.client.names import partition_index
from proxy.client.reconnecting import ReconnectingHandle
from proxy.errors import ClientClosed, ClientError, ConnectionFailed, ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.chunks import ChunkAssembler, is_chunk
from proxy.protocol.commands import T
from proxy.protocol.message import decode_messages

if TYPE_CHECKING:
    from proxy.client.client import PulsarClient

log = logging.getLogger(__name__)

MAX_TRACKED_CHUNKED_MESSAGES: Final = 10_000
SUBSCRIPTION_TYPES: Final = {v.name: v.number for v in api.CommandSubscribe.SubType.DESCRIPTOR.values}
INITIAL_POSITIONS: Final = {v.name: v.number for v in api.CommandSubscribe.InitialPosition.DESCRIPTOR.values}
NON_RETRYABLE: Final = frozenset({
    "AuthenticationError", "AuthorizationError", "ConsumerBusy", "TopicNotFound", "SubscriptionNotFound",
    "IncompatibleSchema", "NotAllowedError", "InvalidTopicName", "UnsupportedVersionError",
    "ConsumerAssignError",
})


@dataclass(slots=True)
class ConsumerConfig:
    """A consumer's settings; defaults are the official clients'."""

    subscription_type: str = "Exclusive"
    initial_position: str = "Latest"
    consumer_name: str | None = None
    receiver_queue_size: int = 1000
    negative_ack_redelivery_delay: float = 60.0
    #: acknowledgements are sent in groups this often (0: each at once), as ackGroupingTime
    ack_group_time: float = 0.1
    ack_group_max_size: int = 1000
    durable: bool = True
    start_message_id: MessageId | None = None
    start_inclusive: bool = False
    read_compacted: bool = False
    priority_level: int | None = None
    properties: dict[str, str] = field(default_factory=dict)
    #: geo-replication: the subscription's position follows to the other clusters
    replicate_subscription_state: bool = False

    def __post_init__(self) -> None:
        if self.subscription_type not in SUBSCRIPTION_TYPES:
            raise ClientError(f"unknown subscription type {self.subscription_type!r}; "
                              f"choose one of {', '.join(SUBSCRIPTION_TYPES)}")
        if self.initial_position not in INITIAL_POSITIONS:
            raise ClientError(f"unknown initial position {self.initial_position!r}; choose Latest or Earliest")


class ReceiveQueue:
    """Messages received and not yet handed to the application, shared by a topic's partitions.

    Bounded by flow control: the broker sends no more than the permits granted
    (``receiver_queue_size`` per consumer, plus at most one batch's overshoot).  A
    broker that ignores permits makes the queue overflow ``hard_limit``; the
    overflow policy is to refuse the message and break that consumer's connection
    (everything unacknowledged is redelivered after reconnecting).
    """

    def __init__(self, hard_limit: int) -> None:
        self.hard_limit = hard_limit
        self._items: deque[tuple[Consumer, int, Message]] = deque()
        self._lot = trio.lowlevel.ParkingLot()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, consumer: Consumer, generation: int, message: Message) -> bool:
        if len(self._items) >= self.hard_limit:
            return False
        self._items.append((consumer, generation, message))
        self._lot.unpark()
        return True

    async def get(self) -> tuple[Consumer, int, Message]:
        while not self._items:
            await self._lot.park()
        return self._items.popleft()

    def get_nowait(self) -> tuple[Consumer, int, Message] | None:
        return self._items.popleft() if self._items else None

    def wake_all(self) -> None:
        self._lot.unpark_all()


class Consumer(ReconnectingHandle):
    """A consumer on one topic (or one partition of a partitioned topic)."""

    NON_RETRYABLE = NON_RETRYABLE
    RETRY_ACTION = "re-subscribing"

    def __init__(self, client: PulsarClient, topic: str, subscription: str, consumer_id: int,
                 config: ConsumerConfig, queue: ReceiveQueue | None = None) -> None:
        super().__init__(client)
        self.topic = topic
        self.subscription = subscription
        self.consumer_id = consumer_id
        self.config = config
        self.partition = partition_index(topic)
        self.consumer_name = config.consumer_name or uuid.uuid4().hex[:10]
        self.queue = queue if queue is not None else ReceiveQueue(config.receiver_queue_size * 2 + 100_000)
        self._flow = FlowControl(config.receiver_queue_size)
        self._batch_acks = BatchAckTracker()
        self._nacks = NegativeAckTracker(config.negative_ack_redelivery_delay)
        self._nack_added = trio.Event()
        self._acks = AckGroup(config.ack_group_max_size)
        self._acks_queued = trio.Event()
        self._chunks = ChunkAssembler()
        #: entries of the chunks received so far, per (producer name, uuid) being assembled
        self._chunk_entries: dict[tuple[str, str], list[MessageId]] = {}
        #: last chunk's entry -> every chunk's entry, for chunked messages handed out and not acked yet;
        #: bounded by MAX_TRACKED_CHUNKED_MESSAGES (oldest forgotten: their chunks are redelivered)
        self._chunked_messages: dict[MessageId, list[MessageId]] = {}
        self._generation = 0
        self._queued = 0
        self.last_dequeued: MessageId | None = None
        self.start_message_id = config.start_message_id
        self.reached_end_of_topic = False
        self.corrupt_messages = 0

    def __repr__(self) -> str:
        return f"<Consumer {self.consumer_name} on {self.topic} / {self.subscription}>"

    # -- life cycle ------------------------------------------------------------------------

    def _timers(self) -> list[Callable[[], Awaitable[None]]]:
        return [self._nack_timer, self._ack_timer]

    async def _register(self) -> None:
        """SUBSCRIBE on the topic's broker, dropping what was queued under the previous connection."""
        self._ready = False
        self._disconnected = trio.Event()
        connection = await self.client.connection_for(self.topic)
        connection.register_consumer(self.consumer_id, self)
        self._connection = connection
        # Whatever is still queued from before will be redelivered by the broker.
        self._generation += 1
        self._queued = 0
        self._batch_acks.clear()
        self._acks.take()  # acks for the old session: the broker redelivers those messages anyway
        self._chunks = ChunkAssembler()
        self._chunk_entries.clear()
        self._chunked_messages.clear()
        cmd = api.CommandSubscribe(
            topic=self.topic, subscription=self.subscription,
            subType=SUBSCRIPTION_TYPES[self.config.subscription_type],
            consumer_id=self.consumer_id, request_id=connection.new_request_id(),
            consumer_name=self.consumer_name, durable=self.config.durable,
            initialPosition=INITIAL_POSITIONS[self.config.initial_position],
        )
        if self.config.read_compacted:
            cmd.read_compacted = True
        if self.config.replicate_subscription_state:
            cmd.replicate_subscription_state = True
        if self.config.priority_level is not None:
            cmd.priority_level = self.config.priority_level
        for name, value in self.config.properties.items():
            cmd.metadata.add(key=name, value=value)
        start = self._resume_position()
        if start is not None:
            # The broker delivers from the start entry itself; what precedes the start (the start
            # message too, unless inclusive) is dropped here (see _skip_position).
            cmd.start_message_id.CopyFrom(start.to_proto())
        try:
            await connection.request(cmd)
        except BaseException:
            connection.unregister_consumer(self.consumer_id)
            if self._connection is connection:
                self._connection = None
            raise
        if self._connection is not connection or connection.closed.is_set():
            raise ConnectionFailed("connection lost while subscribing")
        self._ready = True
        self._send_flow(self._flow.initial_permits())
        self._notify_state()


    def _resume_position(self) -> MessageId | None:
        """Where a non-durable consumer (re)starts; None for durable subscriptions."""
        if self.config.durable:
            return None
        if self.last_dequeued is not None:
            return self.last_dequeued
        return self.start_message_id

    def _unregister(self, connection: ClientConnection) -> None:
        connection.unregister_consumer(self.consumer_id)

    def _send_flow(self, permits: int) -> None:
        connection = self._connection
        if permits <= 0 or connection is None or not self._ready:
            return
        try:
            connection.send_command(api.CommandFlow(consumer_id=self.consumer_id, messagePermits=permits))
        except ConnectionFailed as exc:
            self._lose_connection(str(exc))

    # -- FrameHandler ----------------------------------------------------------------------

    def handle_frame(self, connection: ClientConnection, frame: Any) -> None:
        if connection is not self._connection:
            return
        if frame.type == T.MESSAGE:
            self._on_message(connection, frame)
        elif frame.type == T.CLOSE_CONSUMER:
            self._lose_connection("the broker closed the consumer")
        elif frame.type == T.REACHED_END_OF_TOPIC:
            self.reached_end_of_topic = True

    def _on_message(self, connection: ClientConnection, frame: Any) -> None:
        sub: Any = frame.sub
        section = frame.payload
        entry = MessageId.from_proto(sub.message_id, self.partition)
        try:
            if not section.checksum_ok():
                self._discard(connection, entry, api.CommandAck.ChecksumMismatch)
                return
            metadata = section.metadata
            payload = section.payload
            if is_chunk(metadata):
                chunk_key = (metadata.producer_name, metadata.uuid)
                if metadata.chunk_id == 0:
                    self._chunk_entries[chunk_key] = []
                    while len(self._chunk_entries) > self._chunks.max_pending_messages:
                        del self._chunk_entries[next(iter(self._chunk_entries))]
                self._chunk_entries.setdefault(chunk_key, []).append(entry)
                assembled = self._chunks.add(metadata, payload)
                if assembled is None:
                    self._send_flow(self._flow.consumed(1))
                    return
                self._remember_chunks(entry, self._chunk_entries.pop(chunk_key, []))
                metadata, payload = assembled.metadata, assembled.payload
            decoded = decode_messages(metadata, payload)
        except ProtocolError as exc:
            log.warning("%r: discarding undecodable message %s: %s", self, entry, exc)
            self._discard(connection, entry, api.CommandAck.DecompressionError)
            return
        skip_until = self._skip_position()
        for item in decoded:
            message_id = MessageId(entry.ledger_id, entry.entry_id, item.batch_index, self.partition,
                                   item.batch_size)
            if skip_until is not None and (message_id < skip_until or (
                    message_id == skip_until and not self._inclusive_start())):
                self._send_flow(self._flow.consumed(1))
                continue
            if item.compacted_out:
                self._send_flow(self._flow.consumed(1))
                continue
            message = Message(
                topic=self.topic, message_id=message_id, payload=item.payload, key=item.key,
                properties=item.properties, event_time=item.event_time, publish_time=item.publish_time,
                sequence_id=item.sequence_id, producer_name=item.producer_name,
                redelivery_count=sub.redelivery_count, ordering_key=item.ordering_key,
                consumer_id=self.consumer_id,
            )
            if not self.queue.put(self, self._generation, message):
                connection.close(f"receive queue overflow on consumer {self.consumer_id}")
                return
            self._queued += 1

    def _remember_chunks(self, last: MessageId, entries: list[MessageId]) -> None:
        """A chunked message is acknowledged by acknowledging every one of its chunks' entries."""
        if len(entries) > 1:
            self._chunked_messages[last] = entries
            while len(self._chunked_messages) > MAX_TRACKED_CHUNKED_MESSAGES:
                del self._chunked_messages[next(iter(self._chunked_messages))]

    def _skip_position(self) -> MessageId | None:
        if self.config.durable:
            return None
        position = self.last_dequeued if self.last_dequeued is not None else self.start_message_id
        if position is None or position in (EARLIEST, LATEST):
            return None
        return position

    def _inclusive_start(self) -> bool:
        return self.last_dequeued is None and self.config.start_inclusive

    def _discard(self, connection: ClientConnection, entry: MessageId, error: int) -> None:
        self.corrupt_messages += 1
        ack = api.CommandAck(consumer_id=self.consumer_id, ack_type=api.CommandAck.Individual,
                             validation_error=error)
        ack.message_id.append(entry.to_proto(with_batch=False))
        connection.send_command(ack)
        self._send_flow(self._flow.consumed(1))

    # -- what the application calls ---------------------------------------------------------

    def _delivered(self, generation: int, message: Message) -> bool:
        """Account for a message leaving the queue; False if it is stale (from before a reconnect)."""
        if generation != self._generation:
            return False
        self._queued -= 1
        self.last_dequeued = message.message_id
        self._send_flow(self._flow.consumed(1))
        return True

    async def receive(self) -> Message:
        """The next message (wrap in ``trio.fail_after`` to bound the wait)."""
        return await _receive_from(self.queue, self)

    def acknowledge(self, message: Message | MessageId) -> None:
        """Acknowledge one message (a batch is acked on the broker once all its messages are)."""
        message_id = message.message_id if isinstance(message, Message) else message
        entry = self._batch_acks.individual(message_id)
        if entry is None:
            return
        full = False
        for chunk_entry in self._chunked_messages.pop(entry, [entry]):
            full = self._acks.add_individual(chunk_entry) or full
        if self.config.ack_group_time <= 0 or full:
            self.flush_acknowledgements()
        else:
            self._acks_queued.set()

    def acknowledge_cumulative(self, message: Message | MessageId) -> None:
        """Acknowledge every message up to and including this one."""
        if self.config.subscription_type in ("Shared", "Key_Shared"):
            raise ClientError("cumulative acknowledgement is not allowed on Shared subscriptions")
        message_id = message.message_id if isinstance(message, Message) else message
        entry = self._batch_acks.cumulative(message_id)
        if entry is None:
            return
        self._acks.add_cumulative(entry)
        if self.config.ack_group_time <= 0:
            self.flush_acknowledgements()
        else:
            self._acks_queued.set()

    def flush_acknowledgements(self) -> None:
        """Send the acknowledgements collected so far (one ACK per kind)."""
        individual, cumulative = self._acks.take()
        connection = self._connection
        if connection is None or not self._ready:
            return  # the broker redelivers these messages after the reconnect
        try:
            if individual:
                ack = api.CommandAck(consumer_id=self.consumer_id, ack_type=api.CommandAck.Individual)
                ack.message_id.extend(entry.to_proto(with_batch=False) for entry in individual)
                connection.send_command(ack)
            if cumulative is not None:
                ack = api.CommandAck(consumer_id=self.consumer_id, ack_type=api.CommandAck.Cumulative)
                ack.message_id.append(cumulative.to_proto(with_batch=False))
                connection.send_command(ack)
        except ConnectionFailed as exc:
            self._lose_connection(str(exc))

    async def _ack_timer(self) -> None:
        while True:
            await self._acks_queued.wait()
            self._acks_queued = trio.Event()
            await trio.sleep(self.config.ack_group_time)
            self.flush_acknowledgements()

    def negative_acknowledge(self, message: Message | MessageId) -> None:
        """Ask for this message again after the negative-ack redelivery delay."""
        message_id = message.message_id if isinstance(message, Message) else message
        self._nacks.add(message_id, trio.current_time())
        self._nack_added.set()

    async def _nack_timer(self) -> None:
        while True:
            due = self._nacks.next_due()
            if due is None:
                await self._nack_added.wait()
                self._nack_added = trio.Event()
                continue
            await trio.sleep_until(due)
            entries = self._nacks.pop_due(trio.current_time())
            if entries:
                self.redeliver(entries)

    def redeliver(self, entries: list[MessageId] | None = None) -> None:
        """Ask the broker to redeliver these entries (all unacknowledged ones when None).

        Only Shared and Key_Shared subscriptions can redeliver single messages; for the
        others, as in the official clients, everything unacknowledged is redelivered and
        the local queue is emptied.
        """
        connection = self._connection
        if connection is None or not self._ready:
            return
        cmd = api.CommandRedeliverUnacknowledgedMessages(consumer_id=self.consumer_id)
        if entries is not None and self.config.subscription_type in ("Shared", "Key_Shared"):
            for entry in entries:
                cmd.message_ids.append(entry.to_proto(with_batch=False))
            connection.send_command(cmd)
            return
        self.flush_acknowledgements()
        dropped = self._queued
        self._generation += 1
        self._queued = 0
        self._batch_acks.clear()
        connection.send_command(cmd)
        self._send_flow(self._flow.consumed(dropped))

    async def unsubscribe(self) -> None:
        connection = self._connection
        if connection is None:
            raise ConnectionFailed(f"{self!r} is not connected")
        await connection.request(api.CommandUnsubscribe(consumer_id=self.consumer_id,
                                                        request_id=connection.new_request_id()))
        await self.close(_already_gone=True)

    async def close(self, *, _already_gone: bool = False) -> None:
        if self._closing:
            return
        self._closing = True
        self.flush_acknowledgements()
        connection = self._connection
        try:
            if connection is not None and self._ready and not _already_gone:
                with trio.move_on_after(self.client.config.operation_timeout):
                    try:
                        await connection.request(api.CommandCloseConsumer(
                            consumer_id=self.consumer_id, request_id=connection.new_request_id()))
                    except ClientError as exc:
                        log.debug("%r: close: %s", self, exc)
        finally:
            if connection is not None:
                connection.unregister_consumer(self.consumer_id)
            self._stop_reconnecting()
            self.queue.wake_all()
            self.client._forget(self)

    @property
    def closed(self) -> bool:
        return self._closing


async def _receive_from(queue: ReceiveQueue, owner: Consumer | MultiTopicConsumer) -> Message:
    # Yield once per message even when it is already queued, so acknowledgements and
    # FLOW permits queued by the application get written while it keeps receiving.
    await trio.lowlevel.checkpoint()
    while True:
        if owner.closed:
            raise ClientClosed(f"{owner!r} is closed")
        consumer, generation, message = await queue.get()
        if consumer._delivered(generation, message):
            return message


class MultiTopicConsumer:
    """A consumer on every partition of a partitioned topic, with one receive queue."""

    def __init__(self, topic: str, subscription: str, consumers: list[Consumer], queue: ReceiveQueue) -> None:
        self.topic = topic
        self.subscription = subscription
        self.consumers = consumers
        self.queue = queue
        self._by_id = {c.consumer_id: c for c in consumers}
        self._closed = False

    def __repr__(self) -> str:
        return f"<MultiTopicConsumer on {self.topic} / {self.subscription} ({len(self.consumers)} partitions)>"

    @property
    def closed(self) -> bool:
        return self._closed

    def _owner(self, message: Message | MessageId) -> Consumer:
        if isinstance(message, Message):
            return self._by_id[message.consumer_id]
        for consumer in self.consumers:
            if consumer.partition == message.partition:
                return consumer
        raise ClientError(f"message id {message} belongs to no partition of {self.topic}")

    async def receive(self) -> Message:
        """The next message of any partition (wrap in ``trio.fail_after`` to bound the wait)."""
        return await _receive_from(self.queue, self)

    def acknowledge(self, message: Message | MessageId) -> None:
        self._owner(message).acknowledge(message)

    def acknowledge_cumulative(self, message: Message | MessageId) -> None:
        self._owner(message).acknowledge_cumulative(message)

    def negative_acknowledge(self, message: Message | MessageId) -> None:
        self._owner(message).negative_acknowledge(message)

    async def unsubscribe(self) -> None:
        for consumer in self.consumers:
            await consumer.unsubscribe()
        self._closed = True

    async def close(self) -> None:
        self._closed = True
        async with trio.open_nursery() as nursery:
            for consumer in self.consumers:
                nursery.start_soon(consumer.close)


AnyConsumer = Consumer | MultiTopicConsumer
