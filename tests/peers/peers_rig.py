"""What the real-peer tests share: the upstreams, the proxy in front of them, who dials whom, and the checks.

- :class:`Upstream` is a broker the tests drive the same way whichever it is: the real
  Apache Pulsar standalone (:mod:`real_pulsar`) or the embedded broker run as
  ``pulsar-tap broker`` in a subprocess (:func:`start_embedded`), each with its service
  URL, its admin REST URL, its process id and every address it serves.
- :func:`start_proxy` runs the pulsar-tap proxy as ``pulsar-tap run`` assembles it
  (``running_proxy``: rules, recorder, TLS) in a thread of the test process.
- :class:`DialWatcher` samples the kernel's TCP table while a client runs and tells, for
  every connection to the broker, which process holds it (the client, the proxy or the
  broker itself), and where the client dialled: so a test can say "the broker saw only
  the proxy" and "the client never dialled the broker" from the outside.
- :func:`delivery_problems` checks a client's report: every acknowledged message received
  once, in order per partition; :func:`leaked_addresses` reads a recording with
  ``pulsar-tap show --json`` and lists every frame to a client that names a broker address.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from real_pulsar import ClientRun, PeerFailed, Standalone, TlsFiles, http_json, spawn, stop_process

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, RecordConfig, ServiceUrl, TlsConfig
from proxy.server.stack import ProxyStack
from proxy.server.threaded import ThreadedStack

TENANT_NS = "public/default"


@dataclasses.dataclass
class Upstream:
    """A broker the tests drive: the real standalone or the embedded broker."""

    name: str
    service_url: str
    admin_url: str
    pid: int
    #: every HOST:PORT the broker serves (binary, TLS, HTTP): none may reach a client through the proxy
    addresses: list[str]
    #: the ports of its binary protocol (plaintext and TLS, every broker of the cluster)
    broker_ports: set[int]
    service_url_tls: str | None = None
    tls: TlsFiles | None = None
    #: how many brokers serve topics (lookups on the others answer Redirect)
    brokers: int = 1

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        return http_json(method, self.admin_url + path, body)

    def create_partitioned(self, topic: str, partitions: int) -> str:
        """Create ``persistent://public/default/TOPIC`` with ``partitions`` partitions; its full name."""
        self.admin("PUT", f"/admin/v2/persistent/{TENANT_NS}/{topic}/partitions", partitions)
        return f"persistent://{TENANT_NS}/{topic}"

    def unload(self, topic: str) -> None:
        self.admin("PUT", f"/admin/v2/persistent/{TENANT_NS}/{topic}/unload")

    def owner(self, topic: str) -> str:
        """The broker URL owning ``persistent://public/default/TOPIC`` (HTTP lookup)."""
        return str(self.admin("GET", f"/lookup/v2/topic/persistent/{TENANT_NS}/{topic}")["brokerUrl"])

    def redirected_topic(self, prefix: str, partitions: int, tries: int = 50) -> str:
        """Create a partitioned topic a lookup on the service URL answers with Redirect (some partition is
        owned by another broker) wherever the cluster has more than one broker; its full name."""
        for attempt in range(tries):
            name = f"{prefix}-{attempt}"
            full = self.create_partitioned(name, partitions)
            owners = {self.owner(f"{name}-partition-{i}") for i in range(partitions)}
            if self.brokers == 1 or owners - {self.service_url}:
                return full
        raise AssertionError(f"no topic {prefix}-N owned away from {self.service_url} in {tries} tries")


def upstream_of(broker: Standalone) -> Upstream:
    ports = {broker.broker_port, *([broker.tls_port] if broker.tls_port else [])}
    return Upstream("real", broker.service_url, broker.admin_url, broker.pid, broker.addresses, ports,
                    broker.service_url_tls if broker.tls_port else None, broker.tls)


