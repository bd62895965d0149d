"""The reactor waiting in Trio's place (``proxy.server.reactor``), on loopback sockets.

Relay hops are served inside Trio's idle wait while Trio's own work — timers, I/O of
other tasks, threads handing results back — goes on; a second proxy in the same run,
a virtual clock, and a failure of the wait itself leave the reactor a task that waits
through Trio, with the same traffic.
"""

from __future__ import annotations

import fcntl
import gc
import socket
import sys
import termios
import threading
import time
import weakref

import pytest
import trio
import trio.testing
from proxy_fake_broker import CONNECT, FakeBroker, send_frame
from proxy_harness import ProxyFactory

from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.core.hooks import ConnectionEvent, FrameEvent, RunEvent
from proxy.core.pipeline import ConnectionPipeline
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_command
from proxy.protocol.session import Direction
from proxy.server.app import ProxyServer
from proxy.server.reactor import Reactor

T = api.BaseCommand.Type


async def start(nursery: trio.Nursery, broker: FakeBroker) -> ProxyServer:
    if not broker.port:
        await nursery.start(broker.serve)
    config = ProxyConfig(upstream=ServiceUrl.parse(broker.url), listen=HostPort("127.0.0.1", 0),
                         limits=LimitsConfig(drain_seconds=0.5))
    server: ProxyServer = await nursery.start(ProxyServer(config).run)
    return server


def round_trips(port: int, count: int) -> list[int]:
    """A blocking client (in a thread, so Trio's loop idles between hops): CONNECT, then ``count`` SEND ->
    SEND_RECEIPT one at a time; the receipts' sequence ids."""
    decoder = FrameDecoder(1 << 20)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(CONNECT)
        answers = []
        for seq in [-1, *range(count)]:
            if seq >= 0:
                sock.sendall(send_frame(seq, 100))
            while (frame := decoder.next_frame()) is None:
                data = sock.recv(65536)
                if not data:
                    raise EOFError("the proxy closed the connection")
                decoder.feed(data)
            if seq < 0:
                assert frame.type == T.CONNECTED
            else:
                answers.append(frame.command.send_receipt.sequence_id)
        return answers


async def test_hops_are_served_in_trios_place_while_timers_tasks_and_threads_go_on(nursery: trio.Nursery) -> None:
    broker = FakeBroker()
    server = await start(nursery, broker)
    assert server.reactor is not None and server.reactor.loop_wait is not None
    ticks = 0
    three_more = trio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.005)
            ticks += 1
            if ticks >= 3 + after_round_trips:
                three_more.set()

    after_round_trips = 1 << 30
    nursery.start_soon(ticker)
    with trio.fail_after(30):
        # the broker is a task of this run: every round trip crosses the reactor's wait and Trio's
        answers = await trio.to_thread.run_sync(round_trips, server.main_address.port, 300)
        assert answers == list(range(300))
        rounds = server.reactor.rounds
        assert rounds >= 600  # two hops per round trip, each served by the reactor
        assert await trio.to_thread.run_sync(lambda: "back") == "back"
        after_round_trips = ticks
        await three_more.wait()  # the timer still fires: the reactor ends its wait at Trio's deadlines
        assert server.reactor.loop_wait is not None


async def test_a_second_proxy_in_the_same_run_waits_through_trio_and_both_relay(nursery: trio.Nursery) -> None:
    broker = FakeBroker()
    first = await start(nursery, broker)
    second = await start(nursery, broker)
    assert first.reactor is not None and second.reactor is not None
    assert first.reactor.loop_wait is not None and second.reactor.loop_wait is None
    with trio.fail_after(30):
        async with trio.open_nursery() as clients:
            for server in (first, second, first, second):
                clients.start_soon(trio.to_thread.run_sync, round_trips, server.main_address.port, 100)
    # each proxy: 400 hops, on two connections of two sockets each, so at most 4 per round
    assert first.reactor.rounds >= 100 and second.reactor.rounds >= 100


def _pipelines_alive() -> int:
    return sum(type(thing) is ConnectionPipeline for thing in gc.get_objects())


