"""pulsar-tap chained with Apache Pulsar's own proxy, in front of the real broker, with the official Python client.

Clusters often expose only Pulsar's proxy to clients; users then put pulsar-tap

- (A) in front of it: client -> pulsar-tap -> Pulsar's proxy -> broker.  Pulsar's proxy answers
  lookups with the owner broker's URL and ``proxy_through_service_url = true``, and reaches the
  broker a CONNECT names in ``proxy_to_broker_url``; the broker itself is not reachable from
  where pulsar-tap runs, so pulsar-tap must reach it through Pulsar's proxy too;
- (B) as a sidecar of the broker: client -> Pulsar's proxy -> pulsar-tap -> broker.  Pulsar's
  proxy looks topics up on pulsar-tap (its ``brokerServiceURL``) and dials the broker address
  the answer names, which must be pulsar-tap's listener.

Each test streams async sends without batching (up to 1000 in flight) to a partitioned topic
while consuming them, in both lookup modes, and checks that every acknowledged message
arrived once and in order, and who dialled whom from the kernel's TCP table: the client
dials only the first hop; in (A) only Pulsar's proxy holds connections to the broker
(pulsar-tap never dials it); in (B) only pulsar-tap does, and Pulsar's proxy dials only
pulsar-tap.  What pulsar-tap reports of the connections is checked too: ``GET /connections``
and the recording's CONNECT frames.

One Pulsar proxy serves the module (module-scoped, ~4 s to start): its ``brokerServiceURL``
is a fixed loopback port the tests occupy in turn, with the sidecar pulsar-tap for (B) or a
plain byte forwarder to the broker for (A) (its sockets are told apart in the TCP table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from peers_rig import (
    DialWatcher,
    Upstream,
    _established_tcp,
    delivery_problems,
    leaked_addresses,
    proxy_config,
    show_json,
    wait_for,
)
from real_pulsar import (
    ClientRun,
    PeerFailed,
    PulsarProxy,
    http_json,
    lasting_ports,
    run_client,
    start_client,
    start_pulsar_proxy,
)

from proxy.config.proxy_config import AdminConfig, HostPort
from proxy.recording.reader import open_recordings
from proxy.server.stack import ProxyStack
from proxy.server.threaded import ThreadedStack

MESSAGES = 2000
PARTITIONS = 4
MODES = ("rewrite", "proxy-through")


class BytePipe:
    """A plain TCP forwarder from a loopback port to one address (threads; no protocol at all).

    It keeps the inodes of its sockets to the target, so a :class:`ChainWatcher` can tell its
    connections to the broker from pulsar-tap's (both live in the test process).
    """

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.target = target
        self.upstream_inodes: set[int] = set()
        self._listener = socket.create_server(("127.0.0.1", port))
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="byte-pipe", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self.upstream_inodes.add(os.fstat(upstream.fileno()).st_ino)
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        # shutdown wakes the thread blocked in accept(): a close alone leaves the port listening
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(5)
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()


@dataclasses.dataclass
class ChainedProxy:
    """Pulsar's proxy of the module, and the fixed port its ``brokerServiceURL`` names."""

    process: PulsarProxy
    broker_port: int

    @property
    def service_url(self) -> str:
        return self.process.service_url


@pytest.fixture(scope="module")
def pulsar_proxy(real_upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChainedProxy]:
    (port,) = lasting_ports(1)  # (bound by each test in turn, for minutes)
    process = start_pulsar_proxy(f"pulsar://127.0.0.1:{port}", log_level=0, broker_web_url=real_upstream.admin_url,
                                 workdir=tmp_path_factory.mktemp("pulsar-proxy"), fast_start=True)
    try:
        yield ChainedProxy(process, port)
    finally:
        process.stop()


class ChainWatcher(DialWatcher):
    """A :class:`DialWatcher` that also names Pulsar's proxy (``pulsar-proxy``) and the byte forwarder
    (``forwarder``) as holders of connections to the broker, and records where Pulsar's proxy dialled."""

    def __init__(self, upstream: Upstream, pulsar_proxy: ChainedProxy, pipe: BytePipe | None = None) -> None:
        super().__init__(upstream.broker_ports, upstream.pid)
        self.pulsar_proxy = pulsar_proxy
        self.pipe = pipe
        #: remote ports of the connections Pulsar's proxy opened (not those clients opened to it)
        self.pulsar_proxy_dialled: set[int] = set()

    def _owners(self, fresh: bool = False) -> dict[str, set[int]]:
        owners = super()._owners(fresh)
        forwarder = set(self.pipe.upstream_inodes) if self.pipe is not None else set()
        owners["proxy"] -= forwarder
        return {"pulsar-proxy": self._inodes(self.pulsar_proxy.process.pid, fresh), "forwarder": forwarder, **owners}

    def sample(self) -> None:
        super().sample()
        held = self._inodes(self.pulsar_proxy.process.pid)
        own_ports = {self.pulsar_proxy.process.port, self.pulsar_proxy.process.web_port}
        self.pulsar_proxy_dialled |= {remote for local, remote, inode in _established_tcp()
                                      if inode in held and local not in own_ports}


