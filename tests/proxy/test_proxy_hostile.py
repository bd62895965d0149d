"""Every hostile input of issue #12 against a running proxy, with the official client as a bystander.

Two ``pulsar-tap run`` processes stand in front of one embedded broker: ``plain`` with
the defaults (the scanner passes everything through), and ``full`` with topic rules,
the admin API and recording on.  On each, an official-client producer sends all the
time on its own connection.  Each test makes one attack from a raw socket and checks:

- the attacker's connection alone is closed, with one warning naming it and the reason
  (or, for a legal request, it is answered), and nothing in the log is a traceback;
- the bystander's worst send latency while the attack runs and for a second after
  stays under 1 s (a functional bound: the attacks stalled it for 10 s and more, or
  forever);
- the proxy still accepts new clients.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pulsar
import pytest

from proxy.broker import ClusterConfig, ThreadedCluster
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_command

#: the repository under test (its ``proxy`` is what ``python -m proxy`` must run)
ROOT = Path(__file__).resolve().parents[2]
WORST_SEND_S = 1.0
TOKEN = "hostile-test-token"
RULES = """\
seed: 1
rules:
  - name: slow-pattern
    match: {command: [LOOKUP], topic: {regex: "(a+)+$"}}
    action: mark
  - name: orders
    match: {command: [LOOKUP, PRODUCER], topic: "persistent://public/default/orders-*"}
    action: mark
"""


# -- the parts -----------------------------------------------------------------------------------
@dataclass
class RunningProxy:
    process: subprocess.Popen[str]
    address: tuple[str, int]
    admin: str | None
    log_path: Path
    record_dir: Path | None

    @property
    def service_url(self) -> str:
        return f"pulsar://{self.address[0]}:{self.address[1]}"

    def log(self) -> list[dict[str, Any]]:
        entries = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entries.append(json.loads(line))
        return entries

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:  # a stalled proxy ignores SIGTERM
                self.process.kill()
                self.process.wait(10)


def start_proxy(tmp: Path, name: str, upstream: str, *flags: str) -> RunningProxy:
    ready = tmp / f"{name}-ready.json"
    log_path = tmp / f"{name}.log"
    command = [sys.executable, "-m", "proxy", "run", "--upstream", upstream, "--listen", "127.0.0.1:0",
               "--ready-file", str(ready), "--log-format", "json", "--drain-seconds", "0.5", *flags]
    with log_path.open("w") as log_file:
        # (from ``tmp``: PYTHONPATH names the tree under test, not the venv's editable install's)
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, text=True, cwd=tmp,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"proxy {name} did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    while True:  # the file may be seen before it is written whole
        with contextlib.suppress(json.JSONDecodeError):
            ports = json.loads(ready.read_text())
            break
        time.sleep(0.05)
    host, port = ports["listen"][0].rsplit(":", 1)
    record = Path(flags[flags.index("-c") + 1]).parent / "recordings" if "-c" in flags else None
    return RunningProxy(process, (host, int(port)), ports["admin"], log_path, record)


@dataclass
class Bystander:
    """An official-client producer that sends one message after another and times each."""

    client: pulsar.Client
    producer: Any
    samples: list[tuple[float, float]] = field(default_factory=list)
    in_flight_since: float | None = None
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, service_url: str, topic: str) -> Bystander:
        client = pulsar.Client(service_url, operation_timeout_seconds=30, connection_timeout_ms=10_000,
                               logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        producer = client.create_producer(topic, batching_enabled=False, send_timeout_millis=60_000)
        bystander = cls(client, producer)
        bystander._thread = threading.Thread(target=bystander._run, name="bystander", daemon=True)
        bystander._thread.start()
        return bystander

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            started = time.monotonic()
            self.in_flight_since = started
            try:
                self.producer.send(b"bystander-%d" % index)
            except Exception as exc:  # reported by the test that was running
                self.failures.append(repr(exc))
            self.in_flight_since = None
            self.samples.append((started, time.monotonic() - started))
            index += 1
            time.sleep(0.01)

    def worst_since(self, since: float) -> tuple[float, int]:
        """The longest send that started after ``since`` (or is still waiting), and how many finished."""
        finished = [latency for started, latency in list(self.samples) if started >= since]
        waiting = self.in_flight_since
        worst = max(finished, default=0.0)
        if waiting is not None:
            worst = max(worst, time.monotonic() - waiting)
        return worst, len(finished)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(90)
        with contextlib.suppress(Exception):
            self.client.close()


@dataclass
class Rig:
    proxy: RunningProxy
    bystander: Bystander


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThreadedCluster]:
    running = ThreadedCluster(ClusterConfig(brokers=1)).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile")


def _rig(workdir: Path, cluster: ThreadedCluster, name: str, *flags: str) -> Iterator[Rig]:
    proxy = start_proxy(workdir, name, cluster.service_url, *flags)
    try:
        bystander = Bystander.start(proxy.service_url, f"persistent://public/default/bystander-{name}")
        try:
            yield Rig(proxy, bystander)
        finally:
            bystander.stop()
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def plain(workdir: Path, cluster: ThreadedCluster) -> Iterator[Rig]:
    yield from _rig(workdir, cluster, "plain")


@pytest.fixture(scope="module")
def full(workdir: Path, cluster: ThreadedCluster) -> Iterator[Rig]:
    (workdir / "rules.yaml").write_text(RULES)
    (workdir / "token").write_text(TOKEN)
    (workdir / "proxy.yaml").write_text(f"rules: {workdir / 'rules.yaml'}\n"
                                        f"admin: {{listen: '127.0.0.1:0', token_file: {workdir / 'token'}}}\n"
                                        f"record: {{dir: {workdir / 'recordings'}}}\n")
    yield from _rig(workdir, cluster, "full", "-c", str(workdir / "proxy.yaml"))


# -- the attacker --------------------------------------------------------------------------------
CONNECT = encode_command(api.CommandConnect(client_version="hostile", protocol_version=21))


def connected_socket(proxy: RunningProxy, connect: bytes = CONNECT) -> socket.socket:
    sock = socket.create_connection(proxy.address, timeout=10)
    sock.sendall(connect)
    decoder = FrameDecoder()
    while not decoder.receive(sock.recv(65536)):
        pass
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the proxy closes the socket (EOF or reset) within ``seconds``."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


@contextlib.contextmanager
def watched(rig: Rig) -> Iterator[None]:
    """Around an attack: the bystander's worst send stays under the bound, the proxy takes new clients."""
    rig.bystander.samples.clear()
    started = time.monotonic()
    yield
    time.sleep(1.0)  # sends go on after the attack
    worst, sent = rig.bystander.worst_since(started)
    assert worst < WORST_SEND_S, f"the bystander waited {worst:.2f}s for a send"
    assert sent >= 5, "the bystander hardly sent anything"
    assert not rig.bystander.failures, rig.bystander.failures
    connected_socket(rig.proxy).close()  # still accepting
    assert "Traceback" not in rig.proxy.log_text()


