"""``close`` is a topic unload, as the official client meets one from a real broker.

A rule closes the producer (CLOSE_PRODUCER) while many SENDs are in flight, several
times over a stream of sends: the client re-creates the producer and resends what had
no receipt.  What the topic holds afterwards — read straight from the broker — is every
message sent, once, in the order sent: the proxy forwarded no SEND of the closed
producer after the close, swallowed no receipt of a stored message, and answered
nothing on the broker's behalf.
"""

from __future__ import annotations

import uuid

from official import AsyncSends, clients, official, read_back
from rules_proxy import StackFactory

from proxy.broker.embedded import ThreadedCluster

__all__ = ["clients"]


def test_close_on_sends_in_flight_loses_nothing_and_stores_nothing_twice(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list) -> None:  # type: ignore[type-arg]
    stack = rules_proxy(broker.service_url, """\
seed: 5
rules:
  - name: unload
    match: {command: [SEND], after: 10, probability: 0.05}
    action: close
""")
    topic = f"persistent://public/default/unload-{uuid.uuid4().hex[:8]}"
    producer = official(stack.service_url, clients).create_producer(
        topic, batching_enabled=False, send_timeout_millis=30_000, max_pending_messages=1000)
    sends = AsyncSends(producer)
    sends.send(100)                      # 100 in flight at once
    sends.wait()
    for round_ in range(5):              # then a stream, in bursts
        sends.send(60, start=100 + 60 * round_)
    sends.wait()
    assert stack.hits()["unload"] >= 3   # the rule fired several times while SENDs were in flight
    assert read_back(broker.service_url, topic, len(sends.sent), clients) == sends.sent


def test_close_on_flow_delivers_every_message_in_order(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients: list) -> None:  # type: ignore[type-arg]
    """A consumer closed on its FLOWs re-subscribes; what it had not acknowledged comes again, nothing is lost."""
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: unload
    match: {command: [FLOW], after: 2, times: 3}
    action: close
""")
    topic = f"persistent://public/default/unload-{uuid.uuid4().hex[:8]}"
    client = official(stack.service_url, clients)
    consumer = client.subscribe(topic, "s", receiver_queue_size=20)
    sends = AsyncSends(official(broker.service_url, clients).create_producer(topic, batching_enabled=False))
    sends.send(300)
    sends.wait()
    first_seen: list[bytes] = []
    while len(set(first_seen)) < 300:
        message = consumer.receive(timeout_millis=15_000)
        consumer.acknowledge(message)
        if message.data() not in first_seen:
            first_seen.append(message.data())
    assert first_seen == sends.sent
    assert stack.hits()["unload"] == 3
