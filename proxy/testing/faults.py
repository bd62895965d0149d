"""Fault builders: the rule language (SPEC.md, "Rule language") written the way tests read.

Each builder returns an immutable :class:`Fault`; its methods return a new one, so a
fault can be defined once and refined per test::

    error("ServiceNotReady").on("PRODUCER").times(2)
    delay(ms=200, jitter_ms=50).on("SEND_RECEIPT").topic("orders-*")
    throttle(messages_per_second=100).topic("orders")

:meth:`Fault.to_rule` renders the rule the admin API takes (``{name, match,
action}``) and validates it with the proxy's own loader, so a mistake is reported
where the fault is written, with the same message ``pulsar-tap rules check`` gives.

A fault is one rule, or a few rules switched on in steps (the Toxiproxy
``timeout`` and ``reset_peer`` with a timeout: the second rule is added that many
milliseconds after the first); every step shares the match.  Toxiproxy's toxics map
onto rules as follows (``stream`` is Toxiproxy's: downstream = broker to client,
upstream = client to broker):

==========================  ===================================================
Toxiproxy                   pulsar-tap rule
==========================  ===================================================
``latency(ms, jitter)``     ``delay {ms, jitter_ms}`` on every frame of the stream
``timeout(0)``              ``drop`` every frame of the stream (until removed)
``timeout(ms)``             ``drop``, then after ``ms`` ``disconnect {how: close}``
``reset_peer(0)``           ``disconnect {how: reset}`` at the next frame
``reset_peer(timeout_ms)``  the same, switched on ``timeout_ms`` after injection
``bandwidth(rate_kb)``      ``throttle {bytes_per_second: rate_kb*1024,
                            per: connection}`` on SEND (upstream only: a
                            consumer's rate is paced in messages through its
                            FLOW permits, see :func:`throttle`)
``slicer(average_size)``    ``slice {bytes: average_size}``
==========================  ===================================================

Topics may be written short, as clients write them: ``orders`` means
``persistent://public/default/orders`` and its partitions, ``orders-*`` the glob
``persistent://public/default/orders-*``.  Nothing here does I/O.
"""

from __future__ import annotations

import difflib
import math
import re
import uuid
from collections.abc import Mapping
from typing import Any, Final, Literal

from proxy.protocol.commands import TYPE_VALUES
from proxy.testing.errors import InvalidRule

Stream = Literal["downstream", "upstream"]
Direction = Literal["to_client", "to_broker", "any"]

_STREAM_DIRECTIONS: Final[dict[str, str]] = {"downstream": "to_client", "upstream": "to_broker"}
_GLOB_CHARS: Final = frozenset("*?[")
_DEFAULT_TOPIC_PREFIX: Final = "persistent://public/default/"


def full_topic_pattern(topic: str) -> str | dict[str, str]:
    """A topic as written by a client, as the rule's ``topic`` pattern (a glob, or a regex for exact names).

    A short name gets the default tenant and namespace (``orders`` ->
    ``persistent://public/default/orders``), ``tenant/ns/topic`` the persistent
    domain.  An exact name also matches its partitions (``...orders-partition-N``),
    as a client producing to a partitioned topic talks to its partitions.
    """
    if "://" in topic:
        full = topic
    elif topic.count("/") == 2:
        full = "persistent://" + topic
    else:
        full = _DEFAULT_TOPIC_PREFIX + topic
    if _GLOB_CHARS & set(full):
        return full
    return {"regex": re.escape(full) + "(-partition-[0-9]+)?"}


