"""The actions of the rule language, one class each, and the frames they put on the wire.

Each action is one frozen class (SPEC.md, "Rule language") that owns everything about
it: its name in a rule file (``NAME``), its parameters — read and validated by
:meth:`Action.parse`, written back normalised by :meth:`Action.params` — which
commands it can act on (``APPLIES_TO``: a rule naming others is refused by the loader,
a rule naming none gets these), and its decision on a frame (:meth:`Action.decide`,
a :class:`~proxy.rules.verdict.Verdict`, or None when it turns out not to apply).
``record`` and ``mark`` *compose* with the rule that decides (``COMPOSES``).
:data:`ACTIONS` lists them by name; the loader and the engine know no action by name.

The frames the actions write are built with the protocol encoders:

- ``error``: the reply a broker gives when it refuses the request (Pulsar binary
  protocol, "Error handling"): SEND_ERROR for SEND, a LOOKUP_RESPONSE or
  PARTITIONED_METADATA_RESPONSE with ``response = Failed`` for lookups, for the
  transaction commands and an ACK awaiting its answer their own response with its
  ``error`` and ``message`` set (ServerCnx answers them so, and the Java client waits
  out its operation timeout on an ERROR there), ERROR with the ``request_id`` for
  every other request;
- ``close``: CLOSE_PRODUCER / CLOSE_CONSUMER as a broker sends on a topic unload
  (``request_id`` -1, as ServerCnx does), and the same close as a request to the
  broker so that the client's re-creation succeeds (what happens in between:
  :mod:`proxy.rules.unload`);
- ``corrupt``: a damaged checksum, payload or metadata (the latter two re-encoded
  with a fresh checksum, so only the content is wrong);
- ``rewrite``: fields of the sub-command set from a template;
- ``redirect``: a LOOKUP_RESPONSE of type Redirect to another broker.

Adding an action: README.md, "Adding a rule action".
"""

from __future__ import annotations

import json
import random
import re
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final

from google.protobuf import json_format
from google.protobuf.message import Message

from proxy.core.holding import Poll
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import (
    DATA_PATH_TYPES,
    NAMES_CONSUMER,
    NAMES_PRODUCER,
    PAYLOAD_TYPES,
    RESPONSES,
    SUB_FIELDS,
    T,
    sub_command,
    type_name,
)
from proxy.protocol.frame import Frame, encode_command, encode_payload_command
from proxy.protocol.session import Direction
from proxy.rules.params import Section
from proxy.rules.throttle import FairShare, TokenBucket, Waiting
from proxy.rules.unload import Kind
from proxy.rules.verdict import FORWARD, Deferred, Verdict

if TYPE_CHECKING:
    from proxy.rules.engine import RulesEngine, RuleState
    from proxy.rules.matcher import FrameFacts

#: request_id a broker puts in the CLOSE_PRODUCER / CLOSE_CONSUMER it originates (-1 as uint64)
BROKER_INITIATED_REQUEST_ID: Final = (1 << 64) - 1

#: requests ``error`` can answer on the broker's behalf
ANSWERABLE: Final = frozenset(RESPONSES) | {T.SEND, T.CONNECT}
#: data-path commands that name a producer (``close`` closes it)
PRODUCER_FRAMES: Final = NAMES_PRODUCER & DATA_PATH_TYPES
#: data-path commands that name a consumer, and REDELIVER (``close`` closes it)
CONSUMER_FRAMES: Final = (NAMES_CONSUMER & DATA_PATH_TYPES) | {T.REDELIVER_UNACKNOWLEDGED_MESSAGES}
#: the commands whose payload can be a replication marker (what ``match.marker`` looks at)
MARKER_CARRIERS: Final = PAYLOAD_TYPES
SERVER_ERRORS: Final = tuple(v.name for v in api.ServerError.DESCRIPTOR.values)
_SERVICE_URL = re.compile(r"^pulsar(\+ssl)?://[^/?#\s]+:\d{1,5}/?$")

_U32 = struct.Struct(">I")


#: requests a broker refuses with their own response (its ``error`` set), not with ERROR
_OWN_ERROR_RESPONSE: Final[dict[int, Callable[[], Message]]] = {
    T.NEW_TXN: api.CommandNewTxnResponse,
    T.ADD_PARTITION_TO_TXN: api.CommandAddPartitionToTxnResponse,
    T.ADD_SUBSCRIPTION_TO_TXN: api.CommandAddSubscriptionToTxnResponse,
    T.END_TXN: api.CommandEndTxnResponse,
    T.END_TXN_ON_PARTITION: api.CommandEndTxnOnPartitionResponse,
    T.END_TXN_ON_SUBSCRIPTION: api.CommandEndTxnOnSubscriptionResponse,
    T.TC_CLIENT_CONNECT_REQUEST: api.CommandTcClientConnectResponse,
    T.ACK: api.CommandAckResponse,
}


