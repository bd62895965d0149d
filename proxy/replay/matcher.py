"""The replay matcher: recorded answers indexed by what a request is about, never by its ids.

Broker-side replay answers a live client from a recording.  Ids (request,
producer, consumer) are the client's own and differ on every run, so
:class:`AnswerBook` indexes the recorded request/response pairs of every
connection (:mod:`proxy.replay.conversation`) by command and key fields:

=====================  ===================================================
request                key
=====================  ===================================================
LOOKUP, PARTITIONED_   topic
METADATA, GET_SCHEMA
PRODUCER               topic, requested producer name (None if generated)
SUBSCRIBE              topic, subscription
SEND                   the producer's key, then message order (n-th SEND)
MESSAGE (pushed)       topic, subscription, in recorded order
id-only requests       the key of the producer or consumer they name
GET_TOPICS_OF_NAMESP.  namespace
=====================  ===================================================

Repeated requests with one key take the recorded answers in order; past the
last one the last is repeated, so any number of clients can be served.  The
``remap_*`` functions copy a recorded answer and put the live ids in.  Pure:
no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import T, sub_command
from proxy.protocol.frame import Frame
from proxy.replay.conversation import Conversation, Exchange

#: id fields a recorded answer carries that must become the live client's
_ID_FIELDS: Final = ("request_id", "producer_id", "consumer_id")
_LookupType = api.CommandLookupTopicResponse.LookupType


def message_id_key(frame: Frame) -> tuple[int, int, int, int]:
    """A MESSAGE's id as a hashable tuple (ledger, entry, partition, batch index)."""
    mid = frame.command.message.message_id
    return (mid.ledgerId, mid.entryId, mid.partition if mid.HasField("partition") else -1,
            mid.batch_index if mid.HasField("batch_index") else -1)


def permits_of(frame: Frame) -> int:
    """How many FLOW permits a MESSAGE frame uses: the messages in its batch."""
    section = frame.payload
    if section is None:
        return 1
    metadata = section.metadata
    return metadata.num_messages_in_batch if metadata.HasField("num_messages_in_batch") else 1


