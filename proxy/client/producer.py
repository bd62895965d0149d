"""The producer, on Trio (C++ ``ProducerImpl`` and ``PartitionedProducerImpl``).

Pulsar protocol, "Producer": PRODUCER registers the producer on the broker that
owns the topic (found by lookup) and PRODUCER_SUCCESS answers with its name and
``last_sequence_id``; each SEND carries a sequence id and is answered, in order, by
SEND_RECEIPT with the stored message id.

What happens to a message: ``send_async`` gives it the next sequence id and either
adds it to the :class:`~proxy.client.batching.BatchContainer` (flushed when full or
when the publish delay expires) or encodes it on its own, as chunks if it is
larger than the broker's max_message_size.  Each SEND then joins the
:class:`~proxy.client.pending.PendingQueue` and is written at once if the
producer is connected.  The pending-message limit applies backpressure (or fails
with ProducerQueueIsFull); the send timeout fails messages without a receipt.

Reconnection: when the connection breaks, or the broker sends CLOSE_PRODUCER (a
topic unload), or a receipt arrives out of step, the producer looks the topic up
again, re-creates itself with the same producer id and name (with backoff: 100 ms
doubling to 60 s), and writes every pending SEND again, in order, with its
original sequence id before any new one — so with deduplication on the broker
nothing is lost, duplicated or reordered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import trio

from proxy.client.batching import DEFAULT_MAX_BYTES, DEFAULT_MAX_DELAY, DEFAULT_MAX_MESSAGES, BatchContainer
from proxy.client.chunking import encode_chunks
from proxy.client.connection import ClientConnection, error_of
from proxy.client.message import MessageId
from proxy.client.names import partition_index
from proxy.client.outgoing import OutgoingMessage, encode_batch, single_metadata
from proxy.client.pending import PendingQueue, PendingSend, ReceiptMatch
from proxy.client.receipt import Receipt
from proxy.client.reconnecting import ReconnectingHandle
from proxy.errors import BrokerError, ClientClosed, ClientError, ConnectionFailed, RequestTimeout
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T
from proxy.protocol.compression import compress
from proxy.protocol.frame import encode_payload_command

if TYPE_CHECKING:
    from proxy.client.client import PulsarClient

log = logging.getLogger(__name__)


#: Errors after which retrying cannot help (the official clients give up on these).
NON_RETRYABLE: Final = frozenset({
    "AuthenticationError", "AuthorizationError", "ProducerBusy", "TopicNotFound", "TopicTerminatedError",
    "ProducerFenced", "IncompatibleSchema", "NotAllowedError", "ProducerBlockedQuotaExceededError",
    "InvalidTopicName", "UnsupportedVersionError",
})

ACCESS_MODES: Final = {name: value for value, name in
                       ((v.number, v.name) for v in api.ProducerAccessMode.DESCRIPTOR.values)}


@dataclass(slots=True)
class ProducerConfig:
    """A producer's settings; defaults are the official clients'."""

    producer_name: str | None = None
    access_mode: str = "Shared"
    initial_sequence_id: int | None = None
    batching: bool = True
    batching_max_messages: int = DEFAULT_MAX_MESSAGES
    batching_max_bytes: int = DEFAULT_MAX_BYTES
    batching_max_delay: float = DEFAULT_MAX_DELAY
    compression: int = api.NONE
    chunking: bool = False
    max_pending_messages: int = 1000
    block_if_queue_full: bool = True
    send_timeout: float = 30.0
    properties: dict[str, str] = field(default_factory=dict)


def java_string_hash(key: str) -> int:
    """Java's ``String.hashCode`` (the official clients' default key hash for routing)."""
    value = 0
    for unit in key.encode("utf-16-be").hex(" ", 2).split():
        value = (31 * value + int(unit, 16)) & 0xFFFFFFFF
    return value


class Producer(ReconnectingHandle):
    """A producer on one topic (or one partition of a partitioned topic)."""

    NON_RETRYABLE = NON_RETRYABLE
    RETRY_ACTION = "reconnecting"

    def __init__(self, client: PulsarClient, topic: str, producer_id: int, config: ProducerConfig) -> None:
        super().__init__(client)
        self.topic = topic
        self.producer_id = producer_id
        self.config = config
        self.partition = partition_index(topic)
        self.producer_name = config.producer_name or ""
        self._user_named = config.producer_name is not None
        self._created_once = False
        self._next_sequence_id = 0 if config.initial_sequence_id is None else config.initial_sequence_id + 1
        self.last_sequence_id_published = -1 if config.initial_sequence_id is None else config.initial_sequence_id
        self._batch: BatchContainer[Receipt] = BatchContainer(config.batching_max_messages, config.batching_max_bytes)
        self._pending: PendingQueue[Receipt | None] = PendingQueue()
        self._slots = trio.Semaphore(config.max_pending_messages) if config.max_pending_messages > 0 else None
        self._epoch = 0
        self._closed = trio.Event()
        self._last_receipt: Receipt | None = None
        self.topic_epoch: int | None = None

    def __repr__(self) -> str:
        return f"<Producer {self.producer_name or '?'} on {self.topic}>"

    @property
    def pending_messages(self) -> int:
        return self._pending.messages + len(self._batch)

    # -- life cycle ------------------------------------------------------------------------

    def _timers(self) -> list[Callable[[], Awaitable[None]]]:
        return [self._batch_timer, self._send_timeout_timer]

    def _gave_up_retrying(self, error: BrokerError | ConnectionFailed | RequestTimeout) -> None:
        self._fail_all(error)

    async def _register(self) -> None:
        """PRODUCER on the topic's broker, then write every pending SEND again."""
        self._ready = False
        self._disconnected = trio.Event()
        connection = await self.client.connection_for(self.topic)
        connection.register_producer(self.producer_id, self)
        self._connection = connection
        cmd = api.CommandProducer(topic=self.topic, producer_id=self.producer_id,
                                  request_id=connection.new_request_id(), epoch=self.reconnects,
                                  user_provided_producer_name=self._user_named,
                                  producer_access_mode=ACCESS_MODES[self.config.access_mode])
        if self.producer_name:
            cmd.producer_name = self.producer_name
        if self.topic_epoch is not None:
            cmd.topic_epoch = self.topic_epoch
        for name, value in self.config.properties.items():
            cmd.metadata.add(key=name, value=value)
        try:
            frame = await connection.request(cmd)
        except BaseException:
            connection.unregister_producer(self.producer_id)
            if self._connection is connection:
                self._connection = None
            raise
        success: Any = frame.sub
        self.producer_name = success.producer_name
        if success.HasField("topic_epoch"):
            self.topic_epoch = success.topic_epoch
        if not self._created_once:
            self._created_once = True
            if self.config.initial_sequence_id is None and success.last_sequence_id >= 0:
                self.last_sequence_id_published = success.last_sequence_id
                self._next_sequence_id = success.last_sequence_id + 1
        if self._connection is not connection or connection.closed.is_set():
            raise ConnectionFailed("connection lost while the producer was being created")
        self._resend(connection)

    def _resend(self, connection: ClientConnection) -> None:
        """Write every pending SEND again, in order, then accept new ones (no await inside)."""
        self._epoch += 1
        for send in self._pending:
            connection.send(send.frame, T.SEND)
            send.written_epoch = self._epoch
        self._ready = True
        self._notify_state()

    def _unregister(self, connection: ClientConnection) -> None:
        connection.unregister_producer(self.producer_id)

    # -- FrameHandler ----------------------------------------------------------------------

    def handle_frame(self, connection: ClientConnection, frame: Any) -> None:
        if connection is not self._connection:
            return
        sub: Any = frame.sub
        if frame.type == T.SEND_RECEIPT:
            self._on_receipt(sub)
        elif frame.type == T.SEND_ERROR:
            log.warning("%r: SEND_ERROR for sequence id %d: %s", self, sub.sequence_id, error_of(frame))
            # As the official clients do: reconnect and resend everything pending.
            connection.close(f"SEND_ERROR {api.ServerError.Name(sub.error)} for producer {self.producer_id}")
        elif frame.type == T.CLOSE_PRODUCER:
            self._lose_connection("the broker closed the producer")

    def _on_receipt(self, sub: Any) -> None:
        outcome, send = self._pending.match_receipt(sub.sequence_id)
        if outcome is ReceiptMatch.DUPLICATE or send is None:
            return
        if outcome is ReceiptMatch.UNEXPECTED:
            assert self._connection is not None
            self._connection.close(f"receipt for sequence id {sub.sequence_id} while {send.sequence_id} "
                                   "was expected first")
            return
        self.last_sequence_id_published = max(self.last_sequence_id_published, send.highest_sequence_id)
        base = MessageId.from_proto(sub.message_id, self.partition) if sub.HasField("message_id") \
            else MessageId(-1, -1, partition=self.partition)
        batched = send.batch
        count = len(send.receipts)
        for index, receipt in enumerate(send.receipts):
            if receipt is None:
                continue
            message_id = (MessageId(base.ledger_id, base.entry_id, index, self.partition, count)
                          if batched else base)
            receipt.set_result(message_id)
        self._release(send.num_messages if send.receipts else 0)

    # -- sending ---------------------------------------------------------------------------

    async def send(self, payload: bytes, *, key: str | None = None, properties: dict[str, str] | None = None,
                   event_time: int = 0, sequence_id: int | None = None,
                   ordering_key: bytes | None = None) -> MessageId:
        """Send one message and wait for its receipt."""
        receipt = await self.send_async(payload, key=key, properties=properties, event_time=event_time,
                                        sequence_id=sequence_id, ordering_key=ordering_key)
        return await receipt.wait()

    async def send_async(self, payload: bytes, *, key: str | None = None, properties: dict[str, str] | None = None,
                         event_time: int = 0, sequence_id: int | None = None,
                         ordering_key: bytes | None = None) -> Receipt:
        """Queue one message; waits only for room under the pending-message limit."""
        await self._admit()
        receipt = Receipt()
        msg = OutgoingMessage(bytes(payload), receipt, key, dict(properties or {}), event_time, ordering_key)
        if sequence_id is not None:
            msg.sequence_id = sequence_id
            self._next_sequence_id = max(self._next_sequence_id, sequence_id + 1)
        else:
            msg.sequence_id = self._next_sequence_id
            self._next_sequence_id += 1
        self._last_receipt = receipt
        max_size = self._max_message_size()
        if self.config.batching and msg.size < max_size:
            if not self._batch.has_space_for(msg):
                self._flush_batch()
            if self._batch.add(msg):
                self._flush_batch()
        else:
            self._send_single(msg, max_size)
        return receipt

    async def send_entry(self, metadata: api.MessageMetadata, payload: bytes, num_messages: int = 1) -> Receipt:
        """Queue an already-built message (what a geo-replicator forwards): its metadata and payload as they are.

        The SEND is the one Pulsar's replicator producer writes: it carries the metadata's own
        sequence id (the original producer's; 0 for a marker), ``marker`` when the entry is a
        marker (the remote broker then skips deduplication for it), and ``num_messages`` only
        for a batch.  It takes one slot of the pending-message limit whatever ``num_messages``
        says, as Pulsar's replicator producer counts entries.
        """
        await self._admit()
        receipt = Receipt()
        if metadata.HasField("sequence_id"):
            sequence_id = metadata.sequence_id
        else:
            sequence_id = self._next_sequence_id
            self._next_sequence_id += 1
        self._last_receipt = receipt
        cmd = api.CommandSend(producer_id=self.producer_id, sequence_id=sequence_id)
        if num_messages != 1:
            cmd.num_messages = num_messages
        if metadata.HasField("marker_type"):
            cmd.marker = True
        frame = encode_payload_command(cmd, metadata, payload)
        self._enqueue(PendingSend(sequence_id, sequence_id, frame, 1, self._deadline(), [receipt]))
        return receipt

    async def _admit(self) -> None:
        """Take one slot of the pending-message limit; refuse once the producer is closing."""
        if self._closing:
            raise ClientClosed(f"{self!r} is closed")
        await self._acquire()
        if self._closing:
            self._release(1)
            raise ClientClosed(f"{self!r} is closed")

    async def _acquire(self) -> None:
        if self._slots is None:
            return
        if self.config.block_if_queue_full:
            await self._slots.acquire()
            return
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            raise BrokerError("ProducerQueueIsFull", f"{self.config.max_pending_messages} messages pending") \
                from None

    def _release(self, count: int) -> None:
        if self._slots is None:
            return
        for _ in range(count):
            self._slots.release()

    def _max_message_size(self) -> int:
        connection = self._connection
        return connection.max_message_size if connection is not None else self.client.max_message_size

    def _send_single(self, msg: OutgoingMessage[Receipt], max_size: int) -> None:
        compression = self.config.compression
        body = compress(compression, msg.payload)
        now_ms = _now_ms()
        meta = single_metadata(msg, self.producer_name, now_ms, compression, len(msg.payload))
        if len(body) + meta.ByteSize() <= max_size:
            cmd = api.CommandSend(producer_id=self.producer_id, sequence_id=msg.sequence_id, num_messages=1)
            frame = encode_payload_command(cmd, meta, body)
            self._enqueue(PendingSend(msg.sequence_id, msg.sequence_id, frame, 1, self._deadline(), [msg.receipt]))
            return
        if not self.config.chunking or self.config.batching:
            self._release(1)
            msg.receipt.set_error(BrokerError("MessageTooBig", f"message of {len(body)} bytes exceeds the "
                                                               f"broker's max_message_size {max_size}"))
            return
        frames = encode_chunks(self.producer_id, self.producer_name, msg, compression, body, now_ms, max_size)
        deadline = self._deadline()
        for index, frame in enumerate(frames):
            last = index == len(frames) - 1
            self._enqueue(PendingSend(msg.sequence_id, msg.sequence_id, frame, 1 if last else 0, deadline,
                                      [msg.receipt] if last else [None]))

    def _flush_batch(self) -> None:
        messages = self._batch.drain()
        if not messages:
            return
        frame = encode_batch(self.producer_id, self.producer_name, messages, self.config.compression, _now_ms())
        self._enqueue(PendingSend(messages[0].sequence_id, messages[-1].sequence_id, frame, len(messages),
                                  self._deadline(), [m.receipt for m in messages], batch=True))

    def _enqueue(self, send: PendingSend[Receipt | None]) -> None:
        self._pending.append(send)
        connection = self._connection
        if self._ready and connection is not None:
            try:
                connection.send(send.frame, T.SEND)
                send.written_epoch = self._epoch
            except ConnectionFailed as exc:
                self._lose_connection(str(exc))

    def _deadline(self) -> float:
        timeout = self.config.send_timeout
        return trio.current_time() + timeout if timeout > 0 else float("inf")

    async def flush(self) -> None:
        """Send the open batch now and wait until every message sent so far has its outcome."""
        self._flush_batch()
        last = self._last_receipt
        if last is not None:
            await last.wait_done()

    async def _batch_timer(self) -> None:
        delay = self.config.batching_max_delay
        if not self.config.batching:
            return
        while True:
            await trio.sleep(delay)
            if len(self._batch):
                self._flush_batch()

    async def _send_timeout_timer(self) -> None:
        if self.config.send_timeout <= 0:
            return
        while True:
            next_deadline = self._pending.next_deadline()
            wake = next_deadline if next_deadline is not None else trio.current_time() + self.config.send_timeout
            await trio.sleep_until(wake)
            for send in self._pending.expire(trio.current_time()):
                self._fail_send(send, RequestTimeout(f"no receipt within {self.config.send_timeout} s"))

    def _fail_send(self, send: PendingSend[Receipt | None], error: ClientError) -> None:
        for receipt in send.receipts:
            if receipt is not None:
                receipt.set_error(error)
        self._release(send.num_messages if any(r is not None for r in send.receipts) else 0)

    def _fail_all(self, error: ClientError) -> None:
        for send in self._pending.clear():
            self._fail_send(send, error)
        for msg in self._batch.drain():
            msg.receipt.set_error(error)
            self._release(1)

    def abandon(self) -> None:
        """The client was torn down without closing this producer: what waits for a receipt ends with ClientClosed."""
        self._closing = True
        self._fail_all(ClientClosed(f"{self!r} abandoned: its client was torn down"))
        self._stop_reconnecting()

    async def close(self) -> None:
        """Flush, wait for outstanding receipts (up to the send timeout), and close on the broker."""
        if self._closing:
            await self._closed.wait()
            return
        try:
            with trio.move_on_after(self.config.send_timeout or self.client.config.operation_timeout):
                await self.flush()
            self._closing = True
            connection = self._connection
            if connection is not None and self._ready:
                with trio.move_on_after(self.client.config.operation_timeout):
                    try:
                        await connection.request(api.CommandCloseProducer(
                            producer_id=self.producer_id, request_id=connection.new_request_id()))
                    except ClientError as exc:
                        log.debug("%r: close: %s", self, exc)
                connection.unregister_producer(self.producer_id)
        finally:
            self._closing = True
            self._fail_all(ClientClosed(f"{self!r} closed"))
            self._stop_reconnecting()
            self._closed.set()
            self.client._forget(self)