def _command_name(command: str) -> str:
    name = command.strip().upper()
    if name not in TYPE_VALUES:
        close = difflib.get_close_matches(name, TYPE_VALUES, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise InvalidRule(f"unknown command type {command!r}{hint}", status=400)
    return name


def _whole(value: int, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRule(f"{what} must be a whole number >= {minimum}, not {value!r}", status=400)
    return value


class Fault:
    """One fault to inject: an action, a match, and when to switch it on (see the module docstring)."""

    __slots__ = ("_match", "_name", "_steps")

    def __init__(self, action: str, params: Mapping[str, Any] | None = None) -> None:
        #: (seconds after injection, action name, action parameters), the first at 0
        self._steps: tuple[tuple[float, str, dict[str, Any]], ...] = ((0.0, action, dict(params or {})),)
        self._match: dict[str, Any] = {}
        self._name: str | None = None

    def _copy(self) -> Fault:
        other = Fault.__new__(Fault)
        other._steps = tuple((after, action, dict(params)) for after, action, params in self._steps)
        other._match = dict(self._match)
        other._name = self._name
        return other

    def _with(self, key: str, value: Any) -> Fault:
        other = self._copy()
        other._match[key] = value
        return other

    # -- what it matches ------------------------------------------------------------------------------
    def on(self, *commands: str) -> Fault:
        """Only frames of these command types (BaseCommand names, e.g. ``"SEND"``, ``"PRODUCER"``)."""
        if not commands:
            raise InvalidRule("on() needs at least one command type", status=400)
        return self._with("command", sorted({_command_name(c) for c in commands}))

    def direction(self, direction: Direction) -> Fault:
        """Only frames travelling ``to_client`` or ``to_broker`` (default: either)."""
        return self._with("direction", direction)

    def stream(self, stream: Stream) -> Fault:
        """Toxiproxy's word for the direction: ``downstream`` (to the client) or ``upstream`` (to the broker)."""
        if stream not in _STREAM_DIRECTIONS:
            raise InvalidRule(f"stream must be downstream or upstream, not {stream!r}", status=400)
        return self._with("direction", _STREAM_DIRECTIONS[stream])

    def topic(self, topic: str, *, regex: bool = False) -> Fault:
        """Only frames about this topic: a name or glob as clients write it, or a regex (full names)."""
        return self._with("topic", {"regex": topic} if regex else full_topic_pattern(topic))

    def subscription(self, pattern: str) -> Fault:
        """Only frames of consumers on a subscription matching this glob."""
        return self._with("subscription", pattern)

    def producer_name(self, pattern: str) -> Fault:
        return self._with("producer_name", pattern)

    def consumer_name(self, pattern: str) -> Fault:
        return self._with("consumer_name", pattern)

    def client(self, cidr: str) -> Fault:
        """Only connections from clients in this network (e.g. ``127.0.0.1/32``)."""
        return self._with("client", cidr)

    # -- when it fires ----------------------------------------------------------------------------------
    def times(self, n: int) -> Fault:
        """Act on the first ``n`` matching frames (after :meth:`after`), then let everything pass."""
        return self._with("times", _whole(n, "times", 1))

    def once(self) -> Fault:
        return self.times(1)

    def after(self, n: int) -> Fault:
        """Let the first ``n`` matching frames pass untouched."""
        return self._with("after", _whole(n, "after", 0))

    def probability(self, p: float) -> Fault:
        """Act on each matching frame with probability ``p`` (drawn per frame from the rule set's seed)."""
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1 or math.isnan(p):
            raise InvalidRule(f"probability must be in (0, 1], not {p!r}", status=400)
        return self._with("probability", float(p))

    def named(self, name: str) -> Fault:
        """Give the rule a fixed name (default: the action and a random suffix)."""
        other = self._copy()
        other._name = name
        return other

    def then(self, after_ms: float, fault: Fault) -> Fault:
        """Also switch on ``fault``'s action ``after_ms`` milliseconds after injection (same match)."""
        if after_ms < 0:
            raise InvalidRule(f"after_ms must be >= 0, not {after_ms!r}", status=400)
        other = self._copy()
        other._steps = (*other._steps, *((after_ms / 1000 + after, action, dict(params))
                                         for after, action, params in fault._steps))
        return other

    def starting_after(self, ms: float) -> Fault:
        """Switch the fault on ``ms`` milliseconds after injection instead of at once."""
        if ms < 0:
            raise InvalidRule(f"starting_after must be >= 0 ms, not {ms!r}", status=400)
        other = self._copy()
        other._steps = tuple((after + ms / 1000, action, params) for after, action, params in other._steps)
        return other

    # -- what it becomes --------------------------------------------------------------------------------
    @property
    def action(self) -> str:
        """The first step's action name (``delay``, ``error``...)."""
        return self._steps[0][1]

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def match(self) -> dict[str, Any]:
        return dict(self._match)

    def steps(self, name: str | None = None) -> list[tuple[float, dict[str, Any]]]:
        """``(seconds after injection, rule)`` for every step, each rule validated; later steps are ``NAME-N``."""
        base = name or self._name or f"{self.action}-{uuid.uuid4().hex[:8]}"
        rules: list[tuple[float, dict[str, Any]]] = []
        for index, (after, action, params) in enumerate(self._steps):
            rule = {"name": base if index == 0 else f"{base}-{index}", "match": dict(self._match),
                    "action": {action: dict(params)}}
            _validate(rule)
            rules.append((after, rule))
        return rules

    def to_rule(self, name: str | None = None) -> dict[str, Any]:
        """The rule the admin API takes (the first step's), validated; raises :class:`InvalidRule`."""
        return self.steps(name)[0][1]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Fault) and self._steps == other._steps and self._match == other._match
                and self._name == other._name)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        steps = ", then ".join(
            (f"after {after * 1000:g} ms " if after else "") + f"{action}{params or ''}"
            for after, action, params in self._steps)
        match = " ".join(f"{key}={value}" for key, value in self._match.items())
        named = f" named {self._name!r}" if self._name else ""
        return f"<Fault {steps}{' ' + match if match else ''}{named}>"


