"""Every rule action, experienced by the official client through the running proxy.

The official ``pulsar-client`` talks to the embedded broker through the whole proxy
stack (``running_proxy``: rules hook, admin API, hot reload, recorder), and sees each
action as it would see a real misbehaving broker.  Every call has a timeout (the
client's own operation/send timeouts, and ``receive(timeout_millis=...)``).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from pathlib import Path

import pulsar
import pytest
from official import clients, official
from rules_proxy import StackFactory, ThreadedStack

from proxy.broker.embedded import ThreadedCluster

__all__ = ["clients"]

RULE_FILES = sorted((Path(__file__).parents[2] / "rules").glob("*.yaml"))


def topic(name: str) -> str:
    return f"persistent://public/default/{name}-{uuid.uuid4().hex[:8]}"


def client_for(stack: ThreadedStack, made: list[pulsar.Client], timeout_s: int = 10) -> pulsar.Client:
    return official(stack.service_url, made, timeout_s)


def producer(client: pulsar.Client, name: str, **options: object) -> pulsar.Producer:
    options.setdefault("send_timeout_millis", 10_000)
    return client.create_producer(name, batching_enabled=False, **options)


def receive_all(consumer: pulsar.Consumer, count: int, timeout_ms: int = 10_000) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < count:
        message = consumer.receive(timeout_millis=timeout_ms)
        got.append(message.data())
        consumer.acknowledge(message)
    return got


def timed_sends(prod: pulsar.Producer, count: int) -> list[float]:
    times = []
    for i in range(count):
        start = time.monotonic()
        prod.send(f"m{i}".encode())
        times.append(time.monotonic() - start)
    return times


# -- error, delay + admin DELETE, throttle ------------------------------------------------------------
def test_service_not_ready_twice_on_producer_is_retried_and_counted(broker: ThreadedCluster,
                                                                  rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: flaky-producer
    match: {command: [PRODUCER], times: 2}
    action: {error: {code: ServiceNotReady, message: try again}}
""")
    client = client_for(stack, clients)
    prod = producer(client, topic("flaky"))
    prod.send(b"after two refusals")
    assert stack.hits() == {"flaky-producer": 2}


def test_delay_on_send_receipt_then_delete_rule_over_admin_api(broker: ThreadedCluster,
                                                             rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: slow-receipts
    match: {command: [SEND_RECEIPT]}
    action: {delay: {ms: 300}}
""")
    prod = producer(client_for(stack, clients), topic("slow"))
    assert statistics.median(timed_sends(prod, 5)) >= 0.28
    assert stack.admin is not None
    assert stack.admin.delete("/rules/slow-receipts").status_code == 204
    assert statistics.median(timed_sends(prod, 5)) < 0.05


def test_throttled_topic_is_paced_while_another_topic_on_the_same_connection_is_not(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: pace
    match: {command: [SEND], topic: "persistent://public/default/throttled-*"}
    action: {throttle: {messages_per_second: 100, per: topic}}
""")
    client = client_for(stack, clients)
    slow = producer(client, topic("throttled"), send_timeout_millis=30_000)
    fast = producer(client, topic("free"))
    other_latencies: list[float] = []

    def other_topic() -> None:
        time.sleep(0.5)  # the throttled lane is full by now
        other_latencies.extend(timed_sends(fast, 20))

    start = time.monotonic()
    done = threading.Semaphore(0)
    for i in range(300):
        slow.send_async(f"t{i}".encode(), lambda result, _id: done.release())
    worker = threading.Thread(target=other_topic)
    worker.start()
    for _ in range(300):
        assert done.acquire(timeout=20)
    elapsed = time.monotonic() - start
    worker.join(20)
    assert elapsed >= 2.5
    assert len(other_latencies) == 20 and statistics.median(other_latencies) < 0.1