class EmbeddedBroker:
    """``pulsar-tap broker`` in a subprocess: its own process, as users run it."""

    def __init__(self, workdir: Path, brokers: int, options: Sequence[str] = ()) -> None:
        ready = workdir / "ready.json"
        log_file = workdir / "broker.log"
        command = [sys.executable, "-m", "proxy", "broker", "--listen", "127.0.0.1:0", "--brokers", str(brokers),
                   "--admin", "127.0.0.1:0", "--ready-file", str(ready), "--log-level", "warning", *options]
        self.process = spawn(command, log_file, workdir)
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.stat().st_size):
            if self.process.poll() is not None or time.monotonic() > deadline:
                stop_process(self.process, 1)
                raise PeerFailed(f"pulsar-tap broker did not start: {log_file.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        self.ready = json.loads(ready.read_text())

    def upstream(self) -> Upstream:
        listen = [str(address) for address in self.ready["listen"]]
        admin = str(self.ready["admin"])
        ports = {int(address.rsplit(":", 1)[1]) for address in listen}
        return Upstream("embedded", f"pulsar://{listen[0]}", f"http://{admin}", self.process.pid, [*listen, admin],
                        ports, brokers=len(listen))

    def stop(self) -> None:
        stop_process(self.process, 5)


@contextlib.contextmanager
def embedded_running(brokers: int = 2, options: Sequence[str] = ()) -> Iterator[Upstream]:
    """``pulsar-tap broker`` with ``options`` (more flags) for the block."""
    workdir = Path(tempfile.mkdtemp(prefix="pulsar-tap-broker-"))
    broker = EmbeddedBroker(workdir, brokers, options)
    try:
        yield broker.upstream()
    finally:
        broker.stop()


# --- the proxy -----------------------------------------------------------------------------------

def proxy_config(upstream_url: str, *, lookup: str, record_dir: Path | None = None, rules: Any = None,
                 tls: TlsFiles | None = None) -> ProxyConfig:
    """The config ``pulsar-tap run --upstream URL --lookup MODE [--record DIR] [--rules ...] [--tls-...]`` builds."""
    tls_config = TlsConfig(cert=tls.cert, key=tls.key, upstream_ca=tls.ca) if tls else TlsConfig()
    return ProxyConfig(upstream=ServiceUrl.parse(upstream_url), listen=HostPort("127.0.0.1", 0), lookup=lookup,
                       advertise="127.0.0.1", tls=tls_config, limits=LimitsConfig(drain_seconds=0.5),
                       record=RecordConfig(dir=str(record_dir)) if record_dir else None, rules=rules)


@contextlib.contextmanager
def proxy_running(upstream_url: str, **options: Any) -> Iterator[ProxyStack]:
    """The proxy stack for the duration of a ``with`` block: ``.address``, ``.server``, ``.engine``."""
    threaded = ThreadedStack(proxy_config(upstream_url, **options)).start()
    try:
        assert threaded.stack is not None
        yield threaded.stack
    finally:
        threaded.stop()


def service_url(stack: ProxyStack) -> str:
    scheme = "pulsar+ssl" if stack.config.tls.serves_tls else "pulsar"
    return f"{scheme}://{stack.address}"


# --- who dials whom ------------------------------------------------------------------------------

def _socket_inodes(pid: int, files: set[tuple[int, str]] | None = None) -> set[int]:
    """The inodes of the sockets ``pid`` holds; with ``files``, the (pid, descriptor) of links to files found
    are added to it, and those already in it are not read again."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if files is not None and (pid, fd) in files:
                continue
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
                elif files is not None and link.startswith("/"):
                    files.add((pid, fd))
    return inodes


def _owner_of(inode: int) -> int | None:
    """The process holding a socket (a scan of every process: only to explain a surprise)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if inode in _socket_inodes(int(pid)):
            return int(pid)
    return None


def _describe(pid: int | None) -> str:
    if pid is None:
        return "no process holds it any more"
    with contextlib.suppress(OSError):
        return f"pid {pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    return f"pid {pid}"


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (a process this test started)."""
    for _ in range(64):
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid <= 1:
            return False
    return False


def _established_tcp() -> Iterator[tuple[int, int, int]]:
    """(local port, remote port, inode) of every established TCP connection (IPv4 and IPv6 tables)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                # ESTABLISHED, and still held by a process (a socket its process closed has inode 0)
                if fields[3] != "01" or fields[9] == "0":
                    continue
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                yield local_port, remote_port, int(fields[9])


@dataclasses.dataclass
class Dials:
    """What :class:`DialWatcher` saw: holders of connections to the broker, and where the client dialled."""

    broker_peers: set[str] = dataclasses.field(default_factory=set)
    client_remote_ports: set[int] = dataclasses.field(default_factory=set)
    samples: int = 0
    #: what an ``other`` peer was: "local port -> broker port: owner pid and command line"
    others: list[str] = dataclasses.field(default_factory=list)


class DialWatcher:
    """Samples the TCP table every ``period`` seconds in a thread while a client runs.

    Connections to a broker port are attributed to ``client``, ``proxy`` (this test
    process: the proxy runs in a thread of it), ``broker`` (the broker dialling itself),
    ``other`` (another process this test started) or ``foreign`` (a process the test did
    not start: the machine is shared).
    """

    def __init__(self, broker_ports: Iterable[int], broker_pid: int, period: float = 0.05) -> None:
        self.broker_ports = set(broker_ports)
        self.broker_pid = broker_pid
        self.period = period
        self._client_pid: int | None = None
        self.dials = Dials()
        #: (pid, descriptor) of files a process holds open (a JVM: hundreds of jars), not read again: each
        #: readlink lets the GIL go to the proxy's thread in this process, and reading them all at every sample
        #: made a sample take most of a second on a loaded machine (two samples in a client's whole run)
        self._files: set[tuple[int, str]] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dial-watcher", daemon=True)

    @property
    def client_pid(self) -> int | None:
        return self._client_pid

    @client_pid.setter
    def client_pid(self, pid: int | None) -> None:
        """Set by the thread that started the client: the next sample is taken at once."""
        self._client_pid = pid
        self._wake.set()

    def __enter__(self) -> DialWatcher:
        self._thread.start()
        return self

    def _inodes(self, pid: int, fresh: bool = False) -> set[int]:
        """:func:`_socket_inodes` of ``pid``, the links to files read once (all of them again when ``fresh``)."""
        return _socket_inodes(pid, None if fresh else self._files)

    def _owners(self, fresh: bool = False) -> dict[str, set[int]]:
        client_pid = self.client_pid  # set by another thread once the client started
        return {"proxy": self._inodes(os.getpid(), fresh), "broker": self._inodes(self.broker_pid, fresh),
                "client": self._inodes(client_pid, fresh) if client_pid is not None else set()}

    def sample(self) -> None:
        connections = list(_established_tcp())
        owners = self._owners()
        unknown = {inode for _, remote, inode in connections if remote in self.broker_ports} - set().union(
            *owners.values())
        if unknown:
            # opened or closed between the two reads (or at a descriptor that held a file when it was last
            # read): a connection still there gets a second look, every descriptor read again
            still_open = {inode for _, _, inode in _established_tcp()}
            connections = [c for c in connections if c[2] not in unknown or c[2] in still_open]
            owners = self._owners(fresh=True)
        for local, remote, inode in connections:
            if inode in owners["client"]:
                self.dials.client_remote_ports.add(remote)
            if remote in self.broker_ports:
                holder = next((name for name, inodes in owners.items() if inode in inodes), None)
                if holder is None:
                    # a process of this test run ("other": a failure), or of someone else's on this
                    # shared machine dialling a port it once knew ("foreign": not the proxy's doing)
                    pid = _owner_of(inode)
                    holder = "other" if pid is not None and _descends_from(pid, os.getpid()) else "foreign"
                    if len(self.dials.others) < 5:
                        self.dials.others.append(f"{holder} {local} -> {remote}: {_describe(pid)}")
                self.dials.broker_peers.add(holder)
        self.dials.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._wake.wait(self.period)
            self._wake.clear()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)


