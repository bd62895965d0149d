"""One client connection to an embedded broker: the broker side of the session.

Frames come in through :meth:`BrokerConnection.handle`; everything the broker
answers, and every MESSAGE or broker-initiated close the topics push, is appended
to :attr:`BrokerConnection.outbox` and signalled through the ``wakeup`` callback,
so the Trio server stays a thin loop (sans-IO, as mitmproxy's layers).

The handshake and which side may send what are checked with the project's one
transition table (:mod:`proxy.protocol.session`); replies follow Apache Pulsar's
``ServerCnx``: CONNECTED with the negotiated protocol version and
max_message_size, LOOKUP answered Connect by the owner and Redirect (authoritative)
by any other broker, PRODUCER_SUCCESS with producer_ready, SEND_RECEIPT with the
entry's ledger and entry id, ERROR with the ServerError a broker would use for
anything refused, including commands this broker does not implement.

Outbox bound: messages are bounded by the consumers' FLOW permits and replies by
the client's own requests; a connection whose unsent output passes
:data:`MAX_OUTBOX_BYTES` is a consumer that stopped reading and is closed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

from proxy.broker.cluster import Cluster
from proxy.broker.ledger import Entry
from proxy.broker.naming import TopicName
from proxy.broker.subscription import Consumer, Subscription
from proxy.broker.topic import Producer, Topic, schema_version, signed64
from proxy.errors import BrokerError, ChecksumMismatch, ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T, wrap
from proxy.protocol.frame import Frame, crc32c, encode_command
from proxy.protocol.keepalive import PING_FRAME, PONG_FRAME, Keepalive, KeepaliveStep
from proxy.protocol.session import ConnectionState, Direction, SessionTracker

#: newest protocol version this broker speaks (ProtocolVersion v21)
SERVER_PROTOCOL_VERSION: Final = 21
SERVER_VERSION: Final = "pulsar-tap-broker"
MAX_OUTBOX_BYTES: Final = 256 * 1024 * 1024
#: a request_id of -1, as a Java broker writes it into uint64 fields
NO_REQUEST_ID: Final = (1 << 64) - 1
#: what a broker without a transaction coordinator (transactionCoordinatorEnabled=false) refuses with an ERROR
_TRANSACTION_REQUESTS: Final = frozenset({T.TC_CLIENT_CONNECT_REQUEST, T.NEW_TXN, T.ADD_PARTITION_TO_TXN,
                                          T.ADD_SUBSCRIPTION_TO_TXN, T.END_TXN})
#: ServerCnx's answer, word for word, to an ACK in a transaction when it has no coordinator
_NO_TRANSACTION_ACK: Final = ("org.apache.pulsar.broker.service.BrokerServiceException$NotAllowedException: "
                              "Server don't support transaction ack!")
_HEADER = struct.Struct(">II")


class OutboxOverflow(ProtocolError):
    """The client stopped reading while the broker still had output for it."""

    server_error = "TooManyRequests"


def server_error(name: str) -> int:
    try:
        return int(api.ServerError.Value(name))
    except ValueError:
        return int(api.ServerError.UnknownError)


def message_frame(command: api.BaseCommand, section: bytes) -> bytes:
    """A MESSAGE frame: the command, then a stored payload section with its original checksum."""
    body: bytes = command.SerializeToString()
    return _HEADER.pack(4 + len(body) + len(section), len(body)) + body + section


def topic_list_hash(topics: list[str]) -> str:
    """Pulsar's ``TopicList.calculateHash``: CRC32C of the sorted names joined by commas, as Guava prints it
    (the four bytes little-endian, in hex)."""
    return crc32c(",".join(sorted(topics)).encode()).to_bytes(4, "little").hex()


class BrokerConnection:
    """The broker's side of one client connection."""

    def __init__(self, cluster: Cluster, broker_index: int, connection_id: int, peer: str,
                 clock_ns: Callable[[], int], wakeup: Callable[[], None] = lambda: None) -> None:
        self.cluster = cluster
        self.broker_index = broker_index
        self.connection_id = connection_id
        self.peer = peer
        self.clock_ns = clock_ns
        self.wakeup = wakeup
        self.session = SessionTracker()
        self.outbox: list[bytes] = []
        self.outbox_bytes = 0
        self.closing = False
        self.protocol_version = 0
        self.client_version = ""
        self.producers: dict[int, tuple[Producer, Topic]] = {}
        self.consumers: dict[int, tuple[Consumer, Subscription]] = {}
        self.keepalive = Keepalive(int(cluster.config.keepalive_seconds * 1e9), clock_ns(), every_interval=True)
        self._producer_schema: dict[int, bytes] = {}

    # -- output -----------------------------------------------------------------

    def _emit(self, data: bytes) -> None:
        if self.closing:
            return
        self.outbox.append(data)
        self.outbox_bytes += len(data)
        if self.outbox_bytes > MAX_OUTBOX_BYTES:
            self.closing = True
        self.wakeup()

    def _reply(self, sub: Any) -> None:
        cmd = wrap(sub)
        if self.session.state is not ConnectionState.CONNECTED:
            self.session.advance(cmd.type, Direction.TO_CLIENT)
        self._emit(encode_command(cmd))

    def take_output(self) -> list[bytes]:
        out, self.outbox, self.outbox_bytes = self.outbox, [], 0
        return out

    def _error(self, request_id: int, name: str, message: str) -> None:
        self._reply(api.CommandError(request_id=request_id, error=server_error(name),
                                     message=message))

    def poll_keepalive(self) -> tuple[KeepaliveStep, str]:
        """What keepalive asks for now (the server calls this often) and why: a PING is sent; DEAD: close.

        As Pulsar's PulsarHandler, a tick that finds the handshake unfinished closes the
        connection instead of pinging it.
        """
        step = self.keepalive.poll(self.clock_ns())
        if step is KeepaliveStep.PING:
            if self.session.state is not ConnectionState.CONNECTED:
                return KeepaliveStep.DEAD, "handshake not completed within the keepalive interval"
            self._emit(PING_FRAME)
        return step, "no PONG to keepalive PING"

    # -- input ------------------------------------------------------------------

    def handle(self, frame: Frame) -> None:
        """Act on one frame from the client; raises ProtocolError to drop the connection."""
        self.keepalive.last_rx_ns = self.clock_ns()
        self.session.advance(frame.type, Direction.TO_BROKER)
        handler = _HANDLERS.get(frame.type)
        if handler is None:
            self._unsupported(frame)
            return
        handler(self, frame)

    def _unsupported(self, frame: Frame) -> None:
        sub = frame.sub
        request_id = getattr(sub, "request_id", NO_REQUEST_ID)
        if frame.type in _TRANSACTION_REQUESTS:  # word for word what ServerCnx answers without a coordinator
            self._error(int(request_id), "NotAllowedError", "Transactions are not enabled.")
            return
        self._error(int(request_id), "NotAllowedError", f"{frame.type_name} is not supported by this broker")

    # handshake ------------------------------------------------------------------

    def _on_connect(self, frame: Frame) -> None:
        connect: api.CommandConnect = frame.command.connect
        self.protocol_version = min(connect.protocol_version, SERVER_PROTOCOL_VERSION)
        self.client_version = connect.client_version
        token = self.cluster.config.auth_token
        if token is not None:
            if not connect.HasField("auth_data") or not connect.auth_data:
                self._reply(api.CommandAuthChallenge(
                    server_version=SERVER_VERSION, protocol_version=self.protocol_version,
                    challenge=api.AuthData(auth_method_name="token", auth_data=b"token")))
                return
            if not self._token_ok(connect.auth_method_name, connect.auth_data):
                self._refuse_auth()
                return
        self._connected()

    def _token_ok(self, method: str, data: bytes) -> bool:
        return method == "token" and data.decode(errors="replace").strip() == self.cluster.config.auth_token

    def _refuse_auth(self) -> None:
        self._error(NO_REQUEST_ID, "AuthenticationError", "Unable to authenticate")
        self.closing = True

    def _connected(self) -> None:
        flags = api.FeatureFlags(supports_auth_refresh=True, supports_partial_producer=True)
        self._reply(api.CommandConnected(server_version=SERVER_VERSION, protocol_version=self.protocol_version,
                                         max_message_size=self.cluster.config.max_message_size,
                                         feature_flags=flags))

    def _on_auth_response(self, frame: Frame) -> None:
        response: api.CommandAuthResponse = frame.command.authResponse
        data = response.response
        if self.cluster.config.auth_token is None:
            if self.session.state is not ConnectionState.CONNECTED:
                self._connected()
            return
        if not self._token_ok(data.auth_method_name or "token", data.auth_data):
            self._refuse_auth()
            return
        if self.session.state is not ConnectionState.CONNECTED:
            self._connected()

    def _on_ping(self, frame: Frame) -> None:
        self._emit(PONG_FRAME)

    def _on_pong(self, frame: Frame) -> None:
        self.keepalive.pong_received()

    # lookups ----------------------------------------------------------------------

    def _on_partitioned_metadata(self, frame: Frame) -> None:
        cmd: api.CommandPartitionedTopicMetadata = frame.command.partitionMetadata
        try:
            partitions = self.cluster.partitions_of(cmd.topic)
        except BrokerError as exc:
            self._reply(api.CommandPartitionedTopicMetadataResponse(
                request_id=cmd.request_id, response=api.CommandPartitionedTopicMetadataResponse.Failed,
                error=server_error(exc.server_error), message=exc.message))
            return
        self._reply(api.CommandPartitionedTopicMetadataResponse(
            request_id=cmd.request_id, partitions=partitions,
            response=api.CommandPartitionedTopicMetadataResponse.Success))

    def _on_lookup(self, frame: Frame) -> None:
        cmd: api.CommandLookupTopic = frame.command.lookupTopic
        lookup = api.CommandLookupTopicResponse
        try:
            name = TopicName.parse(cmd.topic)
            self.cluster.check_namespace(name)
            full = str(name)
            owner = self.cluster.owner(full)
        except BrokerError as exc:
            self._reply(lookup(request_id=cmd.request_id, response=lookup.Failed,
                               error=server_error(exc.server_error), message=exc.message))
            return
        local = owner.index == self.broker_index
        self._reply(lookup(request_id=cmd.request_id, brokerServiceUrl=owner.service_url,
                           response=lookup.Connect if local else lookup.Redirect,
                           authoritative=True, proxy_through_service_url=False))

    def _on_get_topics_of_namespace(self, frame: Frame) -> None:
        cmd: api.CommandGetTopicsOfNamespace = frame.command.getTopicsOfNamespace
        mode = api.CommandGetTopicsOfNamespace.Mode
        topics = self.cluster.topics_of_namespace(
            cmd.namespace, persistent=cmd.mode in (mode.PERSISTENT, mode.ALL),
            non_persistent=cmd.mode in (mode.NON_PERSISTENT, mode.ALL))
        # As Pulsar's ServerCnx: the list's hash always; when the client already holds that list
        # (its topics_hash matches) nothing changed and no topics are sent.  A topics_pattern is
        # not evaluated here (as with enableBrokerSideSubscriptionPatternEvaluation=false: a
        # client's regex never runs in the broker), so the list is not filtered.
        digest = topic_list_hash(topics)
        unchanged = cmd.HasField("topics_hash") and cmd.topics_hash == digest
        self._reply(api.CommandGetTopicsOfNamespaceResponse(
            request_id=cmd.request_id, topics=[] if unchanged else topics, filtered=False, changed=not unchanged,
            topics_hash=digest))

    # producers --------------------------------------------------------------------

    def _on_producer(self, frame: Frame) -> None:
        cmd: api.CommandProducer = frame.command.producer
        existing = self.producers.get(cmd.producer_id)
        if existing is not None:
            producer, topic = existing
            if topic.name == str(TopicName.parse(cmd.topic)) and producer.ready:
                self._producer_success(cmd.request_id, producer, topic, ready=True)
                return
            self._error(cmd.request_id, "ServiceNotReady", "Producer is already present on the connection")
            return
        try:
            full = str(TopicName.parse(cmd.topic))
            self.cluster.check_owner(full, self.broker_index)
            topic = self.cluster.get_topic(full)
            name = cmd.producer_name if cmd.HasField("producer_name") and cmd.producer_name else \
                self.cluster.generate_producer_name(self.broker_index)
            producer = Producer(cmd.producer_id, name, cmd.producer_access_mode, self, self.connection_id,
                                request_id=cmd.request_id)
            schema_version = b""
            if cmd.HasField("schema"):
                schema_version = _version_bytes(topic.add_schema(cmd.schema))
            elif topic.schemas:
                schema_version = _version_bytes(topic.schemas[-1].version)
            topic.add_producer(producer)
        except BrokerError as exc:
            self._error(cmd.request_id, exc.server_error, exc.message)
            return
        self.producers[cmd.producer_id] = (producer, topic)
        self._producer_schema[cmd.producer_id] = schema_version
        self._producer_success(cmd.request_id, producer, topic, ready=producer.ready)

    def _producer_success(self, request_id: int, producer: Producer, topic: Topic, ready: bool) -> None:
        reply = api.CommandProducerSuccess(
            request_id=request_id, producer_name=producer.producer_name,
            last_sequence_id=topic.last_sequence_id(producer.producer_name),
            schema_version=self._producer_schema.get(producer.producer_id, b""),
            producer_ready=ready)
        if producer.access_mode != api.ProducerAccessMode.Shared:
            reply.topic_epoch = topic.epoch
        self._reply(reply)

    def send_producer_ready(self, producer: Producer) -> None:
        entry = self.producers.get(producer.producer_id)
        if entry is not None and entry[0] is producer:
            self._producer_success(producer.request_id, producer, entry[1], ready=True)

    def send_close_producer(self, producer: Producer) -> None:
        entry = self.producers.get(producer.producer_id)
        if entry is None or entry[0] is not producer:
            return
        del self.producers[producer.producer_id]
        self._reply(api.CommandCloseProducer(producer_id=producer.producer_id, request_id=NO_REQUEST_ID))

    def _on_send(self, frame: Frame) -> None:
        cmd: api.CommandSend = frame.command.send
        entry = self.producers.get(cmd.producer_id)
        highest = cmd.highest_sequence_id if cmd.HasField("highest_sequence_id") else cmd.sequence_id
        if entry is None:
            self._send_error(cmd, "NotConnected", "Producer is not connected")
            return
        producer, topic = entry
        section = frame.payload
        assert section is not None  # the decoder refuses a SEND without one
        try:
            section.verify_checksum()
        except ChecksumMismatch:
            self._send_error(cmd, "ChecksumError", "Checksum failed on the broker")
            return
        if cmd.HasField("txnid_most_bits") and cmd.HasField("txnid_least_bits"):
            # no transaction buffer (ServerCnx without a coordinator), answered under the highest sequence id
            self._reply(api.CommandSendError(producer_id=cmd.producer_id, sequence_id=highest,
                                             error=server_error("NotAllowedError"),
                                             message="Transaction buffer disable!"))
            return
        try:
            stored = topic.publish(producer, frame.raw[8 + frame.cmd_size:], section.metadata,
                                   cmd.num_messages, self.clock_ns())
        except BrokerError as exc:
            self._send_error(cmd, exc.server_error, exc.message)
            return
        if stored is None:  # a duplicate: Pulsar answers with ids -1
            ledger_id, entry_id = NO_REQUEST_ID, NO_REQUEST_ID
        elif topic.non_persistent:  # (stored nowhere: Pulsar answers 0:0, and no highest sequence id)
            ledger_id, entry_id, highest = 0, 0, NO_REQUEST_ID
        else:
            ledger_id, entry_id = topic.ledger.ledger_id, stored.entry_id
        self._reply(api.CommandSendReceipt(
            producer_id=cmd.producer_id, sequence_id=cmd.sequence_id, highest_sequence_id=highest,
            message_id=api.MessageIdData(ledgerId=ledger_id, entryId=entry_id)))

    def _send_error(self, cmd: api.CommandSend, name: str, message: str) -> None:
        self._reply(api.CommandSendError(producer_id=cmd.producer_id, sequence_id=cmd.sequence_id,
                                         error=server_error(name), message=message))

    def _on_close_producer(self, frame: Frame) -> None:
        cmd: api.CommandCloseProducer = frame.command.close_producer
        entry = self.producers.pop(cmd.producer_id, None)
        if entry is not None:
            entry[1].remove_producer(entry[0])
        self._reply(api.CommandSuccess(request_id=cmd.request_id))

    # consumers --------------------------------------------------------------------

    def _on_subscribe(self, frame: Frame) -> None:
        cmd: api.CommandSubscribe = frame.command.subscribe
        if cmd.consumer_id in self.consumers:
            self._reply(api.CommandSuccess(request_id=cmd.request_id))
            return
        if not cmd.subscription:  # (word for word, code and all, what Pulsar's broker answers)
            self._error(cmd.request_id, "ProducerBusy", "Empty subscription name")
            return
        try:
            full = str(TopicName.parse(cmd.topic))
            self.cluster.check_owner(full, self.broker_index)
            topic = self.cluster.get_topic(full, create=cmd.force_topic_creation)
            if cmd.HasField("schema"):
                topic.take_consumer_schema(cmd.schema)
            durable = cmd.durable
            if durable:
                start = topic.start_position(None, cmd.initialPosition == api.CommandSubscribe.Earliest)
            else:
                start_id = cmd.start_message_id if cmd.HasField("start_message_id") else None
                start = topic.start_position(start_id, cmd.initialPosition == api.CommandSubscribe.Earliest)
            subscription = topic.subscription(cmd.subscription, cmd.subType, durable, start)
            if durable and cmd.replicate_subscription_state and topic.geo is not None \
                    and topic.geo.ensure_controller() is not None:
                subscription.replicated = True
            name = cmd.consumer_name or f"{self.cluster.config.cluster_name}-consumer-{cmd.consumer_id}"
            consumer = Consumer(cmd.consumer_id, name, cmd.priority_level, self, self.connection_id)
            if cmd.HasField("consumer_epoch"):
                consumer.epoch = cmd.consumer_epoch
            ranges: list[tuple[int, int]] | None = None
            if cmd.HasField("keySharedMeta") and cmd.keySharedMeta.keySharedMode == api.KeySharedMode.STICKY:
                ranges = [(r.start, r.end) for r in cmd.keySharedMeta.hashRanges]
            self.consumers[cmd.consumer_id] = (consumer, subscription)
            mark = len(self.outbox)
            try:
                subscription.add_consumer(consumer, cmd.subType, ranges)
            except BrokerError:
                del self.consumers[cmd.consumer_id]
                if not subscription.consumers and not subscription.durable:
                    topic.remove_subscription(subscription.name)
                raise
        except BrokerError as exc:
            self._error(cmd.request_id, exc.server_error, exc.message)
            return
        # SUCCESS must reach the client before what joining already produced for it
        # (ACTIVE_CONSUMER_CHANGE of a Failover subscription), as on a real broker
        self._reply(api.CommandSuccess(request_id=cmd.request_id))
        if mark < len(self.outbox) - 1:
            self.outbox.insert(mark, self.outbox.pop())

    def _consumer(self, consumer_id: int) -> tuple[Consumer, Subscription] | None:
        return self.consumers.get(consumer_id)

    def _requested_consumer(self, consumer_id: int, request_id: int) -> tuple[Consumer, Subscription] | None:
        """The consumer a request names; when there is none, answers ConsumerNotFound and returns None."""
        found = self.consumers.get(consumer_id)
        if found is None:
            self._error(request_id, "ConsumerNotFound", "Consumer not found")
        return found

    def _on_flow(self, frame: Frame) -> None:
        cmd: api.CommandFlow = frame.command.flow
        found = self._consumer(cmd.consumer_id)
        if found is not None:
            found[1].flow(found[0], cmd.messagePermits)

    def _on_ack(self, frame: Frame) -> None:
        cmd: api.CommandAck = frame.command.ack
        found = self._consumer(cmd.consumer_id)
        error: BrokerError | None = None
        if cmd.HasField("txnid_most_bits") and cmd.HasField("txnid_least_bits"):
            error = BrokerError("NotAllowedError", _NO_TRANSACTION_ACK)  # not applied, as without a coordinator
        elif found is not None:
            try:
                found[1].ack(found[0], cmd.ack_type, list(cmd.message_id))
            except BrokerError as exc:
                error = exc
        if cmd.HasField("request_id"):
            reply = api.CommandAckResponse(consumer_id=cmd.consumer_id, request_id=cmd.request_id)
            if error is not None:
                reply.error = server_error(error.server_error)
                reply.message = error.message
            self._reply(reply)

    def _on_redeliver(self, frame: Frame) -> None:
        cmd: api.CommandRedeliverUnacknowledgedMessages = frame.command.redeliverUnacknowledgedMessages
        found = self._consumer(cmd.consumer_id)
        if found is None:
            return
        ids = [int(m.entryId) for m in cmd.message_ids] if len(cmd.message_ids) else None
        if cmd.HasField("consumer_epoch"):
            found[0].epoch = max(found[0].epoch or 0, cmd.consumer_epoch)
        found[1].redeliver(found[0], ids)

    def _on_close_consumer(self, frame: Frame) -> None:
        cmd: api.CommandCloseConsumer = frame.command.close_consumer
        found = self.consumers.pop(cmd.consumer_id, None)
        if found is not None:
            self._drop_consumer(*found)
        self._reply(api.CommandSuccess(request_id=cmd.request_id))

    def _drop_consumer(self, consumer: Consumer, subscription: Subscription) -> None:
        subscription.remove_consumer(consumer)
        if not subscription.durable and not subscription.consumers:
            subscription.topic.remove_subscription(subscription.name)

    def _on_unsubscribe(self, frame: Frame) -> None:
        cmd: api.CommandUnsubscribe = frame.command.unsubscribe
        found = self._requested_consumer(cmd.consumer_id, cmd.request_id)
        if found is None:
            return
        consumer, subscription = found
        others = [c for c in subscription.consumers if c is not consumer]
        if others and not cmd.force:  # (Pulsar's code and words, the dispatcher's canUnsubscribe)
            self._error(cmd.request_id, "MetadataError", "Unconnected or shared consumer attempting to unsubscribe")
            return
        for other in others:
            other.sink.send_close_consumer(other)
        del self.consumers[cmd.consumer_id]
        for c in list(subscription.consumers):
            subscription.remove_consumer(c)
        subscription.topic.remove_subscription(subscription.name)
        self._reply(api.CommandSuccess(request_id=cmd.request_id))

    def _on_seek(self, frame: Frame) -> None:
        cmd: api.CommandSeek = frame.command.seek
        found = self._requested_consumer(cmd.consumer_id, cmd.request_id)
        if found is None:
            return
        subscription = found[1]
        topic = subscription.topic
        if cmd.HasField("message_publish_time"):
            position = topic.ledger.first_at_or_after_time(cmd.message_publish_time)
        elif cmd.HasField("message_id"):
            mid = cmd.message_id
            ledger_id, entry_id = signed64(mid.ledgerId), signed64(mid.entryId)
            if ledger_id < topic.ledger.ledger_id or entry_id < 0:
                position = topic.ledger.first_entry_id
            elif ledger_id > topic.ledger.ledger_id:
                position = topic.ledger.next_entry_id
            else:
                position = min(entry_id, topic.ledger.next_entry_id)
        else:
            self._error(cmd.request_id, "MetadataError", "Message id and message publish time were not present")
            return
        subscription.seek(position)
        self._reply(api.CommandSuccess(request_id=cmd.request_id))

    def _on_get_last_message_id(self, frame: Frame) -> None:
        cmd: api.CommandGetLastMessageId = frame.command.getLastMessageId
        found = self._requested_consumer(cmd.consumer_id, cmd.request_id)
        if found is None:
            return
        subscription = found[1]
        topic = subscription.topic
        if topic.non_persistent:  # (word for word what Pulsar's broker answers there)
            self._error(cmd.request_id, "UnknownError", "Failed to recover Transaction Buffer.")
            return
        ledger = topic.ledger
        last = ledger.get(ledger.last_entry_id)
        batch_index = last.num_messages - 1 if last is not None and last.batched else -1
        entry_id = ledger.last_entry_id
        # (a topic nothing was ever written to: -1:-1, as Pulsar's broker answers)
        last_id = api.MessageIdData(ledgerId=ledger.ledger_id if entry_id >= 0 else NO_REQUEST_ID,
                                    entryId=entry_id if entry_id >= 0 else NO_REQUEST_ID,
                                    partition=topic.partition_index, batch_index=batch_index)
        mark = subscription.cursor.mark_delete
        mark_id = api.MessageIdData(ledgerId=ledger.ledger_id, entryId=mark if mark >= 0 else NO_REQUEST_ID)
        self._reply(api.CommandGetLastMessageIdResponse(last_message_id=last_id, request_id=cmd.request_id,
                                                        consumer_mark_delete_position=mark_id))

    def _on_consumer_stats(self, frame: Frame) -> None:
        cmd: api.CommandConsumerStats = frame.command.consumerStats
        found = self._consumer(cmd.consumer_id)
        if found is None:
            self._reply(api.CommandConsumerStatsResponse(
                request_id=cmd.request_id, error_code=api.ServerError.ConsumerNotFound,
                error_message="Consumer not found"))
            return
        consumer, subscription = found
        self._reply(api.CommandConsumerStatsResponse(
            request_id=cmd.request_id, consumerName=consumer.consumer_name,
            availablePermits=max(consumer.permits, 0), unackedMessages=consumer.unacked_messages,
            blockedConsumerOnUnackedMsgs=(subscription.is_shared
                                          and consumer.unacked_messages >= subscription.max_unacked),
            address=self.peer, connectedSince="", type=api.CommandSubscribe.SubType.Name(subscription.sub_type),
            msgBacklog=subscription.backlog(), msgRateOut=0.0, msgThroughputOut=0.0, msgRateRedeliver=0.0,
            msgRateExpired=0.0))

    # schemas ----------------------------------------------------------------------

    def _on_get_schema(self, frame: Frame) -> None:
        """The schema of a topic's schema name (its partitions share it; the topic need not exist), as the real
        broker answers: an empty version asked is IncompatibleSchema, a name it cannot read InvalidTopicName, no
        such schema (or version) TopicNotFound naming the topic as asked; a found one is named by its schema name."""
        cmd: api.CommandGetSchema = frame.command.getSchema
        response = api.CommandGetSchemaResponse
        if cmd.HasField("schema_version") and not cmd.schema_version:
            self._reply(response(request_id=cmd.request_id, error_code=api.ServerError.IncompatibleSchema,
                                 error_message="Empty schema version"))
            return
        try:
            schema_name = TopicName.parse(cmd.topic).schema_name
        except BrokerError as exc:
            self._reply(response(request_id=cmd.request_id, error_code=server_error(exc.server_error),
                                 error_message=exc.message))
            return
        version = int.from_bytes(cmd.schema_version, "big") if cmd.HasField("schema_version") else None
        stored = schema_version(self.cluster.schemas.get(schema_name, []), version)
        if stored is None:
            self._reply(response(request_id=cmd.request_id, error_code=api.ServerError.TopicNotFound,
                                 error_message=f"Topic not found or no-schema {cmd.topic}"))
            return
        named = api.Schema()
        named.CopyFrom(stored.schema)
        named.name = schema_name
        self._reply(response(request_id=cmd.request_id, schema=named, schema_version=_version_bytes(stored.version)))

    def _on_get_or_create_schema(self, frame: Frame) -> None:
        cmd: api.CommandGetOrCreateSchema = frame.command.getOrCreateSchema
        try:
            version = self.cluster.get_topic(cmd.topic).add_schema(cmd.schema)
        except BrokerError as exc:
            self._reply(api.CommandGetOrCreateSchemaResponse(
                request_id=cmd.request_id, error_code=server_error(exc.server_error),
                error_message=exc.message))
            return
        self._reply(api.CommandGetOrCreateSchemaResponse(request_id=cmd.request_id,
                                                         schema_version=_version_bytes(version)))

    # -- what subscriptions push (ConsumerSink) ------------------------------------------

    def send_message(self, consumer: Consumer, entry: Entry, redelivery_count: int,
                     ack_set: list[int] | None) -> None:
        found = self.consumers.get(consumer.consumer_id)
        if found is None or found[0] is not consumer:
            return
        topic = found[1].topic
        message_id = api.MessageIdData(ledgerId=0, entryId=0) if topic.non_persistent else \
            api.MessageIdData(ledgerId=topic.ledger.ledger_id, entryId=entry.entry_id)
        if topic.partition_index >= 0:
            message_id.partition = topic.partition_index
        cmd = api.BaseCommand(type=T.MESSAGE)
        msg = cmd.message
        msg.consumer_id = consumer.consumer_id
        msg.message_id.CopyFrom(message_id)
        if redelivery_count:
            msg.redelivery_count = redelivery_count
        if ack_set:
            msg.ack_set.extend(ack_set)
        if consumer.epoch is not None:
            msg.consumer_epoch = consumer.epoch
        self._emit(message_frame(cmd, entry.section))

    def send_active_consumer_change(self, consumer: Consumer, is_active: bool) -> None:
        if consumer.consumer_id in self.consumers:
            self._reply(api.CommandActiveConsumerChange(consumer_id=consumer.consumer_id, is_active=is_active))

    def send_reached_end_of_topic(self, consumer: Consumer) -> None:
        if consumer.consumer_id in self.consumers:
            self._reply(api.CommandReachedEndOfTopic(consumer_id=consumer.consumer_id))

    def send_close_consumer(self, consumer: Consumer) -> None:
        found = self.consumers.get(consumer.consumer_id)
        if found is None or found[0] is not consumer:
            return
        del self.consumers[consumer.consumer_id]
        self._reply(api.CommandCloseConsumer(consumer_id=consumer.consumer_id, request_id=NO_REQUEST_ID))

    # -- teardown ----------------------------------------------------------------

    def close(self) -> None:
        """The connection is gone: release its producers and consumers."""
        self.closing = True
        for producer, topic in self.producers.values():
            topic.remove_producer(producer)
        self.producers.clear()
        for consumer, subscription in list(self.consumers.values()):
            self._drop_consumer(consumer, subscription)
        self.consumers.clear()