def error_reply(frame: Frame, code: str, message: str) -> bytes | None:
    """The refusal a broker would send for the request in ``frame``; None if it is no request."""
    error = api.ServerError.Value(code)
    sub: Any = frame.sub
    kind = frame.type
    if kind == T.SEND:
        return encode_command(api.CommandSendError(producer_id=sub.producer_id, sequence_id=sub.sequence_id,
                                                   error=error, message=message))
    if kind == T.LOOKUP:
        return encode_command(api.CommandLookupTopicResponse(
            request_id=sub.request_id, response=api.CommandLookupTopicResponse.Failed, error=error,
            message=message))
    if kind == T.PARTITIONED_METADATA:
        return encode_command(api.CommandPartitionedTopicMetadataResponse(
            request_id=sub.request_id, response=api.CommandPartitionedTopicMetadataResponse.Failed,
            error=error, message=message))
    if kind in _OWN_ERROR_RESPONSE and sub.HasField("request_id"):
        answer: Any = _OWN_ERROR_RESPONSE[kind]()
        for name in ("request_id", "consumer_id", "txnid_most_bits", "txnid_least_bits"):
            if name in answer.DESCRIPTOR.fields_by_name and name in sub.DESCRIPTOR.fields_by_name \
                    and sub.HasField(name):
                setattr(answer, name, getattr(sub, name))
        if kind == T.NEW_TXN:
            answer.txnid_most_bits = sub.tc_id  # the coordinator that refused, as ServerCnx answers
        answer.error, answer.message = error, message
        return encode_command(answer)
    if kind == T.CONNECT:
        # A refused CONNECT gets an ERROR that answers no request (request_id -1, as ServerCnx does).
        return encode_command(api.CommandError(request_id=BROKER_INITIATED_REQUEST_ID, error=error,
                                               message=message))
    if kind in ANSWERABLE and sub.HasField("request_id"):
        return encode_command(api.CommandError(request_id=sub.request_id, error=error, message=message))
    return None


def close_frames(frame: Frame, upstream_request_id: int) -> tuple[Kind, int, bytes, bytes] | None:
    """(kind, id, CLOSE to the client, CLOSE request to the broker) for the producer/consumer of ``frame``."""
    sub: Any = frame.sub
    if frame.type in PRODUCER_FRAMES:
        producer_id = sub.producer_id
        return (Kind.PRODUCER, producer_id,
                encode_command(api.CommandCloseProducer(producer_id=producer_id,
                                                        request_id=BROKER_INITIATED_REQUEST_ID)),
                encode_command(api.CommandCloseProducer(producer_id=producer_id, request_id=upstream_request_id)))
    if frame.type in CONSUMER_FRAMES:
        consumer_id = sub.consumer_id
        return (Kind.CONSUMER, consumer_id,
                encode_command(api.CommandCloseConsumer(consumer_id=consumer_id,
                                                        request_id=BROKER_INITIATED_REQUEST_ID)),
                encode_command(api.CommandCloseConsumer(consumer_id=consumer_id, request_id=upstream_request_id)))
    return None


def _flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    index = rng.randrange(len(data))
    flipped = bytearray(data)
    flipped[index] ^= 1 << rng.randrange(8)
    return bytes(flipped)


def corrupt(frame: Frame, what: str, rng: random.Random) -> bytes | None:
    """``frame`` with its checksum, payload or metadata damaged; None for frames without a payload."""
    section = frame.payload
    if section is None:
        return None
    if what == "checksum":
        position = section.checksum_start - 4
        damaged = (section.checksum ^ (1 << rng.randrange(32))) & 0xFFFFFFFF
        return frame.raw[:position] + _U32.pack(damaged) + frame.raw[position + 4:]
    metadata, payload = section.metadata_raw, section.payload
    if what == "payload":
        payload = _flip(payload, rng)
    else:
        metadata = _flip(metadata, rng)
    return encode_payload_command(frame.command, metadata, payload,
                                  broker_entry_metadata=section.broker_entry_metadata_raw)


