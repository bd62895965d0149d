"""Client-side replay: re-enact the recorded clients against a broker and diff the answers.

``pulsar-tap replay REC --upstream URL [--speed X]``.  Every frame the recorded
clients sent (:mod:`proxy.replay.conversation`) is re-issued in capture order,
paced by the recorded times divided by ``speed`` (0: no waiting), through the
built-in client's connection layer (:mod:`proxy.client.connection`; its
:class:`~proxy.client.lookup.LookupService` redoes lookups against the new
cluster):

- LOOKUP and PARTITIONED_METADATA are redone as lookups;
- PRODUCER and SUBSCRIBE go to the broker that owns their topic there, with new
  producer, consumer and request ids (the recorded ones are mapped to them);
- SEND frames are re-sent with their recorded metadata and payload — keys,
  properties, batches, compression as they were — under the new producer id;
- FLOW is re-issued; ACK too, its message ids translated: the n-th message the
  recorded consumer received is the n-th message the live one receives;
- other requests are re-sent with the ids remapped;
- transaction ids are the live coordinator's: a NEW_TXN's answer maps the recorded
  transaction to the live one, and every SEND (its MessageMetadata too), ACK and
  transaction command that names it is re-sent naming the live one
  (:class:`~proxy.replay.client_side.TxnIds`); an END_TXN waits for the answers
  to the SENDs in flight, as the recorded client did before it ended its
  transaction (the coordinator's connection may not be the producer's).

A CLOSE_PRODUCER the recorded client received (the broker's, or the proxy's on its
behalf, as a ``close`` rule sends) closes the live producer at the same point, so the
SENDs still in flight get the live broker's answer to a closed producer, as they
did; they stay addressed to it.  For such an abandoned SEND, ``unanswered`` and
``error:CODE`` are the same outcome (which one the recording holds is a race with
the end of the connection); only ``ok`` on one side alone is a difference.

A recorded PRODUCER that reuses the id of a producer of the replay is the client
re-creating a producer it lost: the live one is closed (if it is not yet) once its
SENDs are answered, the new one is created under the name the live broker gave the
first (the recorded request names the one the recorded broker gave), and the SENDs
that follow go to it.  Requests the proxy answered or swallowed (``Exchange.proxy_handled``: an injected ERROR, the SEND
a ``close`` rule took) are neither re-sent nor compared — a live broker was never
asked them — and are counted in ``ReplayResult.proxy_handled``.

Each request's answer is compared with the recorded one by outcome only
(``ok``, ``error:CODE`` — an ERROR, or the ``error`` field of a response
such as END_TXN_RESPONSE —, ``unanswered``; ``not-sent`` when the producer or
consumer it needs could not be created): message ids, generated names and
timing are not differences.  :class:`~proxy.replay.client_side.ReplayDiff` is one
differing request, printed as ``DIFF conn=N COMMAND topic=T recorded=OUTCOME replayed=OUTCOME``.
That account, the step order and the comparison are sans-IO
(:mod:`proxy.replay.client_side`); this module is the Trio edge that talks to the broker.

:meth:`ClientReplayer.stop` (``pulsar-tap replay`` calls it on SIGINT/SIGTERM)
ends the replay early: nothing more is sent, the answers to what was sent are
awaited briefly, and only the requests that were replayed are compared
(``ReplayResult.stopped`` is set).  ``requests_total``, ``steps_done`` and
``position_ns`` let a caller show progress while the original pace is kept.
"""

from __future__ import annotations

from typing import Any, Final

import structlog
import trio

from proxy.client.connection import ClientConnection, ConnectionConfig, ConnectionPool
from proxy.client.lookup import LookupService
from proxy.client.names import parse_service_url
from proxy.errors import BrokerError, ClientError, ConnectionFailed, ProtocolError, RequestTimeout
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T, sub_command
from proxy.protocol.frame import Frame, encode_payload_command
from proxy.protocol.session import response_error
from proxy.replay.client_side import (
    NOT_SENT,
    ReplayResult,
    ReplayScore,
    TxnIds,
    live_producer_name,
    load_conversations,
    recorded_producer_name,
    steps_in_order,
)
from proxy.replay.conversation import OK, UNANSWERED, Conversation, Exchange, Step, error_outcome, with_command
from proxy.replay.matcher import message_id_key

