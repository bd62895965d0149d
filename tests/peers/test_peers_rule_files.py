"""Shipped rule files (``rules/*.yaml``, loaded unchanged) with the Java and Go clients against the real broker.

tests/rules/test_rule_files.py keeps every file's promise with the official Python client
on the embedded broker; here are the promises that differ by client, on the real
Apache Pulsar standalone, with the client programs of tests/peers/:

- ``flaky-producer-creation.yaml`` and ``broken-lookups.yaml``: the Java client retries a
  refused creation or lookup by itself; the Go client (pulsar-client-go) returns the
  refusal from ``CreateProducer`` / ``Subscribe`` and leaves the retry to the application.
- ``lossy-topic.yaml``: with hundreds of sends in flight, each lost receipt makes the
  Java and Go clients re-open their connection (through the proxy) and send again
  everything pending, so without deduplication many messages are stored more than once;
  a delivery with a bad checksum is dropped by the client.
- ``consumer-throttling.yaml``: 50 messages per second per consumer on the wire, so a
  consumer of a 4-partition topic (4 consumers) receives up to 200 per second.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from peers_rig import TENANT_NS, Upstream, delivery_problems, proxy_running, run_with_watcher, service_url
from real_pulsar import ClientRun, PeerFailed, run_client, start_client

from proxy.server.stack import ProxyStack

RULES = Path(__file__).parents[2] / "rules"


def _topic(label: str) -> str:
    return f"persistent://{TENANT_NS}/rule-files-{label}-{uuid.uuid4().hex[:8]}"


def _hits(proxy: ProxyStack) -> dict[str, int]:
    engine = proxy.engine
    assert engine is not None
    return dict(engine.hits())


@pytest.mark.parametrize(("rule_file", "codes"), [
    ("flaky-producer-creation.yaml", ("ServiceNotReady",)),
    ("broken-lookups.yaml", ("ServiceNotReady", "MetadataError")),
])
def test_a_refused_creation_is_retried_by_the_java_client_and_returned_by_the_go_client(
        rule_file: str, codes: tuple[str, ...], real_upstream: Upstream) -> None:
    upstream = real_upstream
    with proxy_running(upstream.service_url, lookup="rewrite", rules=str(RULES / rule_file)) as proxy:
        # the Go client first: it meets the file's first refusal
        go = run_client("go", service_url(proxy), _topic("go"), messages=50, batching=False, timeout=60)
        refused = str(go.report.get("error"))
        assert any(code in refused for code in codes), go.report
        assert not go.acked, "the Go client's creation failed: nothing was sent"
        java, dials = run_with_watcher(upstream, lambda: start_client(
            "java", service_url(proxy), _topic("java"), messages=200, batching=False, timeout=120))
        hits = _hits(proxy)
    assert java.report.get("error") is None and java.report["send_errors"] == 0, java.report
    assert len(java.acked_indices()) == 200 and sorted(set(java.received_indices())) == list(range(200))
    assert "client" not in dials.broker_peers
    if rule_file == "flaky-producer-creation.yaml":
        assert hits["not-ready-twice"] == 2  # the second refusal went to the Java client, which retried
    else:
        assert hits["lookup-metadata-error"] == 3 and hits["slow-lookups"] >= 1


def _stored_twice(run: ClientRun) -> set[int]:
    """Indices received under two or more message ids: messages the broker stored more than once."""
    ids: dict[int, set[str]] = {}
    for partition, indices in run.received.items():
        for index, message_id in zip(indices, run.report["received_ids"][partition], strict=True):
            ids.setdefault(index, set()).add(message_id)
    return {index for index, seen in ids.items() if len(seen) > 1}


@pytest.mark.parametrize("client", ["java", "go"])
def test_lossy_topic_resends_what_was_in_flight_through_the_proxy_and_drops_bad_deliveries(
        client: str, real_upstream: Upstream) -> None:
    upstream = real_upstream
    messages = 500
    topic = f"persistent://{TENANT_NS}/telemetry"  # the topic the file matches
    try:  # left by an earlier run in this broker's session
        upstream.admin("DELETE", f"/admin/v2/persistent/{TENANT_NS}/telemetry?force=true")
    except PeerFailed as exc:
        if "HTTP 404" not in str(exc):
            raise
    with proxy_running(upstream.service_url, lookup="rewrite", rules=str(RULES / "lossy-topic.yaml")) as proxy:
        run, dials = run_with_watcher(upstream, lambda: start_client(
            client, service_url(proxy), topic, messages=messages, batching=False, timeout=150,
            subscription=f"readings-{uuid.uuid4().hex[:6]}"))
        hits = _hits(proxy)
    report = run.report
    assert report.get("error") is None, report
    assert hits["lost-receipts"] >= 3 and hits["duplicated-receipts"] >= 1 and hits["corrupted-deliveries"] >= 1
    # every reconnection after a receipt gap went through the proxy
    assert "client" not in dials.broker_peers
    assert not dials.client_remote_ports & upstream.broker_ports
    # a last receipt lost has no later one to show the gap: that send times out (the application's to retry)
    acked = set(run.acked_indices())
    assert len(acked) >= messages - 10 and len(acked) + report["send_errors"] == messages, report["send_errors"]
    # what was in flight at each gap was sent again and stored again: many messages (242 to 473 of 500 seen;
    # fewer in flight on a loaded machine, fewer resent)
    assert len(_stored_twice(run)) > messages // 10, len(_stored_twice(run))
    # a delivery with a bad checksum is dropped (and acknowledged): up to that many never reach the consumer
    never_received = acked - set(run.received_indices())
    assert len(never_received) <= hits["corrupted-deliveries"], never_received


@pytest.mark.parametrize("client", ["java", "go"])
def test_consumer_throttling_holds_each_partition_of_a_partitioned_orders_topic_to_50_per_second(
        client: str, real_upstream: Upstream) -> None:
    """A consumer of a 4-partition topic is 4 consumers on the wire, each with its own bucket."""
    upstream = real_upstream
    messages, partitions, limit = 600, 4, 50
    topic = upstream.create_partitioned(f"orders-rule-files-{client}-{uuid.uuid4().hex[:8]}", partitions)
    with proxy_running(upstream.service_url, lookup="rewrite",
                       rules=str(RULES / "consumer-throttling.yaml")) as proxy:
        run = run_client(client, service_url(proxy), topic, messages=messages, batching=False, timeout=120)
        hits = _hits(proxy)
    assert delivery_problems(run, messages, partitions) == []
    assert hits["slow-dispatch"] >= partitions  # every partition's consumer granted permits through the rule
    elapsed = run.report["elapsed_seconds"]
    # never faster than 50 per second per partition (150 each, the first passing at once) ...
    assert elapsed >= (messages / partitions - 1) / limit * 0.9, elapsed
    # ... and not held to 50 per second in all (12 s): the partitions are paced side by side
    assert elapsed < messages / limit * 0.85, elapsed
