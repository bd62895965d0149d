"""The test rig's FrameCounter frames runs of passed-through bytes itself: a frame counted once,
wherever runs cut the stream, and a run whose lead or stream position disagrees is noticed."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.hooks import ConnectionEvent, ConnectionInfo, RunEvent
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.protocol.session import Direction
from proxy.testing.rig import FrameCounter

CONNECTION = ConnectionInfo(conn_id=3, client="127.0.0.1:5000", listener="127.0.0.1:6650", broker_url=None)
TO_BROKER = Direction.TO_BROKER


def frames() -> list[tuple[str, bytes]]:
    """Frames of several sizes and types, as a producer's stream has them."""
    out = [("PING", encode_command(api.CommandPing()))]
    for i in range(12):
        send = api.CommandSend(producer_id=1, sequence_id=i)
        metadata = api.MessageMetadata(producer_name="p", sequence_id=i, publish_time=1)
        out.append(("SEND", encode_payload_command(send, metadata, bytes(7 * i))))
    out.append(("PONG", encode_command(api.CommandPong())))
    return out


def runs(stream: bytes, cuts: list[int], starts: list[int]) -> list[RunEvent]:
    """The stream cut at ``cuts``, each piece a RunEvent with its position and the lead it continues."""
    events, edges = [], [0, *sorted(set(cuts)), len(stream)]
    for begin, end in pairwise(edges):
        if begin == end:
            continue
        following = min([s for s in starts if s >= begin] + [end])
        events.append(RunEvent(connection=CONNECTION, direction=TO_BROKER, ts_ns=0, data=stream[begin:end],
                               lead=following - begin, stream_pos=begin, forwarded_ns=0))
    return events


def stream_of(picked: list[tuple[str, bytes]]) -> tuple[bytes, list[int], Counter[tuple[str, str, str]]]:
    starts, at = [], 0
    for _, raw in picked:
        starts.append(at)
        at += len(raw)
    expected = Counter((str(TO_BROKER), "client", name) for name, _ in picked)
    return b"".join(raw for _, raw in picked), starts, expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(frames()), min_size=1, max_size=30), st.data())
def test_every_frame_counted_once_wherever_runs_cut_the_stream(picked: list[tuple[str, bytes]],
                                                                data: st.DataObject) -> None:
    stream, starts, expected = stream_of(picked)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=40))
    counter = FrameCounter()
    for event in runs(stream, cuts, starts):
        counter.on_run(event)
    assert counter.counts == expected
    assert (counter.mismatches, counter.gaps) == (0, 0)


def test_a_run_whose_lead_disagrees_is_noticed() -> None:
    stream, starts, expected = stream_of(frames())
    events = runs(stream, [starts[3] + 12, starts[6]], starts)
    counter = FrameCounter()
    counter.on_run(events[0])
    wrong = events[1]
    counter.on_run(RunEvent(connection=CONNECTION, direction=TO_BROKER, ts_ns=0, data=wrong.data,
                            lead=wrong.lead + 1, stream_pos=wrong.stream_pos, forwarded_ns=0))
    counter.on_run(events[2])
    assert counter.mismatches == 1
    assert counter.counts == expected  # it frames by its own reading, not by the lead it was told


def test_after_a_lost_run_counting_resumes_at_the_next_frame() -> None:
    stream, starts, expected = stream_of(frames())
    events = runs(stream, [starts[2] + 3, starts[5] + 9], starts)
    counter = FrameCounter()
    counter.on_run(events[0])
    counter.on_run(events[2])  # events[1] (frame 2 ends in it, 3..5 begin in it) never arrived
    assert counter.gaps == 1
    lost = Counter((str(TO_BROKER), "client", name) for name, _ in frames()[2:6])
    assert counter.counts == expected - lost


def test_a_closed_connection_forgets_its_streams() -> None:
    stream, starts, _ = stream_of(frames())
    counter = FrameCounter()
    counter.on_run(runs(stream, [starts[1] + 2], starts)[0])
    counter.on_connection(ConnectionEvent(connection=CONNECTION, ts_ns=0, closed=True, reason="done"))
    counter.on_run(RunEvent(connection=CONNECTION, direction=TO_BROKER, ts_ns=0, data=stream, lead=0,
                            stream_pos=0, forwarded_ns=0))  # the same id again, a new connection
    assert (counter.mismatches, counter.gaps) == (0, 0)
