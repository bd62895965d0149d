"""Rule files (YAML) and admin bodies (JSON or YAML) into a :class:`RuleSet`, validated.

Every problem is collected, not just the first: unknown keys (pointing at their
own line), unknown command names, unknown ServerError codes, unknown marker types
(``match.marker``: MarkerType names of PulsarMarkers.proto, e.g.
``REPLICATED_SUBSCRIPTION_SNAPSHOT_RESPONSE``, matched on SEND and MESSAGE only),
bad globs and regexes, bad CIDRs, out-of-range numbers, duplicate names, and actions that
cannot act on the commands the rule selects.  Each becomes a
:class:`~proxy.errors.ConfigError` naming the file, the line (from
:mod:`proxy.config.yaml_lines`) and the dotted key (``rules[2].action.delay.ms``);
:class:`RuleFileError` carries them all.  Data that did not come from YAML (a
JSON body) has no lines, and its errors name only the key.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from proxy.config.yaml_lines import CannotRead, LineList, LineMap, load_file, load_text
from proxy.errors import ConfigError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import TYPE_VALUES, type_name
from proxy.protocol.markers import MARKER_NAMES
from proxy.rules import actions as acts
from proxy.rules.model import (
    ACTIONS,
    DIRECTIONS,
    Action,
    Close,
    Corrupt,
    Delay,
    Disconnect,
    Drop,
    Duplicate,
    Error,
    Mark,
    Match,
    Record,
    Redirect,
    Rewrite,
    Rule,
    RuleSet,
    Slice,
    TextPattern,
    Throttle,
)

TOP_KEYS: Final = ("seed", "rules")
RULE_KEYS: Final = ("name", "match", "action")
MATCH_KEYS: Final = ("command", "direction", "topic", "subscription", "producer_name", "consumer_name", "client",
                     "marker", "probability", "after", "times")
SERVER_ERRORS: Final = tuple(v.name for v in api.ServerError.DESCRIPTOR.values)
_SERVICE_URL = re.compile(r"^pulsar(\+ssl)?://[^/?#\s]+:\d{1,5}/?$")


class RuleFileError(ConfigError):
    """One or more rule errors; ``errors`` holds each, in file order."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        first = errors[0]
        super().__init__(first.message, file=first.file, line=first.line, key=first.key)

    def format(self) -> str:
        return "\n".join(error.format() for error in self.errors)


class _Invalid(Exception):
    """One value is wrong; the collector has already recorded why."""


class _Collector:
    def __init__(self, file: str | None) -> None:
        self.file = file
        self.errors: list[ConfigError] = []

    def error(self, line: int | None, key: str, message: str) -> _Invalid:
        self.errors.append(ConfigError(message, file=self.file, line=line or None, key=key))
        return _Invalid()


def _line(container: Any, key: Any) -> int | None:
    if isinstance(container, LineMap | LineList):
        return container.line_of(key) or None
    return None