async def test_a_closed_connections_objects_go_with_it_not_left_to_the_cyclic_collector(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of a finished connection waits for a collection: a reconnect storm's connections left in
    cycles filled the collector's oldest generation, and its full collections cost a tenth of the CPU."""
    server = await start(nursery, FakeBroker())
    relays: list[weakref.ref[object]] = []
    new_relay = server.new_relay

    def recorded(*args: object) -> object:
        relay = new_relay(*args)  # type: ignore[arg-type]
        relays.append(weakref.ref(relay))
        return relay
    monkeypatch.setattr(server, "new_relay", recorded)
    collecting = gc.isenabled()
    gc.disable()  # (a collection in between would free a cycle and hide it)
    # (the pipeline runs compiled, which takes no weak reference: its instances are counted instead)
    pipelines_before = _pipelines_alive()
    try:
        with trio.fail_after(30):
            for _ in range(3):
                assert await trio.to_thread.run_sync(round_trips, server.main_address.port, 2) == [0, 1]
            while server.active_connections:  # noqa: ASYNC110 - the server notices the close in its own time
                await trio.sleep(0.01)
        assert len(relays) == 3 and all(ref() is None for ref in relays)
        assert _pipelines_alive() == pipelines_before
    finally:
        if collecting:
            gc.enable()


@pytest.fixture
def paced_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(rate=1.0)  # virtual time at the pace of real time: a clock not Trio's own


async def test_under_another_clock_the_reactor_is_a_task_and_relays_the_same(
        nursery: trio.Nursery, paced_clock: trio.testing.MockClock) -> None:
    server = await start(nursery, FakeBroker())
    assert server.reactor is not None and server.reactor.loop_wait is None
    with trio.fail_after(30):
        assert await trio.to_thread.run_sync(round_trips, server.main_address.port, 100) == list(range(100))
    assert server.reactor.rounds >= 200


async def test_a_failure_while_waiting_in_trios_place_leaves_the_reactor_serving_as_a_task(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    server = await start(nursery, FakeBroker())
    assert server.reactor is not None and server.reactor.loop_wait is not None
    failures = 0
    real_wait = Reactor.wait_in_trios_place

    def failing_wait(self: Reactor, timeout: float, loop: object) -> None:
        nonlocal failures
        if timeout > 0 and self.rounds > 20 and not failures:
            failures += 1
            raise RuntimeError("bug")
        real_wait(self, timeout, loop)  # type: ignore[arg-type]

    monkeypatch.setattr(Reactor, "wait_in_trios_place", failing_wait)
    with trio.fail_after(30):
        assert await trio.to_thread.run_sync(round_trips, server.main_address.port, 200) == list(range(200))
        assert failures == 1
        assert server.reactor.loop_wait is None
        assert await trio.to_thread.run_sync(round_trips, server.main_address.port, 50) == list(range(50))


async def test_the_reactors_one_piece_write_hands_back_what_the_kernel_did_not_take_and_keeps_the_order() -> None:
    """PlainSocket.try_send of one piece larger than the socket takes: the rest comes back (a view of
    the piece past what was written) and stays owed, the next ``send`` writes it first (here ``send([])``,
    as the relay's task does), and the peer reads every byte in order, once."""
    from proxy.server.transport import SocketTransport

    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    transport = SocketTransport(left, peer="test")
    piece = bytes(range(256)) * 4096  # 1 MiB: more than the socket pair buffers
    rest = transport.plain.try_send([piece])
    assert rest is not None and len(rest) == 1 and 0 < len(rest[0]) < len(piece)  # type: ignore[arg-type]
    assert bytes(rest[0]) == piece[len(piece) - len(rest[0]):]  # type: ignore[arg-type]
    right.setblocking(False)
    received = bytearray()

    async def read_all() -> None:
        while len(received) < len(piece):
            await trio.lowlevel.wait_readable(right)
            received.extend(right.recv(1 << 20))

    with trio.fail_after(10):
        async with trio.open_nursery() as readers:
            readers.start_soon(read_all)
            await transport.send([])
    assert bytes(received) == piece
    assert transport.plain.try_send([b"end"]) == []  # all of it taken at once: nothing comes back
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(right)
    assert right.recv(16) == b"end"
    await transport.aclose()
    right.close()


async def test_reads_into_the_reactors_scratch_buffer_never_overwrite_bytes_a_large_read_handed_out() -> None:
    """Transports without a buffer read into the reactor's scratch: a small read comes out as a copy, a large
    one as a view that keeps its buffer (the scratch takes another), so later reads of any transport
    through the same scratch leave that view's bytes as they were."""
    from proxy.server.plain_socket import ReceiveScratch
    from proxy.server.transport import SocketTransport

    scratch = ReceiveScratch()
    pairs = [socket.socketpair() for _ in range(2)]
    first, second = (SocketTransport(near, peer="test") for near, _ in pairs)
    large = bytes(range(256)) * 200  # 51 200 bytes: more than a small read
    pairs[0][1].sendall(large)
    pairs[1][1].sendall(b"small")
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(pairs[0][0])
        await trio.lowlevel.wait_readable(pairs[1][0])
    got = first.plain.try_receive(scratch)
    assert isinstance(got, memoryview) and bytes(got) == large
    assert got.obj is not scratch.buffer  # the read kept its buffer; the scratch has another
    assert second.plain.try_receive(scratch) == b"small"
    pairs[1][1].sendall(b"x" * len(large))
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(pairs[1][0])
    assert bytes(second.plain.try_receive(scratch) or b"") == b"x" * len(large)
    assert bytes(got) == large
    assert first.plain.try_receive(scratch) is None and second.plain.try_receive(scratch) is None
    for transport in (first, second):
        await transport.aclose()
    for _, far in pairs:
        far.close()


async def test_the_write_lock_says_busy_while_a_writer_holds_it_or_waits_for_it_across_hand_overs() -> None:
    """The reactor's write asks ``busy`` instead of ``trio.Lock.locked()``: it must be non-zero exactly
    while the lock is held — including right after a release that hands the lock to a queued writer
    that has not run yet, and after a queued writer was cancelled while the lock stays held."""
    from proxy.server.transport import _WriteLock

    lock = _WriteLock()
    order: list[str] = []
    given_up = trio.CancelScope()

    async def writer(name: str, scope: trio.CancelScope) -> None:
        with scope:
            async with lock:
                order.append(name)
                await trio.lowlevel.checkpoint()

    with trio.fail_after(10):
        async with trio.open_nursery() as writers:
            async with lock:
                writers.start_soon(writer, "queued", trio.CancelScope())
                writers.start_soon(writer, "given up", given_up)
                await trio.testing.wait_all_tasks_blocked()
                assert lock.busy == 3
                given_up.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert lock.busy == 2  # the cancelled writer left the queue; the queued one still waits
            # released: handed straight to the queued writer, which has not run yet
            assert lock.busy == 1 and order == []
        assert lock.busy == 0 and order == ["queued"]
        lock.acquire_nowait()
        assert lock.busy == 1
        lock.release()
        assert lock.busy == 0


def test_observers_work_on_a_read_after_the_hop_has_written_it(proxy_factory: ProxyFactory) -> None:
    """With observers, the reactor's hop writes a read on first and hands it to them after (metrics' histogram,
    a span: their work is off the request's latency), before it reads again.  Seen from the broker's socket,
    which reads nothing after CONNECTED: whenever the observer gets a run of SENDs, its bytes are there."""
    listener = socket.create_server(("127.0.0.1", 0))
    broker_side: list[socket.socket] = []

    def broker() -> None:
        conn, _ = listener.accept()
        decoder = FrameDecoder(1 << 20)
        while (frame := decoder.next_frame()) is None:
            decoder.feed(conn.recv(65536))
        assert frame.type == T.CONNECT
        broker_side.append(conn)
        conn.sendall(encode_command(api.CommandConnected(server_version="still", protocol_version=21)))

    class BytesAtTheBroker:
        """For each run towards the broker: the bytes of runs so far, and those waiting in the broker's socket."""

        needs_observation = False

        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []
            self.sent = 0

        def on_connection(self, event: ConnectionEvent) -> None:
            pass

        def on_frame(self, event: FrameEvent) -> None:
            pass

        def on_run(self, event: RunEvent) -> None:
            if event.direction is Direction.TO_BROKER:
                self.sent += len(event.data)
                waiting = fcntl.ioctl(broker_side[0], termios.FIONREAD, b"\0\0\0\0")
                self.seen.append((self.sent, int.from_bytes(waiting, sys.byteorder)))

    observer = BytesAtTheBroker()
    accepting = threading.Thread(target=broker, daemon=True)
    accepting.start()
    proxy = proxy_factory(f"pulsar://127.0.0.1:{listener.getsockname()[1]}",
                          server_options={"observers": [observer]})
    assert proxy.server.reactor is not None
    with socket.create_connection(("127.0.0.1", proxy.address.port), timeout=10) as client:
        client.sendall(CONNECT)
        decoder = FrameDecoder(1 << 20)
        while decoder.next_frame() is None:
            decoder.feed(client.recv(65536))
        for seq in range(20):
            client.sendall(send_frame(seq, 100))
            time.sleep(0.01)  # (each its own read, and the hub's account never short)
        deadline = time.monotonic() + 10
        while observer.sent < 20 * len(send_frame(0, 100)) and time.monotonic() < deadline:
            time.sleep(0.01)
    accepting.join(5)
    listener.close()
    for conn in broker_side:
        conn.close()
    assert observer.sent == 20 * len(send_frame(0, 100))
    assert len(observer.seen) >= 10  # (mostly a read a SEND)
    assert all(waiting >= sent for sent, waiting in observer.seen), observer.seen
