"""Token authentication through pulsar-tap against the real broker, with the official Python client.

One real standalone per module (module-scoped) with ``AuthenticationProviderToken`` (HS256
tokens made here with the standard library) and a refresh check every second, so an
expiring token makes the broker send AUTH_CHALLENGE on the live connection.  Through
``pulsar-tap run`` (both lookup modes):

- a valid token streams async sends and a consumer, everything delivered; a wrong or a
  missing token gets the broker's authentication error quickly (no hang, no proxy error)
  while the valid connection carries on;
- a client whose token supplier refreshes an expiring token answers the broker's
  AUTH_CHALLENGE through the proxy mid-stream without loss;
- no token (nor any of its three dot-separated parts) reaches the recording's bytes or a
  log line; ``pulsar-tap show`` shows the auth frames redacted; ``pulsar-tap replay REC
  --upstream <this broker> --token T`` replays with 0 differ and without a token fails with one
  line; ``replay --serve`` of it feeds a client that authenticates what the broker delivered;
- TLS on both sides of pulsar-tap with a token inside.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import io
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulsar
import pytest
import trio
from peers_rig import proxy_running, service_url, show_json, wait_for
from real_pulsar import Standalone, make_tls_files, spawn, start_standalone, stop_process

import proxy
from proxy.client.client import PulsarClient
from proxy.telemetry.logs import configure_logging

TREE = Path(proxy.__file__).resolve().parent.parent
SECRET = os.urandom(32)
ADMIN = "admin"
MESSAGES = 300


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_token(subject: str, *, expires_in: float | None = None, key: bytes = SECRET) -> str:
    """An HS256 JWT with ``sub`` (and ``exp`` no sooner than ``expires_in`` seconds from now: a JWT's times are
    whole seconds, here rounded up), as ``pulsar tokens create`` makes it."""
    claims: dict[str, Any] = {"sub": subject}
    if expires_in is not None:
        claims["exp"] = math.ceil(time.time() + expires_in)
    signing = _b64(json.dumps({"alg": "HS256"}).encode()) + "." + _b64(json.dumps(claims).encode())
    return signing + "." + _b64(hmac.new(key, signing.encode(), hashlib.sha256).digest())


ADMIN_TOKEN = make_token(ADMIN)


@pytest.fixture(scope="module")
def auth_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    workdir = tmp_path_factory.mktemp("pulsar-auth")
    extra = {"authenticationEnabled": "true",
             "authenticationProviders": "org.apache.pulsar.broker.authentication.AuthenticationProviderToken",
             "tokenSecretKey": "data:;base64," + base64.b64encode(SECRET).decode(),
             "superUserRoles": ADMIN,
             "authenticationRefreshCheckSeconds": 1,
             "brokerClientAuthenticationPlugin": "org.apache.pulsar.client.impl.auth.AuthenticationToken",
             "brokerClientAuthenticationParameters": f"token:{ADMIN_TOKEN}"}
    broker = start_standalone(workdir, tls=make_tls_files(workdir), extra=extra, admin_token=ADMIN_TOKEN)
    try:
        yield broker
    finally:
        broker.stop()


class LogLines(logging.Handler):
    """Every log line of the test process at debug level (the proxy runs in a thread of it): structlog's
    rendered lines and the standard library's records, formatted with their arguments."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.structured = io.StringIO()
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name} {record.levelname} {record.getMessage()} {record.exc_text or ''}")

    @property
    def lines(self) -> list[str]:
        return [*self.structured.getvalue().splitlines(), *self.records]


@pytest.fixture
def log_lines() -> Iterator[LogLines]:
    handler = LogLines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    configure_logging("console", "debug", stream=handler.structured)
    try:
        yield handler
    finally:
        configure_logging()
        root.removeHandler(handler)
        root.setLevel(level)


def secret_parts(token: str) -> list[str]:
    return [token, *token.split(".")]


