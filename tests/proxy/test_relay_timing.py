"""The relay's timers on Trio's virtual clock: keepalive, delayed and throttled frames, draining.

Each test runs one :class:`~proxy.server.relay.Relay` between two memory stream pairs
(the client's and the scripted broker's ends; ``ProxyServer.connect_upstream`` hands
the relay the broker's) under ``autojump_clock``: no test waits in real time, and
every time asserted is exact to the tick the relay's own timers use, so a test cannot
pass by a lucky schedule or fail on a busy machine.  The relay serves these
directions in their tasks (the reactor takes plain sockets only); the reactor path is
covered on loopback sockets in ``test_proxy_relay.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
import trio
import trio.testing
from proxy_fake_broker import CONNECT, FakeBroker, receive_frames, send_frame

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.core.hooks import FrameHook
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, encode_command
from proxy.server.app import ProxyServer
from proxy.server.relay import Relay
from proxy.server.transport import StreamTransport, Transport
from proxy.testing.rig import rules_hook

T = api.BaseCommand.Type
#: where the relay's broker "is": never resolved, ``connect_upstream`` hands over a memory stream
BROKER_URL = "pulsar://broker.test:6650"


@contextlib.asynccontextmanager
async def memory_relay(broker: FakeBroker, *, hook: FrameHook | None = None,
                       broker_ends: list[trio.StapledStream[Any, Any]] | None = None,
                       **limits: Any) -> AsyncIterator[tuple[trio.StapledStream[Any, Any], Relay]]:
    """A relay between the test (the client end it yields) and ``broker``, over memory streams
    (``broker_ends`` gets the broker's end of each upstream connection)."""
    config = ProxyConfig(upstream=ServiceUrl.parse(BROKER_URL), listen=HostPort("127.0.0.1", 0),
                         limits=LimitsConfig(**limits))
    async with trio.open_nursery() as nursery:
        async def connect_upstream(url: ServiceUrl) -> Transport:
            proxy_end, broker_end = trio.testing.memory_stream_pair()
            if broker_ends is not None:
                broker_ends.append(broker_end)
            nursery.start_soon(broker.handle, broker_end)
            return StreamTransport(proxy_end, str(url.address))

        server = ProxyServer(config, hook=hook, reactor=False, connect_upstream=connect_upstream)
        await nursery.start(server.keepalive.run)  # (the server's own runs in ``server.run``)
        client_end, proxy_end = trio.testing.memory_stream_pair()
        relay = server.new_relay(StreamTransport(proxy_end, "client.test:50000"), "client.test:50000",
                                 config.upstream, "main")
        nursery.start_soon(relay.run)
        yield client_end, relay
        nursery.cancel_scope.cancel()


async def connected(client: trio.abc.Stream) -> FrameDecoder:
    decoder = FrameDecoder(64 * 1024 * 1024)
    await client.send_all(CONNECT)
    [answer] = await receive_frames(client, decoder, 1)
    assert answer.type == T.CONNECTED
    return decoder


async def receipts_with_times(client: trio.abc.Stream, decoder: FrameDecoder, count: int,
                              start: float) -> list[tuple[int, float]]:
    """(sequence id, seconds after ``start``) of the next ``count`` SEND_RECEIPTs, as they arrive."""
    arrived: list[tuple[int, float]] = []
    while len(arrived) < count:
        for frame in await receive_frames(client, decoder, 1):
            assert frame.type == T.SEND_RECEIPT
            arrived.append((frame.command.send_receipt.sequence_id, trio.current_time() - start))
    return arrived


def frames_of(broker: FakeBroker, kind: int) -> list[Frame]:
    return [frame for frame in broker.frames if frame.type == kind]


async def test_a_broker_that_stops_answering_pings_is_declared_dead_after_two_keepalive_intervals(
        autojump_clock: trio.testing.MockClock) -> None:
    """Silent for one interval: the proxy PINGs it (once); no PONG by the second: both sides closed."""
    broker = FakeBroker(answer_pings=False)
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        async with memory_relay(broker, keepalive_seconds=0.2) as (client, _relay):
            decoder = await connected(client)
            start = trio.current_time()
            pinged: list[float] = []
            while data := await client.receive_some(1 << 16):  # the client answers the proxy's PINGs
                for frame in decoder.receive(data):
                    assert frame.type == T.PING
                    pinged.append(trio.current_time() - start)
                    await client.send_all(encode_command(api.CommandPong()))
            closed_at = trio.current_time() - start
            await trio.testing.wait_all_tasks_blocked()
            # the relay's timer ticks every keepalive/4: the limit is passed by at most one tick
            assert 0.4 <= closed_at <= 0.45 + 1e-6
            assert pinged and all(0.2 <= at <= 0.25 + 1e-6 for at in pinged[:1])
            assert len(frames_of(broker, T.PING)) == 1
            assert broker.open_connections == 0
    [reason] = [entry["reason"] for entry in logs if entry.get("event") == "connection closed"]
    assert reason.startswith("broker silent for ") and reason.endswith("and no PONG: peer is dead")


async def test_a_client_that_never_sends_connect_is_closed_after_two_keepalive_intervals(
        autojump_clock: trio.testing.MockClock) -> None:
    broker = FakeBroker()
    with trio.fail_after(60):
        async with memory_relay(broker, keepalive_seconds=0.2) as (client, _relay):
            start = trio.current_time()
            assert await client.receive_some(1024) == b""
            assert 0.4 < trio.current_time() - start <= 0.45 + 1e-6
            assert broker.connections == 0  # no upstream was ever opened


@pytest.mark.parametrize("gone", ["client", "broker"])
async def test_a_write_to_a_peer_gone_over_a_stream_transport_is_logged_as_that_peers_connection_lost(
        autojump_clock: trio.testing.MockClock, gone: str) -> None:
    """A TLS connection is a StreamTransport: a write that finds its peer gone names that peer, as a socket's
    does — the client when its receipt cannot be delivered, the broker when a SEND cannot."""
    broker = FakeBroker(receipt_delay=0.3)
    broker_ends: list[trio.StapledStream[Any, Any]] = []
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        async with memory_relay(broker, broker_ends=broker_ends) as (client, _relay):
            await connected(client)
            # the peer stops reading: its side's next write from the proxy fails, its own reads go on
            await (client if gone == "client" else broker_ends[0]).receive_stream.aclose()
            await client.send_all(send_frame(0, 10))
            await trio.sleep(5)  # (virtual time: the receipt's 0.3 s delay and the connection's end long past)
    [reason] = [entry["reason"] for entry in logs if entry.get("event") == "connection closed"]
    written = "client.test:50000" if gone == "client" else "broker.test:6650"
    assert reason.startswith(f"{gone} connection lost: send to {written} failed"), reason


async def receipts_under_rule(rule: str, writes: list[bytes], gap_s: float) -> list[tuple[int, float]]:
    """Send ``writes`` ``gap_s`` apart through a relay with ``rule``; receipts with their arrival times."""
    hook = rules_hook(f"rules:\n  - {rule}\n")
    with trio.fail_after(60):
        async with memory_relay(FakeBroker(), hook=hook) as (client, _relay):
            decoder = await connected(client)
            start = trio.current_time()
            for data in writes:
                await client.send_all(data)
                await trio.sleep(gap_s)
            count = sum(len(list(FrameDecoder().receive(data))) for data in writes)
            return await receipts_with_times(client, decoder, count, start)


async def test_delayed_frames_are_each_held_for_their_own_delay_side_by_side(
        autojump_clock: trio.testing.MockClock) -> None:
    """SPEC 'delay': each frame is delayed by its own amount from its arrival, not after the one before."""
    arrived = await receipts_under_rule(  # 50 ms apart: all three are held at once
        "{name: slow-receipts, match: {command: [SEND_RECEIPT]}, action: {delay: {ms: 200}}}",
        [send_frame(seq, 10) for seq in range(3)], 0.05)
    assert [seq for seq, _ in arrived] == [0, 1, 2]
    assert [at for _, at in arrived] == pytest.approx([0.2, 0.25, 0.3], abs=1e-6)


async def test_a_throttle_paces_a_burst_to_its_rate_and_keeps_the_order(
        autojump_clock: trio.testing.MockClock) -> None:
    arrived = await receipts_under_rule(  # five SENDs in one write
        "{name: ten-per-second, match: {command: [SEND]}, action: {throttle: {messages_per_second: 10}}}",
        [b"".join(send_frame(seq, 10) for seq in range(5))], 0)
    assert [seq for seq, _ in arrived] == [0, 1, 2, 3, 4]
    # burst 1 (smooth pacing): the first at once, then one every 100 ms
    assert [at for _, at in arrived] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4], abs=1e-6)