def _now_ms() -> int:
    return int(time.time() * 1000)


class PartitionedProducer:
    """A producer on every partition of a partitioned topic, routing as the official clients do.

    A message with a key goes to ``java_string_hash(key) % partitions``; messages
    without one go round-robin.
    """

    def __init__(self, topic: str, producers: list[Producer]) -> None:
        self.topic = topic
        self.producers = producers
        self._next = 0

    @property
    def producer_name(self) -> str:
        return self.producers[0].producer_name

    @property
    def last_sequence_id_published(self) -> int:
        return max(p.last_sequence_id_published for p in self.producers)

    def _route(self, key: str | None) -> Producer:
        if key is not None:
            return self.producers[java_string_hash(key) % len(self.producers)]
        producer = self.producers[self._next % len(self.producers)]
        self._next += 1
        return producer

    async def send(self, payload: bytes, *, key: str | None = None, properties: dict[str, str] | None = None,
                   event_time: int = 0, sequence_id: int | None = None,
                   ordering_key: bytes | None = None) -> MessageId:
        return await self._route(key).send(payload, key=key, properties=properties, event_time=event_time,
                                           sequence_id=sequence_id, ordering_key=ordering_key)

    async def send_async(self, payload: bytes, *, key: str | None = None, properties: dict[str, str] | None = None,
                         event_time: int = 0, sequence_id: int | None = None,
                         ordering_key: bytes | None = None) -> Receipt:
        return await self._route(key).send_async(payload, key=key, properties=properties, event_time=event_time,
                                                 sequence_id=sequence_id, ordering_key=ordering_key)

    async def flush(self) -> None:
        for producer in self.producers:
            await producer.flush()

    async def close(self) -> None:
        async with trio.open_nursery() as nursery:
            for producer in self.producers:
                nursery.start_soon(producer.close)


AnyProducer = Producer | PartitionedProducer
