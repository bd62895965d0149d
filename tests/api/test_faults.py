"""Fault builders become exactly the rules of the rule language, validated where they are written (no I/O)."""

from __future__ import annotations

import pytest

from proxy.rules.loader import rule_from_data
from proxy.testing import (
    Fault,
    InvalidRule,
    bandwidth,
    delay,
    disconnect,
    drop,
    error,
    latency,
    reset_peer,
    slicer,
    throttle,
    timeout,
    unload,
)


def test_error_on_producer_twice_is_the_rule_users_would_write() -> None:
    rule = error("ServiceNotReady").on("PRODUCER").times(2).to_rule("refuse")
    assert rule == {"name": "refuse", "match": {"command": ["PRODUCER"], "times": 2},
                    "action": {"error": {"code": "ServiceNotReady"}}}


def test_delay_with_a_short_topic_glob_gets_the_default_namespace() -> None:
    rule = delay(ms=200, jitter_ms=50).on("send_receipt").topic("orders-*").to_rule("slow")
    assert rule["match"] == {"command": ["SEND_RECEIPT"], "topic": "persistent://public/default/orders-*"}
    assert rule["action"] == {"delay": {"ms": 200, "jitter_ms": 50}}


def test_an_exact_topic_name_also_matches_its_partitions_and_nothing_else() -> None:
    match = rule_from_data(drop().topic("orders").to_rule("x")).match
    assert match.topic is not None
    assert match.topic.matches("persistent://public/default/orders")
    assert match.topic.matches("persistent://public/default/orders-partition-3")
    assert not match.topic.matches("persistent://public/default/orders-archive")
    assert not match.topic.matches("persistent://public/default/orders2")


def test_topic_forms_as_clients_write_them() -> None:
    assert drop().topic("acme/billing/inv-*").match["topic"] == "persistent://acme/billing/inv-*"
    assert drop().topic("non-persistent://a/b/c*").match["topic"] == "non-persistent://a/b/c*"
    assert drop().topic(r"persistent://.*/orders-\d+", regex=True).match["topic"] == {
        "regex": r"persistent://.*/orders-\d+"}


def test_triggers() -> None:
    fault = disconnect(how="reset").on("SEND").after(10).probability(0.5)
    assert fault.match == {"command": ["SEND"], "after": 10, "probability": 0.5}
    assert error().once().match == {"times": 1}


def test_builders_return_new_faults_and_leave_the_original_alone() -> None:
    base = error("TopicNotFound")
    refined = base.on("LOOKUP").times(3)
    assert base.match == {}
    assert refined.match == {"command": ["LOOKUP"], "times": 3}
    assert refined != base
    assert refined == error("TopicNotFound").on("LOOKUP").times(3)


def test_unnamed_faults_get_a_fresh_name_per_rendering() -> None:
    fault = drop()
    first, second = fault.to_rule()["name"], fault.to_rule()["name"]
    assert first.startswith("drop-") and second.startswith("drop-") and first != second
    assert fault.named("fixed").to_rule()["name"] == "fixed"


def test_unload_closes_the_next_producer_or_consumer_of_the_topic_once() -> None:
    rule = unload("orders").to_rule("u")
    assert rule["action"] == {"close": {}}
    assert rule["match"]["times"] == 1
    assert rule["match"]["topic"] == {"regex": r"persistent://public/default/orders(-partition-[0-9]+)?"}


@pytest.mark.parametrize(("fault", "steps"), [
    (latency(100, jitter=10), [(0.0, {"delay": {"ms": 100, "jitter_ms": 10}}, {"direction": "to_client"})]),
    (latency(100, stream="upstream"), [(0.0, {"delay": {"ms": 100, "jitter_ms": 0.0}}, {"direction": "to_broker"})]),
    (timeout(), [(0.0, {"drop": {}}, {"direction": "to_client"})]),
    (timeout(500), [(0.0, {"drop": {}}, {"direction": "to_client"}),
                    (0.5, {"disconnect": {"how": "close"}}, {"direction": "to_client"})]),
    (reset_peer(), [(0.0, {"disconnect": {"how": "reset"}}, {})]),
    (reset_peer(timeout_ms=250), [(0.25, {"disconnect": {"how": "reset"}}, {})]),
    (bandwidth(10), [(0.0, {"throttle": {"bytes_per_second": 10240, "per": "connection"}}, {"command": ["SEND"]})]),
    (slicer(7), [(0.0, {"slice": {"bytes": 7}}, {})]),
], ids=["latency", "latency-upstream", "timeout-0", "timeout-500", "reset_peer", "reset_peer-250", "bandwidth",
        "slicer"])
def test_toxiproxy_toxics_map_onto_rules(fault: Fault, steps: list[tuple[float, dict[str, object], dict[str, object]]]
                                         ) -> None:
    rendered = fault.steps("t")
    assert [(after, rule["action"], rule["match"]) for after, rule in rendered] == steps
    assert [rule["name"] for _, rule in rendered] == ["t", "t-1"][:len(steps)]


def test_bandwidth_downstream_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidRule, match="messages_per_second"):
        bandwidth(10, stream="downstream")


@pytest.mark.parametrize(("make", "message"), [
    (lambda: drop().on("SNED"), "unknown command type 'SNED' (did you mean SEND"),
    (lambda: drop().times(0), "times must be a whole number >= 1"),
    (lambda: drop().after(-1), "after must be a whole number >= 0"),
    (lambda: drop().probability(1.5), "probability must be in (0, 1]"),
    (lambda: error("NoSuchCode").to_rule("e"), "action.error.code"),
    (lambda: throttle().to_rule("t"), "action.throttle"),
    (lambda: delay(ms=-5).to_rule("d"), "action.delay.ms"),
])
def test_mistakes_are_reported_where_the_fault_is_written(make: object, message: str) -> None:
    with pytest.raises(InvalidRule) as caught:
        make()  # type: ignore[operator]
    assert message in str(caught.value)
    assert caught.value.status == 400
