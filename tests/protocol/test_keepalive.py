"""The keepalive policy every end uses (proxy sides, embedded broker, built-in client), without I/O."""

from __future__ import annotations

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import frame_from_bytes
from proxy.protocol.keepalive import MAX_OWED_PONGS, PING_FRAME, PONG_FRAME, Keepalive, KeepaliveStep

WAIT, PING, DEAD = KeepaliveStep.WAIT, KeepaliveStep.PING, KeepaliveStep.DEAD
S = 1_000_000_000


def test_the_frames_are_ping_and_pong() -> None:
    assert frame_from_bytes(PING_FRAME).type == api.BaseCommand.PING
    assert frame_from_bytes(PONG_FRAME).type == api.BaseCommand.PONG


def test_a_talking_peer_is_never_pinged() -> None:
    k = Keepalive(10 * S, 0)
    for now in range(1, 100):
        k.last_rx_ns = now * S
        assert k.poll(now * S + 9 * S) is WAIT


def test_a_silent_peer_gets_one_ping_and_is_dead_an_interval_later() -> None:
    k = Keepalive(10 * S, 0)
    assert [k.poll(t * S) for t in (5, 10, 12, 19)] == [WAIT, PING, WAIT, WAIT]
    assert k.ping_sent_ns == 10 * S
    assert k.poll(20 * S) is DEAD and k.idle_ns(20 * S) == 20 * S


def test_anything_after_the_ping_proves_the_peer_alive_and_the_next_silence_starts_from_it() -> None:
    k = Keepalive(10 * S, 0)
    assert k.poll(10 * S) is PING
    k.last_rx_ns = 15 * S  # not even the PONG: any frame will do, as in Pulsar's PulsarHandler
    assert k.poll(24 * S) is WAIT
    assert k.poll(25 * S) is PING
    assert k.poll(34 * S) is WAIT and k.poll(35 * S) is DEAD


def test_a_relay_swallows_only_the_pongs_its_own_pings_asked_for_in_order() -> None:
    k = Keepalive(10 * S, 0)
    k.ping_relayed()             # the other side pinged the peer first
    assert k.poll(10 * S) is PING
    k.ping_relayed()
    assert [k.pong_received() for _ in range(4)] == [False, True, False, False]  # the last: nobody's


def test_the_pongs_a_peer_owes_are_bounded() -> None:
    k = Keepalive(10 * S, 0)
    for _ in range(MAX_OWED_PONGS + 10):
        k.ping_relayed()
    assert k.poll(10 * S) is PING
    answered = [k.pong_received() for _ in range(MAX_OWED_PONGS + 10)]
    assert answered.count(True) == 1 and answered[MAX_OWED_PONGS - 1] and len(answered) == MAX_OWED_PONGS + 10


def test_pulsars_schedule_pings_a_busy_peer_at_every_tick() -> None:
    """every_interval (embedded broker, built-in client): PulsarHandler's fixed-rate timer, traffic or not."""
    k = Keepalive(10 * S, 0, every_interval=True)
    steps = []
    for now in range(1, 45):
        k.last_rx_ns = now * S  # the peer talks every second, PONGs included
        steps.append((now, k.poll(now * S)))
    assert [now for now, step in steps if step is PING] == [10, 20, 30, 40]
    assert all(step is not DEAD for _, step in steps)


def test_pulsars_schedule_calls_a_peer_dead_at_the_tick_after_an_unanswered_ping() -> None:
    k = Keepalive(10 * S, 0, every_interval=True)
    assert [k.poll(t * S) for t in (9, 10, 15)] == [WAIT, PING, WAIT]
    k.last_rx_ns = 12 * S  # anything since the PING clears it, as messageReceived() does
    assert k.poll(20 * S) is PING
    assert k.poll(29 * S) is WAIT and k.poll(30 * S) is DEAD


def test_pulsars_schedule_restarts_its_timer_when_polled_more_than_a_tick_late() -> None:
    k = Keepalive(10 * S, 0, every_interval=True)
    assert k.poll(1000 * S) is WAIT and k.next_tick_ns == 1010 * S  # no verdict on ticks nobody saw
    assert k.poll(1010 * S) is PING
