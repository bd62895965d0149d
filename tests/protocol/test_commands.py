"""Per-command knowledge is defined once (proxy.protocol.commands) and agrees with PulsarApi.proto.

The sets are read from the generated descriptors; these tests read the .proto text itself
(the upstream reference when the workspace has it, else the project's own copy) and check
that every command naming a producer, a consumer or a request is known as such, that every
command has a sender, and that the sets the session, the rules, the replay server and the
client use are the ones derived here.
"""

from __future__ import annotations

import re
from pathlib import Path

from proxy.protocol import commands
from proxy.protocol.commands import T, type_name

ROOT = Path(__file__).resolve().parents[2]


def proto_text() -> str:
    for folder in (ROOT.parent / "shared" / "reference", Path("/work/shared/reference"), ROOT / "proto"):
        path = folder / "PulsarApi.proto"
        if path.exists():
            return path.read_text()
    raise AssertionError("no PulsarApi.proto found")


def singular_fields_by_type() -> dict[int, set[str]]:
    """Command type -> the singular field names of its sub-command message, from the .proto text."""
    text = re.sub(r"//[^\n]*", "", proto_text())
    messages: dict[str, set[str]] = {}
    for name, body in re.findall(r"message\s+(\w+)\s*\{(.*?)\n\}", text, re.S):
        messages[name] = set(re.findall(r"(?:optional|required)\s+[\w.]+\s+(\w+)\s*=", body))
    base = re.search(r"message\s+BaseCommand\s*\{(.*?)\n\}", text, re.S)
    assert base is not None
    found: dict[int, set[str]] = {}
    for message, number in re.findall(r"optional\s+(Command\w+)\s+\w+\s*=\s*(\d+)", base.group(1)):
        found[int(number)] = messages[message]
    return found


def carrying(field: str) -> frozenset[int]:
    return frozenset(kind for kind, fields in singular_fields_by_type().items() if field in fields)


def names(types: frozenset[int]) -> list[str]:
    return sorted(type_name(t) for t in types)


def test_the_sets_of_commands_naming_a_producer_consumer_or_request_are_those_of_the_proto() -> None:
    assert names(commands.NAMES_PRODUCER) == names(carrying("producer_id"))
    assert names(commands.NAMES_CONSUMER) == names(carrying("consumer_id"))
    assert names(commands.NAMES_REQUEST) == names(carrying("request_id"))
    assert len(singular_fields_by_type()) == len(commands.TYPE_NAMES)


def test_every_command_has_a_sender_and_every_request_and_response_carries_a_request_id() -> None:
    assert names(frozenset(commands.TYPE_NAMES) - commands.CLIENT_COMMANDS - commands.BROKER_COMMANDS) == []
    assert names(frozenset(commands.RESPONSES) - commands.NAMES_REQUEST) == []
    assert names(commands.RESPONSE_TYPES - commands.NAMES_REQUEST) == []
    assert frozenset(commands.RESPONSES) <= commands.CLIENT_COMMANDS
    assert commands.RESPONSE_TYPES <= commands.BROKER_COMMANDS


def test_every_command_acting_on_a_producer_or_consumer_is_attributed_by_a_field_it_carries() -> None:
    fields = singular_fields_by_type()
    acting = (commands.NAMES_PRODUCER | commands.NAMES_CONSUMER) - commands.CREATES_ID - commands.SCALABLE_TOPIC_TYPES
    assert names(acting - frozenset(commands.ATTRIBUTION)) == []
    for kind, field in commands.ATTRIBUTION.items():
        assert field in fields[kind], type_name(kind)


def test_the_derived_sets_are_the_ones_their_users_relied_on() -> None:
    """What served.py, client/connection.py, rules/actions.py and rules/unload.py each spelled out before."""
    from proxy.rules import actions

    assert names(commands.PRODUCER_REQUESTS) == ["CLOSE_PRODUCER", "SEND"]
    assert names(commands.CONSUMER_REQUESTS) == ["ACK", "CLOSE_CONSUMER", "CONSUMER_STATS", "FLOW",
                                                 "GET_LAST_MESSAGE_ID", "REDELIVER_UNACKNOWLEDGED_MESSAGES", "SEEK",
                                                 "UNSUBSCRIBE"]
    assert names(commands.PRODUCER_NOTICES) == ["CLOSE_PRODUCER", "SEND_ERROR", "SEND_RECEIPT"]
    assert names(commands.CONSUMER_NOTICES) == ["ACTIVE_CONSUMER_CHANGE", "CLOSE_CONSUMER", "MESSAGE",
                                                "REACHED_END_OF_TOPIC"]
    assert names(actions.PRODUCER_FRAMES) == ["SEND", "SEND_ERROR", "SEND_RECEIPT"]
    assert names(actions.CONSUMER_FRAMES) == ["ACK", "ACK_RESPONSE", "FLOW", "MESSAGE",
                                              "REDELIVER_UNACKNOWLEDGED_MESSAGES"]


def test_t_is_the_command_types_as_plain_ints() -> None:
    assert vars(T) == commands.TYPE_VALUES
    assert all(type(value) is int for value in vars(T).values())
