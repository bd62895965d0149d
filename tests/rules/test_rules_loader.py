"""Rule files become typed rules; every mistake is reported as FILE:LINE: KEY: message."""

from __future__ import annotations

import pytest

from proxy.errors import ConfigError
from proxy.pb import PulsarApi_pb2 as api
from proxy.rules.actions import Delay, Error, Rewrite, Throttle
from proxy.rules.loader import RuleFileError, load_rules_text, rule_from_data, ruleset_from_data

T = api.BaseCommand.Type


def errors_of(text: str) -> list[str]:
    with pytest.raises(RuleFileError) as info:
        load_rules_text(text, "chaos.yaml")
    return [error.format() for error in info.value.errors]


def test_valid_file_gives_typed_rules_with_defaults() -> None:
    ruleset = load_rules_text("""\
seed: 9
rules:
  - name: slow-receipts
    match:
      command: [SEND_RECEIPT]
      direction: to_client
      topic: "persistent://public/default/orders-*"
      client: 10.0.0.0/8
      probability: 0.25
      after: 10
      times: 3
    action: {delay: {ms: 200, jitter_ms: 50}}
  - name: refuse
    match: {command: PRODUCER, topic: {regex: ".*/orders-[0-9]+"}}
    action: {error: {code: ServiceNotReady}}
  - name: pace
    action: {throttle: {messages_per_second: 100, per: topic}}
  - name: drop-all
    action: drop
""", "chaos.yaml")
    assert ruleset.seed == 9
    assert ruleset.names() == ["slow-receipts", "refuse", "pace", "drop-all"]
    first = ruleset.rules[0]
    assert first.match.commands == frozenset({T.SEND_RECEIPT})
    assert first.match.after == 10 and first.match.times == 3 and first.match.probability == 0.25
    assert first.match.topic is not None and first.match.topic.matches("persistent://public/default/orders-7")
    assert not first.match.topic.matches("persistent://public/default/other")
    assert first.action == Delay(200.0, 50.0)
    assert first.line == 3
    assert ruleset.rules[1].action == Error("ServiceNotReady", "injected by pulsar-tap")
    assert ruleset.rules[1].match.topic is not None and ruleset.rules[1].match.topic.regex
    assert ruleset.rules[2].action == Throttle(100.0, None, 1.0, "topic")
    assert ruleset.rules[3].to_data()["action"] == {"drop": {}}


def test_every_error_is_reported_with_file_line_and_dotted_key() -> None:
    assert errors_of("""\
seed: -1
colour: red
rules:
  - name: a
    match:
      command: [SEND, NOPE]
      direction: sideways
      topic: {regex: "(("}
      client: 10.0.0.300/8
      probability: 1.5
      times: 0
      flavour: x
    action: {delay: {ms: -5}}
  - name: b
    action: {error: {code: NoSuchError}}
  - name: c
    action: {explode: {}}
  - name: d
    action: {drop: {}, delay: {ms: 1}}
""") == [
        "chaos.yaml:1: seed: must be >= 0, not -1",
        "chaos.yaml:2: colour: unknown key (expected one of: seed, rules)",
        "chaos.yaml:6: rules[0].match.command[1]: unknown command type 'NOPE'",
        "chaos.yaml:7: rules[0].match.direction: must be one of to_client, to_broker, any, not 'sideways'",
        "chaos.yaml:8: rules[0].match.topic.regex: bad regular expression '((': missing ): (( (patterns run on "
        "RE2, in linear time: no backreferences, lookaround or possessive repeats)",
        "chaos.yaml:9: rules[0].match.client: bad CIDR '10.0.0.300/8'",
        "chaos.yaml:10: rules[0].match.probability: must be between 0 and 1, not 1.5",
        "chaos.yaml:11: rules[0].match.times: must be >= 1, not 0",
        "chaos.yaml:12: rules[0].match.flavour: unknown key (expected one of: command, direction, topic, "
        "subscription, producer_name, consumer_name, client, marker, probability, after, times)",
        "chaos.yaml:13: rules[0].action.delay.ms: must be >= 0, not -5",
        "chaos.yaml:15: rules[1].action.error.code: unknown ServerError 'NoSuchError'",
        "chaos.yaml:17: rules[2].action.explode: unknown action 'explode' (expected one of: delay, drop, error, "
        "disconnect, close, corrupt, duplicate, rewrite, throttle, redirect, record, mark, slice)",
        "chaos.yaml:19: rules[3].action: must have exactly one action, not 2 (one of: delay, drop, error, "
        "disconnect, close, corrupt, duplicate, rewrite, throttle, redirect, record, mark, slice)",
    ]


def test_unknown_key_points_at_its_own_line() -> None:
    assert errors_of("""\
rules:
  - name: a
    action:
      delay:
        ms: 10
        jitter: 5
""") == ["chaos.yaml:6: rules[0].action.delay.jitter: unknown key (expected one of: ms, jitter_ms)"]