async def test_while_draining_the_brokers_late_answer_still_reaches_the_client(
        autojump_clock: trio.testing.MockClock) -> None:
    broker = FakeBroker(receipt_delay=0.3)
    with trio.fail_after(60):
        async with memory_relay(broker, drain_seconds=3) as (client, relay):
            decoder = await connected(client)
            start = trio.current_time()
            await client.send_all(send_frame(5, 10))
            await trio.testing.wait_all_tasks_blocked()
            assert [f.command.send.sequence_id for f in frames_of(broker, T.SEND)] == [5]
            relay.begin_drain()
            assert await receipts_with_times(client, decoder, 1, start) == [(5, pytest.approx(0.3, abs=1e-6))]


async def test_a_throttled_frame_released_behind_a_delay_while_the_hold_queue_is_full_does_not_stall(
        autojump_clock: trio.testing.MockClock) -> None:
    """The release task moves a throttled SEND behind a delayed PING in the stream lane while the queue
    is at its bound: it must not wait for room that only it can make (it used to: nothing left again)."""
    hook = rules_hook("rules:\n"
                      "  - {name: ping-late, match: {command: [PING]}, action: {delay: {ms: 1000}}}\n"
                      "  - {name: ten-per-second, match: {command: [SEND]}, "
                      "action: {throttle: {messages_per_second: 10}}}\n")
    broker = FakeBroker()
    with trio.fail_after(60):
        async with memory_relay(broker, hook=hook) as (client, relay):
            decoder = await connected(client)
            # the four throttled SENDs fit; the PING behind them fills the queue (the reader waits)
            relay.pipeline.held.byte_limit = 4 * len(send_frame(0, 10)) + 1
            start = trio.current_time()
            await client.send_all(b"".join(send_frame(seq, 10) for seq in range(5)))
            await trio.testing.wait_all_tasks_blocked()
            await client.send_all(encode_command(api.CommandPing()))
            arrived: list[tuple[str, float]] = []
            while len(arrived) < 6:
                for frame in await receive_frames(client, decoder, 1):
                    name = "pong" if frame.type == T.PONG else str(frame.command.send_receipt.sequence_id)
                    arrived.append((name, trio.current_time() - start))
    # the first SEND passes at once; the others were due 0.1-0.4 s but queue behind the PING held to 1 s
    assert arrived == [("0", 0.0), ("pong", 1.0), ("1", 1.0), ("2", 1.0), ("3", 1.0), ("4", 1.0)]
    assert len(frames_of(broker, T.PING)) == 1