def _validate(rule: dict[str, Any]) -> None:
    from proxy.rules.loader import RuleFileError, rule_from_data

    try:
        rule_from_data(rule)
    except RuleFileError as exc:
        messages = [error.format() for error in exc.errors]
        raise InvalidRule("; ".join(messages), status=400, errors=messages) from None


def _params(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


# -- the actions of the rule language ---------------------------------------------------------------------
def delay(ms: float, jitter_ms: float = 0.0) -> Fault:
    """Hold each matching frame ``ms`` (± ``jitter_ms``) from its arrival; frames keep their order."""
    return Fault("delay", {"ms": ms, "jitter_ms": jitter_ms})


def drop() -> Fault:
    """Swallow matching frames: the sender sees a timeout."""
    return Fault("drop")


def error(code: str = "ServiceNotReady", message: str | None = None) -> Fault:
    """Answer matching requests on the broker's behalf with ``code`` (a ServerError name)."""
    return Fault("error", _params(code=code, message=message))


def disconnect(how: Literal["close", "reset"] = "close") -> Fault:
    """Cut the connection (and its upstream) at a matching frame: FIN (``close``) or RST (``reset``)."""
    return Fault("disconnect", {"how": how})


def close() -> Fault:
    """CLOSE_PRODUCER / CLOSE_CONSUMER for the producer or consumer of a matching frame, as an unload does."""
    return Fault("close")


def unload(topic: str) -> Fault:
    """A topic unload: the next producer or consumer of ``topic`` seen is closed (once; ``.times(n)`` for n).

    The client re-creates it and resends what was pending, as after a real unload.
    """
    return close().topic(topic).once()


def throttle(messages_per_second: float | None = None, bytes_per_second: float | None = None, *,
             burst: float | None = None, per: Literal["rule", "topic", "producer", "consumer", "connection"]
             | None = None) -> Fault:
    """Pace producers' SENDs (messages or bytes per second) and consumers' deliveries (messages per second,
    by holding their FLOW permits); one token bucket per rule unless ``per`` splits it.  Consumers sharing the
    same bucket (the rule's one, or one per topic or connection) get the rate in turns (two waiting: half each),
    whenever each subscribed."""
    return Fault("throttle", _params(messages_per_second=messages_per_second, bytes_per_second=bytes_per_second,
                                     burst=burst, per=per))


def corrupt(what: Literal["checksum", "payload", "metadata"] = "checksum") -> Fault:
    """Damage the checksum, payload or metadata of matching SEND / MESSAGE frames."""
    return Fault("corrupt", {"what": what})


def duplicate() -> Fault:
    """Send matching frames twice."""
    return Fault("duplicate")


def rewrite(**fields: Any) -> Fault:
    """Set fields of the matching command (needs :meth:`Fault.on`), e.g. ``rewrite(max_message_size=1024)``."""
    return Fault("rewrite", fields)


def redirect(url: str, url_tls: str | None = None, *, authoritative: bool = False) -> Fault:
    """Answer LOOKUPs with a Redirect to ``url``."""
    return Fault("redirect", _params(url=url, url_tls=url_tls, authoritative=authoritative))


def slice_frames(size: int) -> Fault:
    """Write matching frames in TCP writes of ``size`` bytes (tests a client's decoder)."""
    return Fault("slice", {"bytes": size})


def mark(label: str | None = None) -> Fault:
    """Tag the trace spans of matching frames (composes with other rules)."""
    return Fault("mark", _params(label=label))


def record() -> Fault:
    """While loaded, the recorder keeps only frames a ``record`` rule matches (composes with other rules)."""
    return Fault("record")


# -- Toxiproxy's toxics, mapped onto rules (see the module docstring) --------------------------------------
def latency(ms: float, jitter: float = 0.0, *, stream: Stream = "downstream") -> Fault:
    return delay(ms=ms, jitter_ms=jitter).stream(stream)


def timeout(ms: float = 0, *, stream: Stream = "downstream") -> Fault:
    fault = drop().stream(stream)
    return fault if ms == 0 else fault.then(ms, disconnect("close"))


def reset_peer(timeout_ms: float = 0) -> Fault:
    fault = disconnect("reset")
    return fault if timeout_ms == 0 else fault.starting_after(timeout_ms)


def bandwidth(rate_kb: float, *, stream: Stream = "upstream") -> Fault:
    if stream != "upstream":
        raise InvalidRule("bandwidth paces the bytes clients send (stream upstream); consumers are paced in "
                          "messages through their FLOW permits: use throttle(messages_per_second=...)", status=400)
    return throttle(bytes_per_second=rate_kb * 1024, per="connection").on("SEND")


def slicer(average_size: int) -> Fault:
    return slice_frames(average_size)


__all__ = ["Fault", "bandwidth", "close", "corrupt", "delay", "disconnect", "drop", "duplicate", "error",
           "full_topic_pattern", "latency", "mark", "record", "redirect", "reset_peer", "rewrite", "slice_frames",
           "slicer", "throttle", "timeout", "unload"]