@dataclass(slots=True)
class AnswerBook:
    """Every recorded answer, indexed by key (see the module docstring)."""

    connected: api.CommandConnected | None = None
    answers: dict[tuple[Any, ...], list[Exchange]] = field(default_factory=dict)
    #: producer key -> the answers to its SENDs (SEND_RECEIPT / SEND_ERROR), in SEND order
    receipts: dict[tuple[Any, ...], list[Frame]] = field(default_factory=dict)
    #: (topic, subscription) -> the MESSAGE frames its consumers received, each message once
    messages: dict[tuple[str, str], list[Frame]] = field(default_factory=dict)
    #: every topic the recording names
    topics: set[str] = field(default_factory=set)
    #: keys of requests the recording saw go unanswered (a replay leaves them unanswered too)
    unanswered: set[tuple[Any, ...]] = field(default_factory=set)

    @classmethod
    def from_conversations(cls, conversations: Iterable[Conversation]) -> AnswerBook:
        book = cls()
        seen_messages: dict[tuple[str, str], set[tuple[int, int, int, int]]] = {}
        for conv in conversations:
            if book.connected is None and conv.connected is not None:
                book.connected = conv.connected.command.connected
            for exchange in conv.exchanges:
                if exchange.topic:
                    book.topics.add(exchange.topic)
                if exchange.request.type == T.SEND:
                    if exchange.response is not None:
                        book.receipts.setdefault(exchange.key[1:], []).append(exchange.response)
                    continue
                if exchange.response is None:
                    book.unanswered.add(exchange.key)
                else:
                    book.answers.setdefault(exchange.key, []).append(exchange)
            for consumer_id, frames in conv.messages.items():
                owner = conv.consumers.get(consumer_id)
                if owner is None:
                    continue
                seen = seen_messages.setdefault(owner, set())
                queue = book.messages.setdefault(owner, [])
                for frame in frames:
                    key = message_id_key(frame)
                    if key not in seen:
                        seen.add(key)
                        queue.append(frame)
        return book

    def lookup(self, key: tuple[Any, ...], index: int) -> Exchange | None:
        """The ``index``-th recorded answer for ``key`` (the last one past the end), with fallbacks.

        A PRODUCER asking for a name the recording does not have falls back to the
        producers of that topic whose names the broker generated, then to any.
        """
        for candidate in self._candidates(key):
            found = self.answers.get(candidate)
            if found:
                return found[min(index, len(found) - 1)]
        return None

    def _candidates(self, key: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        candidates = [key]
        if key[0] == T.PRODUCER:
            if key[2] is not None:
                candidates.append((T.PRODUCER, key[1], None))
            candidates.extend(k for k in self.answers if k[0] == T.PRODUCER and k[1] == key[1] and k not in candidates)
        return candidates

    def knows_topic(self, topic: str) -> bool:
        return topic in self.topics


def remap(recorded: Frame, **live_ids: int) -> api.BaseCommand:
    """A copy of a recorded answer's command with the live ids written over the recorded ones."""
    cmd = api.BaseCommand()
    cmd.CopyFrom(recorded.command)
    sub: Any = sub_command(cmd)
    for name in _ID_FIELDS:
        if name in live_ids and name in sub.DESCRIPTOR.fields_by_name:
            setattr(sub, name, live_ids[name])
    return cmd


def lookup_answer(recorded: Frame, request_id: int, own_url: str) -> api.BaseCommand:
    """A LOOKUP answer: the recorded failure, or Connect to this replay server."""
    cmd = remap(recorded, request_id=request_id)
    if recorded.type == T.LOOKUP_RESPONSE and cmd.lookupTopicResponse.response != _LookupType.Failed:
        answer = cmd.lookupTopicResponse
        answer.response = _LookupType.Connect
        answer.brokerServiceUrl = own_url
        answer.ClearField("brokerServiceUrlTls")
        answer.authoritative = True
        answer.proxy_through_service_url = False
    return cmd


def connected_answer(recorded: api.CommandConnected | None, client_protocol: int) -> api.BaseCommand:
    """CONNECTED: the recorded one (protocol version capped at the client's), or a plain one."""
    connected = api.CommandConnected(server_version="pulsar-tap-replay", protocol_version=client_protocol)
    if recorded is not None:
        connected.CopyFrom(recorded)
        connected.protocol_version = min(recorded.protocol_version, client_protocol)
    return api.BaseCommand(type=T.CONNECTED, connected=connected)


def receipt_answer(recorded: list[Frame], index: int, producer_id: int, sequence_id: int,
                   highest_sequence_id: int | None) -> api.BaseCommand:
    """The answer to the ``index``-th SEND of a producer: the recorded one, or a receipt that
    continues the recorded message ids."""
    if index < len(recorded):
        cmd = remap(recorded[index], producer_id=producer_id)
    else:
        ledger, entry = 0, -1
        for frame in reversed(recorded):
            if frame.type == T.SEND_RECEIPT:
                last = frame.command.send_receipt.message_id
                ledger, entry = last.ledgerId, last.entryId
                break
        extra = index - len(recorded) + 1
        cmd = api.BaseCommand(type=T.SEND_RECEIPT, send_receipt=api.CommandSendReceipt(
            producer_id=producer_id, sequence_id=sequence_id,
            message_id=api.MessageIdData(ledgerId=ledger, entryId=entry + extra)))
    sub: Any = sub_command(cmd)
    sub.sequence_id = sequence_id
    if cmd.type == T.SEND_RECEIPT:
        if highest_sequence_id is not None:
            sub.highest_sequence_id = highest_sequence_id
        else:
            sub.ClearField("highest_sequence_id")
    return cmd


def error_answer(request_id: int, code: int, message: str) -> api.BaseCommand:
    return api.BaseCommand(type=T.ERROR, error=api.CommandError(request_id=request_id, error=code, message=message))


__all__ = ["AnswerBook", "connected_answer", "error_answer", "lookup_answer", "message_id_key", "permits_of",
           "receipt_answer", "remap"]