def test_consumer_throttling_rations_permits_to_the_configured_rate(broker: ThreadedCluster,
                                                                    rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: slow-dispatch
    match: {command: [FLOW], topic: "persistent://public/default/rationed-*"}
    action: {throttle: {messages_per_second: 40, per: consumer}}
""")
    client = client_for(stack, clients)
    name = topic("rationed")
    consumer = client.subscribe(name, "s")
    prod = producer(client, name)
    for i in range(50):
        prod.send_async(f"c{i}".encode(), None)
    prod.flush()
    start = time.monotonic()
    got = receive_all(consumer, 50)
    elapsed = time.monotonic() - start
    assert sorted(got) == sorted(f"c{i}".encode() for i in range(50))
    # 50 messages at 40/s, the first one free: ~1.2 s; never much faster than the rate
    assert elapsed >= 1.0
    assert stack.hits()["slow-dispatch"] >= 1


def test_a_shared_consumer_throttle_splits_its_rate_so_a_later_consumer_is_not_starved(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    """One bucket (no ``per:``), two consumers: the second is not held behind the first one's unused permits."""
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: one-bucket
    match: {command: [FLOW], topic: "persistent://public/default/shared-*"}
    action: {throttle: {messages_per_second: 50}}
""")
    client = client_for(stack, clients)
    names = [topic("shared-a"), topic("shared-b")]
    for name in names:
        prod = producer(client, name)
        for i in range(40):
            prod.send_async(f"{name}-{i}".encode(), None)
        prod.flush()
    finished: dict[str, float] = {}

    def consume(name: str) -> None:
        consumer = client.subscribe(name, "s", initial_position=pulsar.InitialPosition.Earliest)
        receive_all(consumer, 40, timeout_ms=8_000)
        finished[name] = time.monotonic() - start

    start = time.monotonic()
    first = threading.Thread(target=consume, args=(names[0],))
    first.start()
    time.sleep(0.5)
    consume(names[1])
    first.join(10)
    # 80 messages at 50/s take 1.6 s: the second consumer shares the rate from its start; behind the
    # first one's receiver queue (1000 permits, 40 used) it would wait 20 s
    assert finished[names[1]] < 4.0
    assert finished[names[0]] < 4.0
    # and together they never go faster than the bucket pays for
    assert max(finished.values()) >= 1.4


def test_a_per_topic_consumer_throttle_shares_its_rate_and_connections_show_the_permits_it_holds(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    """``per: topic``, two subscriptions of one topic 0.5 s apart: the second is not held behind the first
    one's unused permits, and ``GET /connections`` tells what each consumer's permits the proxy holds back."""
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: per-topic
    match: {command: [FLOW], topic: "persistent://public/default/split-*"}
    action: {throttle: {messages_per_second: 50, per: topic}}
""")
    client = client_for(stack, clients)
    name = topic("split")
    subscribed = [client.subscribe(name, sub, initial_position=pulsar.InitialPosition.Earliest)
                  for sub in ("a", "b")]  # both exist before the messages: each gets all 40
    for consumer in subscribed:
        consumer.close()
    prod = producer(client, name)
    for i in range(40):
        prod.send_async(f"{name}-{i}".encode(), None)
    prod.flush()
    finished: dict[str, float] = {}

    def consume(sub: str) -> None:
        consumer = client.subscribe(name, sub)
        receive_all(consumer, 40, timeout_ms=8_000)
        finished[sub] = time.monotonic() - start

    start = time.monotonic()
    first = threading.Thread(target=consume, args=("a",))
    first.start()
    time.sleep(0.5)
    consume("b")
    first.join(10)
    # 80 messages at 50/s take 1.6 s: behind the first one's receiver queue (1000 permits) the second
    # would wait 20 s
    assert finished["b"] < 4.0 and finished["a"] < 4.0
    assert max(finished.values()) >= 1.4
    assert stack.admin is not None
    rows = stack.admin.get("/connections").json()["connections"]
    elapsed = time.monotonic() - start
    consumers = [c for row in rows for c in row["consumers"] if c["topic"] == name]
    assert sorted(c["subscription"] for c in consumers) == ["a", "b"]
    # each granted 1000 and received 40; most of the rest the throttle still holds
    assert all(0 < c["permits_held"] <= c["permits"] for c in consumers), consumers
    passed = sum(1000 - c["permits_held"] for c in consumers)
    assert 80 <= passed <= 2 + 50 * elapsed
    assert all(row["permits_held"] == sum(c["permits_held"] for c in row["consumers"]) for row in rows)


