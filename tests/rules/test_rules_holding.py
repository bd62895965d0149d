"""Per-lane holding and deferred frames: the HoldQueue and the deferred grants of a throttle's Verdict."""

from __future__ import annotations

from rules_helpers import TO_BROKER, Session, engine_for
from rules_helpers import frame as make_frame

from proxy.core.holding import HoldQueue
from proxy.pb import PulsarApi_pb2 as api


def test_a_lane_keeps_its_order_and_other_lanes_leave_at_their_own_time() -> None:
    held = HoldQueue(limit=3)
    assert held.add(500, TO_BROKER, (b"a1",), lane="a") == 500
    assert held.add(100, TO_BROKER, (b"a2",), lane="a") == 500  # never before the one ahead in its lane
    assert held.add(200, TO_BROKER, (b"b1",), lane="b") == 200
    assert held.full and held.lane_busy("a") and held.next_due_ns() == 200
    assert [e.frames for e in held.pop_due(499)] == [[b"b1"]]
    assert not held.lane_busy("b")
    assert [e.frames for e in held.pop_due(500)] == [[b"a1"], [b"a2"]]
    assert not held.lane_busy("a") and held.next_due_ns() is None


def test_a_stream_lane_gathers_what_follows_a_delayed_frame_and_bytes_count_towards_the_bound() -> None:
    held = HoldQueue(byte_limit=10)
    assert held.add(500, TO_BROKER, (b"delayed",), lane=TO_BROKER) == 500
    assert held.add(300, TO_BROKER, (memoryview(b"run"),), lane=TO_BROKER) == 500  # behind it, in one entry
    assert len(held) == 1 and held.full and held.last_due(TO_BROKER) == 500
    assert held.add(900, TO_BROKER, (b"later",), lane=TO_BROKER) == 900  # its own, later time
    [first] = held.pop_due(500)
    assert first.stream and first.frames == [b"delayed", b"run"] and not held.full


def test_a_poll_is_asked_for_its_frames_when_due_and_held_again_until_it_is_done() -> None:
    asked: list[int] = []

    def poll(now_ns: int) -> tuple[list[bytes], int | None]:
        asked.append(now_ns)
        frames = [b"grant"] if len(asked) % 2 == 0 else []  # every other time: nothing to send
        return frames, (now_ns + 100 if len(asked) < 4 else None)

    held = HoldQueue()
    held.add_poll(100, TO_BROKER, poll)
    released = [(now, [e.frames for e in held.pop_due(now)]) for now in (50, 100, 200, 300, 400, 500)]
    assert released == [(50, []), (100, []), (200, [[b"grant"]]), (300, []), (400, [[b"grant"]]), (500, [])]
    assert asked == [100, 200, 300, 400] and len(held) == 0 and held.held_bytes == 0


def test_rationed_flow_becomes_fewer_permits_now_and_later_grants_towards_the_broker() -> None:
    session = Session(engine_for("""\
rules:
  - name: ration
    match: {command: [FLOW]}
    action: {throttle: {messages_per_second: 10, per: consumer}}
"""))
    session.add_consumer()
    verdict = session.decide(make_frame(api.CommandFlow(consumer_id=2, messagePermits=30)), TO_BROKER, now_s=1.0)
    assert verdict.forward and verdict.replacement is not None and verdict.delay_s == 0
    assert make_frame_permits(verdict.replacement) == 1
    held = HoldQueue()
    for later in verdict.deferred:
        assert later.to_broker and later.poll is not None
        held.add_poll(int((1.0 + later.after_s) * 1e9), TO_BROKER, later.poll)
    granted: list[tuple[float, int]] = []
    for tick in range(1, 400):
        now_ns = int((1.0 + tick / 100) * 1e9)
        granted += [(now_ns / 1e9, make_frame_permits(data)) for entry in held.pop_due(now_ns) for data in entry.frames]
    assert 1 + sum(permits for _, permits in granted) == 30 and not held
    assert granted[-1][0] >= 3.8  # 29 more at 10/s


def make_frame_permits(data: bytes) -> int:
    from proxy.protocol.frame import frame_from_bytes

    return int(frame_from_bytes(data).command.flow.messagePermits)
