"""A peer that resets, half-closes or cuts its connection ends that connection only.

Every stack that accepts Pulsar connections — the embedded broker, the proxy (with rules
that hold, duplicate and corrupt frames loaded, so the rule paths run too), and
``replay --serve`` — is attacked by a raw socket that plays a client and stops at every
step of a session: before CONNECT, in the middle of the CONNECT frame, after CONNECTED,
after PRODUCER_SUCCESS, in the middle of a stream of SENDs (receipts in flight), in the
middle of a SEND frame, and after SUBSCRIBE + FLOW with messages being pushed at it.  At
each step it leaves by a reset (SO_LINGER 0: RST), a half-close (shutdown(SHUT_WR), then
reads until the server lets go) and a plain close (unread data: the kernel resets too).
Meanwhile an official-client producer on another connection keeps sending, and after
every cut it must still get its receipt; at the end a fresh official client produces and
consumes.  The built-in client stack is attacked from the other side: a raw "broker" that
resets or half-closes at every step of its answers.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pulsar
import pytest
import trio

from proxy.broker.embedded import BrokerClusterFactory, ThreadedCluster
from proxy.client import PulsarClient
from proxy.config.proxy_config import HostPort, ProxyConfig, ServiceUrl
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_command, encode_payload_command
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations
from proxy.replay.matcher import AnswerBook
from proxy.rules.engine import RulesEngine
from proxy.rules.hook import RulesHook
from proxy.rules.loader import load_rules_text
from proxy.server.app import ProxyServer
from proxy.server.threaded import ThreadedProxy
from proxy.testing.rig import ThreadedReplayServer

T = api.BaseCommand.Type
LOGGER = pulsar.ConsoleLogger(pulsar.LoggerLevel.Error)
SAMPLE = Path(__file__).resolve().parents[1] / "recordings" / "sample"
#: the sample recording's topic and subscription, so that ``replay --serve`` has answers too
TOPIC = "persistent://public/default/sample-orders"
SUBSCRIPTION = "sample-sub"
_LINGER_RESET = struct.pack("ii", 1, 0)

#: rules that make the proxy decode, hold, duplicate and corrupt on this topic
PROXY_RULES = f"""
seed: 3
rules:
  - name: slow-receipts
    match: {{command: [SEND_RECEIPT], topic: "{TOPIC}", probability: 0.5}}
    action: {{delay: {{ms: 20}}}}
  - name: twice
    match: {{command: [MESSAGE], topic: "{TOPIC}", probability: 0.1}}
    action: duplicate
  - name: damaged
    match: {{command: [MESSAGE], topic: "{TOPIC}", probability: 0.05}}
    action: {{corrupt: {{what: checksum}}}}
  - name: look-at-everything
    match: {{topic: "{TOPIC}"}}
    action: {{mark: {{label: peer-loss}}}}
