"""The built-in client through the pulsar-tap proxy: proxy-through lookups and TLS.

The proxy runs as ``pulsar-tap run`` in a subprocess in front of an embedded
broker cluster; the client must follow ``proxy_through_service_url`` (connect to
the service URL, name the owning broker in CONNECT's ``proxy_to_broker_url``) and
speak TLS with CA and hostname verification.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from proxy.broker import ThreadedCluster
from proxy.client import PulsarClient
from proxy.errors import ConnectionFailed

ClusterFactory = Callable[..., ThreadedCluster]
ProxyFactory = Callable[..., str]


async def test_proxy_through_lookups_reach_every_broker_via_the_service_url(
        cluster_factory: ClusterFactory, proxy_process: ProxyFactory) -> None:
    cluster = cluster_factory(brokers=2)
    listen = await trio.to_thread.run_sync(lambda: proxy_process(cluster.service_url, "--lookup", "proxy-through"))
    with trio.fail_after(30):
        async with PulsarClient(f"pulsar://{listen}") as client:
            topics = [f"through-{i}" for i in range(6)]
            for topic in topics:
                consumer = await client.subscribe(topic, "sub")
                producer = await client.create_producer(topic)
                await producer.send(topic.encode())
                assert (await consumer.receive()).payload == topic.encode()
            connections = client._pool.connections  # type: ignore[union-attr]
            # nothing bypassed the proxy, and some connection named its broker in CONNECT
            assert not {c.physical.host_port for c in connections} & set(cluster.addresses)
            assert any(c.logical != c.physical and c.physical.host_port == listen for c in connections)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[str, str, str, str]:
    import trustme

    ca, other_ca = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = [tmp_path / name for name in ("ca.pem", "cert.pem", "key.pem", "other-ca.pem")]
    ca.cert_pem.write_to_path(str(paths[0]))
    cert.cert_chain_pems[0].write_to_path(str(paths[1]))
    cert.private_key_pem.write_to_path(str(paths[2]))
    other_ca.cert_pem.write_to_path(str(paths[3]))
    return str(paths[0]), str(paths[1]), str(paths[2]), str(paths[3])


async def test_tls_connection_verifies_the_ca_and_hostname(
        cluster: ThreadedCluster, proxy_process: ProxyFactory, tls_files: tuple[str, str, str, str]) -> None:
    ca, cert, key, other_ca = tls_files
    listen = await trio.to_thread.run_sync(lambda: proxy_process(
        cluster.service_url, "--tls-cert", cert, "--tls-key", key, "--lookup", "proxy-through"))
    url = f"pulsar+ssl://{listen}"
    with trio.fail_after(30):
        async with PulsarClient(url, tls_trust_certs_file=ca) as client:
            consumer = await client.subscribe("tls", "sub")
            producer = await client.create_producer("tls")
            await producer.send(b"secret")
            assert (await consumer.receive()).payload == b"secret"
            assert all(c.physical.tls for c in client._pool.connections)  # type: ignore[union-attr]
        with pytest.raises(ConnectionFailed, match="TLS handshake"):
            async with PulsarClient(url, tls_trust_certs_file=other_ca, operation_timeout=2) as client:
                await client.create_producer("tls")
