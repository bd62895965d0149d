"""Starts and stops the real Apache Pulsar parts the tests run against, and runs the real clients.

``scripts/setup.sh`` resolves ``tests/peers/pom.xml`` into ``tests/peers/.resolved/``
(git-ignored): the broker's classpath (pulsar-broker, pulsar-proxy, log4j), the shaded
Java client's classpath, the compiled Java client and the Go client's binary.  This
module only starts what is there; nothing is downloaded at test time.

- :func:`start_standalone` runs ``org.apache.pulsar.PulsarStandaloneStarter`` with the
  project's ``standalone.conf`` plus the per-run keys (free loopback ports, optional TLS
  port and files), RocksDB metadata and the in-process bookie in a temporary directory,
  1 GiB heap, no functions worker, no stream storage, and waits until
  ``GET /admin/v2/clusters`` names the cluster and ``public/default`` exists.
- :func:`start_pulsar_proxy` runs Pulsar's own proxy (``ProxyServiceStarter``) in front
  of a service URL, for the benchmark.
- :func:`run_client` runs one of the three client programs (``python``, ``java``, ``go``)
  and returns its JSON report.

Every process is started in its own session, dies with the process that started it
(``PR_SET_PDEATHSIG``), and is stopped by PID: SIGTERM, then SIGKILL after a grace period.

Run a standalone by hand (Ctrl-C stops it)::

    .venv/bin/python tests/peers/real_pulsar.py standalone
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

PEERS = Path(__file__).resolve().parent
#: the repository these tests belong to: ``python -m proxy`` started here runs its ``proxy`` (see spawn)
TREE = PEERS.parents[1]
RESOLVED = PEERS / ".resolved"
BROKER_LIB = RESOLVED / "broker-lib"
CLIENT_LIB = RESOLVED / "client-lib"
JAVA_CLIENT_CLASSES = RESOLVED / "java-client"
GO_CLIENT = RESOLVED / "go-client"
PY_CLIENT = PEERS / "py_client.py"

CLIENTS = ("python", "java", "go")

#: What makes a test JVM start fast and stay small on 2 shared cores (C1 only, the serial
#: GC): the standalone is ready ~30% sooner.  Not for benchmarks, which want the full JIT.
FAST_START = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")

#: JVM options of every Pulsar process, after Pulsar's own bin/pulsar (module opens for
#: Netty and BookKeeper, Pulsar's metadata drivers for BookKeeper).
JVM_OPTIONS = (
    "-Xss512k", "-XX:MaxDirectMemorySize=512m", "-Djava.net.preferIPv4Stack=true",
    "-Dio.netty.tryReflectionSetAccessible=true",
    "-Dlog4j2.is.webapp=false", "-Dlog4j.shutdownHookEnabled=false", "-Djute.maxbuffer=10485760",
    f"-Dlog4j.configurationFile={PEERS / 'log4j2.xml'}",
    "--add-opens", "java.base/java.io=ALL-UNNAMED", "--add-opens", "java.base/java.util.zip=ALL-UNNAMED",
    "--add-opens", "java.base/java.nio=ALL-UNNAMED", "--add-opens", "java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-opens", "java.base/sun.net=ALL-UNNAMED", "--add-opens", "java.management/sun.management=ALL-UNNAMED",
    "-Dbookkeeper.metadata.bookie.drivers=org.apache.pulsar.metadata.bookkeeper.PulsarMetadataBookieDriver",
    "-Dbookkeeper.metadata.client.drivers=org.apache.pulsar.metadata.bookkeeper.PulsarMetadataClientDriver",
)


class PeersMissing(RuntimeError):
    """The resolved peers are not installed (``bash scripts/setup.sh`` installs them)."""


class PeerFailed(RuntimeError):
    """A real Pulsar process did not start, or a client program failed."""


def require(path: Path, what: str) -> Path:
    if not path.exists():
        raise PeersMissing(f"{what} is not installed ({path} is missing): run bash scripts/setup.sh")
    return path


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (bound and released at once; the kernel does not reuse them soon)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def lasting_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports below the kernel's range of ephemeral ports, for a port chosen now
    and bound later, again and again (a module's fixed port): one from :func:`free_ports` lies in that range,
    and meanwhile an outgoing connection of the JVMs or the clients may get it as its source port (three tests
    failed binding one: Address already in use).  Tried in a random order (pytest's workers choose at once)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(max(1024, low - 8192), low))
    random.shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free loopback ports below {low}")


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the process that started us dies (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def tree_env() -> dict[str, str]:
    """The environment with :data:`TREE` first on ``PYTHONPATH``: ``python -m proxy`` run from any directory
    imports the tree under test (in a git worktree the venv's editable install points at another)."""
    paths = [str(TREE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def spawn(command: Sequence[str], log_file: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """``command`` in its own session, its output in ``log_file``; ``python -m proxy`` runs the tree under test."""
    with log_file.open("ab") as log:
        return subprocess.Popen(list(command), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=tree_env(),
                                preexec_fn=_die_with_parent)


def stop_process(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM by PID, SIGKILL after ``grace`` seconds; returns once the process is gone."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(10)


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0, token: str | None = None) -> Any:
    """One admin REST call; returns the decoded JSON answer (None when empty), raises PeerFailed on HTTP errors.

    ``token`` is sent as ``Authorization: Bearer`` (a broker with authentication enabled).
    """
    text = http_text(method, url, body, timeout, token)
    return json.loads(text) if text.strip() else None


def http_text(method: str, url: str, body: Any = None, timeout: float = 30.0, token: str | None = None) -> str:
    """:func:`http_json`'s call, the answer as text (the health check answers ``ok``, not JSON)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as exc:
        raise PeerFailed(f"{method} {url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") from exc
    return text


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA that signed the certificate, the certificate (for 127.0.0.1 and localhost), its PKCS#8 key."""

    ca: str
    cert: str
    key: str


def make_tls_files(directory: Path) -> TlsFiles:
    """A fresh CA and a certificate for 127.0.0.1/localhost (trustme), the key as PKCS#8 as Pulsar's Netty wants it."""
    import trustme
    from cryptography.hazmat.primitives import serialization

    ca = trustme.CA(key_type=trustme.KeyType.RSA)
    issued = ca.issue_cert("127.0.0.1", "localhost", key_type=trustme.KeyType.RSA)
    paths = TlsFiles(str(directory / "ca.pem"), str(directory / "cert.pem"), str(directory / "key.pem"))
    ca.cert_pem.write_to_path(paths.ca)
    Path(paths.cert).write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), password=None)
    Path(paths.key).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return paths


class JavaProcess:
    """A JVM the tests started: its PID, its working directory and log, and how to stop it."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], workdir: Path, log_file: Path) -> None:
        self.name = name
        self.process = process
        self.workdir = workdir
        self.log_file = log_file
        self.started_at = time.monotonic()
        self.startup_seconds = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid

    def fail(self, why: str) -> PeerFailed:
        return PeerFailed(f"{self.name} {why}; last lines of {self.log_file}:\n{_tail(self.log_file)}")

    def wait_until(self, ready: Any, timeout: float) -> None:
        """Poll ``ready()`` (True when ready; exceptions mean not yet) until ``timeout``; fail if the JVM exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self.fail(f"exited with status {self.process.returncode} while starting")
            with contextlib.suppress(OSError, PeerFailed, ValueError):
                if ready():
                    self.startup_seconds = time.monotonic() - self.started_at
                    return
            time.sleep(0.25)
        raise self.fail(f"did not become ready in {timeout:.0f} s")

    def stop(self, grace: float = 5.0) -> None:
        stop_process(self.process, grace)


def java_command(classpath: Sequence[Path | str], main: str, args: Sequence[str], *, heap: str,
                 log_file: Path, fast_start: bool = True) -> list[str]:
    return ["java", f"-Xmx{heap}", *(FAST_START if fast_start else ()), *JVM_OPTIONS,
            f"-Dpulsar.log.file={log_file}", "-cp", os.pathsep.join(str(p) for p in classpath), main, *args]


class Standalone(JavaProcess):
    """A running ``PulsarStandaloneStarter``: service URLs, admin URL, and the admin calls the tests use."""

    def __init__(self, process: subprocess.Popen[bytes], workdir: Path, log_file: Path, *,
                 broker_port: int, web_port: int, tls_port: int | None, tls: TlsFiles | None,
                 cluster: str = "standalone", admin_token: str | None = None,
                 command: Sequence[str] = ()) -> None:
        super().__init__(f"pulsar standalone {cluster}" if cluster != "standalone" else "pulsar standalone",
                         process, workdir, log_file)
        #: what started it (``restart`` runs it again)
        self.command = list(command)
        self.cluster = cluster
        self.broker_port = broker_port
        self.web_port = web_port
        self.tls_port = tls_port
        self.tls = tls
        #: the token of the admin calls, when the broker authenticates
        self.admin_token = admin_token

    @property
    def service_url(self) -> str:
        return f"pulsar://127.0.0.1:{self.broker_port}"

    @property
    def service_url_tls(self) -> str:
        if self.tls_port is None:
            raise PeerFailed("this standalone has no TLS port")
        return f"pulsar+ssl://127.0.0.1:{self.tls_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def addresses(self) -> list[str]:
        """Every HOST:PORT this broker serves: what must never reach a client through the proxy."""
        ports = [self.broker_port, self.web_port, *([self.tls_port] if self.tls_port else [])]
        return [f"127.0.0.1:{port}" for port in ports]

    def admin(self, method: str, path: str, body: Any = None) -> Any:
        return http_json(method, self.admin_url + path, body, token=self.admin_token)

    def ready(self) -> bool:
        return self.cluster in (self.admin("GET", "/admin/v2/clusters") or []) and \
            "public/default" in (self.admin("GET", "/admin/v2/namespaces/public") or [])

    def stores(self) -> bool:
        """The broker's own health check: a message written to and read back from its heartbeat topic, so a
        ledger could be created (after a crash the bookie may serve the admin API before it takes writes:
        "Not enough non-faulty bookies available")."""
        return http_text("GET", self.admin_url + "/admin/v2/brokers/health", token=self.admin_token).strip() == "ok"

    def restart(self, timeout: float = 120.0, *, crash: bool = False) -> float:
        """Stop the broker as an operator does (SIGTERM: it unloads its topics and closes its connections), or
        as a crash does (``crash``: SIGKILL, its connections reset by the kernel), and start it again on the same
        ports and data; returns the seconds its port was closed.  Call it on a thread that outlives the broker:
        the new JVM dies with the thread that started it (``_die_with_parent``)."""
        if not self.command:
            raise PeerFailed(f"{self.name} cannot be restarted: its command was not kept")
        if crash:
            self.process.kill()
            self.process.wait(30)
        else:
            stop_process(self.process, grace=60.0)
        stopped = time.monotonic()
        self.started_at = stopped
        self.process = spawn(self.command, self.log_file, self.workdir)
        self.wait_until(self.ready, timeout)
        down = time.monotonic() - stopped
        self.wait_until(self.stores, timeout)
        return down


def standalone_config(workdir: Path, *, broker_port: int, web_port: int, tls_port: int | None,
                      tls: TlsFiles | None, cluster: str = "standalone",
                      extra: Mapping[str, str | int] | None = None) -> Path:
    """The project's standalone.conf plus this run's keys, written into ``workdir``.

    ``cluster`` replaces the file's ``clusterName`` (two standalones that replicate need two
    names); ``extra`` adds keys, or replaces the file's value of a key it sets
    (``transactionCoordinatorEnabled``).
    """
    base = (PEERS / "standalone.conf").read_text()
    if cluster != "standalone":
        base = re.sub(r"(?m)^clusterName=.*$", f"clusterName={cluster}", base)
    keys: dict[str, str | int | Path] = {"brokerServicePort": broker_port, "webServicePort": web_port,
                                         # graceful shutdown is bounded: the data is thrown away after the session
                                         "brokerShutdownTimeoutMs": 3000}
    keys.update(extra or {})
    if tls is not None and tls_port is not None:
        keys.update(brokerServicePortTls=tls_port, tlsCertificateFilePath=tls.cert, tlsKeyFilePath=tls.key,
                    tlsTrustCertsFilePath=tls.ca)
    defined = {line.split("=", 1)[0].strip() for line in base.splitlines() if "=" in line and
               not line.lstrip().startswith("#")}
    for key in defined & set(extra or {}):  # a setting of the file this broker wants otherwise (transactions)
        base = re.sub(rf"(?m)^{re.escape(key)}=.*$", f"{key}={keys.pop(key)}", base)
    if clash := defined & set(keys):  # BookKeeper would read a repeated key as a list
        raise PeerFailed(f"standalone.conf must not set {sorted(clash)}: the launcher sets them per run")
    path = workdir / "standalone.conf"
    path.write_text(base + "\n# per run (tests/peers/real_pulsar.py)\n" +
                    "".join(f"{key}={value}\n" for key, value in keys.items()))
    return path


def start_standalone(workdir: Path | None = None, *, tls: TlsFiles | None = None, timeout: float = 240.0,
                     attempts: int = 2, cluster: str = "standalone",
                     extra: Mapping[str, str | int] | None = None, admin_token: str | None = None) -> Standalone:
    """Start a real standalone broker on free loopback ports and wait until it serves ``public/default``.

    ``cluster`` names its cluster (``clusterName``); ``extra`` adds broker settings to the config;
    ``admin_token`` authenticates the admin calls (a broker whose ``extra`` enables authentication).
    """
    require(BROKER_LIB, "the real Pulsar broker")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="pulsar-standalone-"))
    for attempt in range(1, attempts + 1):
        run_dir = workdir / f"run-{attempt}"
        run_dir.mkdir(parents=True)
        broker_port, web_port, tls_port, bookie_port = free_ports(4)
        config = standalone_config(run_dir, broker_port=broker_port, web_port=web_port,
                                   tls_port=tls_port if tls else None, tls=tls, cluster=cluster, extra=extra)
        log_file = run_dir / "pulsar.log"
        command = java_command(
            [BROKER_LIB / "*"], "org.apache.pulsar.PulsarStandaloneStarter",
            ["--config", str(config), "--metadata-dir", str(run_dir / "metadata"),
             "--bookkeeper-dir", str(run_dir / "bookkeeper"), "--bookkeeper-port", str(bookie_port),
             "--no-functions-worker", "--no-stream-storage"],
            heap="1g", log_file=log_file)
        broker = Standalone(spawn(command, log_file, run_dir), run_dir, log_file, broker_port=broker_port,
                            web_port=web_port, tls_port=tls_port if tls else None, tls=tls, cluster=cluster,
                            admin_token=admin_token, command=command)
        try:
            broker.wait_until(broker.ready, timeout)
            return broker
        except PeerFailed:
            broker.stop(grace=1)
            # a port taken between choosing and binding it is worth one more try; anything else is not
            if attempt == attempts or "Address already in use" not in _tail(log_file, 400):
                raise
    raise AssertionError("unreachable")