async def test_an_idle_connection_is_pinged_and_closed_on_time_while_others_come_and_go(
        autojump_clock: trio.testing.MockClock) -> None:
    """One keepalive wheel serves every relay of a server: connections opened and ended around an idle one
    (each one registering and leaving) neither skip nor delay the idle one's PING and its end."""
    broker = FakeBroker(answer_pings=False)
    config = ProxyConfig(upstream=ServiceUrl.parse(BROKER_URL), listen=HostPort("127.0.0.1", 0),
                         limits=LimitsConfig(keepalive_seconds=0.2))
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            async def connect_upstream(url: ServiceUrl) -> Transport:
                proxy_end, broker_end = trio.testing.memory_stream_pair()
                nursery.start_soon(broker.handle, broker_end)
                return StreamTransport(proxy_end, str(url.address))

            server = ProxyServer(config, reactor=False, connect_upstream=connect_upstream)
            await nursery.start(server.keepalive.run)

            def open_client(port: int) -> trio.StapledStream[Any, Any]:
                client_end, proxy_end = trio.testing.memory_stream_pair()
                peer = f"client.test:{port}"
                nursery.start_soon(server.new_relay(StreamTransport(proxy_end, peer), peer, config.upstream,
                                                    "main").run)
                return client_end

            async def come_and_go() -> None:
                for port in range(50001, 50031):  # one every 20 ms, each over before the next
                    other = open_client(port)
                    await connected(other)
                    await other.aclose()
                    await trio.sleep(0.02)

            idle = open_client(50000)
            decoder = await connected(idle)
            start = trio.current_time()
            nursery.start_soon(come_and_go)
            pinged: list[float] = []
            while data := await idle.receive_some(1 << 16):
                for frame in decoder.receive(data):
                    assert frame.type == T.PING
                    pinged.append(trio.current_time() - start)
            closed_at = trio.current_time() - start
            nursery.cancel_scope.cancel()
    assert pinged and 0.2 <= pinged[0] <= 0.25 + 1e-6
    assert 0.4 <= closed_at <= 0.45 + 1e-6
    reasons = [entry["reason"] for entry in logs
               if entry.get("event") == "connection closed" and entry["client"] == "client.test:50000"]
    assert len(reasons) == 1 and reasons[0].endswith("and no PONG: peer is dead")
    assert len(server.keepalive.relays) == 0  # every relay left the wheel when it ended


@pytest.mark.parametrize(("drain_seconds", "lingers_for"), [(3.0, 3.0), (0.0, 1.0)])
async def test_a_half_closed_connection_lingers_for_the_drain_period_then_ends(
        autojump_clock: trio.testing.MockClock, drain_seconds: float, lingers_for: float) -> None:
    """The client half-closes; the broker never closes its side: the connection ends after
    ``limits.drain_seconds`` (at least a second), logged as the client's close with the other side lingering."""
    broker = FakeBroker(read_after_handshake=False)  # (it never reads the half-close)
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        async with memory_relay(broker, drain_seconds=drain_seconds, keepalive_seconds=100) as (client, _relay):
            await connected(client)
            start = trio.current_time()
            await client.send_eof()
            assert await client.receive_some(1024) == b""
            assert trio.current_time() - start == pytest.approx(lingers_for, abs=1e-6)
            await trio.testing.wait_all_tasks_blocked()
    [reason] = [entry["reason"] for entry in logs if entry.get("event") == "connection closed"]
    assert reason == "client closed the connection (the other side lingered)"