log = structlog.get_logger("pulsar_tap.replay")

#: handshake and keepalive frames: the connection layer plays those itself
_CONNECTION_FRAMES: Final = frozenset({T.CONNECT, T.PING, T.PONG, T.AUTH_RESPONSE})


class _LiveProducer:
    """A re-created producer: collects the answers to its SENDs."""

    def __init__(self, connection: ClientConnection, producer_id: int) -> None:
        self.connection = connection
        self.producer_id = producer_id
        self.pending: dict[int, Exchange] = {}  # sequence id -> the recorded SEND's exchange
        self.highest: dict[int, int] = {}  # a batch's highest sequence id -> its sequence id
        self.outcomes: dict[int, str] = {}      # id(exchange) -> outcome
        self.all_answered = trio.Event()
        self.all_answered.set()
        self.closed = False  # closed on the broker, as the recording says it was

    def expect(self, sequence_id: int, exchange: Exchange) -> None:
        self.pending[sequence_id] = exchange
        sub: Any = exchange.request.sub
        if sub.HasField("highest_sequence_id"):
            self.highest[sub.highest_sequence_id] = sequence_id
        if self.all_answered.is_set():
            self.all_answered = trio.Event()

    def handle_frame(self, connection: ClientConnection, frame: Frame) -> None:
        if frame.type not in (T.SEND_RECEIPT, T.SEND_ERROR):
            return
        sub: Any = frame.sub
        # a broker answers some refusals of a batch under its highest sequence id (a SEND in a transaction)
        sequence_id = sub.sequence_id if sub.sequence_id in self.pending else self.highest.get(sub.sequence_id, -1)
        exchange = self.pending.pop(sequence_id, None)
        if exchange is not None:
            request: Any = exchange.request.sub
            if request.HasField("highest_sequence_id"):
                self.highest.pop(request.highest_sequence_id, None)
            self.outcomes[id(exchange)] = (OK if frame.type == T.SEND_RECEIPT
                                           else error_outcome(api.ServerError.Name(sub.error)))
        if not self.pending:
            self.all_answered.set()

    def connection_closed(self, connection: ClientConnection) -> None:
        self.pending.clear()
        self.highest.clear()
        self.all_answered.set()


class _LiveConsumer:
    """A re-created consumer: remembers the ids of the messages it received, in order."""

    def __init__(self, connection: ClientConnection, consumer_id: int) -> None:
        self.connection = connection
        self.consumer_id = consumer_id
        self.received: list[api.MessageIdData] = []
        self.arrived = trio.Event()
        self.starved = False

    def handle_frame(self, connection: ClientConnection, frame: Frame) -> None:
        if frame.type == T.MESSAGE:
            self.received.append(frame.command.message.message_id)
            self.arrived.set()
            self.arrived = trio.Event()

    def connection_closed(self, connection: ClientConnection) -> None:
        self.arrived.set()

    async def message_id(self, index: int, wait_s: float) -> api.MessageIdData | None:
        """The id of the ``index``-th message received, waiting for it up to ``wait_s`` seconds."""
        if not self.starved:
            with trio.move_on_after(wait_s):
                while len(self.received) <= index and not self.connection.closed.is_set():
                    await self.arrived.wait()
        if index < len(self.received):
            return self.received[index]
        self.starved = True  # one wait in vain is enough: later ACKs of it do not wait again
        return None