def hostile_warnings(proxy: RunningProxy, sock_name: tuple[str, int]) -> list[dict[str, Any]]:
    client = f"{sock_name[0]}:{sock_name[1]}"
    deadline = time.monotonic() + 10
    while True:
        found = [e for e in proxy.log() if e.get("client") == client and e.get("level") == "warning"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def dropped_alone(rig: Rig, attack: list[bytes], reason: str, *, pause: float = 0.05,
                  within: float = 10.0) -> None:
    """Send the attack in these writes; the proxy closes this connection with one warning giving ``reason``."""
    with watched(rig):
        sock = connected_socket(rig.proxy)
        name = sock.getsockname()
        for piece in attack:
            sock.sendall(piece)
            time.sleep(pause)
        assert closed_within(sock, within), "the proxy kept the hostile connection open"
        sock.close()
        warnings = hostile_warnings(rig.proxy, name)
        assert len(warnings) == 1, warnings
        assert warnings[0]["event"] == "dropped hostile client" and reason in warnings[0]["reason"], warnings


# -- item 1: the one-frame hang and its family ---------------------------------------------------
ONE_BYTE_SECTION = bytes.fromhex("0000000d0000000808063204080110010e")


def test_a_split_one_byte_payload_section_closes_only_that_client(plain: Rig) -> None:
    """It put the proxy in a 100 % CPU loop: no client got CONNECTED again, SIGTERM was ignored."""
    dropped_alone(plain, [ONE_BYTE_SECTION[:12], ONE_BYTE_SECTION[12:] + b"\x00"], "truncated payload section")


@pytest.mark.parametrize("cut", [4, 8, 9, 10, 11, 13, 15])
def test_the_same_frame_cut_elsewhere_is_refused_the_same_way(plain: Rig, cut: int) -> None:
    dropped_alone(plain, [ONE_BYTE_SECTION[:cut], ONE_BYTE_SECTION[cut:] + b"\x00"], "truncated payload section")


# -- item 6: undecodable commands of the fast path -----------------------------------------------
@pytest.mark.parametrize(("attack", "reason"), [
    (bytes.fromhex("0000001800000014080b5a7fee") + bytes(15), "undecodable command"),
    ((10).to_bytes(4, "big") + (6).to_bytes(4, "big") + bytes.fromhex("080b5a020801"),
     "FLOW lacks required fields: messagePermits"),
    ((20).to_bytes(4, "big") + (6).to_bytes(4, "big") + bytes.fromhex("0806320208ff") + b"\x0e\x01" + bytes(8),
     "undecodable SEND"),
], ids=["flow-overrun", "flow-missing-field", "send-cut-varint"])
def test_an_undecodable_command_never_reaches_the_broker(plain: Rig, cluster: ThreadedCluster, attack: bytes,
                                                         reason: str) -> None:
    dropped_alone(plain, [attack], reason)


# -- item 7: zero sizes --------------------------------------------------------------------------
@pytest.mark.parametrize(("attack", "reason"), [
    (b"\x00\x00\x00\x00", "total size 0 leaves no room for a command"),
    (b"\x00\x00\x00\x10\x00\x00\x00\x00", "command of 0 bytes cannot hold a type"),
], ids=["total-size-0", "cmd-size-0"])
def test_zero_sizes_are_refused_from_the_header_at_once(plain: Rig, attack: bytes, reason: str) -> None:
    """They waited for 10 bytes that never came, for up to 60 s."""
    dropped_alone(plain, [attack], reason, within=5.0)


# -- item 2: text that is not UTF-8 --------------------------------------------------------------
def bad_utf8_lookup() -> bytes:
    good = b"persistent://public/default/orders-xyz"
    frame = encode_command(api.CommandLookupTopic(topic=good.decode(), request_id=7))
    return frame.replace(good, b"persistent://public/default/orders-x\xff\xfe")


def test_a_topic_that_is_not_utf8_closes_only_that_client_without_a_traceback(full: Rig) -> None:
    """With a topic rule loaded, rules/matcher.py raised TypeError (traceback logged); recorded, it broke show."""
    dropped_alone(full, [bad_utf8_lookup()], "undecodable LOOKUP")


# -- item 4: a pattern that backtracks -----------------------------------------------------------
def test_a_topic_built_to_backtrack_is_matched_in_linear_time(full: Rig) -> None:
    """A LOOKUP for 'a'*28+'!' against (a+)+$ blocked the event loop 10.7 s."""
    with watched(full):
        sock = connected_socket(full.proxy)
        sock.sendall(encode_command(api.CommandLookupTopic(topic="a" * 28 + "!", request_id=3)))
        decoder = FrameDecoder()
        frames: list[Any] = []
        sock.settimeout(10)
        while not frames:
            data = sock.recv(65536)
            assert data, "the proxy closed a legal request's connection"
            frames = decoder.receive(data)
        assert frames[0].command.lookupTopicResponse.request_id == 3  # answered
        sock.close()


# -- item 5: documents that expand ---------------------------------------------------------------
def alias_bomb(levels: int) -> str:
    lines = ['x0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"x{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nname: bomb\nmatch: {{command: *a{levels}}}\naction: drop\n"


@pytest.mark.parametrize(("content_type", "body"), [
    ("application/yaml", alias_bomb(9)),
    ("application/json", "[" * 100_000 + "]" * 100_000),
], ids=["alias-bomb", "deep-json"])
def test_a_rules_body_that_expands_is_refused_while_traffic_flows(full: Rig, content_type: str, body: str) -> None:
    """9 levels of aliases (under 600 bytes): more than 60 s frozen and 7.6 GB."""
    assert full.proxy.admin is not None
    with watched(full):
        response = httpx.post(f"http://{full.proxy.admin}/rules", content=body, timeout=30,
                              headers={"Authorization": f"Bearer {TOKEN}", "content-type": content_type})
        assert response.status_code == 400, response.text
        assert response.json()["error"]


# -- item 3: secrets in the recording ------------------------------------------------------------
def test_no_secret_of_any_command_reaches_the_recording(full: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    """original_auth_data of LOOKUP and PARTITIONED_METADATA was recorded in clear."""
    from proxy.cli import main

    assert full.proxy.record_dir is not None
    connect = encode_command(api.CommandConnect(client_version="pulsar-proxy", protocol_version=21,
                                                auth_method_name="token", auth_data=b"SECRET-connect",
                                                original_principal="app", original_auth_data="SECRET-original",
                                                original_auth_method="token"))
    with watched(full):
        sock = connected_socket(full.proxy, connect)
        sock.sendall(encode_command(api.CommandLookupTopic(
            topic="persistent://public/default/secrets", request_id=1, original_auth_data="SECRET-lookup"))
            + encode_command(api.CommandPartitionedTopicMetadata(
                topic="persistent://public/default/secrets", request_id=2, original_auth_data="SECRET-meta")))
        decoder = FrameDecoder()
        answers: list[Any] = []
        sock.settimeout(10)
        while len(answers) < 2:
            data = sock.recv(65536)
            assert data
            answers += decoder.receive(data)
        sock.close()
    time.sleep(1.5)  # the recorder writes at least once a second
    stored = b"".join(p.read_bytes() for p in full.proxy.record_dir.rglob("*") if p.is_file())
    assert b"SECRET" not in stored and b"REDACTED" in stored
    assert main(["show", str(full.proxy.record_dir), "--json"]) == 0
    assert "SECRET" not in capsys.readouterr().out