def rewrite_template(command: int, fields: dict[str, Any]) -> Message:
    """The sub-command of type ``command`` holding ``fields``; ValueError names a bad field."""
    cmd = api.BaseCommand(type=command)
    template = sub_command(cmd)
    try:
        json_format.ParseDict(fields, template)
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from None
    return template


def rewrite(frame: Frame, template: Message, field_names: tuple[str, ...]) -> bytes:
    """``frame`` with the fields named set as in ``template`` (others unchanged), re-encoded."""
    cmd = api.BaseCommand()
    cmd.CopyFrom(frame.command)
    sub = getattr(cmd, SUB_FIELDS[cmd.type])
    for name in field_names:
        sub.ClearField(name)
    sub.MergeFrom(template)
    section = frame.payload
    if section is None:
        return encode_command(cmd)
    return encode_payload_command(cmd, section.metadata_raw, section.payload,
                                  broker_entry_metadata=section.broker_entry_metadata_raw)


def redirect_reply(frame: Frame, url: str, url_tls: str | None, authoritative: bool) -> bytes | None:
    """A LOOKUP_RESPONSE sending the client to ``url``; None unless ``frame`` is a LOOKUP."""
    if frame.type != T.LOOKUP:
        return None
    sub: Any = frame.sub
    response = api.CommandLookupTopicResponse(
        request_id=sub.request_id, response=api.CommandLookupTopicResponse.Redirect,
        brokerServiceUrl=url, authoritative=authoritative)
    if url_tls is not None:
        response.brokerServiceUrlTls = url_tls
    return encode_command(response)


def flow_frame(consumer_id: int, permits: int) -> bytes:
    return encode_command(api.CommandFlow(consumer_id=consumer_id, messagePermits=permits))


def _plain(value: Any) -> Any:
    """YAML data (line-annotated mappings and lists) as plain dicts and lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# -- the actions -------------------------------------------------------------------------------
class Action:
    """Base of the actions; see the module docstring for what a subclass owns."""

    #: the key in the rule file
    NAME: ClassVar[str] = ""
    #: the parameter keys it takes
    KEYS: ClassVar[tuple[str, ...]] = ()
    #: record and mark compose with other rules instead of deciding the frame's fate
    COMPOSES: ClassVar[bool] = False
    #: the commands it can act on (None: any) and how an error message names them
    APPLIES_TO: ClassVar[frozenset[int] | None] = None
    APPLIES_TO_TEXT: ClassVar[str] = ""
    #: a composing action asking the recorder to keep the frame
    RECORDS: ClassVar[bool] = False
    #: an action that unloads producers/consumers (the engine then follows their frames)
    UNLOADS: ClassVar[bool] = False

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        """The action from its parameters ``s``; errors go to ``s``'s collector."""
        del commands
        s.check_keys(cls.KEYS)
        return cls()

    def params(self) -> dict[str, Any]:
        return {}

    def to_data(self) -> dict[str, Any]:
        return {self.NAME: self.params()}

    def skips(self, facts: FrameFacts) -> bool:
        """True for a frame among ``APPLIES_TO`` it has nothing to do with (not even counted as a match)."""
        del facts
        return False

    def mark(self, rule_name: str) -> str | None:
        """A composing action's label for the frame's trace span (None: no label)."""
        del rule_name
        return None

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        """What happens to the frame of ``facts``; None when the action turns out not to apply."""
        raise NotImplementedError(f"{self.NAME} composes; it decides nothing")


@dataclass(frozen=True, slots=True)
class Delay(Action):
    NAME: ClassVar[str] = "delay"
    KEYS: ClassVar[tuple[str, ...]] = ("ms", "jitter_ms")
    ms: float = 0.0
    jitter_ms: float = 0.0

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        ms = s.attempt(lambda: s.number("ms", None, low=0), None)
        jitter_ms = s.attempt(lambda: s.number("jitter_ms", 0.0, low=0), None)
        if "ms" not in s.data:
            s.missing("ms")
        return cls(ms or 0.0, jitter_ms or 0.0)

    def params(self) -> dict[str, Any]:
        return {"ms": self.ms, "jitter_ms": self.jitter_ms}

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        jitter = rule.rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0.0
        return Verdict(delay_s=max(0.0, self.ms + jitter) / 1000.0)


@dataclass(frozen=True, slots=True)
class Drop(Action):
    NAME: ClassVar[str] = "drop"

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        return Verdict(forward=False)