def test_actions_refuse_commands_they_cannot_act_on() -> None:
    assert errors_of("""\
rules:
  - name: e
    match: {command: [PING, PRODUCER]}
    action: {error: {code: ServiceNotReady}}
  - name: t
    match:
      command: [LOOKUP]
    action: {throttle: {messages_per_second: 5}}
  - name: r
    match: {command: [SEND]}
    action: {redirect: {url: "pulsar://127.0.0.1:6651"}}
  - name: c
    match: {command: [PING]}
    action: {corrupt: {what: payload}}
""") == [
        "chaos.yaml:3: rules[0].match.command: error acts only on requests a broker answers, not PING",
        "chaos.yaml:7: rules[1].match.command: throttle acts only on SEND and FLOW, not LOOKUP",
        "chaos.yaml:10: rules[2].match.command: redirect acts only on LOOKUP, not SEND",
        "chaos.yaml:13: rules[3].match.command: corrupt acts only on SEND and MESSAGE, not PING",
    ]


def test_rewrite_fields_are_checked_against_the_command_descriptor() -> None:
    assert errors_of("""\
rules:
  - name: shrink
    match: {command: [CONNECTED]}
    action:
      rewrite:
        max_message_size: 1024
        no_such_field: 1
  - name: unbound
    action: {rewrite: {x: 1}}
""") == [
        "chaos.yaml:7: rules[0].action.rewrite.no_such_field: cannot set on CONNECTED: "
        'Message type "pulsar.proto.CommandConnected" has no field named "no_such_field" at "CommandConnected".',
        "chaos.yaml:9: rules[1].action.rewrite: needs match.command: the fields are those of a command",
    ]
    ok = load_rules_text("rules:\n  - name: s\n    match: {command: CONNECTED}\n"
                         "    action: {rewrite: {max_message_size: 1024}}\n")
    assert ok.rules[0].action == Rewrite('{"max_message_size": 1024}')


def test_duplicate_names_missing_keys_and_bad_values() -> None:
    assert errors_of("""\
rules:
  - name: a
    action: drop
  - name: a
    action: drop
  - match: {command: SEND}
  - name: t
    action: {throttle: {burst: 0}}
  - name: u
    action: {redirect: {url: "http://x"}}
  - name: v
    match: {topic: "orders-[1"}
    action: {slice: {bytes: 0}}
""") == [
        "chaos.yaml:4: rules[1].name: duplicate rule name 'a' (first used by rules[0])",
        "chaos.yaml:6: rules[2].name: is required (a unique rule name)",
        "chaos.yaml:6: rules[2].action: is required",
        "chaos.yaml:8: rules[3].action.throttle.burst: must be > 0, not 0",
        "chaos.yaml:8: rules[3].action.throttle: needs messages_per_second or bytes_per_second",
        "chaos.yaml:10: rules[4].action.redirect.url: 'http://x' is not a pulsar://HOST:PORT or "
        "pulsar+ssl://HOST:PORT URL",
        "chaos.yaml:12: rules[5].match.topic: bad glob 'orders-[1': unbalanced brackets",
        "chaos.yaml:13: rules[5].action.slice.bytes: must be >= 1, not 0",
    ]


def test_yaml_syntax_error_uses_key_yaml() -> None:
    (message,) = errors_of("rules:\n  - name: a\n    action: [drop\n")
    assert message.startswith("chaos.yaml:4: yaml: ")


def test_json_bodies_have_keys_but_no_lines() -> None:
    rule = rule_from_data({"name": "x", "match": {"command": ["SEND"]}, "action": {"delay": {"ms": 5}}})
    assert rule.action == Delay(5.0, 0.0)
    with pytest.raises(RuleFileError) as info:
        rule_from_data({"name": "x", "action": {"delay": {"ms": "soon"}}})
    assert [e.format() for e in info.value.errors] == ["action.delay.ms: must be a number, not a string"]
    assert isinstance(info.value, ConfigError)
    document = ruleset_from_data([{"name": "y", "action": "drop"}])
    assert document.names() == ["y"] and document.seed is None


def test_each_action_class_owns_its_name_and_parses_only_itself() -> None:
    """The registry maps every rule-file name to the class carrying it; no class builds another action."""
    from proxy.rules.actions import ACTIONS

    for name, cls in ACTIONS.items():
        assert name == cls.NAME
        params = {"delay": "{ms: 1}", "error": "{}", "rewrite": "{request_id: 1}", "throttle": "{burst: 2, "
                  "messages_per_second: 1}", "redirect": "{url: 'pulsar://b:6650'}"}.get(name, "{}")
        command = {"rewrite": "\n    match: {command: [LOOKUP]}"}.get(name, "")
        rule = load_rules_text(f"rules:\n  - name: a{command}\n    action: {{{name}: {params}}}\n").rules[0]
        assert type(rule.action) is cls and rule.action.to_data() == rule_from_data(rule.to_data()).action.to_data()