# -- close, disconnect, drop -------------------------------------------------------------------------
@pytest.mark.parametrize("action", ["close", "disconnect"])
def test_close_or_disconnect_on_send_loses_nothing(action: str, broker: ThreadedCluster,
                                                   rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, f"""\
rules:
  - name: unload
    match: {{command: [SEND], after: 5, times: 2}}
    action: {action}
""")
    client = client_for(stack, clients)
    name = topic(action)
    consumer = client.subscribe(name, "s")
    prod = producer(client, name)
    for i in range(20):
        prod.send(f"{action}-{i}".encode())
    got = receive_all(consumer, 20)
    assert set(got) == {f"{action}-{i}".encode() for i in range(20)}
    assert stack.hits() == {"unload": 2}


def test_dropped_send_receipt_times_out_in_the_client(broker: ThreadedCluster, rules_proxy: StackFactory,
                                                      clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: lost-receipt
    match: {command: [SEND_RECEIPT], times: 1}
    action: drop
""")
    prod = producer(client_for(stack, clients), topic("drop"), send_timeout_millis=1000)
    start = time.monotonic()
    with pytest.raises(pulsar.Timeout):
        prod.send(b"never acknowledged")
    assert 0.9 <= time.monotonic() - start < 5
    assert stack.hits() == {"lost-receipt": 1}


# -- error on LOOKUP and SUBSCRIBE, redirect ----------------------------------------------------------
def test_lookup_errors_are_retried_by_the_client(broker: ThreadedCluster, rules_proxy: StackFactory,
                                                 clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: lookup-down
    match: {command: [LOOKUP], times: 2}
    action: {error: {code: ServiceNotReady}}
""")
    producer(client_for(stack, clients), topic("lookup")).send(b"found at last")
    assert stack.hits() == {"lookup-down": 2}


def test_refused_subscribe_reaches_the_client_as_its_error(broker: ThreadedCluster, rules_proxy: StackFactory,
                                                           clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: no-entry
    match: {command: [SUBSCRIBE], subscription: forbidden}
    action: {error: {code: AuthorizationError, message: not for you}}
""")
    client = client_for(stack, clients)
    name = topic("sub")
    with pytest.raises(pulsar.AuthorizationError):
        client.subscribe(name, "forbidden")
    client.subscribe(name, "allowed").close()
    assert stack.hits() == {"no-entry": 1}


def test_redirected_lookup_is_followed_through_the_proxy(broker: ThreadedCluster, rules_proxy: StackFactory,
                                                         clients) -> None:  # type: ignore[no-untyped-def]
    real = broker.service_url
    stack = rules_proxy(real, f"""\
rules:
  - name: elsewhere
    match: {{command: [LOOKUP], times: 1}}
    action: {{redirect: {{url: "{real}"}}}}
""")
    events: list[bytes] = []
    stack.call(lambda: stack.stack.server.observers.observers.append(_Capture(events)))  # type: ignore[union-attr]
    name = topic("redirect")
    producer(client_for(stack, clients), name).send(b"via the redirect")
    assert stack.hits() == {"elsewhere": 1}
    # the Redirect the proxy wrote names a proxy listener, never the broker itself
    time.sleep(0.2)
    from proxy.protocol.frame import frame_from_bytes
    answers = [frame_from_bytes(raw).command.lookupTopicResponse for raw in events]
    redirects = [a for a in answers if a.response == a.Redirect]
    assert redirects and all(real.split("://")[1] not in a.brokerServiceUrl for a in redirects)
    assert all(a.brokerServiceUrl.startswith("pulsar://127.0.0.1:") for a in answers)


class _Capture:
    """An observer keeping the LOOKUP_RESPONSE frames written to the client."""

    def __init__(self, into: list[bytes]) -> None:
        self.into = into

    def on_frame(self, event) -> None:  # type: ignore[no-untyped-def]
        if event.frame.type_name == "LOOKUP_RESPONSE" and event.direction.value == "to_client":
            self.into.append(event.frame.raw)

    def on_connection(self, event) -> None:  # type: ignore[no-untyped-def]
        del event


# -- corrupt, duplicate, rewrite, slice ---------------------------------------------------------------
def test_corrupted_send_fails_with_the_brokers_checksum_error(broker: ThreadedCluster,
                                                              rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: bit-flip
    match: {command: [SEND], times: 1}
    action: {corrupt: {what: checksum}}
""")
    prod = producer(client_for(stack, clients), topic("corrupt"))
    with pytest.raises(pulsar.ChecksumError):
        prod.send(b"damaged on the way")
    prod.send(b"intact")
    assert stack.hits() == {"bit-flip": 1}