@contextlib.contextmanager
def tap_running(upstream_url: str, mode: str, record_dir: Path, port: int = 0,
                rules: list[dict[str, Any]] | None = None) -> Iterator[ProxyStack]:
    """pulsar-tap as ``pulsar-tap run --listen 127.0.0.1:PORT --upstream URL --lookup MODE --record DIR
    --admin 127.0.0.1:0 [--rules ...]`` assembles it, in a thread of the test process."""
    config = dataclasses.replace(
        proxy_config(upstream_url, lookup=mode, record_dir=record_dir,
                     rules={"seed": 1, "rules": rules} if rules is not None else None),
        listen=HostPort("127.0.0.1", port), admin=AdminConfig(HostPort("127.0.0.1", 0)))
    threaded = ThreadedStack(config).start()
    try:
        assert threaded.stack is not None
        yield threaded.stack
    finally:
        threaded.stop()


def _connections(stack: ProxyStack) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = http_json("GET", f"http://{stack.admin_address}/connections")["connections"]
    return rows


def _listener_ports(stack: ProxyStack) -> set[int]:
    return {stack.server.main_address.port, *(address.port for address in stack.server.directory.brokers.values())}


def _stream(upstream: Upstream, url: str, watcher: ChainWatcher, label: str,
            during: Any = None, *, topic: str | None = None, **options: Any) -> ClientRun:
    """A stream of MESSAGES async sends (no batching: one SEND each, up to 1000 in flight) to a new
    partitioned topic, consumed as it goes, through ``url``; the client's report."""
    topic = topic or upstream.create_partitioned(f"chain-{label}-{uuid.uuid4().hex[:8]}", PARTITIONS)
    with watcher:
        client = start_client("python", url, topic, **{"messages": MESSAGES, "batching": False, "timeout": 60,
                                                         **options})
        watcher.client_pid = client.pid
        connections: list[dict[str, Any]] = []
        try:
            if during is not None:
                connections = during(client)
            run = client.result()
        finally:
            client.kill()
    run.report["connections"] = connections
    return run


def _recorded_connects(record_dir: Path) -> list[dict[str, Any]]:
    recordings = [path for path in record_dir.iterdir() if path.is_dir()]
    assert len(recordings) == 1
    return [frame for frame in show_json(recordings[0]) if frame["command"] == "CONNECT"]


@pytest.mark.parametrize("mode", MODES)
def test_sidecar_behind_pulsar_proxy_sees_all_traffic_and_alone_dials_the_broker(
        mode: str, real_upstream: Upstream, pulsar_proxy: ChainedProxy, tmp_path: Path) -> None:
    """(B) client -> Pulsar's proxy -> pulsar-tap -> broker: every message arrives; the broker's only peer is
    pulsar-tap; Pulsar's proxy dials pulsar-tap only (the service port and the per-broker listener its lookup
    answers named); the client dials Pulsar's proxy only."""
    upstream = real_upstream
    record_dir = tmp_path / "recordings"
    with tap_running(upstream.service_url, mode, record_dir, port=pulsar_proxy.broker_port) as tap:
        watcher = ChainWatcher(upstream, pulsar_proxy)

        def busy_connections(client: Any) -> list[dict[str, Any]]:
            # GET /connections while the stream runs: the connections Pulsar's proxy opened, each to the broker
            return _wait_for_producers(tap)

        run = _stream(upstream, pulsar_proxy.service_url, watcher, f"b-{mode}", busy_connections)
        tap_ports = _listener_ports(tap)
    assert delivery_problems(run, MESSAGES, PARTITIONS) == []
    dials = watcher.dials
    assert dials.broker_peers <= {"proxy", "broker", "foreign"}, f"the broker's peers: {dials.others}"
    assert "proxy" in dials.broker_peers
    assert dials.client_remote_ports == {pulsar_proxy.process.port}
    assert watcher.pulsar_proxy_dialled, "the watcher must see Pulsar's proxy dial pulsar-tap"
    assert watcher.pulsar_proxy_dialled <= tap_ports, "Pulsar's proxy dialled past pulsar-tap"
    # (GET /connections mid-stream names the broker; on a loaded machine the stream may end before it is asked,
    # so every connection's broker is also read from the recording)
    assert {row["broker"] for row in run.report["connections"]} <= {upstream.service_url}
    recording = next(p for p in record_dir.iterdir() if p.is_dir())
    connections = open_recordings(recording).connections.values()
    brokers = {f"pulsar://{info.broker.host}:{info.broker.port}" for info in connections}
    assert brokers == {upstream.service_url}
    assert leaked_addresses(show_json(recording), upstream.addresses) == []