class PulsarProxy(JavaProcess):
    """Apache Pulsar's own proxy (``ProxyServiceStarter``) in front of one broker."""

    def __init__(self, process: subprocess.Popen[bytes], workdir: Path, log_file: Path, port: int,
                 web_port: int) -> None:
        super().__init__("pulsar proxy", process, workdir, log_file)
        self.port = port
        self.web_port = web_port

    @property
    def service_url(self) -> str:
        return f"pulsar://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            pass
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/metrics", timeout=2):
            return True


def start_pulsar_proxy(broker_service_url: str, *, log_level: int, workdir: Path | None = None,
                       broker_web_url: str | None = None, timeout: float = 120.0,
                       fast_start: bool = False) -> PulsarProxy:
    """Pulsar's proxy with the project's ``proxy.conf``, ``brokerServiceURL`` = ``broker_service_url``.

    ``log_level`` is Pulsar's ``proxyLogLevel``: 0 forwards bytes without parsing (zero-copy),
    1 and 2 parse every frame (2 also logs each message's metadata at debug level).  It runs
    with the full JIT unless ``fast_start`` (it is a benchmark's baseline).
    """
    require(BROKER_LIB, "Apache Pulsar's proxy")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="pulsar-proxy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    port, web_port = free_ports(2)
    # Pulsar's proxy insists on a broker HTTP URL (or a metadata store); it is used only to
    # relay admin requests, which the benchmark does not make: the broker's host is enough then
    web_url = broker_web_url or "http://" + broker_service_url.split("://", 1)[1]
    keys = {"brokerServiceURL": broker_service_url, "brokerWebServiceURL": web_url,
            "servicePort": port, "webServicePort": web_port, "proxyLogLevel": log_level}
    config = workdir / "proxy.conf"
    config.write_text((PEERS / "proxy.conf").read_text() + "\n# per run (tests/peers/real_pulsar.py)\n" +
                      "".join(f"{key}={value}\n" for key, value in keys.items()))
    log_file = workdir / "pulsar-proxy.log"
    command = java_command([BROKER_LIB / "*"], "org.apache.pulsar.proxy.server.ProxyServiceStarter",
                           ["--config", str(config)], heap="1g", log_file=log_file, fast_start=fast_start)
    proxy = PulsarProxy(spawn(command, log_file, workdir), workdir, log_file, port, web_port)
    try:
        proxy.wait_until(proxy.ready, timeout)
    except BaseException:
        proxy.stop(grace=1)
        raise
    return proxy