def _type_word(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


class _Section:
    """A mapping being validated: reads keys, reports errors at their lines."""

    def __init__(self, collector: _Collector, data: dict[Any, Any], path: str) -> None:
        self.c = collector
        self.data = data
        self.path = path

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def line(self, name: str) -> int | None:
        return _line(self.data, name)

    def line_of_self(self) -> int | None:
        return self.data.line if isinstance(self.data, LineMap) and self.data.line else None

    def fail(self, name: str, message: str) -> _Invalid:
        return self.c.error(self.line(name), self.key(name), message)

    def check_keys(self, allowed: tuple[str, ...]) -> None:
        for name in self.data:
            if name not in allowed:
                self.c.error(_line(self.data, name), self.key(str(name)),
                             f"unknown key (expected one of: {', '.join(allowed)})")

    def number(self, name: str, default: float | None, *, low: float, high: float | None = None,
               low_open: bool = False, integer: bool = False) -> float | None:
        if name not in self.data or self.data[name] is None:
            return default
        value = self.data[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(name, f"must be a number, not {_type_word(value)}")
        if integer and (not isinstance(value, int) and not float(value).is_integer()):
            raise self.fail(name, f"must be a whole number, not {value}")
        too_low = value <= low if low_open else value < low
        if too_low or (high is not None and value > high):
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            if high is not None:
                bound = f"between {low:g} and {high:g}"
            raise self.fail(name, f"must be {bound}, not {value}")
        return int(value) if integer else float(value)

    def text(self, name: str, default: str | None, *, choices: tuple[str, ...] | None = None) -> str | None:
        if name not in self.data or self.data[name] is None:
            return default
        value = self.data[name]
        if not isinstance(value, str):
            raise self.fail(name, f"must be a string, not {_type_word(value)}")
        if choices is not None and value not in choices:
            raise self.fail(name, f"must be one of {', '.join(choices)}, not {value!r}")
        return value

    def flag(self, name: str, default: bool) -> bool:
        if name not in self.data or self.data[name] is None:
            return default
        value = self.data[name]
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, not {_type_word(value)}")
        return value

    def run(self, fn: Callable[[], None]) -> None:
        """Run one field's check; an invalid field is recorded and the others still checked."""
        with contextlib.suppress(_Invalid):
            fn()


def _pattern(section: _Section, name: str) -> TextPattern | None:
    if name not in section.data:
        return None
    value = section.data[name]
    if isinstance(value, str):
        if value.count("[") != value.count("]"):
            raise section.fail(name, f"bad glob {value!r}: unbalanced brackets")
        try:
            return TextPattern.of_glob(value)
        except ValueError as exc:
            raise section.fail(name, f"bad glob {value!r}: {exc}") from None
    if isinstance(value, dict):
        inner = _Section(section.c, value, section.key(name))
        inner.check_keys(("regex",))
        regex = value.get("regex")
        if not isinstance(regex, str):
            raise inner.fail("regex", "must be a string (a regular expression)")
        try:
            return TextPattern.of_regex(regex)
        except ValueError as exc:
            raise inner.fail("regex", f"bad regular expression {regex!r}: {exc} (patterns run on RE2, in linear "
                                      "time: no backreferences, lookaround or possessive repeats)") from None
    raise section.fail(name, f"must be a glob string or {{regex: ...}}, not {_type_word(value)}")


def _type_names(section: _Section, key: str, values: dict[str, int], what: str,
                known: str = "") -> frozenset[int] | None:
    """``key``: one name of ``values`` or a non-empty list of them (case-insensitive), as values."""
    if key not in section.data or section.data[key] is None:
        return None
    value = section.data[key]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise section.fail(key, f"must be a {what} name or a non-empty list of them")
    result: set[int] = set()
    bad = False
    for index, item in enumerate(items):
        if not isinstance(item, str) or item.upper() not in values:
            line = _line(value, index) if isinstance(value, list) else section.line(key)
            section.c.error(line, section.key(key) + (f"[{index}]" if isinstance(value, list) else ""),
                            f"unknown {what} {item!r}{known}")
            bad = True
        else:
            result.add(values[item.upper()])
    if bad:
        raise _Invalid()
    return frozenset(result)


def _commands(section: _Section) -> frozenset[int] | None:
    return _type_names(section, "command", TYPE_VALUES, "command type")


_MARKER_VALUES: Final = {name: value for value, name in MARKER_NAMES.items() if value}


def _markers(section: _Section, commands: frozenset[int] | None) -> frozenset[int] | None:
    found = _type_names(section, "marker", _MARKER_VALUES, "marker type", f" (one of: {', '.join(_MARKER_VALUES)})")
    if found is not None and commands is not None and not commands & acts.MARKER_CARRIERS:
        raise section.fail("marker", "markers travel only in SEND and MESSAGE; add one of them to match.command")
    return found


def _match(c: _Collector, data: Any, path: str, line: int | None) -> Match:
    if data is None:
        return Match()
    if not isinstance(data, dict):
        raise c.error(line, path, f"must be a mapping, not {_type_word(data)}")
    s = _Section(c, data, path)
    s.check_keys(MATCH_KEYS)
    found: dict[str, Any] = {}
    before = len(c.errors)

    def client() -> None:
        if "client" in data:
            try:
                found["client"] = ipaddress.ip_network(str(data["client"]), strict=False)
            except ValueError:
                raise s.fail("client", f"bad CIDR {data['client']!r}") from None

    s.run(lambda: found.__setitem__("commands", _commands(s)))
    s.run(lambda: found.__setitem__("direction", s.text("direction", "any", choices=DIRECTIONS)))
    for name in ("topic", "subscription", "producer_name", "consumer_name"):
        s.run(lambda name=name: found.__setitem__(name, _pattern(s, name)))  # type: ignore[misc]
    s.run(client)
    s.run(lambda: found.__setitem__("markers", _markers(s, found.get("commands"))))
    s.run(lambda: found.__setitem__("probability", s.number("probability", 1.0, low=0.0, high=1.0)))
    s.run(lambda: found.__setitem__("after", s.number("after", 0, low=0, integer=True)))
    s.run(lambda: found.__setitem__("times", s.number("times", None, low=1, integer=True)))
    if len(c.errors) > before:
        raise _Invalid()
    return Match(commands=found["commands"], direction=found["direction"], topic=found["topic"],
                 subscription=found["subscription"], producer_name=found["producer_name"],
                 consumer_name=found["consumer_name"], client=found.get("client"), markers=found["markers"],
                 probability=float(found["probability"]), after=int(found["after"]),
                 times=None if found["times"] is None else int(found["times"]))


def _action(c: _Collector, data: Any, path: str, line: int | None, commands: frozenset[int] | None) -> Action:
    if isinstance(data, str):
        name, params, params_line = data, None, line
    elif isinstance(data, dict):
        if len(data) != 1:
            raise c.error(line, path, f"must have exactly one action, not {len(data)} "
                                      f"(one of: {', '.join(ACTIONS)})")
        name, params = next(iter(data.items()))
        params_line = _line(data, name) or line
    else:
        raise c.error(line, path, f"must be an action name or a mapping with one action, not {_type_word(data)}")
    if name not in ACTIONS:
        raise c.error(params_line, f"{path}.{name}" if isinstance(data, dict) else path,
                      f"unknown action {name!r} (expected one of: {', '.join(ACTIONS)})")
    apath = f"{path}.{name}"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise c.error(params_line, apath, f"must be a mapping of parameters, not {_type_word(params)}")
    s = _Section(c, params, apath)
    before = len(c.errors)
    action = _build_action(s, name, commands)
    if len(c.errors) > before:
        raise _Invalid()
    return action


def _build_action(s: _Section, name: str, commands: frozenset[int] | None) -> Action:
    out: dict[str, Any] = {}

    def put(key: str, fn: Callable[[], Any]) -> None:
        s.run(lambda: out.__setitem__(key, fn()))

    def done(keys: tuple[str, ...]) -> None:
        s.check_keys(keys)

    if name == "delay":
        done(("ms", "jitter_ms"))
        put("ms", lambda: s.number("ms", None, low=0))
        put("jitter_ms", lambda: s.number("jitter_ms", 0.0, low=0))
        if "ms" not in s.data:
            s.c.error(s.line_of_self(), s.key("ms"), "is required")
        return Delay(out.get("ms") or 0.0, out.get("jitter_ms") or 0.0)
    if name in ("drop", "close", "duplicate", "record"):
        done(())
        return {"drop": Drop, "close": Close, "duplicate": Duplicate, "record": Record}[name]()
    if name == "error":
        done(("code", "message"))
        put("code", lambda: s.text("code", "ServiceNotReady"))
        put("message", lambda: s.text("message", "injected by pulsar-tap"))
        code = out.get("code")
        if code is not None and code not in SERVER_ERRORS:
            s.fail("code", f"unknown ServerError {code!r}")
        return Error(code or "UnknownError", out.get("message") or "")
    if name == "disconnect":
        done(("how",))
        put("how", lambda: s.text("how", "close", choices=("close", "reset")))
        return Disconnect(out.get("how") or "close")
    if name == "corrupt":
        done(("what",))
        put("what", lambda: s.text("what", "checksum", choices=("checksum", "payload", "metadata")))
        return Corrupt(out.get("what") or "checksum")
    if name == "rewrite":
        return _rewrite(s, commands)
    if name == "throttle":
        done(("messages_per_second", "bytes_per_second", "burst", "per"))
        put("mps", lambda: s.number("messages_per_second", None, low=0, low_open=True))
        put("bps", lambda: s.number("bytes_per_second", None, low=0, low_open=True))
        put("burst", lambda: s.number("burst", 1.0, low=0, low_open=True))
        put("per", lambda: s.text("per", "rule", choices=("rule", "topic", "producer", "consumer", "connection")))
        if "messages_per_second" not in s.data and "bytes_per_second" not in s.data:
            s.c.error(s.line_of_self(), s.path, "needs messages_per_second or bytes_per_second")
        return Throttle(out.get("mps"), out.get("bps"), out.get("burst") or 1.0, out.get("per") or "rule")
    if name == "redirect":
        done(("url", "url_tls", "authoritative"))
        put("url", lambda: s.text("url", None))
        put("url_tls", lambda: s.text("url_tls", None))
        put("authoritative", lambda: s.flag("authoritative", False))
        url = out.get("url")
        if url is None and "url" not in s.data:
            s.c.error(s.line_of_self(), s.key("url"), "is required (pulsar://HOST:PORT of the other broker)")
        for key in ("url", "url_tls"):
            value = out.get(key)
            if value is not None and not _SERVICE_URL.match(value):
                s.fail(key, f"{value!r} is not a pulsar://HOST:PORT or pulsar+ssl://HOST:PORT URL")
        return Redirect(url or "", out.get("url_tls"), bool(out.get("authoritative")))
    if name == "mark":
        done(("label",))
        put("label", lambda: s.text("label", None))
        return Mark(out.get("label"))
    if name == "slice":
        done(("bytes",))
        put("bytes", lambda: s.number("bytes", 1, low=1, integer=True))
        return Slice(int(out.get("bytes") or 1))
    # an action the model names but this loader cannot build: refused, never taken for another
    raise s.c.error(s.line_of_self(), s.path, f"unknown action {name!r} (expected one of: {', '.join(ACTIONS)})")


def _rewrite(s: _Section, commands: frozenset[int] | None) -> Action:
    if not s.data:
        s.c.error(s.line_of_self(), s.path, "names no field to set")
        return Rewrite()
    if commands is None:
        s.c.error(s.line_of_self(), s.path, "needs match.command: the fields are those of a command")
        return Rewrite()
    for command in sorted(commands):
        for field_name, value in s.data.items():
            try:
                acts.rewrite_template(command, {field_name: _plain(value)})
            except ValueError as exc:
                reason = str(exc).splitlines()[0]
                s.fail(str(field_name), f"cannot set on {type_name(command)}: {reason}")
    return Rewrite(json.dumps(_plain(s.data), sort_keys=True))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


_APPLIES_TO: Final[dict[str, tuple[frozenset[int], str]]] = {
    "error": (acts.ANSWERABLE, "requests a broker answers"),
    "close": (acts.CLOSABLE, "commands naming a producer or consumer"),
    "corrupt": (acts.CORRUPTIBLE, "SEND and MESSAGE"),
    "throttle": (acts.THROTTLEABLE, "SEND and FLOW"),
    "redirect": (acts.REDIRECTABLE, "LOOKUP"),
}


def _rule(c: _Collector, data: Any, path: str, line: int | None) -> Rule:
    if not isinstance(data, dict):
        raise c.error(line, path, f"must be a mapping with name, match and action, not {_type_word(data)}")
    s = _Section(c, data, path)
    s.check_keys(RULE_KEYS)
    before = len(c.errors)
    name: str | None = None
    try:
        name = s.text("name", None)
        if name is None or not name.strip():
            s.fail("name", "is required (a unique rule name)")
            name = None
        elif "/" in name or any(ch.isspace() for ch in name):
            s.fail("name", f"{name!r} must not contain '/' or whitespace")
    except _Invalid:
        pass
    match: Match | None = None
    with contextlib.suppress(_Invalid):
        match = _match(c, data.get("match"), s.key("match"), s.line("match"))
    action: Action | None = None
    if "action" not in data:
        s.fail("action", "is required")
    else:
        with contextlib.suppress(_Invalid):
            action = _action(c, data["action"], s.key("action"), s.line("action"),
                             match.commands if match is not None else None)
    if match is not None and action is not None and match.commands is not None and action.NAME in _APPLIES_TO:
        allowed, what = _APPLIES_TO[action.NAME]
        wrong = sorted(type_name(cmd) for cmd in match.commands - allowed)
        if wrong:
            key = s.key("match") + ".command"
            c.error(_line(data.get("match"), "command") or line, key,
                    f"{action.NAME} acts only on {what}, not {', '.join(wrong)}")
    if len(c.errors) > before or name is None or match is None or action is None:
        raise _Invalid()
    return Rule(name, match, action, line or 0)


def _document(c: _Collector, data: Any) -> RuleSet:
    if isinstance(data, list):
        data = {"rules": data}
    if not isinstance(data, dict):
        raise c.error(getattr(data, "line", None) or 1, "rules",
                      f"a rule file is a mapping with 'rules:' (and optional 'seed:'), not {_type_word(data)}")
    s = _Section(c, data, "")
    s.check_keys(TOP_KEYS)
    seed: int | None = None
    try:
        value = s.number("seed", None, low=0, integer=True)
        seed = None if value is None else int(value)
    except _Invalid:
        pass
    rules_data = data.get("rules")
    if rules_data is None:
        rules_data = []
    if not isinstance(rules_data, list):
        raise s.fail("rules", f"must be a list of rules, not {_type_word(rules_data)}")
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(rules_data):
        path = f"rules[{index}]"
        line = _line(rules_data, index)
        # names are checked for repeats even on rules with other errors: every error at once
        raw_name = item.get("name") if isinstance(item, dict) else None
        name = raw_name if isinstance(raw_name, str) else ""
        repeated = name in seen
        if repeated:
            c.error(_line(item, "name") or line, f"{path}.name",
                    f"duplicate rule name {name!r} (first used by {seen[name]})")
        elif name.strip():
            seen[name] = path
        try:
            rule = _rule(c, item, path, line)
        except _Invalid:
            continue
        if not repeated:
            rules.append(rule)
    return RuleSet(tuple(rules), seed, c.file)


def ruleset_from_data(data: Any, file: str | None = None) -> RuleSet:
    """A rules document (``{seed, rules}``, or a bare list of rules) already parsed."""
    c = _Collector(file)
    try:
        ruleset = _document(c, data)
    except _Invalid:
        ruleset = RuleSet()
    if c.errors:
        raise RuleFileError(sorted(c.errors, key=lambda error: error.line or 0))
    return ruleset


def rule_from_data(data: Any, file: str | None = None) -> Rule:
    """One rule (``{name, match, action}``), e.g. the body of ``POST /rules``."""
    c = _Collector(file)
    rule: Rule | None = None
    with contextlib.suppress(_Invalid):
        rule = _rule(c, data, "", _line(data, "name") if isinstance(data, dict) else None)
    if c.errors or rule is None:
        raise RuleFileError(c.errors or [ConfigError("is not a rule", file=file, key="rule")])
    return rule


def load_rules_text(text: str, file: str = "<string>") -> RuleSet:
    """Parse and validate a rule file's text; YAML errors use KEY ``yaml``."""
    try:
        data = load_text(text, file)
    except ConfigError as exc:
        raise RuleFileError([exc]) from None
    return ruleset_from_data(data, file)


def load_rules_file(path: str | Path) -> RuleSet:
    """Read a rule file; an unreadable one raises :class:`~proxy.config.yaml_lines.CannotRead`."""
    try:
        data = load_file(path)
    except ConfigError as exc:
        if not isinstance(exc, CannotRead):
            raise RuleFileError([exc]) from None
        raise
    return ruleset_from_data(data, str(path))
