"""A slow reader behind a stream of delayed frames gets every byte, in order (found by the i17 audit).

A ``delay`` rule holds some of the broker's frames in the direction's stream lane; a
client that reads slowly makes the proxy's writes to it wait.  The release of held
frames and the relay's own writes of newer bytes then compete for the client's
socket, and neither may slip its bytes between the other's: the client must read
exactly the bytes the broker wrote.  (The audit saw 512 KiB of a later read land in
the middle of the stream: the release task wrote its due entries one ``send`` at a
time, and between two of them the write lock went to the relay's newer bytes.)
"""

from __future__ import annotations

import ssl

import pytest
import trio

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_command, encode_payload_command
from proxy.rules.engine import RulesEngine
from proxy.rules.hook import RulesHook
from proxy.rules.loader import load_rules_text
from proxy.server.app import ProxyServer

T = api.BaseCommand.Type

DELAY_SOME_MESSAGES = """
seed: 4
rules:
  - name: slow-messages
    match: {command: [MESSAGE], probability: 0.5}
    action: {delay: {ms: 1}}
"""


def message_frame(entry: int, size: int) -> bytes:
    """A MESSAGE whose payload says which it is in every byte (a misplaced piece shows)."""
    return encode_payload_command(
        api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(ledgerId=1, entryId=entry)),
        api.MessageMetadata(producer_name="p", sequence_id=entry, publish_time=1), bytes([entry % 251]) * size)


class StreamingBroker:
    """Answers CONNECT, then writes ``frames`` MESSAGEs as fast as the proxy takes them; keeps what it wrote."""

    def __init__(self, frames: int, size: int) -> None:
        self.frames = frames
        self.size = size
        self.sent = bytearray()
        self.done = False
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.SocketStream) -> None:
        decoder = FrameDecoder(1 << 20)
        while not any(frame.type == T.CONNECT for frame in decoder.receive(await stream.receive_some(1 << 16))):
            pass
        connected = encode_command(api.CommandConnected(server_version="streaming", protocol_version=21))
        self.sent += connected
        await stream.send_all(connected)
        for entry in range(self.frames):
            frame = message_frame(entry, self.size)
            self.sent += frame
            await stream.send_all(frame)
        self.done = True
        await trio.sleep_forever()


#: the ways the proxy relays: its reactor, a task per direction, and a client over TLS (written by tasks only)
PATHS = pytest.mark.parametrize("path", ["reactor", "task-per-direction", "tls"])


async def slow_client_through_proxy(nursery: trio.Nursery, broker: StreamingBroker, rules: str, path: str,
                                    request: pytest.FixtureRequest) -> tuple[ProxyServer, trio.abc.Stream]:
    """The broker, a proxy with ``rules`` in front of it, and a client with a small receive buffer, connected
    (over TLS on the ``tls`` path)."""
    await nursery.start(broker.serve)
    tls = request.getfixturevalue("tls_material") if path == "tls" else None
    config = ProxyConfig(upstream=ServiceUrl.parse(f"pulsar://127.0.0.1:{broker.port}"),
                         listen=HostPort("127.0.0.1", 0), limits=LimitsConfig(drain_seconds=0.5),
                         **({"tls": tls.server_tls()} if tls is not None else {}))
    hook = RulesHook(RulesEngine(load_rules_text(rules, "rules.yaml")))
    server: ProxyServer = await nursery.start(ProxyServer(config, hook=hook, reactor=path != "task-per-direction").run)
    tcp = await trio.open_tcp_stream("127.0.0.1", server.main_address.port)
    tcp.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 32 * 1024)
    client: trio.abc.Stream = tcp
    if tls is not None:
        client = trio.SSLStream(tcp, ssl.create_default_context(cafile=tls.ca_file), server_hostname="localhost")
    await client.send_all(encode_command(api.CommandConnect(client_version="slow", protocol_version=21)))
    return server, client


@PATHS
async def test_a_slow_reader_behind_delayed_frames_reads_exactly_what_the_broker_wrote(
        nursery: trio.Nursery, path: str, request: pytest.FixtureRequest) -> None:
    broker = StreamingBroker(frames=160, size=200_000)
    server, client = await slow_client_through_proxy(nursery, broker, DELAY_SOME_MESSAGES, path, request)
    received = bytearray()
    with trio.fail_after(30):
        while not server.relays:  # noqa: ASYNC110 - the proxy accepts in its own time
            await trio.sleep(0.001)
        # a small hold queue fills and empties often: the release and the relay's newer bytes meet
        next(iter(server.relays)).pipeline.held.byte_limit = 1 << 20
        while not broker.done or len(received) < len(broker.sent):
            received += await client.receive_some(64 * 1024)
            if len(received) % 7 == 0:
                await trio.sleep(0.0005)  # a reader slower than the broker
        await client.aclose()
    assert len(received) == len(broker.sent)
    first_difference = next((at for at in range(0, len(received), 4096)
                             if received[at:at + 4096] != broker.sent[at:at + 4096]), None)
    assert first_difference is None, f"the stream differs from byte {first_difference} on"


ANSWER_EVERY_SEND = """
rules:
  - name: refuse-sends
    match: {command: [SEND]}
    action: {error: {code: PersistenceError}}
"""


@PATHS
async def test_answers_the_proxy_gives_a_slow_reader_land_between_the_brokers_frames(
        nursery: trio.Nursery, path: str, request: pytest.FixtureRequest) -> None:
    """The client sends while the broker's stream backs up: the SEND_ERRORs the proxy answers with
    go between whole frames of that stream, never inside one written in part."""
    broker = StreamingBroker(frames=160, size=200_000)
    _, client = await slow_client_through_proxy(nursery, broker, ANSWER_EVERY_SEND, path, request)
    decoder = FrameDecoder(1 << 20)
    messages: list[bytes] = []
    refused = sends = 0
    with trio.fail_after(30):
        while len(messages) < broker.frames or refused < sends:
            if sends < 2000:
                await client.send_all(encode_payload_command(
                    api.CommandSend(producer_id=1, sequence_id=sends),
                    api.MessageMetadata(producer_name="p", sequence_id=sends, publish_time=1), b"x"))
                sends += 1
            for frame in decoder.receive(await client.receive_some(64 * 1024)):  # raises on a torn frame
                if frame.type == T.MESSAGE:
                    messages.append(frame.raw)
                elif frame.type == T.SEND_ERROR:
                    refused += 1
        await client.aclose()
    assert b"".join(messages) == broker.sent[len(broker.sent) - sum(map(len, messages)):]
