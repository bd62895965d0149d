"""Rules as typed, immutable values: what a rule file (SPEC.md, "Rule language") means.

A :class:`RuleSet` holds the rules in evaluation order and the file's ``seed``.
Each :class:`Rule` has a name, a :class:`Match` (command types, direction, topic,
subscription, producer/consumer name, client CIDR, replication marker types,
probability, ``after``, ``times``) and exactly one action (a class of
:mod:`proxy.rules.actions`, which owns its parameters and its decision).  Everything
here can be compared (hot reload
keeps the counters of rules that did not change) and turned back into the
normalised plain data the admin API returns (:meth:`Rule.to_data`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Final

import re2

from proxy.protocol.commands import type_name
from proxy.protocol.markers import marker_name
from proxy.rules.actions import Action

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DIRECTIONS: Final = ("to_client", "to_broker", "any")


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False  # the loader reports the error itself, on one line
    return options


_RE2_OPTIONS: Final = _re2_options()


def compile_linear(pattern: str) -> Any:
    """Compile for RE2, whose matching time is linear in the text (no catastrophic backtracking).

    Raises ValueError saying why RE2 cannot run the pattern (backreferences, lookaround
    and possessive or atomic groups have no linear-time meaning; nor has a pattern too
    large for its memory budget).
    """
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) \
            else str(exc)
        raise ValueError(reason) from None


def glob_to_regex(glob: str) -> str:
    """A glob (``*``, ``?``, ``[abc]``, ``[!abc]``, as fnmatch reads them) as an RE2 pattern."""
    out: list[str] = []
    i, n = 0, len(glob)
    while i < n:
        char = glob[i]
        i += 1
        if char == "*":
            if not out or out[-1] != ".*":
                out.append(".*")
        elif char == "?":
            out.append(".")
        elif char == "[":
            j = i + 1 if i < n and glob[i] == "!" else i
            if j < n and glob[j] == "]":
                j += 1
            while j < n and glob[j] != "]":
                j += 1
            if j >= n:
                out.append(re.escape("["))
                continue
            body = glob[i:j].replace("\\", "\\\\")
            i = j + 1
            if body.startswith("!"):
                body = "^" + body[1:]
            elif body.startswith("^"):
                body = "\\" + body
            out.append(f"[{body}]")
        else:
            out.append(re.escape(char))
    return "(?s)" + "".join(out)


@dataclass(frozen=True, slots=True)
class TextPattern:
    """A glob (``orders-*``) or a regular expression, matched against the whole text.

    Both run on RE2 (SPEC: rule patterns run on a linear-time regex engine), so no
    topic name a client sends can make a rule take longer than the name is long.
    """

    pattern: str
    regex: bool = False
    compiled: Any = field(compare=False, repr=False, default=None)

    @classmethod
    def of_glob(cls, glob: str) -> TextPattern:
        return cls(glob, False, compile_linear(glob_to_regex(glob)))

    @classmethod
    def of_regex(cls, regex: str) -> TextPattern:
        """Raises ValueError when RE2 cannot run ``regex``."""
        return cls(regex, True, compile_linear(regex))

    def matches(self, text: str | None) -> bool:
        return text is not None and self.compiled.fullmatch(text) is not None

    def to_data(self) -> Any:
        return {"regex": self.pattern} if self.regex else self.pattern


@dataclass(frozen=True, slots=True)
class Match:
    """Which frames a rule applies to; every criterion left unset matches anything."""

    commands: frozenset[int] | None = None
    direction: str = "any"
    topic: TextPattern | None = None
    subscription: TextPattern | None = None
    producer_name: TextPattern | None = None
    consumer_name: TextPattern | None = None
    client: IPNetwork | None = None
    #: MarkerType values: only SEND/MESSAGE frames carrying one of these markers match
    markers: frozenset[int] | None = None
    probability: float = 1.0
    after: int = 0
    times: int | None = None

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.commands is not None:
            data["command"] = sorted(type_name(c) for c in self.commands)
        data["direction"] = self.direction
        for key in ("topic", "subscription", "producer_name", "consumer_name"):
            pattern: TextPattern | None = getattr(self, key)
            if pattern is not None:
                data[key] = pattern.to_data()
        if self.client is not None:
            data["client"] = str(self.client)
        if self.markers is not None:
            data["marker"] = sorted(marker_name(m) for m in self.markers)
        data["probability"] = self.probability
        data["after"] = self.after
        if self.times is not None:
            data["times"] = self.times
        return data


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    match: Match
    action: Action
    #: where the rule starts in its file (0 when it came from elsewhere); not part of equality
    line: int = field(default=0, compare=False)

    def to_data(self) -> dict[str, Any]:
        return {"name": self.name, "match": self.match.to_data(), "action": self.action.to_data()}


@dataclass(frozen=True, slots=True)
class RuleSet:
    """The rules of one file or admin document, in evaluation order."""

    rules: tuple[Rule, ...] = ()
    #: the file's ``seed:``; None means "choose one at start and report it"
    seed: int | None = None
    file: str | None = field(default=None, compare=False)

    def names(self) -> list[str]:
        return [rule.name for rule in self.rules]
