"""The official Pulsar client, through pulsar-tap, to a 3-broker embedded cluster.

Each test produces and consumes on a 4-partition topic with batching and LZ4 and
checks that every message arrives, and that the brokers only ever saw the proxy
as their peer (the client never bypassed it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pulsar
import pytest
import structlog
from proxy_harness import ProxyFactory, ThreadedProxy, TlsMaterial

from proxy.broker import ClusterConfig, ThreadedCluster
from proxy.core.hooks import ConnectionEvent, FrameEvent
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.session import Direction

MESSAGES = 10_000


@pytest.fixture
def cluster() -> Iterator[ThreadedCluster]:
    running = ThreadedCluster(ClusterConfig(brokers=3, auto_partitions=4)).start()
    yield running
    running.stop()


def client_for(url: str, **options: Any) -> pulsar.Client:
    return pulsar.Client(url, operation_timeout_seconds=20, connection_timeout_ms=5000,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn), **options)


def produce_and_consume(client: pulsar.Client, topic: str, count: int = MESSAGES,
                        during: Any = None) -> list[bytes]:
    consumer = client.subscribe(topic, "acceptance", consumer_type=pulsar.ConsumerType.Shared,
                                receiver_queue_size=2000)
    producer = client.create_producer(topic, batching_enabled=True, batching_max_messages=200,
                                      batching_max_publish_delay_ms=5,
                                      compression_type=pulsar.CompressionType.LZ4,
                                      send_timeout_millis=60_000, block_if_queue_full=True)
    received: list[bytes] = []
    failures: list[Any] = []

    def consume() -> None:
        deadline = time.monotonic() + 90
        while len(set(received)) < count and time.monotonic() < deadline:
            try:
                message = consumer.receive(1000)
            except pulsar.Timeout:
                continue
            received.append(message.data())
            consumer.acknowledge(message)

    reader = threading.Thread(target=consume)
    reader.start()
    for index in range(count):
        producer.send_async(b"message-%06d" % index,
                            lambda result, _id: failures.append(result) if result != pulsar.Result.Ok else None)
        if during is not None and index == count // 2:
            during()
    producer.flush()
    reader.join(120)
    producer.close()
    consumer.close()
    assert not failures, failures[:5]
    return received


def broker_peers(cluster: ThreadedCluster) -> set[str]:
    return set(cluster.call(lambda: {c.peer for node in cluster.runner.nodes for c in node.connections}))


def proxy_upstream_addresses(proxy: ThreadedProxy) -> set[str]:
    """The proxy's own addresses towards brokers: relays' upstreams and proxy-through lookup connections."""
    return set(proxy.call(lambda: {address for r in proxy.server.relays
                                   for address in (r.upstream_local_address, *r.lookup_local_addresses)}))


def check_every_message_once(received: list[bytes]) -> None:
    expected = {b"message-%06d" % i for i in range(MESSAGES)}
    assert len(received) == MESSAGES and set(received) == expected


@pytest.mark.parametrize("mode", ["rewrite", "proxy-through"])
def test_produce_and_consume_10000_messages_through_the_proxy(cluster: ThreadedCluster,
                                                               proxy_factory: ProxyFactory, mode: str) -> None:
    proxy = proxy_factory(cluster.service_url, lookup=mode)
    client = client_for(proxy.service_url)
    try:
        topic = f"persistent://public/default/accept-{mode}"
        seen_peers: set[str] = set()
        seen_proxy: set[str] = set()

        def snapshot() -> None:
            seen_peers.update(broker_peers(cluster))
            seen_proxy.update(proxy_upstream_addresses(proxy))

        received = produce_and_consume(client, topic, during=snapshot)
        snapshot()
        check_every_message_once(received)
        assert seen_peers and seen_peers <= seen_proxy
        if mode == "rewrite":
            # one listener per broker that owns a partition, plus the bootstrap listener
            assert len(proxy.server.listeners) == 1 + len(proxy.server.directory.brokers) >= 3
        else:
            # producer/consumer connections named their broker in CONNECT, as the lookups told them
            routed = proxy.call(lambda: [r.pipeline.proxied_to for r in proxy.server.relays])
            assert any(routed)
    finally:
        client.close()


def test_tls_on_both_sides(cluster: ThreadedCluster, proxy_factory: ProxyFactory, tls_material: TlsMaterial) -> None:
    """Client --TLS--> proxy --TLS (verified against upstream_ca)--> TLS proxy --> brokers.

    The embedded broker speaks plain TCP only, so a second pulsar-tap that serves TLS
    stands in for a TLS broker: the proxy under test dials pulsar+ssl:// and
    verifies its certificate.
    """
    tls_front = proxy_factory(cluster.service_url, tls=tls_material.server_tls())
    proxy = proxy_factory(tls_front.service_url, tls=tls_material.server_tls(upstream_ca=tls_material.ca_file))
    assert proxy.service_url.startswith("pulsar+ssl://")
    client = client_for(proxy.service_url, tls_trust_certs_file_path=tls_material.ca_file,
                        tls_validate_hostname=False)
    try:
        received = produce_and_consume(client, "persistent://public/default/accept-tls")
        check_every_message_once(received)
        dialled = proxy.server.directory.brokers
        assert dialled and all(url.tls for url in dialled)
    finally:
        client.close()


def test_a_broker_killed_mid_stream_is_survived_without_loss(cluster: ThreadedCluster,
                                                             proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory(cluster.service_url)
    client = client_for(proxy.service_url)
    topic = "persistent://public/default/accept-kill"
    accepted_at_kill: list[int] = []
    try:
        def kill_and_restart() -> None:
            victim = cluster.call(lambda: cluster.cluster.owner(f"{topic}-partition-0").index)
            accepted_at_kill.append(proxy.server.accepted_connections)
            cluster.kill_broker(victim)
            time.sleep(1.0)
            cluster.restart_broker(victim)

        received = produce_and_consume(client, topic, during=kill_and_restart)
        expected = {b"message-%06d" % i for i in range(MESSAGES)}
        assert set(received) == expected  # redelivery after reconnect may repeat, never lose
        # the clients came back through the proxy
        assert proxy.server.accepted_connections > accepted_at_kill[0]
    finally:
        client.close()


class SeenByClients:
    """An observer: the listener every connection came in on, and every LOOKUP answer sent to a client."""

    def __init__(self) -> None:
        self.listeners: set[str] = set()
        self.lookup_answers: list[Any] = []

    def on_connection(self, event: ConnectionEvent) -> None:
        self.listeners.add(event.connection.listener)

    def on_frame(self, event: FrameEvent) -> None:
        if event.frame.type == api.BaseCommand.LOOKUP_RESPONSE and event.direction is Direction.TO_CLIENT:
            self.lookup_answers.append((event.origin, event.frame.command.lookupTopicResponse))


def test_proxy_through_follows_redirects_so_clients_dial_only_the_service_url(
        cluster: ThreadedCluster, proxy_factory: ProxyFactory) -> None:
    """4 partitions over 3 brokers: every lookup the client sees is Connect via the service URL."""
    seen = SeenByClients()
    proxy = proxy_factory(cluster.service_url, lookup="proxy-through", server_options={"observers": [seen]})
    client = client_for(proxy.service_url)
    try:
        received = produce_and_consume(client, "persistent://public/default/through-redirects", count=2000)
    finally:
        client.close()
    assert len(set(received)) == 2000
    owners = cluster.call(lambda: {cluster.cluster.owner(f"persistent://public/default/through-redirects"
                                                         f"-partition-{i}").index for i in range(4)})
    assert len(owners) >= 2  # the partitions live on several brokers: the bootstrap broker redirected
    # the client connected to the service URL only: no per-broker listener was ever dialled
    assert seen.listeners == {str(proxy.address)}
    answers = [answer for origin, answer in seen.lookup_answers if origin.value == "proxy"]
    assert answers and all(a.response == api.CommandLookupTopicResponse.Connect and a.proxy_through_service_url
                           for a in answers)


def test_an_official_clients_close_is_logged_as_the_client_closing(cluster: ThreadedCluster,
                                                                     proxy_factory: ProxyFactory) -> None:
    proxy = proxy_factory(cluster.service_url)
    with structlog.testing.capture_logs() as logs:
        client = client_for(proxy.service_url)
        producer = client.create_producer("persistent://public/default/closing", batching_enabled=False)
        producer.send(b"one")
        client.close()
        deadline = time.monotonic() + 10
        while len([e for e in logs if e.get("event") == "connection closed"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    reasons = [e["reason"] for e in logs if e.get("event") == "connection closed"]
    assert len(reasons) >= 2 and set(reasons) == {"client closed the connection"}
