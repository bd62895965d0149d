"""Observers that take passed-through bytes in bulk (``on_run``: the recorder) cost no decoding.

With every observer taking runs, the pipeline hands them each stretch of bytes it
passed through unchanged as one RunEvent (no Frame, no FrameEvent) and the frames it
looks at anyway as FrameEvents: together, in order, they are each direction's stream.
"""

from __future__ import annotations

import random

from proxy.config.proxy_config import ServiceUrl
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.protocol.session import Direction
from proxy.server.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, Origin, RunEvent
from proxy.server.lookup import BrokerDirectory
from proxy.server.observer_hub import ObserverHub
from proxy.server.pipeline import ConnectionPipeline, PipelineSettings, Send

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

    hub = ObserverHub([Runs()], queue_bytes=1000)
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    for index in range(5):
        hub.publish(RunEvent(info, TO_BROKER, 0, b"x" * 300, 0, index * 300, 0))
    assert (hub.queued, hub.dropped) == (3, 2)
