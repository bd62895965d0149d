"""The relay on real loopback sockets, against a scripted broker: bytes, limits, hostile clients.

Its timers (keepalive, held frames, draining) are tested on memory streams and Trio's virtual
clock in ``test_relay_timing.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct

import pytest
import structlog
import trio
import trio.testing
from proxy_fake_broker import CONNECT, FakeBroker, handshake, receive_frames, send_frame

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import Direction
from proxy.rules.engine import RulesEngine
from proxy.rules.hook import RulesHook
from proxy.rules.loader import load_rules_text
from proxy.server.app import ProxyServer

T = api.BaseCommand.Type


async def start(nursery: trio.Nursery, broker: FakeBroker, reactor: bool = True, **limits: object) -> ProxyServer:
    await nursery.start(broker.serve)
    config = ProxyConfig(upstream=ServiceUrl.parse(broker.url), listen=HostPort("127.0.0.1", 0),
                         limits=LimitsConfig(**{"drain_seconds": 0.5, **limits}))  # type: ignore[arg-type]
    server: ProxyServer = await nursery.start(ProxyServer(config, reactor=reactor).run)
    return server


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_frames_cross_byte_for_byte_in_both_directions(nursery: trio.Nursery, reactor: bool) -> None:
    broker = FakeBroker()
    server = await start(nursery, broker, reactor)
    with trio.fail_after(10):
        stream, decoder = await handshake(server.main_address.port)
        frames = b"".join(send_frame(i, size) for i, size in enumerate([0, 1, 100, 1024, 70_000, 600_000] * 3))
        # Odd-sized writes: frames are cut everywhere, including inside headers.
        for start_at in range(0, len(frames), 777):
            await stream.send_all(frames[start_at:start_at + 777])
        receipts = await receive_frames(stream, decoder, 18)
        assert [f.command.send_receipt.sequence_id for f in receipts] == list(range(18))
        assert bytes(broker.received) == CONNECT + frames
        await stream.aclose()


async def hostile_client_is_dropped_alone(server: ProxyServer, attack: bytes, close_after: bool = False) -> None:
    good, decoder = await handshake(server.main_address.port)
    bad = await trio.open_tcp_stream("127.0.0.1", server.main_address.port)
    await bad.send_all(CONNECT)
    await receive_frames(bad, FrameDecoder(), 1)
    await bad.send_all(attack)
    if close_after:
        await bad.aclose()
    else:
        # the proxy closes the hostile connection: EOF, or a reset
        with contextlib.suppress(trio.BrokenResourceError):
            while await bad.receive_some(1024):
                pass
    await bad.aclose()
    for seq in range(20):
        await good.send_all(send_frame(seq, 10))
        [receipt] = await receive_frames(good, decoder, 1)
        assert receipt.command.send_receipt.sequence_id == seq
    await good.aclose()


@pytest.mark.parametrize(("attack", "close_after"), [
    (b"\xde\xad\xbe\xef" * 64, False),                                   # garbage
    ((6 * 1024 * 1024).to_bytes(4, "big") + b"\x00" * 100, False),       # a frame over the limit
    (send_frame(1, 5000)[:2500], True),                                  # disconnect mid-frame
    (encode_command(api.CommandPing())[:8] + b"\x08\x7f\x00\x00\x00", False),  # unknown command type
], ids=["garbage", "oversized", "mid-frame-disconnect", "unknown-command"])
@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_hostile_client_is_dropped_and_others_are_unaffected(nursery: trio.Nursery, attack: bytes,
                                                                     close_after: bool, reactor: bool) -> None:
    server = await start(nursery, FakeBroker(), reactor)
    with trio.fail_after(10):
        await hostile_client_is_dropped_alone(server, attack, close_after)


async def test_connections_beyond_max_connections_are_refused(nursery: trio.Nursery) -> None:
    server = await start(nursery, FakeBroker(), max_connections=2)
    with trio.fail_after(10):
        first, _ = await handshake(server.main_address.port)
        second, _ = await handshake(server.main_address.port)
        extra = await trio.open_tcp_stream("127.0.0.1", server.main_address.port)
        with contextlib.suppress(trio.BrokenResourceError):  # closed at once: EOF or reset
            assert await extra.receive_some(10) == b""
        await extra.aclose()
        assert server.refused_connections == 1
        await first.send_all(send_frame(0, 10))
        await second.aclose()
        while server.active_connections > 1:  # noqa: ASYNC110 - the server notices the close in its own time
            await trio.sleep(0.01)
        third, _ = await handshake(server.main_address.port)  # room again
        await third.aclose()
        await first.aclose()


async def test_a_slow_reader_applies_backpressure_instead_of_buffering(nursery: trio.Nursery) -> None:
    broker = FakeBroker(read_after_handshake=False)
    server = await start(nursery, broker)
    stream, _ = await handshake(server.main_address.port)
    chunk = send_frame(0, 60_000) * 16
    written = 0
    with trio.move_on_after(1.5):
        while True:
            await stream.send_all(chunk)
            written += len(chunk)
    # Kernel socket buffers on both hops plus one receive buffer in the proxy, not more.
    assert written < 64 * 1024 * 1024
    relay = next(iter(server.relays))
    assert relay.pipeline.scanners[Direction.TO_BROKER].buffered < 1024
    await stream.aclose()


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_thousand_idle_connections_keep_memory_bounded(nursery: trio.Nursery) -> None:
    broker = FakeBroker()
    server = await start(nursery, broker)
    socks: list[socket.socket] = []
    with trio.fail_after(30):
        await trio.sleep(0.1)
        before = rss_bytes()
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", server.main_address.port))
            sock.sendall(CONNECT)
            socks.append(sock)
            if len(socks) % 100 == 0:
                await trio.sleep(0.01)
        while broker.open_connections < 1000:  # noqa: ASYNC110 - polling a counter of another task
            await trio.sleep(0.05)
        grown = rss_bytes() - before
        assert server.active_connections == 1000
    for sock in socks:
        sock.close()
    # proxy relays + pipelines + 1000 fake-broker handlers live in this process
    print(f"{grown / 1000:.0f} bytes per idle connection")
    assert grown / 1000 < 96 * 1024, f"{grown / 1000:.0f} bytes per connection"


async def test_shutdown_lets_in_flight_answers_drain(nursery: trio.Nursery) -> None:
    broker = FakeBroker(receipt_delay=0.3)
    server = await start(nursery, broker, drain_seconds=3)
    with trio.fail_after(10):
        stream, decoder = await handshake(server.main_address.port)
        await stream.send_all(send_frame(5, 10))
        while not any(frame.type == T.SEND for frame in broker.frames):  # noqa: ASYNC110 - in flight now
            await trio.sleep(0.01)
        server.request_shutdown()
        [receipt] = await receive_frames(stream, decoder, 1)
        assert receipt.command.send_receipt.sequence_id == 5
        await stream.aclose()
        with pytest.raises(OSError):  # no longer accepting
            await trio.open_tcp_stream("127.0.0.1", server.main_address.port)


def test_pulsar_tap_run_prints_ready_and_exits_0_on_sigterm(tmp_path: object) -> None:
    """The CLI as users run it: ready line, ready file, clean exit on SIGTERM."""
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    ready_file = Path(str(tmp_path)) / "ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "run", "--listen", "127.0.0.1:0", "--upstream", "pulsar://127.0.0.1:1",
         "--ready-file", str(ready_file), "--drain-seconds", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("ready: listening on 127.0.0.1:")
        address = line.split()[-1]
        assert json.loads(ready_file.read_text()) == {"listen": [address], "admin": None}
        # an unreachable upstream closes that client alone; the proxy keeps running
        host, port = address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as client:
            client.sendall(CONNECT)
            assert client.recv(100) == b""
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def test_pulsar_tap_run_on_a_busy_port_prints_one_error_line() -> None:
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "proxy", "run", "--listen", f"127.0.0.1:{port}",
                                 "--upstream", "pulsar://127.0.0.1:6650"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == f"pulsar-tap run: error: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_fast_writer_that_closes_gets_every_byte_through(nursery: trio.Nursery, reactor: bool) -> None:
    """Large frames in large writes, then EOF: nothing may be left behind in a socket buffer."""
    broker = FakeBroker()
    server = await start(nursery, broker, reactor)
    with trio.fail_after(20):
        stream, _ = await handshake(server.main_address.port)
        block = send_frame(1, 512 * 1024 - 60) * 2
        for _ in range(40):
            await stream.send_all(block)
        await stream.send_eof()
        while broker.open_connections:  # noqa: ASYNC110 - polling a counter of another task
            await trio.sleep(0.02)
        assert len(broker.received) == len(CONNECT) + 40 * len(block)
        await stream.aclose()


async def test_proxy_through_follows_redirects_and_gives_up_after_ten_hops(nursery: trio.Nursery) -> None:
    """A broker that redirects ``loop-*`` topics to itself forever, and answers others after one hop."""
    broker = FakeBroker()

    def answer(frame: Frame) -> bytes:
        lookup = frame.command.lookupTopic
        done = lookup.topic.startswith("one-hop") and lookup.authoritative
        return encode_command(api.CommandLookupTopicResponse(
            request_id=lookup.request_id, brokerServiceUrl=broker.url, authoritative=True,
            response=api.CommandLookupTopicResponse.Connect if done else api.CommandLookupTopicResponse.Redirect))

    broker.lookup_answer = answer
    await nursery.start(broker.serve)
    config = ProxyConfig(upstream=ServiceUrl.parse(broker.url), listen=HostPort("127.0.0.1", 0), lookup="proxy-through")
    server: ProxyServer = await nursery.start(ProxyServer(config).run)
    with trio.fail_after(10):
        stream, decoder = await handshake(server.main_address.port)
        await stream.send_all(encode_command(api.CommandLookupTopic(topic="loop-a", request_id=7)) +
                              encode_command(api.CommandLookupTopic(topic="one-hop-b", request_id=8)))
        answers = {f.command.lookupTopicResponse.request_id: f.command.lookupTopicResponse
                   for f in await receive_frames(stream, decoder, 2)}
    assert answers[8].response == api.CommandLookupTopicResponse.Connect and answers[8].proxy_through_service_url
    assert answers[7].response == api.CommandLookupTopicResponse.Failed
    assert (answers[7].error, answers[7].message) == (api.ServerError.ServiceNotReady,
                                                       "Reached max number of redirections")
    lookups = [f.command.lookupTopic for f in broker.frames if f.type == T.LOOKUP]
    loop = [lookup for lookup in lookups if lookup.topic == "loop-a"]
    assert len(loop) == 1 + 10  # the client's, then ten hops
    assert not loop[0].authoritative and all(hop.authoritative for hop in loop[1:])  # as the Redirects said
    await stream.aclose()


def _closing_reasons(logs: list[dict[str, object]]) -> list[object]:
    return [entry["reason"] for entry in logs if entry.get("event") == "connection closed"]


async def _logged_closing_reasons(logs: list[dict[str, object]]) -> list[object]:
    """The reasons logged for closed connections, once there is one (the log line ends the relay)."""
    for _ in range(1000):
        if _closing_reasons(logs):
            break
        await trio.sleep(0.01)
    return _closing_reasons(logs)


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_client_that_closes_after_connected_is_logged_as_the_client_closing(
        nursery: trio.Nursery, reactor: bool) -> None:
    broker = FakeBroker()
    server = await start(nursery, broker, reactor)
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream, _ = await handshake(server.main_address.port)
        await stream.aclose()  # the client's FIN; the broker answers with its own
        assert await _logged_closing_reasons(logs) == ["client closed the connection"]


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_broker_that_closes_is_logged_as_the_broker_closing(nursery: trio.Nursery, reactor: bool) -> None:
    broker = FakeBroker(close_after_handshake=True)
    server = await start(nursery, broker, reactor)
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream, _ = await handshake(server.main_address.port)
        assert await stream.receive_some(1024) == b""  # the broker's FIN, passed on
        await stream.aclose()
        assert await _logged_closing_reasons(logs) == ["broker closed the connection"]


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_broker_that_closes_after_an_error_is_logged_with_it_with_nobody_watching(
        nursery: trio.Nursery, reactor: bool) -> None:
    """An ERROR after the handshake is named too, on a plain proxy (no rules, no observers: it decodes no
    other frame), and the client gets it as the broker sent it."""
    error = api.CommandError(request_id=7, error=api.ServerError.ServiceNotReady, message="Namespace is being unloaded")
    broker = FakeBroker(close_after_handshake=True, error_after_handshake=error)
    server = await start(nursery, broker, reactor)
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", server.main_address.port)
        await stream.send_all(CONNECT)
        [_, got] = await receive_frames(stream, FrameDecoder(), 2)
        assert got.raw == encode_command(error)
        assert await stream.receive_some(1024) == b""
        await stream.aclose()
        assert await _logged_closing_reasons(logs) == [
            "broker closed the connection after ERROR ServiceNotReady: Namespace is being unloaded"]


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_broker_that_refuses_the_connect_is_logged_with_its_error(nursery: trio.Nursery,
                                                                         reactor: bool) -> None:
    """The closing line names the broker's last ERROR, on one line, its message cut short."""
    message = "Failed to authenticate:\n  " + "x" * 1000
    broker = FakeBroker(refuse_connect=api.CommandError(request_id=0, error=api.ServerError.AuthenticationError,
                                                        message=message))
    server = await start(nursery, broker, reactor)
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", server.main_address.port)
        await stream.send_all(CONNECT)
        [error] = await receive_frames(stream, FrameDecoder(), 1)
        assert error.command.error.message == message  # the client gets the broker's ERROR as it was
        assert await stream.receive_some(1024) == b""  # then the broker's FIN, passed on
        await stream.aclose()
        [reason] = await _logged_closing_reasons(logs)
    assert reason == "broker closed the connection after ERROR AuthenticationError: Failed to authenticate: " \
                     + "x" * (300 - len("Failed to authenticate: ")) + "..."


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_broker_that_resets_what_it_refused_is_logged_with_its_error(nursery: trio.Nursery,
                                                                             reactor: bool) -> None:
    """A broker that resets the connection after its ERROR (not a FIN): the line says the connection was lost
    and names the ERROR that came before, which says why."""
    broker = FakeBroker(refuse_connect=api.CommandError(request_id=0, error=api.ServerError.AuthenticationError,
                                                        message="Failed to authenticate"), reset_after_refusal=0.2)
    server = await start(nursery, broker, reactor)
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", server.main_address.port)
        await stream.send_all(CONNECT)
        [error] = await receive_frames(stream, FrameDecoder(), 1)
        assert error.command.error.error == api.ServerError.AuthenticationError
        [reason] = await _logged_closing_reasons(logs)
        await stream.aclose()
    assert isinstance(reason, str) and reason.startswith("broker connection lost: "), reason
    assert reason.endswith(" (after ERROR AuthenticationError: Failed to authenticate)"), reason


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_a_write_to_a_client_gone_with_a_reset_is_logged_as_the_client_lost(
        nursery: trio.Nursery, reactor: bool) -> None:
    # the client half-closes with a SEND in flight, then resets; its receipt, passed on late,
    # finds the client gone: that is the client's connection lost, not the broker's
    broker = FakeBroker(receipt_delay=0.3)
    server = await start(nursery, broker, reactor)
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream, _ = await handshake(server.main_address.port)
        await stream.send_all(send_frame(0, 10))
        await stream.send_eof()
        await trio.sleep(0.05)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # a reset: the proxy's next write to it fails
        [reason] = await _logged_closing_reasons(logs)
        assert isinstance(reason, str) and reason.startswith("client connection lost: send to "), reason


