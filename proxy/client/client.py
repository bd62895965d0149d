"""The built-in Pulsar client: ``async with PulsarClient(url) as client`` (C++ ``ClientImpl``).

The client owns one nursery in which every connection, producer and consumer task
runs, a :class:`~proxy.client.connection.ConnectionPool` (one connection per
broker, shared), and a :class:`~proxy.client.lookup.LookupService`.  Creating a
producer or consumer first asks PARTITIONED_METADATA: a partitioned topic gets
one producer or consumer per partition (``<topic>-partition-N``) behind a
:class:`~proxy.client.producer.PartitionedProducer` or
:class:`~proxy.client.consumer.MultiTopicConsumer`.  Leaving the ``async with``
closes producers (flushing them), consumers and connections.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from types import TracebackType
from typing import Any, Final

import trio

from proxy.client.connection import (
    Authentication,
    ClientConnection,
    ConnectionConfig,
    ConnectionPool,
    TokenAuthentication,
)
from proxy.client.consumer import Consumer, ConsumerConfig, MultiTopicConsumer, ReceiveQueue
from proxy.client.lookup import LookupService
from proxy.client.message import EARLIEST, MessageId
from proxy.client.names import complete_topic_name, parse_service_url, partition_name
from proxy.client.producer import PartitionedProducer, Producer, ProducerConfig
from proxy.client.reader import Reader
from proxy.errors import ClientClosed, ClientError
from proxy.protocol.compression import compression_value
from proxy.protocol.frame import DEFAULT_MAX_MESSAGE_SIZE

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT: Final = 10.0


class PulsarClient:
    """A Pulsar client on Trio; use it as an async context manager."""

    def __init__(self, service_url: str, *, token: str | None = None, auth: Authentication | None = None,
                 tls_trust_certs_file: str | None = None, tls_validate_hostname: bool = True,
                 tls_allow_insecure: bool = False, operation_timeout: float = 30.0,
                 connection_timeout: float = 10.0, keepalive_interval: float = 30.0) -> None:
        self.service_url = service_url
        self.service = parse_service_url(service_url)
        if token is not None and auth is None:
            auth = TokenAuthentication(token)
        self.config = ConnectionConfig(
            auth=auth, tls_trust_certs_file=tls_trust_certs_file, tls_validate_hostname=tls_validate_hostname,
            tls_allow_insecure=tls_allow_insecure, connection_timeout=connection_timeout,
            operation_timeout=operation_timeout, keepalive_interval=keepalive_interval)
        self.max_message_size = DEFAULT_MAX_MESSAGE_SIZE
        self._stack: contextlib.AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._pool: ConnectionPool | None = None
        self._lookup: LookupService | None = None
        self._next_id = 0
        self._handlers: set[Producer | Consumer] = set()
        self._closed = False

    async def __aenter__(self) -> PulsarClient:
        stack = contextlib.AsyncExitStack()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        self._pool = ConnectionPool(self._nursery, self.config)
        self._lookup = LookupService(self._pool, self.service)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._stack is not None
        if exc is None:
            try:
                await self.close()
            finally:
                await self._stack.__aexit__(None, None, None)
            return
        # The body failed: stop everything, and let the body's own exception through
        # rather than wrapped in the nursery's exception group.
        self._shut_down()
        await self._stack.__aexit__(None, None, None)

    async def close(self) -> None:
        """Close every producer (flushing it) and consumer, then every connection."""
        if self._closed:
            return
        with trio.move_on_after(_CLOSE_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for handler in list(self._handlers):
                    nursery.start_soon(handler.close)
        self._shut_down()

    def _shut_down(self) -> None:
        self._closed = True
        for handler in list(self._handlers):
            if isinstance(handler, Producer):  # (cut short before closing: no receipt waits forever)
                handler.abandon()
        if self._pool is not None:
            self._pool.close_all()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- plumbing the producers and consumers use ------------------------------------------

    @property
    def nursery(self) -> trio.Nursery:
        if self._nursery is None or self._closed:
            raise ClientClosed("the client is not open (use 'async with PulsarClient(...)')")
        return self._nursery

    @property
    def lookup_service(self) -> LookupService:
        if self._lookup is None or self._closed:
            raise ClientClosed("the client is not open (use 'async with PulsarClient(...)')")
        return self._lookup

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _forget(self, handler: Producer | Consumer) -> None:
        self._handlers.discard(handler)

    async def connection_for(self, topic: str) -> ClientConnection:
        """The connection to the broker that owns ``topic`` (looked up each time it is asked)."""
        lookup = self.lookup_service
        result = await lookup.lookup(topic)
        assert self._pool is not None
        connection = await self._pool.get(result.logical, result.physical)
        self.max_message_size = connection.max_message_size
        return connection

    async def get_partitions(self, topic: str) -> list[str]:
        """The partitions of a topic (the topic itself when it is not partitioned)."""
        topic = complete_topic_name(topic)
        count = await self.lookup_service.partitioned_metadata(topic)
        return [partition_name(topic, i) for i in range(count)] if count > 0 else [topic]

    # -- the public API ----------------------------------------------------------------------

    async def create_producer(self, topic: str, *, producer_name: str | None = None,
                              compression: int | str = 0, **options: Any) -> Producer | PartitionedProducer:
        """Create a producer; options are the fields of :class:`ProducerConfig`."""
        topic = complete_topic_name(topic)
        kind = compression_value(compression) if isinstance(compression, str) else compression
        count = await self.lookup_service.partitioned_metadata(topic)
        if count <= 0:
            config = ProducerConfig(producer_name=producer_name, compression=kind, **options)
            return await self._start_producer(topic, config)
        producers = []
        try:
            for index in range(count):
                name = None if producer_name is None else producer_name
                config = ProducerConfig(producer_name=name, compression=kind, **options)
                producers.append(await self._start_producer(partition_name(topic, index), config))
        except BaseException:
            for producer in producers:
                with trio.move_on_after(1):
                    await producer.close()
            raise
        return PartitionedProducer(topic, producers)

    async def _start_producer(self, topic: str, config: ProducerConfig) -> Producer:
        producer = Producer(self, topic, self._new_id(), config)
        self._handlers.add(producer)
        try:
            started: Producer = await self.nursery.start(producer.run)
        except BaseException:
            self._handlers.discard(producer)
            raise
        return started

    async def subscribe(self, topic: str, subscription: str, *, subscription_type: str = "Exclusive",
                        initial_position: str = "Latest", **options: Any) -> Consumer | MultiTopicConsumer:
        """Subscribe; options are the fields of :class:`ConsumerConfig`."""
        topic = complete_topic_name(topic)
        count = await self.lookup_service.partitioned_metadata(topic)
        if count <= 0:
            config = ConsumerConfig(subscription_type=subscription_type, initial_position=initial_position,
                                    **options)
            return await self._start_consumer(topic, subscription, config, None)
        queue_size = int(options.get("receiver_queue_size", 1000))
        # As the official clients: each partition gets a share of the receive queue.
        per_partition = max(1, min(queue_size, options.pop("max_total_receiver_queue_size_across_partitions",
                                                           50_000) // count))
        options["receiver_queue_size"] = per_partition
        shared = ReceiveQueue(2 * per_partition * count + 100_000)
        consumers = []
        try:
            for index in range(count):
                config = ConsumerConfig(subscription_type=subscription_type, initial_position=initial_position,
                                        **options)
                consumers.append(await self._start_consumer(partition_name(topic, index), subscription, config,
                                                            shared))
        except BaseException:
            for consumer in consumers:
                with trio.move_on_after(1):
                    await consumer.close()
            raise
        return MultiTopicConsumer(topic, subscription, consumers, shared)

    async def _start_consumer(self, topic: str, subscription: str, config: ConsumerConfig,
                              queue: ReceiveQueue | None) -> Consumer:
        consumer = Consumer(self, topic, subscription, self._new_id(), config, queue)
        self._handlers.add(consumer)
        try:
            started: Consumer = await self.nursery.start(consumer.run)
        except BaseException:
            self._handlers.discard(consumer)
            raise
        return started

    async def create_reader(self, topic: str, start_message_id: MessageId = EARLIEST, *,
                            inclusive: bool = False, receiver_queue_size: int = 1000,
                            subscription_name: str | None = None) -> Reader:
        """A reader of a non-partitioned topic (or one partition) from ``start_message_id``."""
        topic = complete_topic_name(topic)
        partitions = await self.get_partitions(topic)
        if partitions != [topic]:
            raise ClientError(f"{topic} is partitioned; create a reader per partition ({partitions[0]}, ...)")
        config = ConsumerConfig(subscription_type="Exclusive", durable=False, start_message_id=start_message_id,
                                start_inclusive=inclusive, receiver_queue_size=receiver_queue_size,
                                initial_position="Earliest" if start_message_id == EARLIEST else "Latest")
        name = subscription_name or f"reader-{uuid.uuid4().hex[:10]}"
        return Reader(await self._start_consumer(topic, name, config, None))