def _wait_for_producers(tap: ProxyStack) -> list[dict[str, Any]]:
    """``GET /connections`` once a producer is open through ``tap`` (within 30 s)."""
    deadline = time.monotonic() + 30
    rows = _connections(tap)
    while not any(row.get("producers") for row in rows) and time.monotonic() < deadline:
        time.sleep(0.1)
        rows = _connections(tap)
    return rows


@pytest.mark.parametrize("mode", MODES)
def test_in_front_of_pulsar_proxy_the_broker_is_reached_only_through_it(
        mode: str, real_upstream: Upstream, pulsar_proxy: ChainedProxy, tmp_path: Path) -> None:
    """(A) client -> pulsar-tap -> Pulsar's proxy -> broker: every message arrives; the client dials only
    pulsar-tap; pulsar-tap never dials the broker Pulsar's lookup answers name (behind Pulsar's proxy it is
    not reachable), it reaches it through Pulsar's proxy, naming it in CONNECT's ``proxy_to_broker_url``."""
    upstream = real_upstream
    broker_host, broker_port = upstream.service_url.split("://", 1)[1].rsplit(":", 1)
    pipe = BytePipe(pulsar_proxy.broker_port, (broker_host, int(broker_port)))
    record_dir = tmp_path / "recordings"
    try:
        with tap_running(pulsar_proxy.service_url, mode, record_dir) as tap:
            watcher = ChainWatcher(upstream, pulsar_proxy, pipe)
            run = _stream(upstream, f"pulsar://{tap.address}", watcher, f"a-{mode}",
                          lambda client: _wait_for_producers(tap))
            tap_ports = _listener_ports(tap)
    finally:
        pipe.close()
    assert delivery_problems(run, MESSAGES, PARTITIONS) == []
    dials = watcher.dials
    assert dials.client_remote_ports <= tap_ports and dials.client_remote_ports, "the client dialled past pulsar-tap"
    assert "proxy" not in dials.broker_peers, "pulsar-tap dialled the broker behind Pulsar's proxy"
    assert dials.broker_peers <= {"pulsar-proxy", "forwarder", "broker", "foreign"}, dials.others
    assert "pulsar-proxy" in dials.broker_peers
    to_broker = [frame["fields"] for frame in _recorded_connects(record_dir) if frame["origin"] == "proxy"]
    assert {fields.get("proxy_to_broker_url") for fields in to_broker} == {f"{broker_host}:{broker_port}"}


@contextlib.contextmanager
def _front_chain(upstream: Upstream, pulsar_proxy: ChainedProxy, mode: str, record_dir: Path,
                 rules: list[dict[str, Any]] | None = None) -> Iterator[tuple[ProxyStack, BytePipe]]:
    """(A): pulsar-tap in front of the module's Pulsar proxy, whose brokerServiceURL forwards to the broker."""
    host, port = upstream.service_url.split("://", 1)[1].rsplit(":", 1)
    pipe = BytePipe(pulsar_proxy.broker_port, (host, int(port)))
    try:
        with tap_running(pulsar_proxy.service_url, mode, record_dir, rules=rules) as tap:
            yield tap, pipe
    finally:
        pipe.close()