"""


# -- the raw client ----------------------------------------------------------------------------
def _connect_frame() -> bytes:
    return encode_command(api.CommandConnect(client_version="raw-socket", protocol_version=21))


def _producer_frame() -> bytes:
    return encode_command(api.CommandProducer(topic=TOPIC, producer_id=1, request_id=1))


def _send_frame(sequence_id: int) -> bytes:
    metadata = api.MessageMetadata(producer_name="raw", sequence_id=sequence_id, publish_time=int(time.time() * 1000))
    return encode_payload_command(api.CommandSend(producer_id=1, sequence_id=sequence_id),
                                  metadata, b"raw message %d " % sequence_id + bytes(1000))


def _subscribe_frames() -> bytes:
    return encode_command(api.CommandSubscribe(
        topic=TOPIC, subscription=SUBSCRIPTION, subType=api.CommandSubscribe.Shared, consumer_id=1,
        request_id=2, initialPosition=api.CommandSubscribe.Earliest)) + \
        encode_command(api.CommandFlow(consumer_id=1, messagePermits=1000))


class RawClient:
    """A client that speaks the protocol byte by byte and can leave at any moment."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.decoder = FrameDecoder(64 << 20)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def expect(self, kind: int) -> None:
        """Read until a frame of ``kind`` arrives (others — receipts, PINGs — are skipped)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = self.sock.recv(1 << 16)
            assert data, f"the server closed before {api.BaseCommand.Type.Name(kind)}"
            if any(frame.type == kind for frame in self.decoder.receive(data)):
                return
        raise AssertionError(f"no {api.BaseCommand.Type.Name(kind)} within 10 s")

    def leave(self, how: str) -> None:
        if how == "reset":
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        elif how == "half-close":
            self.sock.shutdown(socket.SHUT_WR)
            # the server may still answer; it lets go of the connection by closing its side
            self.sock.settimeout(5)
            with contextlib.suppress(OSError):
                while self.sock.recv(1 << 16):
                    pass
        self.sock.close()


def _before_connect(client: RawClient) -> None:
    del client


def _mid_connect(client: RawClient) -> None:
    frame = _connect_frame()
    client.send(frame[:len(frame) // 2])


def _after_connect(client: RawClient) -> None:
    client.send(_connect_frame())
    client.expect(T.CONNECTED)


def _after_producer(client: RawClient) -> None:
    _after_connect(client)
    client.send(_producer_frame())
    client.expect(T.PRODUCER_SUCCESS)


def _mid_send_stream(client: RawClient) -> None:
    _after_producer(client)
    client.send(b"".join(_send_frame(i) for i in range(200)))  # receipts are on their way back


def _mid_send_frame(client: RawClient) -> None:
    _after_producer(client)
    frame = _send_frame(10)
    client.send(b"".join(_send_frame(i) for i in range(10)) + frame[:len(frame) // 2])


def _messages_in_flight(client: RawClient) -> None:
    _after_connect(client)
    client.send(_subscribe_frames())
    client.expect(T.MESSAGE)  # the server is pushing; the rest stays unread


STEPS: dict[str, Callable[[RawClient], None]] = {
    "before CONNECT": _before_connect,
    "mid CONNECT frame": _mid_connect,
    "after CONNECTED": _after_connect,
    "after PRODUCER_SUCCESS": _after_producer,
    "mid SEND stream": _mid_send_stream,
    "mid SEND frame": _mid_send_frame,
    "SUBSCRIBE+FLOW, messages in flight": _messages_in_flight,
}
LEAVINGS = ("reset", "half-close", "close")


# -- the servers under attack ------------------------------------------------------------------
@contextlib.contextmanager
def _embedded_broker(cluster_factory: BrokerClusterFactory) -> Iterator[str]:
    cluster = cluster_factory()
    _fill_topic(cluster.service_url)
    yield cluster.addresses[0]


@contextlib.contextmanager
def _proxy(cluster_factory: BrokerClusterFactory) -> Iterator[str]:
    cluster = cluster_factory()
    _fill_topic(cluster.service_url)
    config = ProxyConfig(upstream=ServiceUrl.parse(cluster.service_url), listen=HostPort("127.0.0.1", 0))
    engine = RulesEngine(load_rules_text(PROXY_RULES, "peer-loss.yaml"))
    proxy = ThreadedProxy(ProxyServer(config, hook=RulesHook(engine))).start()
    try:
        yield str(proxy.address)
    finally:
        proxy.stop()


@contextlib.contextmanager
def _replay_server(cluster_factory: BrokerClusterFactory) -> Iterator[str]:
    del cluster_factory
    book = AnswerBook.from_conversations(build_conversations(open_recordings(SAMPLE).frames()).values())
    with ThreadedReplayServer(book) as server:
        yield server.server.address


def _fill_topic(service_url: str) -> None:
    """Enough messages that a consumer's FLOW keeps the server writing for a while."""
    client = pulsar.Client(service_url, operation_timeout_seconds=10, logger=LOGGER)
    try:
        producer = client.create_producer(TOPIC, batching_enabled=False)
        for i in range(300):
            producer.send_async(b"backlog %d " % i + bytes(2000), None)
        producer.flush()
    finally:
        client.close()


SERVERS = {"embedded broker": _embedded_broker, "proxy": _proxy, "replay --serve": _replay_server}


