"""Observers that take passed-through bytes in bulk (``on_run``: the recorder) cost no decoding.

With every observer taking runs, the pipeline hands them each stretch of bytes it
passed through unchanged as one RunEvent (no Frame, no FrameEvent) and the frames it
looks at anyway as FrameEvents: together, in order, they are each direction's stream.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config.proxy_config import ServiceUrl
from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, Origin, RunEvent
from proxy.core.lookup import BrokerDirectory
from proxy.core.pipeline import ConnectionPipeline, PipelineSettings, Send
from proxy.core.run_cutter import count_frame_starts
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.protocol.session import Direction
from proxy.server.observer_hub import ObserverHub

TO_BROKER, TO_CLIENT = Direction.TO_BROKER, Direction.TO_CLIENT
Event = FrameEvent | RunEvent | ConnectionEvent
UPSTREAM = ServiceUrl.parse("pulsar://10.9.9.1:6650")
CONNECT = encode_command(api.CommandConnect(client_version="test", protocol_version=21))
CONNECTED = encode_command(api.CommandConnected(server_version="broker", protocol_version=21,
                                                max_message_size=8 * 1024 * 1024))
PING = encode_command(api.CommandPing())


def pipeline(events: list[Event]) -> ConnectionPipeline:
    return ConnectionPipeline(
        ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None), settings=PipelineSettings(),
        directory=BrokerDirectory("proxy.example", upstream_tls=False, open_listener=lambda broker: 40001),
        default_broker=UPSTREAM, now_ns=0, publish=events.append, observations=False,
        runs=True)


def sends(count: int, size: int) -> bytes:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1)
    return b"".join(encode_payload_command(api.CommandSend(producer_id=1, sequence_id=seq), metadata, b"x" * size)
                    for seq in range(count))


def test_passed_through_frames_come_as_runs_that_rebuild_each_stream_exactly() -> None:
    events: list[Event] = []
    p = pipeline(events)
    receipts = b"".join(encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=seq)) for seq in range(50))
    streams = {TO_BROKER: CONNECT + sends(40, 100) + PING + sends(5, 300_000) + sends(40, 10),
               TO_CLIENT: CONNECTED + receipts + PING + receipts}
    rng = random.Random(7)
    p.receive(TO_BROKER, streams[TO_BROKER][:len(CONNECT)], 0)
    p.receive(TO_CLIENT, streams[TO_CLIENT][:len(CONNECTED)], 0)
    positions = {TO_BROKER: len(CONNECT), TO_CLIENT: len(CONNECTED)}
    forwarded = {TO_BROKER: CONNECT, TO_CLIENT: CONNECTED}
    while any(positions[d] < len(streams[d]) for d in streams):
        direction = rng.choice([d for d in streams if positions[d] < len(streams[d])])
        take = rng.choice([1, 3, 9, 100, 4096, 65536, 300_000])
        chunk = streams[direction][positions[direction]:positions[direction] + take]
        positions[direction] += len(chunk)
        for action in p.receive(direction, chunk, positions[direction]):
            assert isinstance(action, Send)
            forwarded[action.direction] += b"".join(bytes(piece) for piece in action.data)
    assert forwarded == streams  # passed through byte for byte
    for direction, stream in streams.items():
        rebuilt = b""
        for event in events:
            if isinstance(event, RunEvent) and event.direction is direction:
                assert event.stream_pos == len(rebuilt)
                rebuilt += event.data
            elif isinstance(event, FrameEvent) and event.direction is direction and event.origin is not Origin.PROXY:
                rebuilt += event.frame.raw
        assert rebuilt == stream
    frame_events = [e for e in events if isinstance(e, FrameEvent)]
    # only what the proxy looks at anyway: the handshake and the PINGs
    assert [e.frame.type_name for e in frame_events] == ["CONNECT", "CONNECTED", "PING", "PING"]


def test_a_run_says_how_many_of_its_first_bytes_finish_a_frame_begun_before() -> None:
    events: list[Event] = []
    p = pipeline(events)
    p.receive(TO_BROKER, CONNECT, 0)
    p.receive(TO_CLIENT, CONNECTED, 0)
    big = sends(1, 100_000)
    small = sends(1, 10)
    p.receive(TO_BROKER, big[:50_000], 1)
    p.receive(TO_BROKER, big[50_000:70_000], 2)
    p.receive(TO_BROKER, big[70_000:] + small, 3)
    runs = [e for e in events if isinstance(e, RunEvent)]
    rest = len(big) - 70_000
    assert [(len(r.data), r.lead) for r in runs] == [(50_000, 0), (20_000, 20_000), (rest, rest), (len(small), 0)]


def test_every_run_says_how_many_of_its_first_bytes_finish_a_frame_begun_before_even_after_a_carried_head() -> None:
    """A receive that completes a frame head the scanner carried over from the one before hands out
    that head, then the rest of its frame, then the frames after it: each run's ``lead`` is what of
    it belongs to a frame begun before it (the recorder counts the frames a dropped run begins, and
    cuts a written one, from there)."""
    events: list[Event] = []
    p = pipeline(events)
    p.receive(TO_BROKER, CONNECT, 0)
    p.receive(TO_CLIENT, CONNECTED, 0)
    stream = sends(30, 1000) + sends(5, 70_000) + sends(60, 10)
    starts, pos = set(), 0
    while pos < len(stream):
        starts.add(pos)
        pos += int.from_bytes(stream[pos:pos + 4], "big") + 4
    rng = random.Random(3)
    pos = 0
    while pos < len(stream):
        take = rng.choice([1, 3, 5, 9, 20, 700, 1500, 40_000])
        p.receive(TO_BROKER, stream[pos:pos + take], 1)
        pos += take
    runs = [e for e in events if isinstance(e, RunEvent) and e.direction is TO_BROKER]
    assert b"".join(bytes(r.data) for r in runs) == stream
    offset = len(CONNECT)
    for run in runs:
        start = run.stream_pos - offset
        lead = 0
        while start + lead < start + len(run.data) and start + lead not in starts:
            lead += 1
        assert run.lead == lead, (start, len(run.data))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0, 10, 100, 1000, 70_000]), min_size=1, max_size=40),
       st.lists(st.integers(1, 90_000), min_size=1, max_size=60), st.booleans())
def test_a_run_that_says_how_many_frames_begin_in_it_counts_as_the_recorder_would(
        payloads: list[int], cuts: list[int], receipts: bool) -> None:
    """A receive that comes out as one run carries the frames its scanner counted (``RunEvent.frames``),
    which the recorder counts for a dropped run in place of walking it (``count_frame_starts``): for
    any stream cut anywhere (heads cut short, frames longer than a receive, rows of one size), each
    such run's count is the walk's (a receive that also hands out a Frame leaves its runs at -1: walked)."""
    events: list[Event] = []
    p = pipeline(events)
    p.receive(TO_BROKER, CONNECT, 0)
    p.receive(TO_CLIENT, CONNECTED, 0)
    if receipts:  # (the broker's answers: rows of small frames, their sequence ids' sizes varying)
        direction = TO_CLIENT
        frames = [encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=seq * 97))
                  for seq, _ in enumerate(payloads * 8)]
    else:
        direction, frames = TO_BROKER, [sends(1, size) for size in payloads]
    stream = b"".join(frames)
    pos = index = 0
    while pos < len(stream):
        take = cuts[index % len(cuts)]
        index += 1
        p.receive(direction, stream[pos:pos + take], 1)
        pos += take
    runs = [e for e in events if isinstance(e, RunEvent) and e.direction is direction]
    assert b"".join(bytes(r.data) for r in runs) == stream
    for run in runs:  # (nothing here is looked at: every receive comes out as runs only, all counted)
        assert run.frames == count_frame_starts(run.data, run.lead), (run.stream_pos, len(run.data), run.lead)
    assert sum(r.frames for r in runs) == len(frames)
    if len(cuts) == 1 and cuts[0] >= len(stream):
        assert [r.frames for r in runs] == [len(frames)]  # one receive, one run: the scanner's count


def test_the_hub_hands_runs_only_when_every_observer_takes_them() -> None:
    class Frames:
        def on_frame(self, event: FrameEvent) -> None: ...
        def on_connection(self, event: ConnectionEvent) -> None: ...

    class Runs(Frames):
        def on_run(self, event: RunEvent) -> None: ...

    assert ObserverHub([Runs(), Runs()]).takes_runs
    assert not ObserverHub([Runs(), Frames()]).takes_runs
    assert not ObserverHub([]).takes_runs


def test_the_hub_bounds_the_bytes_of_queued_runs_and_counts_what_it_drops() -> None:
    class Runs:
        def on_frame(self, event: FrameEvent) -> None: ...
        def on_connection(self, event: ConnectionEvent) -> None: ...
        def on_run(self, event: RunEvent) -> None: ...

    hub = ObserverHub([Runs()], queue_bytes=1000, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    for index in range(5):
        hub.publish(RunEvent(info, TO_BROKER, 0, b"x" * 300, 0, index * 300, 0))
    assert (hub.queued, hub.dropped) == (3, 2)


def test_a_run_the_full_queue_refuses_is_not_copied() -> None:
    """The relay hands runs over as views of its receive buffer; the hub copies those it queues.
    At saturation most runs are refused, and copying them first cost the relay ~6 % of its time."""
    import tracemalloc

    class Runs:
        def on_frame(self, event: FrameEvent) -> None: ...
        def on_connection(self, event: ConnectionEvent) -> None: ...
        def on_run(self, event: RunEvent) -> None: ...

    hub = ObserverHub([Runs()], queue_bytes=1 << 20, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    buffer = memoryview(bytearray(1 << 20))
    tracemalloc.start()
    try:
        hub.publish(RunEvent(info, TO_BROKER, 0, buffer, 0, 0, 0))  # type: ignore[arg-type]
        queued = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for index in range(1, 4):
            hub.publish(RunEvent(info, TO_BROKER, 0, buffer, 0, index << 20, 0))  # type: ignore[arg-type]
        refused = tracemalloc.get_traced_memory()[1] - queued
    finally:
        tracemalloc.stop()
    assert (hub.queued, hub.dropped) == (1, 3)
    assert queued >= 1 << 20  # the queued run was copied
    assert refused < 1 << 16  # the refused ones were not


class _Collect:
    runs_in_pieces = True

    def __init__(self, log: list[object]) -> None:
        self.log = log

    def on_frame(self, event: FrameEvent) -> None: ...
    def on_connection(self, event: ConnectionEvent) -> None: ...

    def on_run(self, event: RunEvent) -> None:
        self.log.append(event)


class _Views(_Collect):
    run_views = True

    def on_run(self, event: RunEvent) -> None:
        assert type(event.data) is memoryview
        self.log.append((event.stream_pos, bytes(event.data)))


async def _deliver_all(hub: ObserverHub, *events: RunEvent, ticks: list[object] | None = None) -> None:
    import trio

    async def tick() -> None:
        assert ticks is not None
        for _ in range(1000):
            ticks.append("tick")
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        if ticks is not None:
            nursery.start_soon(tick)
        for event in events:
            hub.publish(event)
        hub.close()


async def test_the_hub_hands_a_long_run_over_in_pieces_cut_between_frames() -> None:
    from proxy.core.run_cutter import RunCutter, whole_frames

    big, small = sends(1, 100_000), sends(3000, 60)
    tail = big[:30_000]  # a frame begun here, finished by a later run
    lead = 5_000  # the run starts with the last bytes of a frame begun before
    data = big[-lead:] + small + big + tail
    log: list[object] = []
    hub = ObserverHub([_Collect(log)], run_piece_bytes=32 * 1024, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    run = RunEvent(info, TO_BROKER, 7, data, lead, 1000, 8)
    await _deliver_all(hub, run)
    pieces = [event for event in log if isinstance(event, RunEvent)]
    assert len(pieces) > 3
    assert b"".join(piece.data for piece in pieces) == data
    assert [piece.stream_pos for piece in pieces] == [1000 + sum(len(p.data) for p in pieces[:i])
                                                      for i in range(len(pieces))]
    assert [piece.lead for piece in pieces] == [lead] + [0] * (len(pieces) - 1)
    assert {(piece.ts_ns, piece.forwarded_ns) for piece in pieces} == {(7, 8)}
    # each piece holds whole frames up to the limit, or one frame longer than it
    for piece in pieces[1:-1]:
        spans, end = whole_frames(piece.data, 0)
        assert end == len(piece.data)
        assert len(piece.data) <= 32 * 1024 or len(spans) == 1
    # cut into frames, the pieces give what the whole run gives
    def frames_of(runs: list[RunEvent]) -> list[bytes]:
        cutter, out = RunCutter(), []
        for r in runs:
            completed, pos = cutter.begin(r.data, r.lead, r.stream_pos)
            spans, end = whole_frames(r.data, pos)
            cutter.end(r.data, end)
            out += ([completed] if completed else []) + [r.data[a:b] for a, b in spans]
        return out
    assert frames_of(pieces) == frames_of([run]) and len(frames_of([run])) == 3001
    assert hub.delivered == len(pieces) and hub._queued_run_bytes == 0


def _piece_starts_frame_by_frame(data: bytes, pos: int, limit: int) -> list[int]:
    """The cuts of a run as the hub found them walking frame by frame (what piece_starts must give)."""
    cuts, start, end = [], 0, len(data)
    while end - pos >= 4:
        frame_end = pos + int.from_bytes(data[pos:pos + 4], "big") + 4
        if frame_end - start > limit and pos > start:
            cuts.append(pos)
            start = pos
        pos = frame_end
    return cuts


def test_a_run_is_cut_where_the_walk_frame_by_frame_cut_it_though_rows_of_one_size_are_read_at_once() -> None:
    """piece_starts reads rows of frames of one size as one array: its cuts are those of the walk frame by
    frame, for rows long and short, frames shorter and longer than a piece, a run that begins with a lead
    and one that ends inside a frame."""
    from proxy.server.observer_hub import piece_starts

    rng = random.Random(17)
    for _ in range(300):
        frames, count = [], rng.randrange(1, 400)
        while len(frames) < count:
            size = rng.choice([8, 40, 41, 100, 1000, 1024, 5000, 40_000])
            frames += [(size - 4).to_bytes(4, "big") + bytes(size - 4)] * rng.choice([1, 2, 15, 16, 17, 40, 300])
        lead = rng.choice([0, 0, 3, 700, 50_000])
        data = bytes(lead) + b"".join(frames)
        data = data[:len(data) - rng.choice([0, 0, 1, 3, 4, 500])]
        limit = rng.choice([100, 1024, 4096, 32 * 1024])
        assert piece_starts(data, lead, limit) == _piece_starts_frame_by_frame(data, lead, limit), (lead, limit)
        view = memoryview(bytearray(data))  # (the hub's ring hands over views)
        assert piece_starts(view, lead, limit) == _piece_starts_frame_by_frame(data, lead, limit)  # type: ignore[arg-type]


async def test_the_relays_run_between_the_pieces_of_a_long_run() -> None:
    log: list[object] = []
    hub = ObserverHub([_Collect(log)], slice_seconds=0.0, run_piece_bytes=4096, share=0.0, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    await _deliver_all(hub, RunEvent(info, TO_BROKER, 0, sends(500, 60), 0, 0, 0), ticks=log)
    kinds = ["piece" if isinstance(entry, RunEvent) else "tick" for entry in log]
    first, last = kinds.index("piece"), len(kinds) - 1 - kinds[::-1].index("piece")
    assert kinds.count("piece") > 5
    assert "tick" in kinds[first:last]  # the other task ran while the run was being delivered
    # and with no slice limit the whole run goes at once
    log.clear()
    hub = ObserverHub([_Collect(log)], slice_seconds=60.0, run_piece_bytes=4096, inline=False)
    await _deliver_all(hub, RunEvent(info, TO_BROKER, 0, sends(500, 60), 0, 0, 0), ticks=log)
    kinds = ["piece" if isinstance(entry, RunEvent) else "tick" for entry in log]
    first, last = kinds.index("piece"), len(kinds) - 1 - kinds[::-1].index("piece")
    assert "tick" not in kinds[first:last]


@pytest.mark.parametrize(("export", "minimum"), [(0.0, 0.0), (0.00003, 0.0), (0.0001, 0.002)])
@pytest.mark.parametrize("share", [0.2, 0.4, 0.6])
async def test_while_events_wait_the_hub_takes_its_share_of_the_loop(share: float, export: float,
                                                                      minimum: float) -> None:
    """Each hub turn lasts share / (1 - share) of the relays' time since its previous one.

    A fake clock: a relay turn publishes 1000 events and takes 10 ms; an observer takes
    0.03 ms an event.  Over 40 relay turns the hub must have used about share / (1 - share)
    of the relays' 400 ms (it has plenty queued), not a fixed 2 ms per turn.  With
    ``export``, each event also costs that much CPU on another thread (its exporter),
    spent during the relays' next turn (holding the GIL: the turn takes that much longer):
    it comes out of the hub's slices, so the hub's time plus its thread's keeps the share.
    At 0.1 ms an event (spans at 100 % sampling) the exports of one minimum slice (the
    default 2 ms) exceed the share: the hub repays the excess in its next turns, one event
    each (traces at 100 % had left the relays a quarter of their plain throughput).
    """
    import trio

    now, side, exports = [0.0], [0.0], [0.0]

    class Slow(_Collect):
        runs_in_pieces = False

        def on_run(self, event: RunEvent) -> None:
            now[0] += 0.00003
            exports[0] += export

    hub = ObserverHub([Slow([])], queue_size=100_000, share=share, slice_seconds=minimum, max_slice_seconds=1.0,
                      clock=lambda: now[0], side_clock=lambda: side[0], inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    relay_seconds = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        for turn in range(40):
            for index in range(1000):
                hub.publish(RunEvent(info, TO_BROKER, 0, b"x", 0, turn * 1000 + index, 0))
            now[0] += 0.010 + exports[0]
            side[0] += exports[0]
            exports[0] = 0.0
            relay_seconds += 0.010
            await trio.lowlevel.checkpoint()
        observers_seconds = hub.delivered * (0.00003 + export)
        hub.close()
    assert hub.dropped == 0
    # (exports are charged a turn late, so the hub's slices swing around the target: a wider margin,
    # still far from the 2x of a hub that ignored them)
    margin = 0.25 if export else 0.15
    ratio = observers_seconds / relay_seconds / (share / (1 - share))
    assert 1 - margin < ratio < 1 + margin, (observers_seconds, relay_seconds)


async def test_observers_that_take_runs_whole_get_them_as_received() -> None:
    log: list[object] = []

    class Whole(_Collect):
        runs_in_pieces = False

    hub = ObserverHub([Whole(log)], slice_seconds=0.0, run_piece_bytes=4096, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    run = RunEvent(info, TO_BROKER, 0, sends(500, 60), 0, 0, 0)
    await _deliver_all(hub, run)
    assert log == [run]


async def test_an_immediate_observer_sees_each_event_as_published_and_the_queue_gets_copies() -> None:
    """With ``run_views`` the pipeline hands runs over as views of the receive buffer: an
    ``immediate`` observer (the recorder) is called inside ``publish``, in order, before the relay
    reuses the buffer, and is never queued; the hub copies each run for the observers it queues."""

    class Immediate:
        immediate = True

        def __init__(self) -> None:
            self.seen: list[tuple[str, bytes]] = []

        def on_frame(self, event: FrameEvent) -> None:
            self.seen.append(("frame", bytes(event.frame.raw)))

        def on_connection(self, event: ConnectionEvent) -> None:
            self.seen.append(("connection", b""))

        def on_run(self, event: RunEvent) -> None:
            assert type(event.data) is memoryview  # uncopied
            self.seen.append(("run", bytes(event.data)))

    immediate, queued_log = Immediate(), list[object]()

    class Queued(_Collect):
        runs_in_pieces = False

    hub = ObserverHub([immediate, Queued(queued_log)], slice_seconds=0.0, inline=False)
    pipe = ConnectionPipeline(
        ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None), settings=PipelineSettings(),
        directory=BrokerDirectory("proxy.example", upstream_tls=False, open_listener=lambda broker: 40001),
        default_broker=UPSTREAM, now_ns=0, publish=hub.publish, observations=False, runs=hub.takes_runs,
        run_views=True)
    pipe.receive(TO_BROKER, CONNECT, 1)
    pipe.receive(TO_CLIENT, CONNECTED, 2)
    data = sends(40, 600)
    buffer = bytearray(data)  # the relay's receive buffer, big enough to be handed over as a view
    pipe.receive(TO_BROKER, memoryview(buffer), 3)
    assert [kind for kind, _ in immediate.seen] == ["connection", "frame", "frame", "run"]  # before any hub turn
    assert immediate.seen[-1][1] == data
    buffer[:] = b"\0" * len(buffer)  # the relay reuses its buffer
    assert hub.queued == 4  # the same events, for the other observer
    import trio

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        hub.close()
    runs = [event for event in queued_log if isinstance(event, RunEvent)]
    assert [bytes(run.data) for run in runs] == [data]
    assert len(immediate.seen) == 4  # delivered once


def test_with_only_immediate_observers_the_hub_queues_nothing() -> None:
    class Immediate(_Collect):
        immediate = True

    log: list[object] = []
    hub = ObserverHub([Immediate(log)], queue_size=1, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    runs = [RunEvent(info, TO_BROKER, 0, b"x" * 300, 0, index * 300, 0) for index in range(5)]
    for run in runs:
        hub.publish(run)
    assert log == runs and (hub.queued, hub.dropped) == (0, 0)


def test_pieces_of_a_long_run_still_to_deliver_count_as_queued() -> None:
    # (the test API's capture windows wait until ``queued`` is 0: the pieces of a run the hub
    # took off its queue but has not yet handed out are still on their way)
    import trio

    hub = ObserverHub(run_piece_bytes=1000, inline=False)
    seen: list[int] = []

    class FrameByFrame(_Collect):
        runs_in_pieces = True

        def on_run(self, event: RunEvent) -> None:
            seen.append(hub.queued)

    hub.observers.append(FrameByFrame([]))
    data = sends(20, 600)  # 12 000 bytes: pieces of at most 1 000 bytes, one frame each
    hub.publish(RunEvent(ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None), TO_BROKER, 0, data, 0, 0, 0))
    assert hub.queued == 1

    async def deliver() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            hub.close()

    trio.run(deliver)
    assert seen == list(range(19, -1, -1))
    assert hub.queued == 0


async def test_an_event_handed_straight_to_the_waiting_hub_counts_as_queued_until_delivered() -> None:
    # The test API's capture windows end once ``queued`` is 0: an event published while the hub's
    # task waits goes straight to that task (never into the channel's buffer) and must still count,
    # or a window ends before its last frame is delivered (a capture that missed 1 frame of 30).
    import trio
    import trio.testing

    log: list[object] = []
    hub = ObserverHub([_Collect(log)], inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        await trio.testing.wait_all_tasks_blocked()  # the hub's task waits for an event
        hub.publish(RunEvent(info, TO_BROKER, 0, sends(1, 10), 0, 0, 0))
        assert hub.queued == 1 and not log
        await trio.testing.wait_all_tasks_blocked()
        assert hub.queued == 0 and len(log) == 1 and hub.delivered == 1
        hub.close()


async def test_observers_that_take_views_get_runs_copied_into_the_hubs_ring_and_its_space_comes_back() -> None:
    """With every queued observer taking views (``run_views``: telemetry), the hub copies each run into its
    run ring, not into a ``bytes`` of its own (those filled the top of the heap and, freed together,
    were given back to the system and faulted in again): what each observer reads is the stream as
    received, though the relay reuses its buffer, and the ring's space is reused once delivered."""
    import trio
    import trio.testing

    log: list[object] = []
    hub = ObserverHub([_Views(log)], queue_bytes=2500, run_piece_bytes=512, slice_seconds=60.0, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    stream = sends(200, 40)  # frames of ~75 bytes, 4 rounds' worth
    buffer = bytearray(1000)  # the relay's receive buffer
    runs, position, accepted, dropped = 0, 0, [], 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        for round_ in range(4):
            for _ in range(4):  # 4 runs of 900 bytes a round: the ring takes 2 of them
                if position >= len(stream):
                    break
                chunk = stream[position:position + 900]
                buffer[:len(chunk)] = chunk
                before = hub.dropped
                hub.publish(RunEvent(info, TO_BROKER, 0, memoryview(buffer)[:len(chunk)], 0,  # type: ignore[arg-type]
                                     position, 0))
                if hub.dropped == before:
                    accepted.append((position, chunk))
                else:
                    dropped += 1
                buffer[:] = b"\xff" * len(buffer)  # reused
                position += len(chunk)
                runs += 1
            await trio.testing.wait_all_tasks_blocked()  # the hub delivered all
            assert hub.queued == 0
            assert hub._ring is not None and hub._ring.runs == 0, round_  # delivered: its space is free
        hub.close()
    assert dropped and len(accepted) >= 2 * 4 - 1  # each round's first runs fit again
    delivered: dict[int, bytes] = dict(log)  # type: ignore[arg-type]  # (stream position: bytes of each piece)
    got = b"".join(delivered[pos] for pos in sorted(delivered))
    assert got == b"".join(chunk for _, chunk in accepted)
    assert hub.delivered == len(log) > len(accepted)  # (in pieces)
    assert hub._queued_run_bytes == 0


async def test_the_hubs_ring_gives_back_a_backlogs_pages_once_it_has_gone_though_no_event_comes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst fills the hub's ring past the pages runs reuse; once delivered, those pages go back to the
    system although the proxy then stays idle (the hub's delivery task waits for an event for good)."""

    import trio
    import trio.testing

    from proxy.recording import run_ring
    from proxy.server import observer_hub

    monkeypatch.setattr(run_ring, "REUSE_FROM", 256 * 1024)
    monkeypatch.setattr(observer_hub, "RING_TICK_SECONDS", 0.02)
    log: list[object] = []
    hub = ObserverHub([_Views(log)], queue_bytes=1 << 20, slice_seconds=60.0, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    run = sends(1300, 40)  # ~100 KiB of frames

    def resident_kib() -> int:
        assert hub._ring is not None and hub._ring._address is not None
        return _resident_kib(hub._ring._address, hub._ring.size)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            for position in range(0, 8 * len(run), len(run)):  # a burst: 8 runs before the hub's task goes on
                hub.publish(RunEvent(info, TO_BROKER, 0, run, 0, position, 0))
            assert hub.dropped == 0 and resident_kib() >= 700
            await trio.testing.wait_all_tasks_blocked()
            assert hub.queued == 0 and hub._ring is not None and hub._ring.runs == 0
            for _ in range(500):  # (no event comes any more)
                if resident_kib() <= 256:
                    break
                await trio.sleep(0.01)
            assert resident_kib() <= 256
            hub.publish(RunEvent(info, TO_BROKER, 0, run, 0, 8 * len(run), 0))  # the ring is in use again
            await trio.testing.wait_all_tasks_blocked()
            assert hub.queued == 0 and hub._ring is not None and hub._ring.runs == 0
            hub.close()
    assert b"".join(data for _, data in sorted(log)) == run * 9  # type: ignore[misc]


async def test_the_hubs_ring_is_memory_of_its_own_in_huge_pages_where_the_system_gives_them() -> None:
    """The hub's ring is private memory in transparent huge pages: a saturating burst's backlog faults in
    2 MiB at a time on the relay's thread, not each page of 4 KiB (memory shared with a writer process, as
    the recorder's ring is, gets no huge pages)."""
    import trio
    import trio.testing

    if not _huge_pages_offered():
        pytest.skip("no transparent huge pages here")
    log: list[object] = []
    hub = ObserverHub([_Views(log)], queue_bytes=8 << 20, slice_seconds=60.0, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    run = sends(1300, 40)  # ~100 KiB of frames
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            for position in range(0, 60 * len(run), len(run)):  # a burst of ~6 MiB
                hub.publish(RunEvent(info, TO_BROKER, 0, run, 0, position, 0))
            assert hub.dropped == 0 and hub._ring is not None and hub._ring._address is not None
            assert hub._ring.fd is None  # (no descriptor: no other process maps it)
            assert _huge_kib(hub._ring._address) >= 2048
            await trio.testing.wait_all_tasks_blocked()
            hub.close()
    assert len(log) >= 60


def _huge_pages_offered() -> bool:
    """Whether the system gives transparent huge pages (to memory that asks: ``madvise``, or ``always``)."""
    from pathlib import Path

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.exists() and "[never]" not in thp.read_text()


def _huge_kib(address: int) -> int:
    """The memory of the mapping at ``address`` in huge pages (its ``AnonHugePages`` in /proc/self/smaps)."""
    return _smaps_kib(address, "AnonHugePages:")


def _resident_kib(address: int, size: int) -> int:
    """The memory from ``address`` on, ``size`` bytes, that is in use (``mincore``: the mapping in smaps may
    have merged with others)."""
    import ctypes
    import mmap

    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    assert mincore(address, size, pages) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in pages.raw) * mmap.PAGESIZE // 1024


def _smaps_kib(address: int, field: str) -> int:
    """A field of the mapping at ``address`` in /proc/self/smaps (KiB)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == field:
                return int(line.split()[1])
    raise AssertionError("no mapping at the ring's address")


class _Failing(_Views):
    def on_run(self, event: RunEvent) -> None:
        raise RuntimeError("an observer bug")


async def test_an_observer_whose_on_run_raises_is_counted_and_the_others_and_the_ring_go_on() -> None:
    """The hub hands each run to each observer's ``on_run`` directly: one that raises is counted (and logged),
    the next observer still gets the run, later runs still come, and the ring's space still comes back."""
    import trio
    import trio.testing

    log: list[object] = []
    hub = ObserverHub([_Failing([]), _Views(log)], inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    frame = sends(1, 10)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            for index in range(3):  # lone runs, each handed to the waiting hub, then a backlog of two
                await trio.testing.wait_all_tasks_blocked()
                hub.publish(RunEvent(info, TO_BROKER, 0, frame, 0, index * len(frame), 0))
            hub.publish(RunEvent(info, TO_BROKER, 0, frame, 0, 3 * len(frame), 0))
            await trio.testing.wait_all_tasks_blocked()
            assert hub.queued == 0 and hub._ring is not None and hub._ring.runs == 0
            hub.close()
    assert hub.observer_errors == 4 and hub.delivered == 4
    assert log == [(index * len(frame), frame) for index in range(4)]


async def test_an_event_waiting_behind_the_one_handed_to_the_hub_goes_in_the_same_turn() -> None:
    """The hub skips looking in its channel when nothing was put there (a lone run, below saturation the
    common case), never when something was: an event published after the one handed straight to the
    waiting hub is delivered in the same turn, the relays (here: a task that marks its turns) not in between."""
    import trio
    import trio.testing

    log: list[object] = []
    # (time passes only in the relays' turns, a millisecond each: the hub's slices do not hang on how fast this
    # machine runs the test — a loaded one ended a slice of the real clock before the second event)
    now = [0.0]
    hub = ObserverHub([_Views(log)], clock=lambda: now[0], side_clock=lambda: 0.0, inline=False)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    frame = sends(1, 10)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            for pair in range(12):  # (the scheduler orders a turn's tasks at random: several tries)
                await trio.testing.wait_all_tasks_blocked()
                for index in (2 * pair, 2 * pair + 1):
                    hub.publish(RunEvent(info, TO_BROKER, 0, frame, 0, index * len(frame), 0))
                for _ in range(3):
                    log.append("relay")
                    now[0] += 0.001
                    await trio.lowlevel.checkpoint()
            await trio.testing.wait_all_tasks_blocked()
            hub.close()
    delivered = [index for index, entry in enumerate(log) if entry != "relay"]
    assert len(delivered) == 24
    assert all(second == first + 1 for first, second in zip(delivered[::2], delivered[1::2], strict=True))


def test_with_nothing_waiting_an_event_goes_to_the_observers_as_it_is_published() -> None:
    """Below saturation each run went through the queue alone: a copy, a wake-up of the hub's task and a trip
    through the scheduler per run, more than telemetry's own work on it.  Now, with nothing waiting, the
    observers get it in ``publish`` (no task runs here): one that takes views gets the relay's view itself, one
    that keeps what it gets a copy, and nothing is queued."""
    views: list[object] = []
    kept: list[object] = []
    hub = ObserverHub([_Collect(kept)])
    viewer = ObserverHub([_Views(views)])
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    buffer = bytearray(sends(2, 10))
    run = memoryview(buffer)
    for target in (hub, viewer):
        target.publish(RunEvent(info, TO_BROKER, 0, run, 0, 0, 0, 2))  # type: ignore[arg-type]
        target.publish(ConnectionEvent(info, 1, closed=True, reason="done"))
        assert (target.queued, target.delivered, target.dropped) == (0, 2, 0)
    assert views == [(0, bytes(buffer))]
    (event,) = kept
    assert isinstance(event, RunEvent) and type(event.data) is bytes and event.data == bytes(buffer)
    assert event.frames == 2
    buffer[:4] = b"\0\0\0\0"  # the relay reuses its buffer: the copy kept stays as it was
    assert event.data == bytes(sends(2, 10))


async def test_once_the_share_is_spent_events_queue_and_keep_their_order() -> None:
    """What observers take in ``publish`` is charged to the hub's account, which only the relays' time fills:
    an observer slower than its share gets the next events through the queue, in the hub's turns, and an
    event never overtakes one queued before it; a run longer than a piece always goes through the queue."""
    import trio
    import trio.testing

    now = [0.0]

    class Slow(_Collect):
        def on_run(self, event: RunEvent) -> None:
            now[0] += 0.001  # a millisecond a run
            self.log.append(event.stream_pos)

    log: list[object] = []
    hub = ObserverHub([Slow(log)], clock=lambda: now[0], side_clock=lambda: 0.0, share=0.5, run_piece_bytes=4096,
                      slice_seconds=0.0)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    frame = sends(1, 10)
    now[0] += 0.01  # the relays ran 10 ms: the hub has earned a share of that (at 0.5, as much)
    published: list[int] = []
    inline: list[int] = []
    for index in range(20):
        published.append(index * len(frame))
        before = len(log)
        hub.publish(RunEvent(info, TO_BROKER, 0, frame, 0, index * len(frame), 0))
        if len(log) > before:
            inline.append(index)
        now[0] += 0.0002  # the relays' turn between two runs
    # 10 ms earned, each run costs 1 ms and the relays' 0.2 ms turn between two earns 0.2: 13 runs, then the queue
    assert inline == list(range(13)), inline
    now[0] += 1.0  # the account is full again, but events wait: the next one queues behind them
    published.append(20 * len(frame))
    hub.publish(RunEvent(info, TO_BROKER, 0, frame, 0, 20 * len(frame), 0))
    assert hub.queued == 21 - len(inline) and len(log) == len(inline)
    long_run = sends(400, 10)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            await trio.testing.wait_all_tasks_blocked()
            assert log == published and hub.queued == 0  # the queued ones in order, after those taken at once
            now[0] += 1.0
            hub.publish(RunEvent(info, TO_BROKER, 0, long_run, 0, 10_000, 0))
            assert log == published  # longer than a piece: through the queue, in pieces
            await trio.testing.wait_all_tasks_blocked()
            hub.close()
    assert log[21] == 10_000 and len(log) > 22


def test_events_published_while_the_hub_defers_go_on_at_the_flush_in_order() -> None:
    """The reactor's hop defers around a read it relays, so that the observers work on it after its write: at
    ``flush`` the immediate observer (the recorder, which copies the relay's view) and the queued ones get the
    events in order, as ``publish`` would have given them (here at once: nothing waits), and a view of the
    receive buffer is read before the relay reuses the buffer."""

    class Immediate(_Collect):
        immediate = True

        def on_run(self, event: RunEvent) -> None:
            self.log.append(("immediate", event.stream_pos))

    log: list[object] = []
    hub = ObserverHub([Immediate(log), _Views(log)])
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    buffer = bytearray(sends(2, 10))
    hub.defer()
    hub.publish(RunEvent(info, TO_BROKER, 0, memoryview(buffer), 0, 0, 0, 2))  # type: ignore[arg-type]
    hub.publish(RunEvent(info, TO_BROKER, 0, memoryview(buffer)[:10], 0, len(buffer), 0))  # type: ignore[arg-type]
    assert log == [] and hub.delivered == 0  # (the hop's write comes here)
    hub.flush()
    assert log == [("immediate", 0), (0, bytes(buffer)), ("immediate", len(buffer)), (len(buffer), bytes(buffer[:10]))]
    assert (hub.queued, hub.delivered, hub.dropped) == (0, 2, 0)
    hub.publish(RunEvent(info, TO_BROKER, 0, memoryview(buffer), 0, 99, 0))  # type: ignore[arg-type]
    assert log[-2:] == [("immediate", 99), (99, bytes(buffer))] and hub.delivered == 3  # no longer deferring