class ClientReplayer:
    """Re-enacts recorded client connections against ``upstream`` (see the module docstring)."""

    def __init__(self, conversations: dict[int, Conversation], upstream: str, *, speed: float = 1.0,
                 operation_timeout: float = 10.0, receipt_timeout: float = 10.0, token: str | None = None) -> None:
        if speed < 0:
            raise ValueError("speed must be 0 (as fast as possible) or more")
        self.conversations = conversations
        self.service = parse_service_url(upstream)
        self.speed = speed
        self.receipt_timeout = receipt_timeout
        auth = None
        if token is not None:
            from proxy.client.connection import TokenAuthentication
            auth = TokenAuthentication(token)
        self.config = ConnectionConfig(auth=auth, operation_timeout=operation_timeout,
                                       connection_timeout=operation_timeout)
        self._producers: dict[tuple[int, int], _LiveProducer] = {}
        self._retired_producers: list[_LiveProducer] = []  # replaced by a re-creation; answers still count
        self._producer_names: dict[str, str] = {}  # name the recorded broker gave -> name the live one gave
        self._consumers: dict[tuple[int, int], _LiveConsumer] = {}
        self._txnids = TxnIds()
        self._next_id = 0
        self._lookup: LookupService | None = None
        self._pool: ConnectionPool | None = None
        self.score = ReplayScore(conversations)
        self.result = self.score.result
        self._stop = trio.Event()
        #: progress: recorded requests in all, steps issued, and the recorded time reached (ns from the first step)
        self.requests_total = sum(1 for conv in conversations.values() for e in conv.exchanges if not e.proxy_handled)
        self.steps_done = 0
        self.position_ns = 0
        steps = [step.ts_ns for conv in conversations.values() for step in conv.steps]
        self.span_ns = max(steps) - min(steps) if steps else 0

    def stop(self) -> None:
        """Send nothing more; wait briefly for the answers to what was sent, then compare that."""
        self.result.stopped = True
        self._stop.set()

    async def run(self) -> ReplayResult:
        """Replay everything; raises ConnectionFailed when the upstream cannot be reached at all."""
        unreachable: ClientError | None = None
        async with trio.open_nursery() as nursery:
            self._pool = ConnectionPool(nursery, self.config)
            self._lookup = LookupService(self._pool, self.service)
            try:
                await self._lookup.service_connection()
            except ClientError as exc:
                unreachable = exc
            try:
                if unreachable is None:
                    with trio.CancelScope() as replaying:
                        nursery.start_soon(self._cancel_on_stop, replaying)
                        await self._replay_all()
                    await self._await_receipts()
            finally:
                self._pool.close_all()
                nursery.cancel_scope.cancel()
        if unreachable is not None:
            raise ConnectionFailed(f"cannot reach the upstream: {unreachable}")
        self.score.diffs()
        if self.result.proxy_handled:
            log.info("requests the proxy answered or swallowed were not replayed",
                     proxy_handled=self.result.proxy_handled)
        return self.result

    async def _cancel_on_stop(self, scope: trio.CancelScope) -> None:
        await self._stop.wait()
        scope.cancel()

    async def _replay_all(self) -> None:
        start_ns: int | None = None
        clock_start = trio.current_time()
        first_ns: int | None = None
        for conv, step in steps_in_order(self.conversations):
            first_ns = step.ts_ns if first_ns is None else first_ns
            self.position_ns = step.ts_ns - first_ns
            self.steps_done += 1
            if step.frame.type in _CONNECTION_FRAMES:
                continue
            if step.closed_under_client:
                producer = self._producers.get((conv.conn, step.frame.command.close_producer.producer_id))
                if producer is not None:
                    await self._close_producer(conv.conn, producer)
                continue
            if step.exchange is not None and step.exchange.proxy_handled:
                self.result.proxy_handled += 1
                continue
            if self.speed > 0:
                start_ns = step.ts_ns if start_ns is None else start_ns
                await trio.sleep_until(clock_start + (step.ts_ns - start_ns) / 1e9 / self.speed)
            if step.exchange is not None:
                self.score.issued(step.exchange)
            try:
                outcome = await self._replay_step(conv, step)
            except BrokerError as exc:
                outcome = error_outcome(exc.server_error)
            except RequestTimeout:
                outcome = UNANSWERED
            except (ClientError, ProtocolError) as exc:
                # the connection could not be opened or broke: the request got no broker answer
                log.warning("replayed request failed", conn=conv.conn, command=step.frame.type_name, error=str(exc))
                outcome = NOT_SENT
            if step.exchange is not None and outcome is not None:
                self.score.answered(step.exchange, outcome)

    async def _replay_step(self, conv: Conversation, step: Step) -> str | None:
        """Re-issue one recorded frame; returns the outcome of a request (None: answered later, or none)."""
        frame = step.frame
        kind = frame.type
        sub: Any = frame.sub
        assert self._lookup is not None
        if kind == T.LOOKUP:
            await self._lookup.lookup(sub.topic)
            return OK
        if kind == T.PARTITIONED_METADATA:
            await self._lookup.partitioned_metadata(sub.topic)
            return OK
        if kind == T.PRODUCER:
            return await self._create(conv, frame, sub, producer=True)
        if kind == T.SUBSCRIBE:
            return await self._create(conv, frame, sub, producer=False)
        if kind == T.SEND:
            return self._send(conv, step, sub)
        if kind == T.ACK:
            return await self._ack(conv, frame, sub)
        if kind == T.END_TXN:
            await self._sends_answered()
        cmd = api.BaseCommand()
        cmd.CopyFrom(frame.command)
        live_sub: Any = sub_command(cmd)
        fields = live_sub.DESCRIPTOR.fields_by_name
        connection: ClientConnection | None = None
        if "producer_id" in fields and live_sub.HasField("producer_id"):
            producer = self._producers.get((conv.conn, live_sub.producer_id))
            if producer is None:
                return NOT_SENT
            live_sub.producer_id, connection = producer.producer_id, producer.connection
        elif "consumer_id" in fields and live_sub.HasField("consumer_id"):
            consumer = self._consumers.get((conv.conn, live_sub.consumer_id))
            if consumer is None:
                return NOT_SENT
            live_sub.consumer_id, connection = consumer.consumer_id, consumer.connection
        if connection is None:
            connection = await self._lookup.service_connection()
        self._txnids.translate(live_sub)
        if "request_id" in fields and live_sub.HasField("request_id"):
            live_sub.request_id = connection.new_request_id()
            answer = await connection.request(live_sub)
            self._txnids.learn(step.exchange.response if step.exchange is not None else None, answer)
            return _outcome_of_answer(answer)
        connection.send_command(live_sub)
        self.result.frames_sent += 1
        return None

    async def _create(self, conv: Conversation, frame: Frame, sub: Any, *, producer: bool) -> str:
        assert self._lookup is not None and self._pool is not None
        where = await self._lookup.lookup(sub.topic)
        connection = await self._pool.get(where.logical, where.physical)
        live: Any = type(sub)()
        live.CopyFrom(sub)
        self._next_id += 1
        live.request_id = connection.new_request_id()
        if producer:
            await self._retire_producer(conv.conn, sub.producer_id)
            if live.HasField("producer_name") and live.producer_name in self._producer_names:
                live.producer_name = self._producer_names[live.producer_name]
            live.producer_id = self._next_id
            handler_p = _LiveProducer(connection, self._next_id)
            connection.register_producer(self._next_id, handler_p)
            try:
                answer = await connection.request(live)
            except ClientError:
                connection.unregister_producer(self._next_id)
                raise
            self._producers[(conv.conn, sub.producer_id)] = handler_p
            self._remember_producer_name(conv, sub.producer_id, answer)
        else:
            live.consumer_id = self._next_id
            handler_c = _LiveConsumer(connection, self._next_id)
            connection.register_consumer(self._next_id, handler_c)
            try:
                await connection.request(live)
            except ClientError:
                connection.unregister_consumer(self._next_id)
                raise
            self._consumers[(conv.conn, sub.consumer_id)] = handler_c
        return OK

    async def _retire_producer(self, conn: int, recorded_id: int) -> None:
        """Close the live producer a re-creation replaces, once its SENDs are answered.

        The recorded client only re-creates a producer it lost; the live broker never
        closed it, so it is closed here, as the recorded one was, without losing an answer.
        """
        old = self._producers.pop((conn, recorded_id), None)
        if old is None:
            return
        self._retired_producers.append(old)
        with trio.move_on_after(self.receipt_timeout):
            await old.all_answered.wait()
        await self._close_producer(conn, old)
        old.connection.unregister_producer(old.producer_id)

    async def _close_producer(self, conn: int, producer: _LiveProducer) -> None:
        """Close ``producer`` on the live broker; it stays registered for the answers to SENDs in flight."""
        if producer.closed or producer.connection.closed.is_set():
            return
        producer.closed = True
        try:
            await producer.connection.request(api.CommandCloseProducer(
                producer_id=producer.producer_id, request_id=producer.connection.new_request_id()))
        except ClientError as exc:
            log.warning("closing a replayed producer failed", conn=conn, error=str(exc))

    def _remember_producer_name(self, conv: Conversation, recorded_id: int, answer: Frame) -> None:
        recorded_name, live_name = recorded_producer_name(conv, recorded_id), live_producer_name(answer)
        if recorded_name is not None and live_name is not None:
            self._producer_names.setdefault(recorded_name, live_name)

    def _send(self, conv: Conversation, step: Step, sub: Any) -> str | None:
        producer = self._producers.get((conv.conn, sub.producer_id))
        if producer is None or producer.connection.closed.is_set():
            return NOT_SENT
        frame = step.frame
        cmd = api.BaseCommand()
        cmd.CopyFrom(frame.command)
        cmd.send.producer_id = producer.producer_id
        self._txnids.translate(cmd.send)
        section = frame.payload
        metadata = None
        if section is not None and sub.HasField("txnid_least_bits"):
            metadata = api.MessageMetadata()
            metadata.CopyFrom(section.metadata)
            if not self._txnids.translate(metadata):
                metadata = None
        if section is not None and (metadata is not None or not section.checksum_ok()):
            # a metadata naming the live transaction, or payloads that were not recorded (zero-filled):
            # sent with a checksum that holds
            data = encode_payload_command(cmd, section.metadata_raw if metadata is None else metadata,
                                          section.payload)
        else:
            data = with_command(frame, cmd)
        if step.exchange is not None:
            producer.expect(sub.sequence_id, step.exchange)
        producer.connection.send(data, T.SEND)
        self.result.frames_sent += 1
        return None

    async def _ack(self, conv: Conversation, frame: Frame, sub: Any) -> str | None:
        consumer = self._consumers.get((conv.conn, sub.consumer_id))
        if consumer is None:
            return NOT_SENT
        order = {message_id_key(m)[:2]: i for i, m in enumerate(conv.messages.get(sub.consumer_id, []))}
        cmd = api.BaseCommand()
        cmd.CopyFrom(frame.command)
        ack = cmd.ack
        ack.consumer_id = consumer.consumer_id
        self._txnids.translate(ack)
        for message_id in ack.message_id:
            index = order.get((message_id.ledgerId, message_id.entryId))
            live = None if index is None else await consumer.message_id(index, self.receipt_timeout)
            if live is None:
                log.warning("cannot translate an acked message id", conn=conv.conn,
                            ledger=message_id.ledgerId, entry=message_id.entryId)
                continue
            message_id.ledgerId, message_id.entryId = live.ledgerId, live.entryId
            if live.HasField("partition"):
                message_id.partition = live.partition
        if ack.HasField("request_id"):
            ack.request_id = consumer.connection.new_request_id()
            return _outcome_of_answer(await consumer.connection.request(ack))
        consumer.connection.send_command(ack)
        self.result.frames_sent += 1
        return None

    async def _sends_answered(self) -> None:
        """Wait (up to the receipt timeout) for the answers to the SENDs in flight: a client ends a transaction
        once its sends in it are acknowledged, and END_TXN may travel on another connection than they did."""
        with trio.move_on_after(self.receipt_timeout):
            for producer in self._producers.values():
                await producer.all_answered.wait()

    async def _await_receipts(self) -> None:
        with trio.move_on_after(min(self.receipt_timeout, 2.0) if self.result.stopped else self.receipt_timeout):
            for producer in self._producers.values():
                await producer.all_answered.wait()
        for producer in [*self._retired_producers, *self._producers.values()]:
            self.score.outcomes.update(producer.outcomes)

def _outcome_of_answer(answer: Frame) -> str:
    """``ok``, or ``error:CODE`` for a response whose own ``error`` field reports a failure (END_TXN_RESPONSE,
    ACK_RESPONSE...: the connection raises only for ERROR)."""
    code, _message = response_error(answer.type, answer.sub)
    return OK if code is None else error_outcome(code)


async def replay_recording(path: str, upstream: str, *, speed: float = 1.0, operation_timeout: float = 10.0,
                           receipt_timeout: float = 10.0, token: str | None = None) -> ReplayResult:
    """Replay the recording at ``path`` (a recording or a parent of several) against ``upstream``."""
    conversations, _ = await trio.to_thread.run_sync(load_conversations, path)
    replayer = ClientReplayer(conversations, upstream, speed=speed, operation_timeout=operation_timeout,
                              receipt_timeout=receipt_timeout, token=token)
    return await replayer.run()


__all__ = ["ClientReplayer", "replay_recording"]