def leaks(record_dir: Path, lines: list[str], tokens: list[str]) -> list[str]:
    """Which token or part of one is in a file of the recording or a log line."""
    blobs = [path.read_bytes() for path in record_dir.rglob("*") if path.is_file()]
    found = []
    for token in tokens:
        for part in secret_parts(token):
            # the header part is the same in every token and not secret by itself, but the proxy must not
            # write it either: it writes auth data only redacted, whole
            if any(part.encode() in blob for blob in blobs):
                found.append(f"recording: {part[:12]}...")
            if any(part in line for line in lines):
                found.append(f"log: {part[:12]}...")
    return found


def stream(url: str, auth: pulsar.Authentication, topic: str, messages: int, *,
           pace: float = 0.0) -> tuple[list[int], list[int], int]:
    """Async sends (no batching) of ``messages`` indices while a consumer receives them; (acked, received, errors)."""
    client = pulsar.Client(url, authentication=auth, operation_timeout_seconds=15, logger=_quiet())
    try:
        consumer = client.subscribe(topic, "auth-sub", consumer_type=pulsar.ConsumerType.Exclusive)
        producer = client.create_producer(topic, batching_enabled=False, max_pending_messages=1000,
                                          block_if_queue_full=True)
        acked: list[int] = []
        errors = [0]
        lock = threading.Lock()

        def receipt(index: int) -> Any:
            def done(result: Any, _message_id: Any) -> None:
                with lock:
                    if result == pulsar.Result.Ok:
                        acked.append(index)
                    else:
                        errors[0] += 1
            return done

        received: list[int] = []

        def consume() -> None:
            while len(received) < messages:
                try:
                    message = consumer.receive(timeout_millis=15000)
                except pulsar.Timeout:
                    return
                received.append(int(message.data()))
                consumer.acknowledge(message)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        for index in range(messages):
            producer.send_async(str(index).encode(), receipt(index))
            if pace:
                time.sleep(pace)
        producer.flush()
        reader.join(60)
        return sorted(acked), received, errors[0]
    finally:
        client.close()


def _quiet() -> logging.Logger:
    logger = logging.getLogger("pulsar-client")
    logger.setLevel(logging.WARNING)
    return logger


def produce_until_refused(url: str, token: str, topic: str, seconds: float) -> tuple[int, int]:
    """A producer whose token cannot be refreshed sends one message every 20 ms for ``seconds``; (acked, failed)."""
    client = pulsar.Client(url, authentication=pulsar.AuthenticationToken(token), operation_timeout_seconds=3,
                           logger=_quiet())
    counts = {pulsar.Result.Ok: 0}
    lock = threading.Lock()

    def done(result: Any, _message_id: Any) -> None:
        with lock:
            counts[result] = counts.get(result, 0) + 1

    try:
        producer = client.create_producer(topic, batching_enabled=False, send_timeout_millis=2000)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            producer.send_async(b"x", done)
            time.sleep(0.02)
        with contextlib.suppress(Exception):
            producer.flush()
        time.sleep(2.5)  # the last sends time out
    finally:
        client.close()
    failed = sum(count for result, count in counts.items() if result != pulsar.Result.Ok)
    return counts[pulsar.Result.Ok], failed


def refused(url: str, token: str | None) -> tuple[str, float]:
    """Try to create a producer with pulsar-tap's own client, which reports the broker's refusal of a CONNECT
    (the official Python client retries it until its operation timeout); the error and how long it took."""
    async def attempt() -> str:
        try:
            async with PulsarClient(url, token=token, operation_timeout=10) as client:
                await client.create_producer(f"auth-refused-{uuid.uuid4().hex[:6]}")
        except Exception as exc:  # the error is the result
            return repr(exc)
        return "no error"

    started = time.monotonic()
    error = trio.run(attempt)
    return error, time.monotonic() - started


