"""Tap, inject() and recording(): rules always removed, captures decoded as the client saw them.

Injection tests front an address where nothing listens (no broker needed); capture tests drive the
official client through a tap in front of an embedded broker.  The capture observer's bounds are
checked on frames made here, with no sockets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pulsar
import pytest
import trio
import trio.lowlevel

from proxy.broker.embedded import ThreadedCluster
from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, Origin
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, frame_from_bytes
from proxy.protocol.session import Direction
from proxy.testing import AdminClient, Tap, TapError, delay, drop, error, timeout
from proxy.testing.capture import CaptureObserver

NOWHERE = "pulsar://127.0.0.1:1"


@pytest.fixture(scope="module")
def idle_tap() -> Iterator[Tap]:
    with Tap(NOWHERE) as tap:
        yield tap


def _eventually(condition: object, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- the rule is gone however the block ends ------------------------------------------------------------------
def test_a_block_that_raises_leaves_no_rule_behind(idle_tap: Tap) -> None:
    fault = idle_tap.inject(drop().on("SEND"))

    def failing_block(error: BaseException) -> None:
        with fault:
            assert [r.name for r in idle_tap.rules()] == [fault.name]
            raise error

    with pytest.raises(ValueError, match="boom"):
        failing_block(ValueError("boom"))
    assert idle_tap.rules() == []
    with pytest.raises(KeyboardInterrupt):
        failing_block(KeyboardInterrupt())
    assert idle_tap.rules() == []
    assert fault.hits == 0 and not fault.active


def test_inject_as_a_decorator_activates_per_call(idle_tap: Tap) -> None:
    seen: list[list[str]] = []
    injection = idle_tap.inject(error("TopicNotFound").on("LOOKUP").named("lookups"))

    @injection
    def failing(x: int) -> int:
        seen.append([r.name for r in idle_tap.rules()])
        if x < 0:
            raise RuntimeError("negative")
        return x * 2

    assert failing(21) == 42
    with pytest.raises(RuntimeError):
        failing(-1)
    assert seen == [["lookups"], ["lookups"]]
    assert idle_tap.rules() == []
    assert failing.__name__ == "failing"


def test_a_decorator_may_be_written_before_the_tap_starts() -> None:
    tap = Tap(NOWHERE)

    @tap.inject(delay(ms=1).named("early"))
    def body() -> list[str]:
        return [r.name for r in tap.rules()]

    with tap:
        assert body() == ["early"]
        assert tap.rules() == []


async def test_trio_blocks_remove_their_rules_when_raising_or_cancelled(idle_tap: Tap) -> None:
    with pytest.raises(ValueError, match="trio"):
        async with idle_tap.inject(drop().on("FLOW")):
            raise ValueError("trio")
    with trio.move_on_after(0.2):
        async with idle_tap.inject(drop().on("FLOW")):
            await trio.sleep_forever()
    assert idle_tap.rules() == []

    @idle_tap.inject(drop().on("ACK"))
    async def decorated() -> int:
        await trio.lowlevel.checkpoint()
        return len(idle_tap.rules())

    assert await decorated() == 1
    assert idle_tap.rules() == []


def test_asyncio_blocks_remove_their_rules_when_cancelled(idle_tap: Tap) -> None:
    async def main() -> None:
        entered = asyncio.Event()

        async def hold() -> None:
            async with idle_tap.inject(drop().on("FLOW")):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(hold())
        await entered.wait()
        assert len(idle_tap.rules()) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _eventually(lambda: idle_tap.rules() == [])  # the removal finishes in its worker thread


def test_later_steps_are_switched_on_by_a_timer_and_never_after_the_block(idle_tap: Tap) -> None:
    with idle_tap.inject(timeout(300).named("stall")) as fault:
        assert [r.name for r in idle_tap.rules()] == ["stall"]
        _eventually(lambda: [r.name for r in idle_tap.rules()] == ["stall", "stall-1"])
        assert idle_tap.admin.rule("stall-1").action == {"disconnect": {"how": "close"}}
    assert idle_tap.rules() == []
    assert fault.rule_names == ["stall", "stall-1"]
    with idle_tap.inject(timeout(300).named("short")):
        pass
    time.sleep(0.6)
    assert idle_tap.rules() == []


def test_an_injection_is_entered_once_at_a_time(idle_tap: Tap) -> None:
    injection = idle_tap.inject(drop().named("once"))
    with injection, pytest.raises(TapError, match="already in force"):
        injection.start()
    assert idle_tap.rules() == []


def test_a_failed_removal_is_noted_on_the_block_error_not_hidden_by_it() -> None:
    tap = Tap(NOWHERE).start()
    admin = AdminClient(tap.admin_url, timeout=2)

    def block_losing_its_proxy() -> None:
        with admin.inject(drop().named("orphan")):
            tap.close()  # the admin API goes away under the block
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside") as caught:
        block_losing_its_proxy()
    assert any("could not" in note and "cannot reach the admin API" in note
               for note in getattr(caught.value, "__notes__", []))
    tap = Tap(NOWHERE).start()
    admin = AdminClient(tap.admin_url, timeout=2)
    with pytest.raises(TapError, match="cannot reach the admin API"), admin.inject(drop().named("orphan")):
        tap.close()
    with Tap(NOWHERE) as tap, tap.inject(drop().named("gone")):
        tap.close()  # closing the tap itself takes its rules along: nothing to complain about


def test_a_tap_that_is_not_running_says_so() -> None:
    tap = Tap(NOWHERE)
    with pytest.raises(TapError, match="not running"):
        _ = tap.service_url
    with pytest.raises(TapError, match="upstream"):
        Tap("http://not-pulsar").start()


# -- recording() ------------------------------------------------------------------------------------------------
@pytest.fixture
def tap_and_client(broker: ThreadedCluster) -> Iterator[tuple[Tap, pulsar.Client]]:
    with Tap(broker) as tap:
        client = pulsar.Client(tap.service_url, operation_timeout_seconds=30)
        try:
            yield tap, client
        finally:
            client.close()


def test_recording_attributes_the_block_frames_and_pairs_requests(tap_and_client: tuple[Tap, pulsar.Client]
                                                                  ) -> None:
    tap, client = tap_and_client
    producer = client.create_producer("capture-orders", batching_enabled=False)  # before the block
    producer.send(b"before")
    with tap.recording() as rec:
        with pytest.raises(TapError, match="still running"):
            rec.frames()
        for i in range(5):
            producer.send(f"order-{i}".encode())
        with tap.inject(error("ServiceNotReady").on("PRODUCER").times(1)):
            client.create_producer("capture-other")
    sends = rec.frames("SEND", topic="capture-orders")
    assert len(sends) == 5 and rec.messages_sent("capture-orders") == 5
    assert all(f.topic == "persistent://public/default/capture-orders" and f.origin == "client" for f in sends)
    receipts = rec.frames("SEND_RECEIPT", topic="capture-orders")
    assert len(receipts) == 5 and all(f.latency_ms is not None for f in receipts)
    requests = rec.requests("SEND", topic="capture-orders")
    assert [r.outcome for r in requests] == ["ok"] * 5 and [r.sequence_id for r in requests] == [1, 2, 3, 4, 5]
    producers = rec.requests("PRODUCER")
    assert [(r.outcome, r.error_code) for r in producers] == [("error", "ServiceNotReady"), ("ok", None)]
    assert len(rec.frames("ERROR", origin="proxy")) == 1
    refused, created = rec.frames("PRODUCER")
    assert refused.rules and not refused.delivered  # answered by the rule, never reached the broker
    assert created.delivered and not created.rules
    assert not rec.frames(topic="capture-nothing")


def test_recording_counts_rule_delays_and_lists_what_rules_swallowed(tap_and_client: tuple[Tap, pulsar.Client]
                                                                     ) -> None:
    tap, client = tap_and_client
    producer = client.create_producer("capture-slow", batching_enabled=False, send_timeout_millis=60_000)
    with tap.inject(delay(ms=150).on("SEND_RECEIPT")), tap.recording() as rec:
        producer.send(b"slow")
    [slow] = rec.requests("SEND")
    assert slow.latency_ms is not None and slow.latency_ms >= 150  # the delay is part of what the client saw
    done: list[pulsar.Result] = []
    with tap.inject(drop().on("SEND_RECEIPT").once()) as dropped, tap.recording() as rec:
        producer.send_async(b"lost receipt", lambda result, _id: done.append(result))
        _eventually(lambda: dropped.hits == 1)
    [swallowed] = rec.frames("SEND_RECEIPT")
    assert not swallowed.delivered and swallowed.rules
    [unanswered] = rec.requests("SEND")
    assert (unanswered.outcome, unanswered.latency_ms) == ("unanswered", None)


def test_a_tap_in_a_child_process_does_the_same(broker: ThreadedCluster) -> None:
    with Tap(broker.service_url, process=True, token="child-secret") as tap:
        client = pulsar.Client(tap.service_url, operation_timeout_seconds=30)
        try:
            with tap.inject(error("ServiceNotReady").on("PRODUCER").times(2)) as refusals, \
                    tap.recording() as rec:
                producer = client.create_producer("child-orders")
                producer.send(b"hello")
        finally:
            client.close()
        backend = tap._backend
    assert refusals.hits == 2
    assert [r.outcome for r in rec.requests("PRODUCER")] == ["error", "error", "ok"]
    assert len(rec.frames("SEND", topic="child-orders")) == 1
    process = getattr(backend, "log_path", None)
    assert process is not None and not process.exists()  # a clean exit leaves no log behind


# -- the observer's bounds (no sockets) --------------------------------------------------------------------------
def _event(conn: int, sub: object, ts_ns: int, direction: Direction = Direction.TO_BROKER) -> FrameEvent:
    raw = encode_command(sub)  # type: ignore[arg-type]
    origin = Origin.CLIENT if direction is Direction.TO_BROKER else Origin.BROKER
    return FrameEvent(ConnectionInfo(conn, "127.0.0.1:1", "l", None), direction, origin, ts_ns,
                      frame_from_bytes(raw, 1 << 20), forwarded_ns=ts_ns)


def test_outside_windows_only_set_up_frames_are_kept_and_closed_connections_forgotten() -> None:
    observer = CaptureObserver()
    observer.on_frame(_event(1, api.CommandProducer(topic="t", producer_id=1, request_id=1), 10))
    observer.on_frame(_event(1, api.CommandFlow(consumer_id=1, messagePermits=5), 11))
    window = observer.begin()
    now = time.time_ns()
    observer.on_frame(_event(1, api.CommandPing(), now + 1))
    captured = observer.end(window, now + 10)
    assert [frame_from_bytes(f.raw, 1 << 20).type_name for f in captured.frames] == ["PRODUCER", "PING"]
    observer.on_connection(ConnectionEvent(ConnectionInfo(1, "127.0.0.1:1", "l", None), now + 20, closed=True))
    window = observer.begin()
    assert observer.end(window).frames == []


def test_a_window_keeps_at_most_max_frames_and_counts_the_rest() -> None:
    observer = CaptureObserver(max_frames=3, max_setup_frames=2)
    window = observer.begin()
    start = time.time_ns()
    for i in range(5):
        observer.on_frame(_event(7, api.CommandPing(), start + i + 1))
    for i in range(4):
        observer.on_frame(_event(7, api.CommandProducer(topic="t", producer_id=i, request_id=i), start + 10 + i))
    captured = observer.end(window, start + 100)
    assert len(captured.frames) == 3 and captured.dropped == 6
    window = observer.begin()
    later = time.time_ns()
    observer.on_frame(_event(7, api.CommandPing(), later + 1))
    # set-up frames kept per connection: only the newest max_setup_frames
    assert [frame_from_bytes(f.raw, 1 << 20).command.producer.producer_id for f in observer.end(window).frames
            if f.raw != encode_command(api.CommandPing())] == [2, 3]
