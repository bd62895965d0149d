"""The real broker restarted under a stream of messages through pulsar-tap.

An operator restarts the broker (SIGTERM: it unloads its topics, closes its connections, and is
down for the seconds a JVM takes to start again on the same ports and data), or it crashes
(SIGKILL: the kernel resets its connections; what it had written survives in the page cache) and
is started again, while a client
produces and consumes through pulsar-tap.  Meanwhile the client reconnects to pulsar-tap, which
accepts it and cannot reach the broker (it closes the client's connection, and the client tries
again); once the broker is back the client's producer and consumer are re-created through
pulsar-tap and the stream goes on.  On a deduplicating namespace nothing may be lost,
duplicated or reordered (without deduplication Pulsar itself may store a message the client
resends twice, with or without a proxy), and pulsar-tap keeps no connection of the broker that
went.  The broker is each case's own: a restart would disturb the shared one's other users, and
after a crash the real standalone (4.0, RocksDB metadata) flaps its bookie's registration for as
long as it runs (thousands of "Bookie ... deleted" / "created" a second in its log), so a ledger
created then fails at random with "Not enough non-faulty bookies available" -- which the clients
ride through on reconnection, but which the next case's first subscription (the Go client's
fails at once) would meet.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from peers_rig import Upstream, delivery_problems, proxy_running, service_url, upstream_of, wait_for
from real_pulsar import Standalone, start_client, start_standalone

DEDUP_NS = "public/restart-dedup"
MESSAGES = 3000
RATE = 150.0  # messages a second: 20 s of producing, the restart in its middle


@pytest.fixture
def restarting_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    broker = start_standalone(tmp_path_factory.mktemp("pulsar-restart"))
    try:
        broker.admin("PUT", f"/admin/v2/namespaces/{DEDUP_NS}")
        broker.admin("POST", f"/admin/v2/namespaces/{DEDUP_NS}/deduplication", True)
        yield broker
    finally:
        broker.stop()


@pytest.mark.parametrize(("client", "crash"), [("java", False), ("python", True), ("go", True)],
                         ids=["java-restart", "python-crash", "go-crash"])
def test_a_broker_restart_under_a_stream_loses_nothing_through_pulsar_tap(
        client: str, crash: bool, restarting_broker: Standalone) -> None:
    upstream: Upstream = upstream_of(restarting_broker)
    topic = f"persistent://{DEDUP_NS}/restart-{client}-{uuid.uuid4().hex[:8]}"
    down: list[float] = []
    # (a client's first subscription fails at once if it cannot create a ledger)
    restarting_broker.wait_until(restarting_broker.stores, 60)
    with proxy_running(upstream.service_url, lookup="rewrite") as proxy:
        # (a send waits for the broker's return: a loaded machine's JVM restart took 30 s, past the clients' 30 s
        # send timeout, and the Java client's reconnection backs off to ~12 s between tries)
        run = start_client(client, service_url(proxy), topic, messages=MESSAGES, rate=RATE, batching=False,
                           timeout=150, send_timeout=120, idle=30)

        time.sleep(6)  # ~900 messages in (here, not on a thread: the broker dies with the thread that started it)
        down.append(restarting_broker.restart(crash=crash))
        result = run.result()
        assert down, "the broker did not come back"
        assert delivery_problems(result, MESSAGES, redelivery=True) == [], result.report
        # what ended with the broker is gone from pulsar-tap too: once the client has gone, nothing is left
        server = proxy.server
        wait_for(lambda: server.active_connections == 0, 15, "pulsar-tap's connections to end")
        assert server.accepted_connections > 2, "the client never reconnected through pulsar-tap"
    print(f"{client}: the broker's port was closed {down[0]:.1f} s; {server.accepted_connections} connections "
          "accepted in all")