def _version_bytes(version: int) -> bytes:
    """A schema version as Pulsar's LongSchemaVersion writes it: 8 bytes, big-endian."""
    return version.to_bytes(8, "big")


_HANDLERS: Final[dict[int, Callable[[BrokerConnection, Frame], None]]] = {
    T.CONNECT: BrokerConnection._on_connect,
    T.AUTH_RESPONSE: BrokerConnection._on_auth_response,
    T.PING: BrokerConnection._on_ping,
    T.PONG: BrokerConnection._on_pong,
    T.PARTITIONED_METADATA: BrokerConnection._on_partitioned_metadata,
    T.LOOKUP: BrokerConnection._on_lookup,
    T.GET_TOPICS_OF_NAMESPACE: BrokerConnection._on_get_topics_of_namespace,
    T.PRODUCER: BrokerConnection._on_producer,
    T.SEND: BrokerConnection._on_send,
    T.CLOSE_PRODUCER: BrokerConnection._on_close_producer,
    T.SUBSCRIBE: BrokerConnection._on_subscribe,
    T.FLOW: BrokerConnection._on_flow,
    T.ACK: BrokerConnection._on_ack,
    T.REDELIVER_UNACKNOWLEDGED_MESSAGES: BrokerConnection._on_redeliver,
    T.CLOSE_CONSUMER: BrokerConnection._on_close_consumer,
    T.UNSUBSCRIBE: BrokerConnection._on_unsubscribe,
    T.SEEK: BrokerConnection._on_seek,
    T.GET_LAST_MESSAGE_ID: BrokerConnection._on_get_last_message_id,
    T.CONSUMER_STATS: BrokerConnection._on_consumer_stats,
    T.GET_SCHEMA: BrokerConnection._on_get_schema,
    T.GET_OR_CREATE_SCHEMA: BrokerConnection._on_get_or_create_schema,
}
