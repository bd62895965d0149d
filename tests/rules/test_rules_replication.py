"""Rules on a replication link: replicator producer names by glob, replication markers by type."""

from __future__ import annotations

import pytest
from rules_helpers import TO_BROKER, Session, engine_for, frame

from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import PulsarMarkers_pb2 as pm
from proxy.protocol import markers
from proxy.protocol.frame import Frame, encode_payload_command, frame_from_bytes
from proxy.rules.loader import RuleFileError, load_rules_text, ruleset_from_data
from proxy.rules.verdict import FORWARD

REPLICATOR = "pulsar.repl.B-->A"


def replicated_send(producer_id: int, sequence_id: int, marker_type: int | None = None) -> Frame:
    metadata = api.MessageMetadata(producer_name="app", sequence_id=sequence_id, publish_time=5,
                                   replicated_from="B")
    payload = b"data"
    if marker_type is not None:
        metadata = markers.marker_metadata(marker_type, 5, "A")
        metadata.replicated_from = "B"
        payload = pm.ReplicatedSubscriptionsSnapshotResponse(snapshot_id="s1").SerializeToString()
    cmd = api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=1)
    return frame_from_bytes(encode_payload_command(cmd, metadata, payload))


def link_session(text: str) -> Session:
    session = Session(engine_for(text))
    session.add_producer(1, "persistent://public/default/geo", name=REPLICATOR)
    session.add_producer(2, "persistent://public/default/geo", name="app-producer")
    return session


def test_replicator_sends_match_a_producer_name_glob_by_producer_id() -> None:
    session = link_session("""\
rules:
  - name: wan
    match: {command: [SEND], producer_name: "pulsar.repl.*"}
    action: {delay: {ms: 2000}}
""")
    assert session.decide(replicated_send(1, 0), TO_BROKER).delay_s == pytest.approx(2.0)
    assert session.decide(replicated_send(2, 0), TO_BROKER) is FORWARD  # an ordinary producer on the same link


def test_a_marker_rule_matches_only_sends_carrying_that_marker() -> None:
    session = link_session("""\
rules:
  - name: lose-responses
    match: {marker: [REPLICATED_SUBSCRIPTION_SNAPSHOT_RESPONSE]}
    action: drop
""")
    assert not session.decide(replicated_send(1, 0, markers.SNAPSHOT_RESPONSE), TO_BROKER).forward
    assert session.decide(replicated_send(1, 1, markers.SNAPSHOT_REQUEST), TO_BROKER) is FORWARD
    assert session.decide(replicated_send(1, 2), TO_BROKER) is FORWARD
    assert session.decide(frame(api.CommandFlow(consumer_id=1, messagePermits=3)), TO_BROKER) is FORWARD
    # only SEND and MESSAGE need inspecting for it
    assert session.engine.interest(TO_BROKER) == frozenset({api.BaseCommand.SEND, api.BaseCommand.MESSAGE})


def test_marker_names_are_checked_and_normalised() -> None:
    ruleset = load_rules_text("rules:\n  - name: m\n    match: {marker: replicated_subscription_update}\n"
                              "    action: drop\n", "t.yaml")
    assert ruleset.rules[0].match.markers == frozenset({markers.UPDATE})
    assert ruleset.rules[0].to_data()["match"]["marker"] == ["REPLICATED_SUBSCRIPTION_UPDATE"]
    with pytest.raises(RuleFileError) as caught:
        load_rules_text("rules:\n  - name: m\n    match:\n      marker: [SNAPSHOT_RESPONSE, 11]\n"
                        "    action: drop\n", "t.yaml")
    assert [e.format().split(" (one of")[0] for e in caught.value.errors] == [
        "t.yaml:4: rules[0].match.marker[0]: unknown marker type 'SNAPSHOT_RESPONSE'",
        "t.yaml:4: rules[0].match.marker[1]: unknown marker type 11"]
    with pytest.raises(RuleFileError) as caught:
        load_rules_text("rules:\n  - name: m\n    match: {command: [FLOW], marker: REPLICATED_SUBSCRIPTION_SNAPSHOT}"
                        "\n    action: drop\n", "t.yaml")
    assert caught.value.errors[0].format() == ("t.yaml:3: rules[0].match.marker: markers travel only in SEND and "
                                               "MESSAGE; add one of them to match.command")


def test_admin_bodies_take_the_marker_key_too() -> None:
    ruleset = ruleset_from_data({"rules": [{"name": "m", "match": {"marker": ["REPLICATED_SUBSCRIPTION_SNAPSHOT"]},
                                            "action": "drop"}]})
    assert ruleset.rules[0].match.markers == frozenset({markers.SNAPSHOT})
