"""Does a frame meet a rule's ``match``?  The criteria other than the counters.

Command type and direction are read from the frame, and so is the replication
marker type of a SEND or MESSAGE (from its MessageMetadata, decoded only for rules
that ask); topic, subscription and producer/consumer name come from the session's id maps (the
:class:`~proxy.protocol.session.Observation` of the frame), so a SEND that only
carries a ``producer_id`` matches a topic glob, with the fields of the command
itself as the fallback for requests that name their topic.  The client address
is the peer of the proxied connection.  ``probability``, ``after`` and ``times``
are counted by the engine, which owns the counters and the random generators.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any, Final

from google.protobuf.descriptor import FieldDescriptor

from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import SUB_FIELDS
from proxy.protocol.frame import Frame
from proxy.protocol.session import Direction, Observation
from proxy.rules.model import IPNetwork, Match, TextPattern


def host_of(address: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address of a peer ``host:port`` (``[v6]:port``, or a bare host); None when it names none."""
    if not address:
        return None
    host = address
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return _ip_address(host)


@functools.lru_cache(maxsize=4096)
def _ip_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` parsed (clients come back from few hosts: a reconnect storm parses each once, not
    several times a connection; the addresses are immutable), None when it is no IP address."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


_UNSET: Any = object()
#: per command type, its sub-command's single (not repeated) string fields
_TEXT_FIELDS: Final = {
    kind: frozenset(field.name for field in getattr(api.BaseCommand(), name).DESCRIPTOR.fields
                    if field.type == FieldDescriptor.TYPE_STRING and not field.is_repeated)
    for kind, name in SUB_FIELDS.items()}


class FrameFacts:
    """What the criteria look at, worked out once per frame and only when asked.

    (Plain lazy attributes rather than ``functools.cached_property``, whose lock costs more per
    frame than the lookups it caches.)
    """

    __slots__ = ("frame", "direction", "observation", "client_address", "_sub", "_topic", "_subscription",
                 "_producer_name", "_consumer_name", "_client_host", "_marker")

    def __init__(self, frame: Frame, direction: Direction, observation: Observation | None,
                 client_address: str | None) -> None:
        self.frame = frame
        self.direction = direction
        self.observation = observation
        self.client_address = client_address
        self._sub = self._topic = self._subscription = self._producer_name = self._consumer_name = _UNSET
        self._client_host = _UNSET
        self._marker = _UNSET

    @property
    def sub(self) -> Any:
        if self._sub is _UNSET:
            self._sub = self.frame.sub
        return self._sub

    def _field(self, name: str) -> str | None:
        """The command's own single text field ``name`` (a list of topics names no one topic)."""
        if name not in _TEXT_FIELDS.get(self.frame.type, ()):
            return None  # (no need to decode the command to know it has none)
        sub = self.sub
        field = sub.DESCRIPTOR.fields_by_name.get(name)
        if field is None or field.is_repeated or not sub.HasField(name):
            return None
        value = getattr(sub, name)
        return value if isinstance(value, str) else None

    @property
    def topic(self) -> str | None:
        if self._topic is _UNSET:
            obs = self.observation
            self._topic = obs.topic if obs is not None and obs.topic is not None else self._field("topic")
        result: str | None = self._topic
        return result

    @property
    def subscription(self) -> str | None:
        if self._subscription is _UNSET:
            obs = self.observation
            self._subscription = obs.consumer.subscription if obs is not None and obs.consumer is not None \
                else self._field("subscription")
        result: str | None = self._subscription
        return result

    @property
    def producer_name(self) -> str | None:
        if self._producer_name is _UNSET:
            obs = self.observation
            if obs is not None and obs.producer is not None and obs.producer.producer_name:
                self._producer_name = obs.producer.producer_name
            else:
                self._producer_name = self._field("producer_name")
        result: str | None = self._producer_name
        return result

    @property
    def consumer_name(self) -> str | None:
        if self._consumer_name is _UNSET:
            obs = self.observation
            if obs is not None and obs.consumer is not None and obs.consumer.consumer_name:
                self._consumer_name = obs.consumer.consumer_name
            else:
                self._consumer_name = self._field("consumer_name")
        result: str | None = self._consumer_name
        return result

    @property
    def marker(self) -> int | None:
        """The MarkerType of a SEND or MESSAGE that carries a marker; None for anything else."""
        if self._marker is _UNSET:
            self._marker = None
            try:
                section = self.frame.payload
                if section is not None and section.metadata.HasField("marker_type"):
                    self._marker = section.metadata.marker_type
            except ProtocolError:
                pass  # an undecodable payload carries no marker we can tell
        result: int | None = self._marker
        return result

    @property
    def client_host(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        if self._client_host is _UNSET:
            self._client_host = host_of(self.client_address)
        result: ipaddress.IPv4Address | ipaddress.IPv6Address | None = self._client_host
        return result


#: (Match field, the FrameFacts attribute it tests): everything criteria_met reads besides
#: the command type and the direction
CRITERIA_FACTS: Final = (("topic", "topic"), ("subscription", "subscription"), ("producer_name", "producer_name"),
                         ("consumer_name", "consumer_name"), ("client", "client_host"), ("markers", "marker"))

#: (pattern, is regex, text) -> matched; topics and names repeat, so each is matched once
_PATTERN_RESULTS: dict[tuple[str, bool, str], bool] = {}
#: the memo is cleared when it grows past this (bounded memory under many topics)
_PATTERN_RESULTS_MAX = 65_536


def _matches(pattern: TextPattern, text: str | None) -> bool:
    if text is None:
        return False
    key = (pattern.pattern, pattern.regex, text)
    result = _PATTERN_RESULTS.get(key)
    if result is None:
        if len(_PATTERN_RESULTS) >= _PATTERN_RESULTS_MAX:
            _PATTERN_RESULTS.clear()
        result = _PATTERN_RESULTS[key] = pattern.matches(text)
    return result


def _in_network(host: ipaddress.IPv4Address | ipaddress.IPv6Address | None, network: IPNetwork) -> bool:
    if host is None:
        return False
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
        host = host.ipv4_mapped
    return host.version == network.version and host in network


def criteria_met(match: Match, commands: frozenset[int] | None, facts: FrameFacts) -> bool:
    """Every criterion but the counters; ``commands`` is the rule's effective command set."""
    if commands is not None and facts.frame.type not in commands:
        return False
    if match.direction != "any" and match.direction != facts.direction.value:
        return False
    if match.topic is not None and not _matches(match.topic, facts.topic):
        return False
    if match.subscription is not None and not _matches(match.subscription, facts.subscription):
        return False
    if match.producer_name is not None and not _matches(match.producer_name, facts.producer_name):
        return False
    if match.consumer_name is not None and not _matches(match.consumer_name, facts.consumer_name):
        return False
    if match.markers is not None and facts.marker not in match.markers:
        return False
    return match.client is None or _in_network(facts.client_host, match.client)


#: the Match fields a producer's or consumer's registration decides for every frame naming it
ENTITY_CRITERIA: Final = ("topic", "subscription", "producer_name", "consumer_name")

#: (topic, subscription, producer name, consumer name) of one producer or consumer
EntityFacts = tuple[str | None, str | None, str | None, str | None]


def client_met(match: Match, host: ipaddress.IPv4Address | ipaddress.IPv6Address | None) -> bool:
    """The ``client`` criterion alone (the same for every frame of a connection)."""
    return match.client is None or _in_network(host, match.client)


def entity_met(match: Match, facts: EntityFacts) -> bool:
    """The criteria of ENTITY_CRITERIA, for a frame naming the producer or consumer of ``facts``."""
    topic, subscription, producer_name, consumer_name = facts
    return (match.topic is None or _matches(match.topic, topic)) \
        and (match.subscription is None or _matches(match.subscription, subscription)) \
        and (match.producer_name is None or _matches(match.producer_name, producer_name)) \
        and (match.consumer_name is None or _matches(match.consumer_name, consumer_name))