def _replay(recording: Path, upstream_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", "replay", str(recording), "--upstream", upstream_url,
                           "--speed", "0", "--timeout", "5", "--log-level", "warning", "--quiet"],
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_recording_made_in_front_of_pulsar_proxy_replays_through_it_and_to_the_broker(
        real_upstream: Upstream, pulsar_proxy: ChainedProxy, tmp_path: Path) -> None:
    """Record (A), then ``pulsar-tap replay REC --upstream`` Pulsar's proxy (its lookups answer
    ``proxy_through_service_url``: the replaying client names the broker in CONNECT, as HOST:PORT as Pulsar's
    proxy wants it) and the broker itself: no request's outcome differs."""
    upstream = real_upstream
    messages = 300
    topic = upstream.create_partitioned(f"chain-replay-{uuid.uuid4().hex[:8]}", PARTITIONS)
    record_dir = tmp_path / "recordings"
    host, port = upstream.service_url.split("://", 1)[1].rsplit(":", 1)
    pipe = BytePipe(pulsar_proxy.broker_port, (host, int(port)))  # Pulsar's proxy's lookups, for the replays too
    try:
        with tap_running(pulsar_proxy.service_url, "proxy-through", record_dir) as tap:
            run = run_client("python", f"pulsar://{tap.address}", topic, messages=messages, batching=False,
                             subscription="chain-replay", timeout=60)
        assert delivery_problems(run, messages, PARTITIONS) == []
        recording = next(path for path in record_dir.iterdir() if path.is_dir())
        for target in (pulsar_proxy.service_url, upstream.service_url):
            done = _replay(recording, target)
            diffs = [line for line in done.stdout.splitlines() if line.startswith("DIFF ")]
            assert (done.returncode, diffs[:3]) == (0, []), f"replay to {target}: {done.stderr[-1500:]}"
            assert " 0 differ" in done.stderr
    finally:
        pipe.close()


#: a namespace with broker-side deduplication: what a client resends after a cut or a closed producer is
#: stored once (without it Pulsar itself may store it twice, proxy or not)
DEDUP_NS = "public/chain-dedup"

#: rule -> (chain, lookup mode, messages, the rule): each rule once, on one chain, in one mode
CHAIN_RULES: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "close-producer": ("B", "rewrite", 1000, {"match": {"command": ["SEND"], "after": 300, "times": 1},
                                              "action": "close"}),
    "close-consumer": ("A", "rewrite", 1000, {"match": {"command": ["MESSAGE"], "after": 300, "times": 1},
                                              "action": "close"}),
    "disconnect": ("B", "proxy-through", 1000, {"match": {"command": ["SEND"], "after": 300, "times": 1},
                                                "action": {"disconnect": {"how": "reset"}}}),
    "delay": ("A", "proxy-through", 100, {"match": {"command": ["SEND_RECEIPT"], "direction": "to_client"},
                                          "action": {"delay": {"ms": 200}}}),
    "flow-throttle": ("B", "proxy-through", 400, {"match": {"command": ["FLOW"]},
                                                  "action": {"throttle": {"messages_per_second": 50,
                                                                          "per": "consumer"}}}),
    "error-producer": ("A", "proxy-through", 1000, {"match": {"command": ["PRODUCER"], "times": 2},
                                                    "action": {"error": {"code": "ServiceNotReady",
                                                                         "message": "chain: not yet"}}}),
}


@pytest.fixture(scope="module")
def dedup_namespace(real_upstream: Upstream) -> str:
    with contextlib.suppress(PeerFailed):  # made by an earlier module of this session's broker
        real_upstream.admin("PUT", f"/admin/v2/namespaces/{DEDUP_NS}")
    real_upstream.admin("POST", f"/admin/v2/namespaces/{DEDUP_NS}/deduplication", True)
    wait_for(lambda: real_upstream.admin("GET", f"/admin/v2/namespaces/{DEDUP_NS}/deduplication") is True, 30,
             "deduplication on the namespace")
    return DEDUP_NS


@contextlib.contextmanager
def _chain(kind: str, mode: str, upstream: Upstream, pulsar_proxy: ChainedProxy, record_dir: Path,
           rules: list[dict[str, Any]] | None = None) -> Iterator[tuple[ProxyStack, str, ChainWatcher]]:
    """Chain (A) or (B) with pulsar-tap in ``mode``: (pulsar-tap, the URL clients dial, a watcher)."""
    if kind == "B":
        with tap_running(upstream.service_url, mode, record_dir, port=pulsar_proxy.broker_port, rules=rules) as tap:
            yield tap, pulsar_proxy.service_url, ChainWatcher(upstream, pulsar_proxy)
        return
    with _front_chain(upstream, pulsar_proxy, mode, record_dir, rules) as (tap, pipe):
        yield tap, f"pulsar://{tap.address}", ChainWatcher(upstream, pulsar_proxy, pipe)