@pytest.mark.parametrize("server", list(SERVERS))
def test_a_peer_leaving_at_any_step_ends_only_its_own_connection(
        server: str, broker_cluster: BrokerClusterFactory) -> None:
    with SERVERS[server](broker_cluster) as address:
        client = pulsar.Client(f"pulsar://{address}", operation_timeout_seconds=10, logger=LOGGER)
        try:
            # another connection, open all along: it must keep working through every cut
            bystander = client.create_producer(TOPIC, batching_enabled=False, send_timeout_millis=10_000)
            for step, play in STEPS.items():
                for how in LEAVINGS:
                    raw = RawClient(address)
                    try:
                        play(raw)
                    finally:
                        raw.leave(how)
                    try:
                        bystander.send(f"after {how} {step}".encode())
                    except Exception as exc:
                        raise AssertionError(f"{server} stopped serving after a {how} {step}: {exc!r}") from exc
        finally:
            client.close()
        _fresh_official_client_works(address, server)


def _fresh_official_client_works(address: str, server: str) -> None:
    client = pulsar.Client(f"pulsar://{address}", operation_timeout_seconds=10, logger=LOGGER)
    try:
        consumer = client.subscribe(TOPIC, "after-the-cuts" if server != "replay --serve" else SUBSCRIPTION,
                                    consumer_type=pulsar.ConsumerType.Shared,
                                    initial_position=pulsar.InitialPosition.Earliest)
        producer = client.create_producer(TOPIC, batching_enabled=False)
        producer.send(b"the last one")
        assert consumer.receive(timeout_millis=10_000) is not None
    finally:
        client.close()


# -- the built-in client, and the proxy, against a broker that leaves ---------------------------
class RawBroker:
    """A one-broker "cluster" on raw sockets: answers a producer's session and leaves at ``step``.

    Every accepted connection is served in a thread of its own; ``left`` is set once a
    connection reached ``step`` and left by ``how``.  With ``step`` None it never leaves.
    """

    def __init__(self) -> None:
        self.step: str | None = None
        self.how = "reset"
        self.left = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def leave_at(self, step: str | None, how: str = "reset") -> None:
        self.step, self.how = step, how
        self.left = threading.Event()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        raw = RawClient.__new__(RawClient)
        raw.sock, raw.decoder = conn, FrameDecoder(64 << 20)
        step, how, left = self.step, self.how, self.left
        reached = False
        try:
            reached = self._play(raw, step)
        except OSError:
            pass
        finally:
            raw.leave(how if reached else "close")
            if reached:
                left.set()

    def _play(self, raw: RawClient, step: str | None) -> bool:
        """Answer as a broker would until ``step`` (True) or until the client leaves (False)."""
        while True:
            data = raw.sock.recv(1 << 16)
            if not data:
                return False
            for frame in raw.decoder.receive(data):
                answer = self._answer(frame.type, frame.sub)
                if frame.type == T.CONNECT and step == "before CONNECTED":
                    return True
                if frame.type == T.CONNECT and step == "mid CONNECTED frame":
                    raw.send(answer[:5])
                    return True
                if frame.type == T.SEND and step == "mid SEND_RECEIPT frame":
                    raw.send(answer[:-3])
                    return True
                if answer:
                    raw.send(answer)
                if step == f"after {_ANSWER_NAMES.get(frame.type)}":
                    return True

    def _answer(self, kind: int, sub: Any) -> bytes:
        if kind == T.CONNECT:
            return encode_command(api.CommandConnected(server_version="raw", protocol_version=21))
        if kind == T.PARTITIONED_METADATA:
            return encode_command(api.CommandPartitionedTopicMetadataResponse(
                request_id=sub.request_id, partitions=0, response=api.CommandPartitionedTopicMetadataResponse.Success))
        if kind == T.LOOKUP:
            return encode_command(api.CommandLookupTopicResponse(
                request_id=sub.request_id, brokerServiceUrl=f"pulsar://{self.address}", authoritative=True,
                response=api.CommandLookupTopicResponse.Connect))
        if kind == T.PRODUCER:
            return encode_command(api.CommandProducerSuccess(request_id=sub.request_id, producer_name="raw-producer",
                                                             last_sequence_id=-1))
        if kind == T.SEND:
            return encode_command(api.CommandSendReceipt(producer_id=sub.producer_id, sequence_id=sub.sequence_id))
        if kind == T.PING:
            return encode_command(api.CommandPong())
        if kind == T.CLOSE_PRODUCER:
            return encode_command(api.CommandSuccess(request_id=sub.request_id))
        return b""