# --- checks ------------------------------------------------------------------------------------------

def _pairs(indices: dict[str, list[int]], ids: dict[str, list[str]]) -> dict[str, list[tuple[int, str]]]:
    return {p: list(zip(values, ids[p], strict=True)) for p, values in indices.items()}


def delivery_problems(run: ClientRun, messages: int, partitions: int | None = None, *,
                      redelivery: bool = False) -> list[str]:
    """What is wrong with a roundtrip report; [] when every message was acknowledged and then received, in order
    within its partition, as the very message the broker acknowledged (same partition and message id).

    A message persisted twice (two message ids for one index) is a duplicate; the same message delivered
    again (same id: a consumer's unacknowledged messages after its connection was cut, as Pulsar redelivers
    them) is allowed only with ``redelivery``.  Order is checked on first deliveries.
    """
    report = run.report
    problems: list[str] = []
    if report.get("error"):
        problems.append(f"client error: {report['error']}")
    if report.get("send_errors"):
        problems.append(f"{report['send_errors']} send errors, first: {report.get('first_send_error')}")
    acked = {i: (p, mid) for p, pairs in _pairs(run.acked, report.get("acked_ids") or {}).items()
             for i, mid in pairs}
    if len(acked) != messages:
        problems.append(f"{len(acked)} of {messages} messages acknowledged")
    if partitions is not None and set(run.acked) != {str(p) for p in range(partitions)}:
        problems.append(f"acknowledged on partitions {sorted(run.acked)}, expected 0..{partitions - 1}")
    received: dict[int, tuple[str, str]] = {}
    ids_of: dict[int, set[str]] = {}
    for partition, pairs in _pairs(run.received, report.get("received_ids") or {}).items():
        firsts: list[int] = []
        seen: set[int] = set()
        for i, mid in pairs:
            if i not in seen:
                seen.add(i)
                firsts.append(i)
            ids_of.setdefault(i, set()).add(mid)
            received.setdefault(i, (partition, mid))
        redelivered = len(pairs) - len(firsts)
        if redelivered and not redelivery:
            problems.append(f"partition {partition}: {redelivered} messages delivered twice")
        inversions = sum(1 for a, b in itertools.pairwise(firsts) if b <= a)
        if inversions:
            problems.append(f"partition {partition}: {inversions} ordering inversions")
    persisted_twice = sorted(i for i, ids in ids_of.items() if len(ids) > 1)
    if persisted_twice:
        problems.append(f"{len(persisted_twice)} messages stored twice (two message ids), e.g. {persisted_twice[:5]}")
    lost = sorted(set(acked) - set(received))
    if lost:
        problems.append(f"{len(lost)} acknowledged messages never received, e.g. {lost[:5]}")
    # an id of -1:-1 acknowledges a resend the broker's deduplication dropped: it names no stored message
    moved = [i for i, (p, mid) in acked.items()
             if i in received and received[i] != (p, mid) and not mid.startswith("-1:-1:")]
    if moved:
        problems.append(f"{len(moved)} messages received under another partition or id than acknowledged, "
                        f"e.g. {[(i, acked[i], received[i]) for i in moved[:3]]}")
    strangers = sorted(set(received) - set(range(messages)))
    if strangers:
        problems.append(f"received indices never sent: {strangers[:5]}")
    return problems


