"""Rules that look only where they can fire still fire on everything they match (official client).

The proxy shows a topic-scoped rule only the connections with a producer or consumer
on its topic, and draws a probability rule's hits before decoding.  Through the whole
stack (rules hook, admin API, hot reload) with the official ``pulsar-client`` streaming
``send_async``: a producer created later on a connection already streaming is matched
from its first message, a reloaded rule set applies to live connections, and a
probability rule fires at its rate, the same frames for the same seed.
"""

from __future__ import annotations

import time
import uuid

import pulsar
from official import AsyncSends, clients, official
from rules_proxy import StackFactory, ThreadedStack

from proxy.broker.embedded import ThreadedCluster

__all__ = ["clients"]

PREFIX = "persistent://public/default"


def stream(client: pulsar.Client, topic: str, count: int) -> AsyncSends:
    """``count`` async sends on a new producer of ``topic`` (no batching: one SEND each), all answered Ok."""
    sends = AsyncSends(client.create_producer(topic, batching_enabled=False, send_timeout_millis=30_000,
                                              block_if_queue_full=True))
    sends.send(count)
    sends.wait()
    return sends


def wait_for_rule(stack: ThreadedStack, name: str) -> None:
    deadline = time.monotonic() + 10
    while name not in stack.hits():
        assert time.monotonic() < deadline, "the rule file was not reloaded"
        time.sleep(0.05)


def test_a_producer_created_later_on_a_streaming_connection_is_matched_from_its_first_send(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:8]
    stack = rules_proxy(broker.service_url, f"""\
rules:
  - name: watched-sends
    match: {{command: [SEND], topic: "{PREFIX}/watched-{tag}-*"}}
    action: mark
  - name: watched-receipts
    match: {{command: [SEND_RECEIPT], topic: "{PREFIX}/watched-{tag}-*"}}
    action: mark
""")
    client = official(stack.service_url, clients)  # one broker: one connection for every producer
    stream(client, f"{PREFIX}/free-{tag}", 300)
    assert stack.hits() == {"watched-sends": 0, "watched-receipts": 0}
    free = AsyncSends(client.create_producer(f"{PREFIX}/free-{tag}-2", batching_enabled=False))
    free.send(300)  # still streaming while the watched producer registers and streams
    stream(client, f"{PREFIX}/watched-{tag}-a", 400)
    free.wait()
    assert stack.hits() == {"watched-sends": 400, "watched-receipts": 400}
    assert stack.admin is not None  # (and all three producers shared one connection)
    rows = stack.admin.get("/connections").json()["connections"]
    assert sorted(len(row["producers"]) for row in rows if row["producers"]) == [3]


def test_a_reloaded_rule_set_applies_to_a_connection_already_streaming(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:8]
    watched = f"{PREFIX}/reloaded-{tag}"
    rule = """\
rules:
  - name: {name}
    match: {{command: [SEND], topic: "{topic}"}}
    action: mark
"""
    stack = rules_proxy(broker.service_url, rule.format(name="elsewhere", topic=f"{PREFIX}/nobody-{tag}"))
    client = official(stack.service_url, clients)
    sends = stream(client, watched, 200)
    assert stack.hits() == {"elsewhere": 0}
    stack.rule_file.write_text(rule.format(name="here", topic=watched), encoding="utf-8")
    wait_for_rule(stack, "here")
    sends.send(300, start=200)
    sends.wait()
    assert stack.hits() == {"here": 300}
    assert stack.admin is not None
    assert stack.admin.delete("/rules/here").status_code == 204
    assert stack.admin.post("/rules", content=f'{{"name": "back", "match": {{"command": ["SEND_RECEIPT"], '
                                              f'"topic": "{watched}"}}, "action": "mark"}}').status_code == 201
    sends.send(100, start=500)
    sends.wait()
    assert stack.hits() == {"back": 100}


SAMPLED = """\
seed: 42
rules:
  - name: one-in-ten
    match: {command: [SEND], probability: 0.1}
    action: mark
  - name: nobody
    match: {command: [SEND], topic: "persistent://public/default/nobody-*"}
    action: {delay: {ms: 10}}
"""


def test_a_probability_rule_drawn_before_decoding_fires_at_its_rate_and_repeats_with_its_seed(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    counts = []
    for _ in range(2):
        stack = rules_proxy(broker.service_url, SAMPLED)
        stream(official(stack.service_url, clients), f"{PREFIX}/sampled-{uuid.uuid4().hex[:8]}", 2000)
        hits = stack.hits()
        assert hits["nobody"] == 0
        counts.append(hits["one-in-ten"])
    assert 130 <= counts[0] <= 270  # 200 expected; 5 standard deviations either way
    assert counts[0] == counts[1]  # one connection, the same SENDs: the same draws
