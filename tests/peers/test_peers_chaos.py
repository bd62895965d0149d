"""Chaos against the real Apache Pulsar broker, with the official Python client and the Java client.

Every test runs a client program (tests/peers/) through the pulsar-tap proxy, with a rule,
in front of the real standalone, and checks what the client saw against what Pulsar
promises:

- ``error`` ServiceNotReady on the first two PRODUCER requests: the client retries and
  its producer is created; every message then arrives.
- ``close`` on a producer (CLOSE_PRODUCER, as on a topic unload): the client re-creates
  the producer and resends; nothing is lost, duplicated or reordered.
- ``disconnect`` mid-stream: the client reconnects through the proxy (never to the
  broker) and resends; on a deduplicating namespace nothing is lost or duplicated.
- ``delay`` on SEND_RECEIPT: each receipt is late by its own delay, not by the sum of
  those before it.
- ``throttle`` on SEND: the rate the broker acknowledges is held to the limit.
- ``throttle`` on FLOW with one bucket for two Go consumers: the later one shares the
  rate at once instead of waiting behind the first one's unused permits.
- a **real** unload (``PUT /admin/v2/persistent/public/default/T/unload`` on the broker's
  admin API) while producing: the client looks the topic up again through the proxy,
  never dials the broker, and loses nothing.

Rates and delays are checked as bounds that load cannot break (a throttled stream is
never faster than its limit; a delayed receipt is never early), except the one upper
bound that tells per-frame delays from accumulated ones, which has seconds of margin.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from peers_rig import (
    Upstream,
    delivery_problems,
    frames_delivered_to_clients,
    proxy_running,
    run_with_watcher,
    service_url,
    show_json,
    wait_for,
)
from real_pulsar import ClientRun, PeerFailed, run_client, start_client

CHAOS_CLIENTS = ("python", "java")
#: a namespace with broker-side deduplication: resends after a cut connection are dropped by the broker
DEDUP_NS = "public/chaos-dedup"


@pytest.fixture(scope="module")
def dedup_namespace(real_upstream: Upstream) -> str:
    upstream = real_upstream
    upstream.admin("PUT", f"/admin/v2/namespaces/{DEDUP_NS}")
    upstream.admin("POST", f"/admin/v2/namespaces/{DEDUP_NS}/deduplication", True)
    wait_for(lambda: upstream.admin("GET", f"/admin/v2/namespaces/{DEDUP_NS}/deduplication") is True, 30,
             "deduplication on the namespace")
    return DEDUP_NS


def _topic(label: str, namespace: str = "public/default") -> str:
    return f"persistent://{namespace}/chaos-{label}-{uuid.uuid4().hex[:8]}"


class ChaosRun:
    """One client run through a rule-bearing proxy in front of the real broker."""

    def __init__(self, upstream: Upstream, tmp_path: Path, rules: list[dict[str, Any]], *, lookup: str = "rewrite"):
        self.upstream = upstream
        self.record_dir = tmp_path / "recordings"
        self.rules = rules
        self.lookup = lookup
        self.hits: dict[str, int] = {}

    def run(self, client: str, topic: str, **options: Any) -> tuple[ClientRun, Any]:
        with proxy_running(self.upstream.service_url, lookup=self.lookup, record_dir=self.record_dir,
                           rules={"seed": 1, "rules": self.rules}) as proxy:
            run, dials = run_with_watcher(self.upstream, lambda: start_client(client, service_url(proxy), topic,
                                                                                **options))
            engine = proxy.engine
            assert engine is not None
            self.hits = engine.hits()
        return run, dials

    def frames(self) -> list[dict[str, Any]]:
        return show_json(next(path for path in self.record_dir.iterdir() if path.is_dir()))


@pytest.fixture
def chaos(real_upstream: Upstream, tmp_path: Path) -> Any:
    def make(rules: list[dict[str, Any]], **options: Any) -> ChaosRun:
        return ChaosRun(real_upstream, tmp_path, rules, **options)

    return make


@pytest.mark.parametrize("client", CHAOS_CLIENTS)
def test_error_service_not_ready_on_producer_is_retried(client: str, chaos: Any) -> None:
    rig = chaos([{"name": "refuse-producer", "match": {"command": ["PRODUCER"], "times": 2},
                  "action": {"error": {"code": "ServiceNotReady", "message": "chaos: not yet"}}}])
    run, dials = rig.run(client, _topic("error"), messages=200, batching=False, timeout=120)
    assert delivery_problems(run, 200) == []
    assert rig.hits == {"refuse-producer": 2}
    frames = rig.frames()
    refused = [f for f in frames if f["origin"] == "proxy" and f["command"] == "ERROR"]
    assert [f["fields"].get("error") for f in refused] == ["ServiceNotReady", "ServiceNotReady"]
    assert sum(f["command"] == "PRODUCER_SUCCESS" for f in frames) == 1
    assert "client" not in dials.broker_peers


def _answers_after_close(frames: list[dict[str, Any]]) -> list[str]:
    """Receipts or send errors delivered to the client for a producer between the CLOSE_PRODUCER it was sent
    and the PRODUCER_SUCCESS of its re-creation (a closed producer has nothing in flight on the broker)."""
    delivered = frames_delivered_to_clients(frames)
    close = next(f for f in delivered if f["command"] == "CLOSE_PRODUCER")
    conn, producer_id = close["conn"], close["fields"]["producer_id"]
    requests = {f["fields"]["request_id"] for f in frames if f["command"] == "PRODUCER" and f["conn"] == conn
                and f["fields"]["producer_id"] == producer_id}
    recreated = min((f["ts_ns"] for f in delivered if f["command"] == "PRODUCER_SUCCESS" and f["conn"] == conn
                     and f["fields"]["request_id"] in requests and f["ts_ns"] > close["ts_ns"]), default=None)
    return [f"{f['command']} sequence_id={f['fields'].get('sequence_id')}" for f in delivered
            if f["conn"] == conn and f["command"] in ("SEND_RECEIPT", "SEND_ERROR")
            and f["fields"].get("producer_id") == producer_id
            and close["ts_ns"] < f["ts_ns"] and (recreated is None or f["ts_ns"] < recreated)]


@pytest.mark.parametrize("client", CHAOS_CLIENTS)
def test_close_producer_is_recreated_and_nothing_is_lost_duplicated_or_reordered(
        client: str, chaos: Any, dedup_namespace: str) -> None:
    """Sends as fast as the client can, so hundreds are in flight when the producer is closed; on a
    deduplicating namespace (as for a real unload, the client's resends would otherwise be stored twice)."""
    messages = 3000
    rig = chaos([{"name": "unload-once", "match": {"command": ["SEND"], "after": 500, "times": 1},
                  "action": "close"}])
    run, _ = rig.run(client, _topic("close", dedup_namespace), messages=messages, batching=False, timeout=120)
    assert rig.hits == {"unload-once": 1}
    frames = rig.frames()
    assert sum(f["command"] == "CLOSE_PRODUCER" and f["direction"] == "to_client" for f in frames) == 1
    assert _answers_after_close(frames) == [], "nothing for a closed producer reaches the client"
    # only the producer was closed: the consumer's stream is untouched (no redelivery)
    assert delivery_problems(run, messages) == []
    assert sum(f["command"] == "PRODUCER_SUCCESS" for f in frames) == 2


@pytest.mark.parametrize("client", CHAOS_CLIENTS)
def test_disconnect_reconnects_through_the_proxy(client: str, chaos: Any, dedup_namespace: str) -> None:
    rig = chaos([{"name": "cut", "match": {"command": ["SEND"], "after": 300, "times": 1},
                  "action": {"disconnect": {"how": "reset"}}}])
    run, dials = rig.run(client, _topic("disconnect", dedup_namespace), messages=2000, batching=False, rate=1000,
                         timeout=120)
    assert rig.hits == {"cut": 1}
    # the consumer's connection was cut too: Pulsar redelivers what it had not acknowledged yet
    assert delivery_problems(run, 2000, redelivery=True) == []
    assert "client" not in dials.broker_peers
    assert not dials.client_remote_ports & rig.upstream.broker_ports
    frames = rig.frames()
    producer_conns = {f["conn"] for f in frames if f["command"] == "PRODUCER"}
    assert len(producer_conns) == 2, "the producer came back on a new connection through the proxy"


@pytest.mark.parametrize("client", CHAOS_CLIENTS)
def test_delay_makes_each_receipt_late_by_its_own_delay(client: str, chaos: Any) -> None:
    delay_ms, messages = 200, 20
    rig = chaos([{"name": "slow-receipts", "match": {"command": ["SEND_RECEIPT"], "direction": "to_client"},
                  "action": {"delay": {"ms": delay_ms}}}])
    run, _ = rig.run(client, _topic("delay"), messages=messages, batching=False, latencies=True, timeout=120)
    assert delivery_problems(run, messages) == []
    latencies = run.report["latency_ms"]
    assert min(latencies) >= delay_ms, "no receipt may arrive before its delay"
    # 20 sends within milliseconds: delayed side by side they span well under a second;
    # delayed one after another they would span 19 x 200 ms
    assert max(latencies) - min(latencies) < 2500, latencies


@pytest.mark.parametrize("client", CHAOS_CLIENTS)
def test_throttle_holds_the_rate(client: str, chaos: Any) -> None:
    limit, messages = 50, 150
    rig = chaos([{"name": "slow-sends", "match": {"command": ["SEND"], "direction": "to_broker"},
                  "action": {"throttle": {"messages_per_second": limit}}}])
    run, _ = rig.run(client, _topic("throttle"), messages=messages, batching=False, timeout=120)
    assert delivery_problems(run, messages) == []
    # the first SEND passes at once (burst 1), the rest at the limit: never faster
    assert run.report["produce_seconds"] >= (messages - 1) / limit * 0.95, run.report["produce_seconds"]


def test_a_shared_flow_throttle_splits_its_rate_between_two_go_consumers(real_upstream: Upstream) -> None:
    """The Go client grants its whole receiver queue (1000 permits): a later consumer must not wait behind it."""
    upstream, limit, messages = real_upstream, 50, 100
    topics = [f"persistent://public/default/orders-fair-{label}-{uuid.uuid4().hex[:8]}" for label in "ab"]
    for name in topics:  # the backlog, straight to the broker
        filled = run_client("go", upstream.service_url, name, messages=messages, batching=False, timeout=60,
                            subscription="fill")
        assert len(filled.acked_indices()) == messages, filled.report
    rules = [{"name": "orders-shared", "match": {"command": ["FLOW"], "topic": "persistent://public/default/orders*"},
              "action": {"throttle": {"messages_per_second": limit}}}]
    with proxy_running(upstream.service_url, lookup="rewrite", rules=rules) as proxy:
        first = start_client("go", service_url(proxy), topics[0], messages=messages, mode="consume",
                             subscription="fair", timeout=60)
        time.sleep(1.0)
        second = run_client("go", service_url(proxy), topics[1], messages=messages, mode="consume",
                            subscription="fair", timeout=60)
        first_run = first.result()
    for run in (first_run, second):
        assert sorted(set(run.received_indices())) == list(range(messages)), run.report
    # 200 messages at 50/s take 4 s: the second consumer shares the rate from its start (behind the first
    # one's 1000 permits it took 21 s; the bound leaves a loaded machine's client start room, ~3-4 s measured);
    # and both together are never faster than the bucket
    assert second.report["elapsed_seconds"] < 10.0, second.report["elapsed_seconds"]
    last = max(first_run.report["elapsed_seconds"], 1.0 + second.report["elapsed_seconds"])
    assert last >= (2 * messages - 1) / limit * 0.9, last


def _started_producing(running: Any, upstream: Upstream, topic: str) -> None:
    path = topic.removeprefix("persistent://")

    def producing() -> bool:
        if running.process.poll() is not None:
            return True
        try:
            stats = upstream.admin("GET", f"/admin/v2/persistent/{path}/stats")
        except PeerFailed:  # 404 until the client created the topic
            return False
        return int(stats.get("msgInCounter", 0)) > 200

    wait_for(producing, 60, "the client to be producing")


@pytest.mark.parametrize("lookup", ["rewrite", "proxy-through"])
@pytest.mark.parametrize("client", CHAOS_CLIENTS)
def test_real_unload_while_producing_relooks_up_through_the_proxy(client: str, lookup: str,
                                                                   real_upstream: Upstream, dedup_namespace: str,
                                                                   tmp_path: Path) -> None:
    """On a deduplicating namespace: without it Pulsar itself may store a message twice on an unload (the
    client resends what it had in flight), with or without a proxy."""
    upstream = real_upstream
    topic = _topic("unload", dedup_namespace)
    record_dir = tmp_path / "recordings"
    messages = 1200
    def unload_while_producing(running: Any) -> None:
        _started_producing(running, upstream, topic)
        upstream.admin("PUT", f"/admin/v2/persistent/{topic.removeprefix('persistent://')}/unload")

    with proxy_running(upstream.service_url, lookup=lookup, record_dir=record_dir) as proxy:
        run, dials = run_with_watcher(upstream, lambda: start_client(
            client, service_url(proxy), topic, messages=messages, batching=False, rate=400, timeout=120),
            during=unload_while_producing)
    # the broker closed the consumer too: it redelivers what was not acknowledged yet
    assert delivery_problems(run, messages, redelivery=True) == []
    assert "client" not in dials.broker_peers, "the client dialled the broker"
    assert not dials.client_remote_ports & upstream.broker_ports
    frames = show_json(next(path for path in record_dir.iterdir() if path.is_dir()))
    # The unload shows as the broker's CLOSE_PRODUCER, or, when SENDs were in flight as the topic was fenced,
    # first as SEND_ERROR (PersistenceError "fenced"), on which the official client closes the connection
    # itself before any CLOSE_PRODUCER comes: whichever the broker sent first.
    closed_at = min(f["ts_ns"] for f in frames
                    if f["command"] in ("CLOSE_PRODUCER", "SEND_ERROR") and f["origin"] == "broker")
    relookups = [f for f in frames if f["command"] == "LOOKUP" and f["ts_ns"] > closed_at]
    assert relookups, "after the unload the client looks the topic up again, through the proxy"
    assert sum(f["command"] == "PRODUCER_SUCCESS" for f in frames) == 2