@dataclass(frozen=True, slots=True)
class Error(Action):
    NAME: ClassVar[str] = "error"
    KEYS: ClassVar[tuple[str, ...]] = ("code", "message")
    APPLIES_TO: ClassVar[frozenset[int] | None] = ANSWERABLE
    APPLIES_TO_TEXT: ClassVar[str] = "requests a broker answers"
    code: str = "ServiceNotReady"
    message: str = "injected by pulsar-tap"

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        code = s.attempt(lambda: s.text("code", "ServiceNotReady"), None)
        message = s.attempt(lambda: s.text("message", "injected by pulsar-tap"), None)
        if code is not None and code not in SERVER_ERRORS:
            s.fail("code", f"unknown ServerError {code!r}")
        return cls(code or "UnknownError", message or "")

    def params(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}

    def skips(self, facts: FrameFacts) -> bool:
        # an ACK without request_id expects no answer
        return facts.frame.type == T.ACK and not facts.sub.HasField("request_id")

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        reply = error_reply(facts.frame, self.code, self.message)
        if reply is None:
            return None
        return Verdict(forward=False, to_client=(reply,)) if facts.direction is Direction.TO_BROKER else \
            Verdict(forward=False, to_broker=(reply,))


@dataclass(frozen=True, slots=True)
class Disconnect(Action):
    NAME: ClassVar[str] = "disconnect"
    KEYS: ClassVar[tuple[str, ...]] = ("how",)
    how: str = "close"

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        return cls(s.attempt(lambda: s.text("how", "close", choices=("close", "reset")), None) or "close")

    def params(self) -> dict[str, Any]:
        return {"how": self.how}

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        return Verdict(forward=False, close=self.how)


@dataclass(frozen=True, slots=True)
class Close(Action):
    NAME: ClassVar[str] = "close"
    APPLIES_TO: ClassVar[frozenset[int] | None] = PRODUCER_FRAMES | CONSUMER_FRAMES
    APPLIES_TO_TEXT: ClassVar[str] = "commands naming a producer or consumer"
    UNLOADS: ClassVar[bool] = True

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        to_broker = facts.direction is Direction.TO_BROKER
        upstream = engine.begin_unload(rule.rule.name, facts.frame, conn_id)
        if upstream is None:
            return None
        # A frame on its way to the broker is not taken (the client resends it on the re-created
        # producer); one on its way to the client left the broker before the unload: it arrives.
        return Verdict(forward=False, to_broker=(upstream,)) if to_broker else Verdict(to_broker=(upstream,))


@dataclass(frozen=True, slots=True)
class Corrupt(Action):
    NAME: ClassVar[str] = "corrupt"
    KEYS: ClassVar[tuple[str, ...]] = ("what",)
    APPLIES_TO: ClassVar[frozenset[int] | None] = MARKER_CARRIERS
    APPLIES_TO_TEXT: ClassVar[str] = "SEND and MESSAGE"
    what: str = "checksum"

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        return cls(s.attempt(lambda: s.text("what", "checksum", choices=("checksum", "payload", "metadata")), None)
                   or "checksum")

    def params(self) -> dict[str, Any]:
        return {"what": self.what}

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        damaged = corrupt(facts.frame, self.what, rule.rng)
        return None if damaged is None else Verdict(replacement=damaged)


@dataclass(frozen=True, slots=True)
class Duplicate(Action):
    NAME: ClassVar[str] = "duplicate"

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        raw = facts.frame.raw
        return Verdict(to_broker=(raw,)) if facts.direction is Direction.TO_BROKER else Verdict(to_client=(raw,))


@dataclass(frozen=True, slots=True)
class Rewrite(Action):
    """Set fields of the sub-command; kept as canonical JSON so the value stays immutable."""

    NAME: ClassVar[str] = "rewrite"
    fields_json: str = "{}"
    #: per command type, the template and the names of the fields it sets (built on first use)
    _templates: dict[int, tuple[Message, tuple[str, ...]]] = field(default_factory=dict, compare=False,
                                                                    repr=False)

    @property
    def fields(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.fields_json)
        return value

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        if not s.data:
            s.refuse("names no field to set")
            return cls()
        if commands is None:
            s.refuse("needs match.command: the fields are those of a command")
            return cls()
        for command in sorted(commands):
            for field_name, value in s.data.items():
                try:
                    rewrite_template(command, {field_name: _plain(value)})
                except ValueError as exc:
                    reason = str(exc).splitlines()[0]
                    s.fail(str(field_name), f"cannot set on {type_name(command)}: {reason}")
        return cls(json.dumps(_plain(s.data), sort_keys=True))

    def params(self) -> dict[str, Any]:
        return self.fields

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        frame = facts.frame
        entry = self._templates.get(frame.type)
        if entry is None:
            if rule.commands is None or frame.type not in rule.commands:
                return None
            template = rewrite_template(frame.type, self.fields)
            entry = self._templates[frame.type] = (template, tuple(f.name for f, _ in template.ListFields()))
        return Verdict(replacement=rewrite(frame, entry[0], entry[1]))