def test_duplicated_send_is_stored_twice(broker: ThreadedCluster, rules_proxy: StackFactory,
                                         clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: twice
    match: {command: [SEND], times: 1}
    action: duplicate
""")
    client = client_for(stack, clients)
    name = topic("dup")
    consumer = client.subscribe(name, "s")
    prod = producer(client, name)
    for i in range(3):
        prod.send(f"d{i}".encode())
    assert sorted(receive_all(consumer, 4)) == [b"d0", b"d0", b"d1", b"d2"]


def test_rewritten_producer_success_gives_the_client_another_name(broker: ThreadedCluster,
                                                                  rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: rename
    match: {command: [PRODUCER_SUCCESS]}
    action: {rewrite: {producer_name: renamed-by-proxy}}
""")
    prod = producer(client_for(stack, clients), topic("rewrite"))
    assert prod.producer_name() == "renamed-by-proxy"


def test_sliced_messages_are_reassembled_by_the_client(broker: ThreadedCluster, rules_proxy: StackFactory,
                                                       clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, """\
rules:
  - name: tiny-writes
    match: {command: [MESSAGE]}
    action: {slice: {bytes: 7}}
""")
    client = client_for(stack, clients)
    name = topic("slice")
    consumer = client.subscribe(name, "s")
    prod = producer(client, name)
    for i in range(3):
        prod.send(f"slice-{i}".encode() * 10)
    assert receive_all(consumer, 3) == [f"slice-{i}".encode() * 10 for i in range(3)]
    assert stack.hits()["tiny-writes"] == 3


# -- record and mark -----------------------------------------------------------------------------------
def test_record_rule_keeps_only_matching_frames(broker: ThreadedCluster, rules_proxy: StackFactory,
                                                tmp_path: Path, clients) -> None:  # type: ignore[no-untyped-def]
    from proxy.config.proxy_config import RecordConfig
    from proxy.recording.reader import open_recordings

    stack = rules_proxy(broker.service_url, """\
rules:
  - name: keep-sends
    match: {command: [SEND]}
    action: record
  - name: tag-sends
    match: {command: [SEND]}
    action: {mark: {label: sends}}
""", record=RecordConfig(dir=str(tmp_path / "rec")))
    prod = producer(client_for(stack, clients), topic("record"))
    for i in range(3):
        prod.send(f"r{i}".encode())
    clients.pop().close()
    stack.stop()
    frames = list(open_recordings(tmp_path / "rec").frames())
    assert [f.frame.type_name for f in frames] == ["SEND"] * 3
    assert all(set(f.rules) == {"keep-sends", "tag-sends"} for f in frames)


