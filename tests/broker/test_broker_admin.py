"""The admin REST API answers as Pulsar's admin API v2 does."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pulsar
import pytest

from proxy.broker import ThreadedCluster


def http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


@pytest.fixture
def admin_cluster(broker_cluster) -> ThreadedCluster:  # type: ignore[no-untyped-def]
    cluster: ThreadedCluster = broker_cluster(brokers=2, admin=True)
    return cluster


def test_create_and_list_partitioned_topics(admin_cluster: ThreadedCluster) -> None:
    base = f"{admin_cluster.admin_url}/admin/v2/persistent/public/default"
    assert http("PUT", f"{base}/orders/partitions", 3) == (204, None)
    assert http("PUT", f"{base}/orders/partitions", 3)[0] == 409
    assert http("GET", f"{base}/partitioned") == (200, ["persistent://public/default/orders"])
    assert http("GET", f"{base}/orders/partitions") == (200, {"partitions": 3})
    client = pulsar.Client(admin_cluster.service_url, operation_timeout_seconds=5)
    try:
        assert len(client.get_topic_partitions("orders")) == 3
    finally:
        client.close()


def test_stats_report_publishers_subscriptions_and_backlog(admin_cluster: ThreadedCluster) -> None:
    client = pulsar.Client(admin_cluster.service_url, operation_timeout_seconds=5)
    try:
        consumer = client.subscribe("stats", "sub")
        producer = client.create_producer("stats", producer_name="p", batching_enabled=False)
        for _ in range(5):
            producer.send(b"x")
        status, stats = http("GET", f"{admin_cluster.admin_url}/admin/v2/persistent/public/default/stats/stats")
        assert status == 200
        assert stats["msgInCounter"] == 5
        assert stats["msgRateIn"] > 0
        assert [p["producerName"] for p in stats["publishers"]] == ["p"]
        assert stats["subscriptions"]["sub"]["msgBacklog"] == 5
        assert len(stats["subscriptions"]["sub"]["consumers"]) == 1
        consumer.acknowledge_cumulative(consumer.receive(5000))
        for _ in range(4):
            consumer.acknowledge(consumer.receive(5000))
    finally:
        client.close()


def test_unload_terminate_and_lookup(admin_cluster: ThreadedCluster) -> None:
    base = f"{admin_cluster.admin_url}/admin/v2/persistent/public/default"
    client = pulsar.Client(admin_cluster.service_url, operation_timeout_seconds=5)
    try:
        producer = client.create_producer("life", batching_enabled=False)
        producer.send(b"1")
        assert http("PUT", f"{base}/life/unload") == (204, None)
        producer.send(b"2")
        status, last = http("POST", f"{base}/life/terminate")
        assert status == 200
        assert last["entryId"] == 1
        status, lookup = http("GET", f"{admin_cluster.admin_url}/lookup/v2/topic/persistent/public/default/life")
        assert status == 200
        assert lookup["brokerUrl"].replace("pulsar://", "") in admin_cluster.addresses
        assert http("GET", f"{base}/nothing-here/stats")[0] == 404
        assert http("DELETE", f"{base}/life/unload")[0] == 405
    finally:
        client.close()


def test_known_namespaces_make_others_not_found_as_on_a_real_broker(broker_cluster) -> None:  # type: ignore[no-untyped-def]
    """FIDELITY.md: with ClusterConfig.known_namespaces, a topic of another namespace is not found (the real
    broker's answers); its namespace exists once created through the admin API, and --topic's namespaces do."""
    cluster: ThreadedCluster = broker_cluster(admin=True, known_namespaces=frozenset({"public/default"}),
                                              topics={"persistent://acme/audit/log": 0})
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=5)
    try:
        client.create_producer("persistent://public/default/t").close()
        client.create_producer("persistent://acme/audit/other").close()
        for topic in ("persistent://nosuch/ns/t", "persistent://public/nosuch/t"):
            with pytest.raises(pulsar.PulsarException, match="TopicNotFound"):
                client.create_producer(topic)
            with pytest.raises(pulsar.PulsarException, match="TopicNotFound"):
                client.subscribe(topic, "s")
            with pytest.raises(pulsar.PulsarException, match="TopicNotFound"):
                client.get_topic_partitions(topic)
        assert not any("nosuch" in name for name in cluster.cluster.topics)
        base = f"{cluster.admin_url}/admin/v2/namespaces/public/nosuch"
        assert http("PUT", base) == (204, None)
        assert http("PUT", base) == (409, {"reason": "Namespace already exists"})
        client.create_producer("persistent://public/nosuch/t").close()
    finally:
        client.close()


def test_without_known_namespaces_every_namespace_exists(broker_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster: ThreadedCluster = broker_cluster(admin=True)
    client = pulsar.Client(cluster.service_url, operation_timeout_seconds=5)
    try:
        client.create_producer("persistent://public/nosuch/t").close()
        assert http("PUT", f"{cluster.admin_url}/admin/v2/namespaces/public/nosuch") == (204, None)
    finally:
        client.close()
