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
JSON body) has no lines, and its errors name only the key.  Each action's parameters
are read by its own class (:meth:`proxy.rules.actions.Action.parse`), with the
readers of :mod:`proxy.rules.params`.
"""

from __future__ import annotations

import contextlib
import ipaddress
from pathlib import Path
from typing import Any, Final

from proxy.config.yaml_lines import CannotRead, load_file, load_text
from proxy.errors import ConfigError
from proxy.protocol.commands import TYPE_VALUES, type_name
from proxy.protocol.markers import MARKER_NAMES
from proxy.rules.actions import ACTIONS, MARKER_CARRIERS, Action
from proxy.rules.model import DIRECTIONS, Match, Rule, RuleSet, TextPattern
from proxy.rules.params import Collector, Invalid, Section, line_of, type_word

TOP_KEYS: Final = ("seed", "rules")
RULE_KEYS: Final = ("name", "match", "action")
MATCH_KEYS: Final = ("command", "direction", "topic", "subscription", "producer_name", "consumer_name", "client",
                     "marker", "probability", "after", "times")


class RuleFileError(ConfigError):
    """One or more rule errors; ``errors`` holds each, in file order."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        first = errors[0]
        super().__init__(first.message, file=first.file, line=first.line, key=first.key)

    def format(self) -> str:
        return "\n".join(error.format() for error in self.errors)


def _pattern(section: Section, name: str) -> TextPattern | None:
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
        inner = Section(section.c, value, section.key(name))
        inner.check_keys(("regex",))
        regex = value.get("regex")
        if not isinstance(regex, str):
            raise inner.fail("regex", "must be a string (a regular expression)")
        try:
            return TextPattern.of_regex(regex)
        except ValueError as exc:
            raise inner.fail("regex", f"bad regular expression {regex!r}: {exc} (patterns run on RE2, in linear "
                                      "time: no backreferences, lookaround or possessive repeats)") from None
    raise section.fail(name, f"must be a glob string or {{regex: ...}}, not {type_word(value)}")