# --- the client programs -------------------------------------------------------------------------

def client_command(client: str, url: str, topic: str, *, messages: int, batching: bool = True,
                   compression: str = "NONE", subscription: str = "peers", tls_ca: str | None = None,
                   rate: float = 0.0, timeout: float = 120.0, send_timeout: float = 30.0, idle: float = 5.0,
                   latencies: bool = False, mode: str = "roundtrip", extra_args: Sequence[str] = ()) -> list[str]:
    """The command line of one client program; all three take the same options (``extra_args``: one's own)."""
    options = ["--url", url, "--topic", topic, "--messages", str(messages),
               "--batching" if batching else "--no-batching", "--compression", compression,
               "--subscription", subscription, "--rate", str(rate), "--timeout", str(timeout),
               "--send-timeout", str(send_timeout),
               "--idle", str(idle), "--mode", mode]
    if tls_ca:
        options += ["--tls-ca", tls_ca]
    if latencies:
        options.append("--latencies")
    options += extra_args
    if client == "python":
        return [sys.executable, str(PY_CLIENT), *options]
    if client == "java":
        require(JAVA_CLIENT_CLASSES / "PeerClient.class", "the Java client")
        return ["java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
                "-cp", os.pathsep.join([str(JAVA_CLIENT_CLASSES), str(CLIENT_LIB / "*")]), "PeerClient", *options]
    if client == "go":
        return [str(require(GO_CLIENT, "the Go client")), *options]
    raise ValueError(f"unknown client {client!r}; one of {CLIENTS}")