_ANSWER_NAMES = {T.CONNECT: "CONNECTED", T.LOOKUP: "LOOKUP answer", T.PRODUCER: "PRODUCER_SUCCESS"}
BROKER_STEPS = ("before CONNECTED", "mid CONNECTED frame", "after CONNECTED", "after LOOKUP answer",
                "after PRODUCER_SUCCESS", "mid SEND_RECEIPT frame")


async def _produce_until_the_broker_leaves(url: str, broker: RawBroker) -> None:
    async def produce(client: PulsarClient) -> None:
        with contextlib.suppress(Exception):
            producer = await client.create_producer(TOPIC, batching=False, send_timeout=0.5)
            await producer.send(b"into the void")

    async with PulsarClient(url, operation_timeout=2, connection_timeout=2) as doomed, \
            trio.open_nursery() as nursery:
        nursery.start_soon(produce, doomed)
        assert await trio.to_thread.run_sync(broker.left.wait, 15), f"the client never reached {broker.step}"
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


async def _produce(url: str, count: int) -> None:
    async with PulsarClient(url, operation_timeout=5) as client:
        producer = await client.create_producer(TOPIC, batching=False)
        for i in range(count):
            await producer.send(b"message %d" % i)


async def test_the_built_in_client_survives_a_broker_leaving_at_any_step(
        broker_cluster: BrokerClusterFactory) -> None:
    cluster: ThreadedCluster = await trio.to_thread.run_sync(broker_cluster)
    broker = RawBroker()
    try:
        async with PulsarClient(cluster.service_url, operation_timeout=5) as healthy:
            bystander = await healthy.create_producer(TOPIC, batching=False)
            for step in BROKER_STEPS:
                for how in LEAVINGS:
                    broker.leave_at(step, how)
                    with trio.fail_after(30):
                        await _produce_until_the_broker_leaves(f"pulsar://{broker.address}", broker)
                    # the client that lost its broker ended cleanly; the other one never noticed
                    await bystander.send(f"after {how} {step}".encode())
    finally:
        broker.close()


def test_the_proxy_survives_a_broker_leaving_at_any_step() -> None:
    broker = RawBroker()
    config = ProxyConfig(upstream=ServiceUrl.parse(f"pulsar://{broker.address}"), listen=HostPort("127.0.0.1", 0))
    proxy = ThreadedProxy(ProxyServer(config)).start()
    try:
        url = f"pulsar://{proxy.address}"
        for step in BROKER_STEPS:
            for how in LEAVINGS:
                broker.leave_at(step, how)
                trio.run(_produce_until_the_broker_leaves, url, broker)
        broker.leave_at(None)
        trio.run(_produce, url, 20)  # the proxy still relays whole sessions
    finally:
        proxy.stop()  # raises whatever the proxy failed with
        broker.close()


def test_ctrl_c_on_perf_leaves_the_broker_serving(tmp_path: Path) -> None:
    """Ctrl-C on ``perf`` connected straight to ``pulsar-tap broker`` ends perf, never the broker."""
    ready_file = tmp_path / "ready.json"
    command = [sys.executable, "-m", "proxy"]
    broker = subprocess.Popen([*command, "broker", "--listen", "127.0.0.1:0", "--ready-file", str(ready_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (ready_file.exists() and ready_file.read_text().endswith("\n")):
            assert broker.poll() is None and time.monotonic() < deadline, "the broker did not start"
            time.sleep(0.05)
        [address] = json.loads(ready_file.read_text())["listen"]
        for mode in ("produce", "roundtrip"):
            perf = subprocess.Popen([*command, "perf", mode, "--url", f"pulsar://{address}", "--topic", TOPIC,
                                     "--subscription", "perf", "--duration", "30"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # producers and consumers are mid-stream
            perf.send_signal(signal.SIGINT)
            perf.wait(timeout=30)
            assert broker.poll() is None, broker.communicate()[1]
        _fresh_official_client_works(address, "embedded broker")
    finally:
        broker.send_signal(signal.SIGTERM)
        _, err = broker.communicate(timeout=20)
    assert broker.returncode == 0 and "Traceback" not in err, err