@pytest.mark.parametrize("rule", list(CHAIN_RULES))
def test_rules_through_the_chain_keep_their_promises(rule: str, real_upstream: Upstream,
                                                     pulsar_proxy: ChainedProxy, dedup_namespace: str,
                                                     tmp_path: Path) -> None:
    """A closed producer or consumer is re-created and a cut connection re-opened through the chain (Pulsar's
    proxy passes pulsar-tap's CLOSE_* and ERROR through to the client); a delayed receipt is late by its own
    delay; FLOW throttled per consumer holds each partition to the rate; a refused PRODUCER is retried."""
    upstream = real_upstream
    kind, mode, messages, body = CHAIN_RULES[rule]
    name = f"chain-rule-{rule}-{uuid.uuid4().hex[:8]}"
    upstream.admin("PUT", f"/admin/v2/persistent/{dedup_namespace}/{name}/partitions", PARTITIONS)
    record_dir = tmp_path / "recordings"
    with _chain(kind, mode, upstream, pulsar_proxy, record_dir, [{"name": rule, **body}]) as (tap, url, watcher):
        # (the closed consumer's partition must still have messages to come when the client re-subscribes: as
        # fast as it can, the whole stream may already be in the client's queue and the run end before that)
        paced = {"rate": 500.0} if rule == "close-consumer" else {}
        run = _stream(upstream, url, watcher, rule, topic=f"persistent://{dedup_namespace}/{name}",
                      messages=messages, latencies=rule == "delay", timeout=90, **paced)
        first_hop = {pulsar_proxy.process.port} if kind == "B" else _listener_ports(tap)
        assert tap.engine is not None
        hits = dict(tap.engine.hits())
    assert delivery_problems(run, messages, PARTITIONS, redelivery=rule in ("close-consumer", "disconnect")) == []
    assert watcher.dials.client_remote_ports and watcher.dials.client_remote_ports <= first_hop
    frames = show_json(next(path for path in record_dir.iterdir() if path.is_dir()))
    injected = [f["command"] for f in frames if f["origin"] == "proxy" and f["direction"] == "to_client"]
    if rule == "close-producer":
        assert hits == {rule: 1} and injected.count("CLOSE_PRODUCER") == 1
        assert sum(f["command"] == "PRODUCER_SUCCESS" for f in frames) == PARTITIONS + 1
    elif rule == "close-consumer":
        assert hits == {rule: 1} and injected.count("CLOSE_CONSUMER") == 1
        assert sum(f["command"] == "SUBSCRIBE" for f in frames) == PARTITIONS + 1
    elif rule == "disconnect":
        assert hits == {rule: 1} and sum(f["command"] == "CONNECT" for f in frames) == 3
    elif rule == "delay":
        assert min(run.report["latency_ms"]) >= 200, "no receipt may arrive before its delay"
    elif rule == "flow-throttle":
        assert hits[rule] >= PARTITIONS
        assert run.report["elapsed_seconds"] >= (messages / PARTITIONS - 1) / 50 * 0.9
    else:
        assert hits == {rule: 2} and injected.count("ERROR") == 2


@pytest.mark.parametrize(("kind", "mode"), [("A", "proxy-through"), ("B", "rewrite")])
def test_killing_one_client_ends_only_its_connections(kind: str, mode: str, real_upstream: Upstream,
                                                      pulsar_proxy: ChainedProxy, tmp_path: Path) -> None:
    """kill -9 of one client mid-stream: pulsar-tap's connections carrying its topic end (GET /connections),
    the other client's stay and its stream completes."""
    upstream = real_upstream
    doomed_topic = upstream.create_partitioned(f"chain-doomed-{uuid.uuid4().hex[:8]}", PARTITIONS)
    survivor_topic = upstream.create_partitioned(f"chain-survivor-{uuid.uuid4().hex[:8]}", PARTITIONS)
    with _chain(kind, mode, upstream, pulsar_proxy, tmp_path / "recordings") as (tap, url, _):
        survivor = start_client("python", url, survivor_topic, messages=3000, batching=False, rate=1000, timeout=60)
        doomed = start_client("python", url, doomed_topic, messages=100_000, batching=False, rate=2000, timeout=60)
        try:
            def carrying(topic: str) -> list[int]:
                return [row["conn_id"] for row in _connections(tap) if any(t.startswith(topic) for t in row["topics"])]

            wait_for(lambda: carrying(doomed_topic) and carrying(survivor_topic), 30, "both clients to be streaming")
            survivors = carrying(survivor_topic)
            doomed.process.kill()
            doomed.process.communicate()
            wait_for(lambda: not carrying(doomed_topic), 10, "the killed client's connections to end")
            assert carrying(survivor_topic) == survivors
            run = survivor.result()
        finally:
            doomed.kill()
            survivor.kill()
    assert delivery_problems(run, 3000, PARTITIONS) == []