@dataclasses.dataclass
class ClientRun:
    """A client program's report (its JSON line) and what it wrote on stderr."""

    report: dict[str, Any]
    stderr: str
    pid: int

    @property
    def acked(self) -> dict[str, list[int]]:
        return dict(self.report.get("acked") or {})

    @property
    def received(self) -> dict[str, list[int]]:
        return dict(self.report.get("received") or {})

    def acked_indices(self) -> list[int]:
        return [i for indices in self.acked.values() for i in indices]

    def received_indices(self) -> list[int]:
        return [i for indices in self.received.values() for i in indices]


class ClientProcess:
    """A client program running in the background (``start_client``); ``result()`` waits for its report."""

    def __init__(self, client: str, command: list[str], timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True,
                                        preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int:
        return self.process.pid

    def result(self) -> ClientRun:
        try:
            out, err = self.process.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            raise PeerFailed(f"the {self.client} client did not finish in {self.timeout:.0f} s; "
                             f"stderr:\n{err.decode(errors='replace')[-3000:]}") from None
        lines = [line for line in out.decode(errors="replace").splitlines() if line.startswith("{")]
        if self.process.returncode != 0 or not lines:
            raise PeerFailed(f"the {self.client} client exited with {self.process.returncode}; "
                             f"stdout: {out.decode(errors='replace')[-1000:]}\n"
                             f"stderr:\n{err.decode(errors='replace')[-3000:]}")
        return ClientRun(json.loads(lines[-1]), err.decode(errors="replace"), self.process.pid)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def start_client(client: str, url: str, topic: str, **options: Any) -> ClientProcess:
    """Start a client program; its own ``--timeout`` plus a margin bounds how long ``result()`` waits."""
    command = client_command(client, url, topic, **options)
    return ClientProcess(client, command, float(options.get("timeout", 120.0)) + 60.0)


def run_client(client: str, url: str, topic: str, **options: Any) -> ClientRun:
    """Run a client program to the end and return its report."""
    running = start_client(client, url, topic, **options)
    try:
        return running.result()
    finally:
        running.kill()


@contextlib.contextmanager
def standalone_running(tls: bool = True) -> Iterator[Standalone]:
    """A standalone for the duration of a ``with`` block (with a TLS port and fresh certificates when ``tls``)."""
    workdir = Path(tempfile.mkdtemp(prefix="pulsar-standalone-"))
    files = make_tls_files(workdir) if tls else None
    broker = start_standalone(workdir, tls=files)
    try:
        yield broker
    finally:
        broker.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["standalone"]:
        print("usage: real_pulsar.py standalone   (starts a real Pulsar standalone; Ctrl-C stops it)",
              file=sys.stderr)
        return 2
    try:
        with standalone_running() as broker:
            ca = broker.tls.ca if broker.tls else None
            print(f"ready in {broker.startup_seconds:.1f} s: {broker.service_url} {broker.service_url_tls} "
                  f"admin {broker.admin_url} (pid {broker.pid}, log {broker.log_file}, CA {ca})", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while broker.process.poll() is None:
                    time.sleep(1)
    except (PeersMissing, PeerFailed) as exc:
        print(f"real_pulsar: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