@pytest.mark.parametrize("mode", ["rewrite", "proxy-through"])
def test_tokens_pass_through_the_proxy_and_never_reach_its_recording_or_logs(
        auth_broker: Standalone, tmp_path: Path, log_lines: LogLines, mode: str) -> None:
    good = make_token("alice")
    wrong = make_token("mallory", key=os.urandom(32))
    record_dir = tmp_path / "recordings"
    topic = f"persistent://public/default/auth-{mode}-{uuid.uuid4().hex[:6]}"
    outcome: dict[str, Any] = {}
    with proxy_running(auth_broker.service_url, lookup=mode, record_dir=record_dir) as proxy:
        url = service_url(proxy)
        streaming = threading.Thread(target=lambda: outcome.update(
            run=stream(url, pulsar.AuthenticationToken(good), topic, MESSAGES, pace=0.005)))
        streaming.start()
        refusals = [refused(url, wrong), refused(url, None)]
        streaming.join(120)
    acked, received, errors = outcome["run"]
    assert (len(acked), errors) == (MESSAGES, 0)
    assert received == list(range(MESSAGES))
    for error, seconds in refusals:
        assert "AuthenticationError: Failed to authenticate" in error
        assert seconds < 5
    assert not [line for line in log_lines.lines if "[error" in line or "Traceback" in line]
    assert leaks(record_dir, log_lines.lines, [good, wrong]) == []
    recording = next(path for path in record_dir.iterdir() if path.is_dir())
    connects = [frame for frame in show_json(recording) if frame.get("command") == "CONNECT"]
    assert connects, "no CONNECT recorded"
    assert all(frame.get("redacted") for frame in connects if "auth_data" in frame["fields"])
    refusals_seen = [frame for frame in show_json(recording) if frame.get("error_code") == "AuthenticationError"]
    assert len(refusals_seen) == 2 and {frame["direction"] for frame in refusals_seen} == {"to_client"}
    for frame in refusals_seen:  # each refused connection: one line at info (its end, saying why), no proxy error
        said = [line for line in log_lines.lines if f" conn={frame['conn']} " in line + " " and "[debug" not in line]
        assert len(said) == 1 and "connection closed" in said[0], said
        # (whichever side closed first: pulsar-tap's client closes on the ERROR, racing the broker)
        assert "ERROR AuthenticationError: Failed to authenticate" in said[0], said


def test_an_expiring_token_is_refreshed_through_the_proxy_mid_stream(
        auth_broker: Standalone, tmp_path: Path, log_lines: LogLines) -> None:
    issued: list[str] = []

    def supplier() -> str:
        issued.append(make_token("refresher", expires_in=2))  # 2-3 s, as before exp was rounded up
        return issued[-1]

    record_dir = tmp_path / "recordings"
    topic = f"persistent://public/default/auth-refresh-{uuid.uuid4().hex[:6]}"
    stuck: dict[str, tuple[int, int]] = {}
    with proxy_running(auth_broker.service_url, lookup="rewrite", record_dir=record_dir) as proxy:
        url = service_url(proxy)
        # (the stale token made as its client starts: made before the proxy, its 1-2 s left little for a loaded
        # machine to connect and produce before it expired)
        other = threading.Thread(target=lambda: stuck.update(
            run=produce_until_refused(url, make_token("stale", expires_in=2), topic + "-stale", 6)))
        other.start()
        acked, received, errors = stream(url, pulsar.AuthenticationToken(supplier), topic,
                                         MESSAGES, pace=0.025)  # ~8 s: the token expires twice mid-stream
        other.join(30)
    # the client that cannot refresh is disconnected by the broker and cannot reconnect: its sends fail
    stale_acked, stale_failed = stuck["run"]
    assert stale_acked > 0 and stale_failed > 0, stuck
    assert (len(acked), errors) == (MESSAGES, 0)
    assert received == list(range(MESSAGES))
    assert len(issued) >= 2, "the broker never challenged the client"
    recording = next(path for path in record_dir.iterdir() if path.is_dir())
    commands = [frame.get("command") for frame in show_json(recording)]
    assert "AUTH_CHALLENGE" in commands and "AUTH_RESPONSE" in commands
    assert leaks(record_dir, log_lines.lines, issued) == []