def show_json(recording: Path) -> list[dict[str, Any]]:
    """``pulsar-tap show REC --json``, run in-process (the command's own code), as parsed lines."""
    from proxy.recording.show import ShowOptions, show

    out, err = io.StringIO(), io.StringIO()
    status = show(str(recording), ShowOptions(json=True), out=out, err=err)
    if status != 0:
        raise AssertionError(f"pulsar-tap show {recording} --json: exit {status}: {err.getvalue()}")
    return [json.loads(line) for line in out.getvalue().splitlines() if line]


def _answer_key(frame: dict[str, Any]) -> tuple[Any, ...]:
    fields = frame.get("fields", {})
    return (frame["conn"], frame["command"], fields.get("request_id"), fields.get("producer_id"),
            fields.get("consumer_id"))


def frames_delivered_to_clients(frames: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The frames clients actually got: a broker frame the proxy changed is recorded as received and again
    (as delivered) with origin ``proxy``; the received one did not reach the client."""
    to_client = [frame for frame in frames if frame["direction"] == "to_client"]
    replaced = {_answer_key(frame) for frame in to_client if frame["origin"] == "proxy"}
    return [frame for frame in to_client if frame["origin"] == "proxy" or _answer_key(frame) not in replaced]


def leaked_addresses(frames: Sequence[dict[str, Any]], addresses: Iterable[str]) -> list[str]:
    """Every frame delivered to a client that names one of ``addresses`` (HOST:PORT), as 'COMMAND: address'."""
    wanted = list(addresses)
    leaks = []
    for frame in frames_delivered_to_clients(frames):
        text = json.dumps(frame.get("fields", {}))
        leaks += [f"{frame['command']} (conn {frame['conn']}): {address}" for address in wanted if address in text]
    return leaks


def run_with_watcher(upstream: Upstream, start: Any, during: Any = None, period: float = 0.05
                     ) -> tuple[ClientRun, Dials]:
    """Start a client (``start()`` returns a ClientProcess) under a :class:`DialWatcher` sampling every ``period``
    seconds, call ``during(client)`` if given while it runs; the client's report and the dials."""
    with DialWatcher(upstream.broker_ports, upstream.pid, period) as watcher:
        client = start()
        watcher.client_pid = client.pid
        try:
            if during is not None:
                during(client)
            run = client.result()
        finally:
            client.kill()
    return run, watcher.dials


def wait_for(predicate: Any, timeout: float, what: str, period: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


__all__ = [
    "DialWatcher",
    "Dials",
    "EmbeddedBroker",
    "Upstream",
    "delivery_problems",
    "embedded_running",
    "frames_delivered_to_clients",
    "leaked_addresses",
    "proxy_config",
    "proxy_running",
    "run_with_watcher",
    "service_url",
    "show_json",
    "upstream_of",
    "wait_for",
]