@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_frames_the_session_table_refuses_pass_unchanged_and_the_closing_line_counts_them(
        nursery: trio.Nursery, reactor: bool) -> None:
    broker = FakeBroker()
    server = await start(nursery, broker, reactor)
    message = encode_payload_command(api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(ledgerId=1,
                                                                                                    entryId=2)),
                                     api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1), b"m")
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream, decoder = await handshake(server.main_address.port)
        await stream.send_all(message + send_frame(0, 10))  # a MESSAGE is the broker's to send
        [receipt] = await receive_frames(stream, decoder, 1)
        assert receipt.command.send_receipt.sequence_id == 0
        assert bytes(broker.received) == CONNECT + message + send_frame(0, 10)
        await stream.aclose()
        assert await _logged_closing_reasons(logs) == ["client closed the connection"]
    [closed] = [entry for entry in logs if entry.get("event") == "connection closed"]
    assert closed["protocol_violations"] == 1


def _spoilt_send(seq: int) -> bytes:
    """A SEND whose header and payload section pass the scan's quick look but whose command lacks
    its required sequence_id (its tag made field 15's): caught only when the read's commands are
    parsed together, after the frames before and after it were scanned."""
    frame = bytearray(send_frame(seq, 10))
    assert frame[14] == 0x10  # sequence_id's tag, after size, cmd size, 08 06 32 LEN and producer_id's 08 01
    frame[14] = 0x78
    return bytes(frame)