@dataclass(frozen=True, slots=True)
class Throttle(Action):
    """A token bucket (:mod:`proxy.rules.throttle`) per rule, or per topic, producer, consumer or connection.

    A SEND waits in its producer's lane until its messages (or bytes) are paid for.  A
    FLOW's permits are passed as the bucket pays for them, round robin with the waiting
    permits of every other consumer of the same bucket (:class:`~proxy.rules.throttle.FairShare`;
    the rule's one bucket, or one per topic or connection, is shared), so a consumer that
    comes later shares the rate at once; with ``per: consumer`` a consumer waits alone.
    """

    NAME: ClassVar[str] = "throttle"
    KEYS: ClassVar[tuple[str, ...]] = ("messages_per_second", "bytes_per_second", "burst", "per")
    APPLIES_TO: ClassVar[frozenset[int] | None] = frozenset({T.SEND, T.FLOW})
    APPLIES_TO_TEXT: ClassVar[str] = "SEND and FLOW"
    messages_per_second: float | None = None
    bytes_per_second: float | None = None
    burst: float = 1.0
    per: str = "rule"

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        mps = s.attempt(lambda: s.number("messages_per_second", None, low=0, low_open=True), None)
        bps = s.attempt(lambda: s.number("bytes_per_second", None, low=0, low_open=True), None)
        burst = s.attempt(lambda: s.number("burst", 1.0, low=0, low_open=True), None)
        per = s.attempt(lambda: s.text("per", "rule", choices=("rule", "topic", "producer", "consumer",
                                                               "connection")), None)
        if "messages_per_second" not in s.data and "bytes_per_second" not in s.data:
            s.refuse("needs messages_per_second or bytes_per_second")
        return cls(mps, bps, burst or 1.0, per or "rule")

    def params(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.messages_per_second is not None:
            data["messages_per_second"] = self.messages_per_second
        if self.bytes_per_second is not None:
            data["bytes_per_second"] = self.bytes_per_second
        data["burst"] = self.burst
        data["per"] = self.per
        return data

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        frame = facts.frame
        sub: Any = facts.sub
        if frame.type == T.SEND:
            owner: tuple[Any, ...] = ("producer", conn_id, sub.producer_id)
        elif frame.type == T.FLOW:
            owner = ("consumer", conn_id, sub.consumer_id)
        else:
            return None
        if self.per == "topic":
            key: Hashable = ("topic", facts.topic, frame.type)
        elif self.per in ("producer", "consumer"):
            key = owner
        elif self.per == "connection":
            key = ("connection", conn_id, frame.type)
        else:
            key = ("rule", None, frame.type)
        if frame.type == T.FLOW:
            if self.messages_per_second is None:
                return FORWARD  # bytes cannot be rationed through permits: FLOW passes
            return self._share_permits(rule, key, facts, now_ns, conn_id, engine)
        buckets = rule.buckets.get(key)
        if buckets is None:
            buckets = (
                None if self.messages_per_second is None else
                TokenBucket(self.messages_per_second, self.burst, now_ns),
                None if self.bytes_per_second is None else TokenBucket(self.bytes_per_second, self.burst, now_ns),
            )
            rule.buckets[key] = buckets
        messages, octets = buckets
        wait = 0.0
        if messages is not None:
            count = sub.num_messages if sub.HasField("num_messages") else 1
            wait = max(wait, messages.reserve(max(1, count), now_ns))
        if octets is not None:
            wait = max(wait, octets.reserve(frame.size, now_ns))
        return Verdict(delay_s=wait, lane=owner)

    def _share_permits(self, rule: RuleState, key: Hashable, facts: FrameFacts, now_ns: int, conn_id: int,
                       engine: RulesEngine) -> Verdict:
        """A FLOW under bucket ``key``: its permits wait their turn with every other consumer's of that bucket."""
        assert self.messages_per_second is not None
        share = rule.flow_shares.get(key)
        if share is None:
            share = rule.flow_shares[key] = FairShare(TokenBucket(self.messages_per_second, self.burst, now_ns))
        consumer_id = facts.sub.consumer_id
        permits = facts.sub.messagePermits
        lane = (conn_id, consumer_id)
        now_permits, started = share.request(lane, permits, now_ns)
        deferred: tuple[Deferred, ...] = ()
        if started is not None:
            alive = engine.consumer_alive(conn_id, consumer_id, facts.observation)
            deferred = (Deferred(share.interval_s, True, b"", _permit_poll(share, lane, started, consumer_id, alive)),)
        if now_permits == permits:
            return Verdict(deferred=deferred) if deferred else FORWARD
        if now_permits == 0:
            return Verdict(forward=False, deferred=deferred)
        return Verdict(replacement=flow_frame(consumer_id, now_permits), deferred=deferred)


def _permit_poll(share: FairShare, lane: Hashable, waiting: Waiting, consumer_id: int,
                 alive: Callable[[], bool]) -> Poll:
    """The poll of one consumer's waiting permits: a FLOW of its share each time round, until all are sent."""
    def poll(now_ns: int) -> tuple[list[bytes], int | None]:
        if not alive():
            share.drop(lane)  # closed: what it waited for goes nowhere
            return [], None
        permits, again = share.poll(lane, waiting, now_ns)
        frames = [flow_frame(consumer_id, permits)] if permits else []
        return frames, now_ns + int(share.interval_s * 1e9) if again else None
    return poll


@dataclass(frozen=True, slots=True)
class Redirect(Action):
    NAME: ClassVar[str] = "redirect"
    KEYS: ClassVar[tuple[str, ...]] = ("url", "url_tls", "authoritative")
    APPLIES_TO: ClassVar[frozenset[int] | None] = frozenset({T.LOOKUP})
    APPLIES_TO_TEXT: ClassVar[str] = "LOOKUP"
    url: str = ""
    url_tls: str | None = None
    authoritative: bool = False

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        url = s.attempt(lambda: s.text("url", None), None)
        url_tls = s.attempt(lambda: s.text("url_tls", None), None)
        authoritative = s.attempt(lambda: s.flag("authoritative", False), False)
        if url is None and "url" not in s.data:
            s.missing("url", "is required (pulsar://HOST:PORT of the other broker)")
        for key, value in (("url", url), ("url_tls", url_tls)):
            if value is not None and not _SERVICE_URL.match(value):
                s.fail(key, f"{value!r} is not a pulsar://HOST:PORT or pulsar+ssl://HOST:PORT URL")
        return cls(url or "", url_tls, authoritative)

    def params(self) -> dict[str, Any]:
        data: dict[str, Any] = {"url": self.url}
        if self.url_tls is not None:
            data["url_tls"] = self.url_tls
        data["authoritative"] = self.authoritative
        return data

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        reply = redirect_reply(facts.frame, self.url, self.url_tls, self.authoritative)
        return None if reply is None else Verdict(forward=False, to_client=(reply,))


@dataclass(frozen=True, slots=True)
class Record(Action):
    NAME: ClassVar[str] = "record"
    COMPOSES: ClassVar[bool] = True
    RECORDS: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Mark(Action):
    NAME: ClassVar[str] = "mark"
    KEYS: ClassVar[tuple[str, ...]] = ("label",)
    COMPOSES: ClassVar[bool] = True
    label: str | None = None

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        return cls(s.attempt(lambda: s.text("label", None), None))

    def params(self) -> dict[str, Any]:
        return {} if self.label is None else {"label": self.label}

    def mark(self, rule_name: str) -> str | None:
        return self.label or rule_name


@dataclass(frozen=True, slots=True)
class Slice(Action):
    NAME: ClassVar[str] = "slice"
    KEYS: ClassVar[tuple[str, ...]] = ("bytes",)
    bytes: int = 1

    @classmethod
    def parse(cls, s: Section, commands: frozenset[int] | None) -> Action:
        s.check_keys(cls.KEYS)
        return cls(int(s.attempt(lambda: s.number("bytes", 1, low=1, integer=True), None) or 1))

    def params(self) -> dict[str, Any]:
        return {"bytes": self.bytes}

    def decide(self, rule: RuleState, facts: FrameFacts, now_ns: int, conn_id: int,
               engine: RulesEngine) -> Verdict | None:
        return Verdict(slice_bytes=self.bytes)


#: every action class by its rule-file name, in the order error messages list them
ACTIONS: Final[dict[str, type[Action]]] = {
    cls.NAME: cls
    for cls in (Delay, Drop, Error, Disconnect, Close, Corrupt, Duplicate, Rewrite, Throttle, Redirect,
                Record, Mark, Slice)
}