def _type_names(section: Section, key: str, values: dict[str, int], what: str,
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
            line = line_of(value, index) if isinstance(value, list) else section.line(key)
            section.c.error(line, section.key(key) + (f"[{index}]" if isinstance(value, list) else ""),
                            f"unknown {what} {item!r}{known}")
            bad = True
        else:
            result.add(values[item.upper()])
    if bad:
        raise Invalid()
    return frozenset(result)


def _commands(section: Section) -> frozenset[int] | None:
    return _type_names(section, "command", TYPE_VALUES, "command type")


_MARKER_VALUES: Final = {name: value for value, name in MARKER_NAMES.items() if value}


def _markers(section: Section, commands: frozenset[int] | None) -> frozenset[int] | None:
    found = _type_names(section, "marker", _MARKER_VALUES, "marker type", f" (one of: {', '.join(_MARKER_VALUES)})")
    if found is not None and commands is not None and not commands & MARKER_CARRIERS:
        raise section.fail("marker", "markers travel only in SEND and MESSAGE; add one of them to match.command")
    return found


def _match(c: Collector, data: Any, path: str, line: int | None) -> Match:
    if data is None:
        return Match()
    if not isinstance(data, dict):
        raise c.error(line, path, f"must be a mapping, not {type_word(data)}")
    s = Section(c, data, path)
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
        raise Invalid()
    return Match(commands=found["commands"], direction=found["direction"], topic=found["topic"],
                 subscription=found["subscription"], producer_name=found["producer_name"],
                 consumer_name=found["consumer_name"], client=found.get("client"), markers=found["markers"],
                 probability=float(found["probability"]), after=int(found["after"]),
                 times=None if found["times"] is None else int(found["times"]))


def _action(c: Collector, data: Any, path: str, line: int | None, commands: frozenset[int] | None) -> Action:
    if isinstance(data, str):
        name, params, params_line = data, None, line
    elif isinstance(data, dict):
        if len(data) != 1:
            raise c.error(line, path, f"must have exactly one action, not {len(data)} "
                                      f"(one of: {', '.join(ACTIONS)})")
        name, params = next(iter(data.items()))
        params_line = line_of(data, name) or line
    else:
        raise c.error(line, path, f"must be an action name or a mapping with one action, not {type_word(data)}")
    if name not in ACTIONS:
        raise c.error(params_line, f"{path}.{name}" if isinstance(data, dict) else path,
                      f"unknown action {name!r} (expected one of: {', '.join(ACTIONS)})")
    apath = f"{path}.{name}"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise c.error(params_line, apath, f"must be a mapping of parameters, not {type_word(params)}")
    s = Section(c, params, apath)
    before = len(c.errors)
    action = ACTIONS[name].parse(s, commands)
    if len(c.errors) > before:
        raise Invalid()
    return action


def _rule(c: Collector, data: Any, path: str, line: int | None) -> Rule:
    if not isinstance(data, dict):
        raise c.error(line, path, f"must be a mapping with name, match and action, not {type_word(data)}")
    s = Section(c, data, path)
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
    except Invalid:
        pass
    match: Match | None = None
    with contextlib.suppress(Invalid):
        match = _match(c, data.get("match"), s.key("match"), s.line("match"))
    action: Action | None = None
    if "action" not in data:
        s.fail("action", "is required")
    else:
        with contextlib.suppress(Invalid):
            action = _action(c, data["action"], s.key("action"), s.line("action"),
                             match.commands if match is not None else None)
    if match is not None and action is not None and match.commands is not None and action.APPLIES_TO is not None:
        wrong = sorted(type_name(cmd) for cmd in match.commands - action.APPLIES_TO)
        if wrong:
            key = s.key("match") + ".command"
            c.error(line_of(data.get("match"), "command") or line, key,
                    f"{action.NAME} acts only on {action.APPLIES_TO_TEXT}, not {', '.join(wrong)}")
    if len(c.errors) > before or name is None or match is None or action is None:
        raise Invalid()
    return Rule(name, match, action, line or 0)


def _document(c: Collector, data: Any) -> RuleSet:
    if isinstance(data, list):
        data = {"rules": data}
    if not isinstance(data, dict):
        raise c.error(getattr(data, "line", None) or 1, "rules",
                      f"a rule file is a mapping with 'rules:' (and optional 'seed:'), not {type_word(data)}")
    s = Section(c, data, "")
    s.check_keys(TOP_KEYS)
    seed: int | None = None
    try:
        value = s.number("seed", None, low=0, integer=True)
        seed = None if value is None else int(value)
    except Invalid:
        pass
    rules_data = data.get("rules")
    if rules_data is None:
        rules_data = []
    if not isinstance(rules_data, list):
        raise s.fail("rules", f"must be a list of rules, not {type_word(rules_data)}")
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(rules_data):
        path = f"rules[{index}]"
        line = line_of(rules_data, index)
        # names are checked for repeats even on rules with other errors: every error at once
        raw_name = item.get("name") if isinstance(item, dict) else None
        name = raw_name if isinstance(raw_name, str) else ""
        repeated = name in seen
        if repeated:
            c.error(line_of(item, "name") or line, f"{path}.name",
                    f"duplicate rule name {name!r} (first used by {seen[name]})")
        elif name.strip():
            seen[name] = path
        try:
            rule = _rule(c, item, path, line)
        except Invalid:
            continue
        if not repeated:
            rules.append(rule)
    return RuleSet(tuple(rules), seed, c.file)


def ruleset_from_data(data: Any, file: str | None = None) -> RuleSet:
    """A rules document (``{seed, rules}``, or a bare list of rules) already parsed."""
    c = Collector(file)
    try:
        ruleset = _document(c, data)
    except Invalid:
        ruleset = RuleSet()
    if c.errors:
        raise RuleFileError(sorted(c.errors, key=lambda error: error.line or 0))
    return ruleset


def rule_from_data(data: Any, file: str | None = None) -> Rule:
    """One rule (``{name, match, action}``), e.g. the body of ``POST /rules``."""
    c = Collector(file)
    rule: Rule | None = None
    with contextlib.suppress(Invalid):
        rule = _rule(c, data, "", line_of(data, "name") if isinstance(data, dict) else None)
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