@pytest.mark.parametrize("bad", ["garbage", "spoilt-command"])
@pytest.mark.parametrize("at", [0, 1, 300, 599])
@pytest.mark.parametrize("reactor", [True, False], ids=["reactor", "task-per-direction"])
async def test_the_frames_before_a_bad_one_in_the_same_write_reach_the_broker(
        nursery: trio.Nursery, bad: str, at: int, reactor: bool) -> None:
    """As a broker reading frame by frame would, the proxy passes on every whole frame before the
    bad one (not a byte of it or after it), then closes the connection with one warning."""
    broker = FakeBroker()
    server = await start(nursery, broker, reactor)
    sends = [send_frame(seq, 10) for seq in range(600)]
    spoilt = b"\xde\xad\xbe\xef" * 4 if bad == "garbage" else _spoilt_send(at)
    with structlog.testing.capture_logs() as logs, trio.fail_after(10):
        stream, decoder = await handshake(server.main_address.port)
        await stream.send_all(b"".join(sends[:at]) + spoilt + b"".join(sends[at:]))
        receipts = []
        with contextlib.suppress(trio.BrokenResourceError):
            while data := await stream.receive_some(1 << 16):  # until the proxy closes
                receipts += [frame.command.send_receipt.sequence_id for frame in decoder.receive(data)]
        await stream.aclose()
        await trio.testing.wait_all_tasks_blocked(0.05)  # the broker has read all it will get
    assert bytes(broker.received) == CONNECT + b"".join(sends[:at])
    assert receipts == list(range(len(receipts))) and len(receipts) <= at  # (those the broker answered in time)
    [dropped] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert dropped["event"] == "dropped hostile client" and " broke the protocol: " in str(dropped["reason"])


def test_a_throttle_removed_after_the_proxy_stopped_is_removed_without_an_error() -> None:
    """The engine outlives the proxy's run (a threaded proxy stopped, its rules still reachable): removing a
    throttle that holds FLOW permits then has no relay to wake, and must not fail for it."""
    engine = RulesEngine(load_rules_text(
        "rules:\n  - name: slow\n    match: {command: [FLOW]}\n    action: {throttle: {messages_per_second: 1}}\n"))

    async def serve_then_stop() -> None:
        async with trio.open_nursery() as nursery:
            broker = FakeBroker()
            await nursery.start(broker.serve)
            config = ProxyConfig(upstream=ServiceUrl.parse(broker.url), listen=HostPort("127.0.0.1", 0))
            await nursery.start(ProxyServer(config, hook=RulesHook(engine)).run)
            nursery.cancel_scope.cancel()

    trio.run(serve_then_stop)
    flow = frame_from_bytes(encode_command(api.CommandFlow(consumer_id=1, messagePermits=100)))
    verdict = engine.evaluate(flow, Direction.TO_BROKER, 0, conn_id=1)
    assert verdict.deferred  # permits held back, waiting in the throttle
    assert engine.remove("slow")