def test_a_recording_replays_against_the_authenticated_broker_only_with_a_token(
        auth_broker: Standalone, tmp_path: Path) -> None:
    token = make_token("recorder")
    record_dir = tmp_path / "recordings"
    topic = f"persistent://public/default/auth-replay-{uuid.uuid4().hex[:6]}"
    with proxy_running(auth_broker.service_url, lookup="rewrite", record_dir=record_dir) as proxy:
        acked, received, errors = stream(service_url(proxy), pulsar.AuthenticationToken(token), topic, 20)
    assert (len(acked), len(received), errors) == (20, 20, 0)
    recording = next(path for path in record_dir.iterdir() if path.is_dir())

    def replay(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy", "replay", str(recording), "--upstream",
                               auth_broker.service_url, "--speed", "0", "--timeout", "10", "--log-level", "error",
                               *extra], capture_output=True, text=True, timeout=120, check=False)

    done = replay("--token", make_token("replayer"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " 0 differ" in done.stderr
    refused_run = replay()
    assert refused_run.returncode != 0
    assert len(refused_run.stderr.strip().splitlines()) == 1, refused_run.stderr
    assert "AuthenticationError" in refused_run.stderr, refused_run.stderr

    # broker-side: the recording served to a client that authenticates gets what the broker delivered
    ready = tmp_path / "ready.json"
    server = spawn([sys.executable, "-m", "proxy", "replay", str(recording), "--serve", "--listen", "127.0.0.1:0",
                    "--ready-file", str(ready), "--log-level", "warning"], tmp_path / "serve.log",
                   TREE)  # ``python -m proxy`` of the tree under test (the venv's install points at another)
    try:
        wait_for(lambda: ready.exists() and ready.stat().st_size and server.poll() is None, 30, "replay --serve")
        served = f"pulsar://{json.loads(ready.read_text())['listen'][0]}"
        client = pulsar.Client(served, authentication=pulsar.AuthenticationToken(make_token("watcher")),
                               operation_timeout_seconds=10, logger=_quiet())
        try:
            consumer = client.subscribe(topic, "auth-sub", consumer_type=pulsar.ConsumerType.Exclusive)
            replayed = [int(consumer.receive(timeout_millis=10000).data()) for _ in range(20)]
        finally:
            client.close()
    finally:
        stop_process(server)
    assert sorted(replayed) == sorted(received)


def test_a_token_over_tls_through_the_proxy(auth_broker: Standalone, tmp_path: Path, log_lines: LogLines) -> None:
    """TLS on both sides of pulsar-tap (the module's trustme certificates), a token inside: delivered, not leaked."""
    assert auth_broker.tls is not None
    token = make_token("tls-user")
    record_dir = tmp_path / "recordings"
    topic = f"persistent://public/default/auth-tls-{uuid.uuid4().hex[:6]}"
    with proxy_running(auth_broker.service_url_tls, lookup="rewrite", record_dir=record_dir,
                       tls=auth_broker.tls) as proxy:
        url = service_url(proxy)
        assert url.startswith("pulsar+ssl://")
        client = pulsar.Client(url, authentication=pulsar.AuthenticationToken(token),
                               tls_trust_certs_file_path=str(auth_broker.tls.ca), tls_validate_hostname=True,
                               operation_timeout_seconds=15,
                               logger=_quiet())
        try:
            producer = client.create_producer(topic, batching_enabled=False)
            consumer = client.subscribe(topic, "tls-sub")
            for index in range(20):
                producer.send(str(index).encode())
            received = [int(consumer.receive(timeout_millis=10000).data()) for _ in range(20)]
        finally:
            client.close()
    assert received == list(range(20))
    assert leaks(record_dir, log_lines.lines, [token]) == []