# -- seed, hot reload, ready files ------------------------------------------------------------------------
SEEDED = """\
seed: 11
rules:
  - name: sometimes-slow
    match: {command: [SEND_RECEIPT], probability: 0.5}
    action: {delay: {ms: 120}}
"""


def test_same_seed_gives_the_same_hits_in_two_runs(broker: ThreadedCluster, rules_proxy: StackFactory,
                                                   clients) -> None:  # type: ignore[no-untyped-def]
    patterns = []
    for _ in range(2):
        stack = rules_proxy(broker.service_url, SEEDED)
        prod = producer(client_for(stack, clients), topic("seed"))
        patterns.append([latency >= 0.1 for latency in timed_sends(prod, 10)])
        assert stack.hits()["sometimes-slow"] == sum(patterns[-1])
    assert patterns[0] == patterns[1]
    assert 0 < sum(patterns[0]) < 10


def test_hot_reload_of_the_watched_rule_file_changes_behaviour_live(broker: ThreadedCluster,
                                                                    rules_proxy: StackFactory, clients) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url)
    prod = producer(client_for(stack, clients), topic("reload"))
    assert statistics.median(timed_sends(prod, 3)) < 0.05
    stack.rule_file.write_text("""\
rules:
  - name: now-slow
    match: {command: [SEND_RECEIPT]}
    action: {delay: {ms: 200}}
""", encoding="utf-8")
    deadline = time.monotonic() + 5
    while "now-slow" not in stack.hits():
        assert time.monotonic() < deadline, "the rule file was not reloaded"
        time.sleep(0.1)
    assert statistics.median(timed_sends(prod, 3)) >= 0.18


@pytest.mark.parametrize("path", RULE_FILES, ids=[p.name for p in RULE_FILES])
def test_every_ready_rule_file_loads_in_a_running_proxy(path: Path, broker: ThreadedCluster,
                                                        rules_proxy: StackFactory) -> None:
    from proxy.rules.loader import load_rules_file

    stack = rules_proxy(broker.service_url, path.read_text(encoding="utf-8"))
    expected = load_rules_file(path)
    assert stack.admin is not None
    body = stack.admin.get("/rules").json()
    assert [rule["name"] for rule in body["rules"]] == [rule.name for rule in expected.rules]
    assert body["seed"] == expected.seed


# -- GET /connections ---------------------------------------------------------------------------------
def _outstanding_permits_metric(stack: ThreadedStack) -> float:
    assert stack.admin is not None
    text = stack.admin.get("/metrics").text
    [value] = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pulsar_tap_outstanding_permits") and not line.startswith("#")]
    return value


@pytest.mark.parametrize("rules", ["rules: []\n", (Path(__file__).parents[2] / "rules" / "demo.yaml").read_text()],
                         ids=["no-rules", "demo-rules"])
def test_connections_always_report_each_consumers_permits_as_metrics_count_them(
        broker: ThreadedCluster, rules_proxy: StackFactory, clients, rules: str) -> None:  # type: ignore[no-untyped-def]
    stack = rules_proxy(broker.service_url, rules)
    client = client_for(stack, clients)
    name = topic("permits")
    consumer = client.subscribe(name, "s", receiver_queue_size=100)
    prod = producer(client, name)
    for i in range(30):
        prod.send(f"p{i}".encode())
    receive_all(consumer, 30)
    assert stack.admin is not None
    deadline = time.monotonic() + 10
    while True:  # the counts settle once the last MESSAGE and FLOW crossed the proxy
        rows = stack.admin.get("/connections").json()["connections"]
        consumers = [c for row in rows for c in row["consumers"]]
        total = sum(row["permits"] for row in rows)
        if (consumers and total == _outstanding_permits_metric(stack)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [c["topic"] for c in consumers] == [name]
    assert all(isinstance(c["permits"], int) for c in consumers)
    assert 0 < consumers[0]["permits"] <= 100  # the queue's permits, less what is still on its way
    assert total == consumers[0]["permits"] == _outstanding_permits_metric(stack)
