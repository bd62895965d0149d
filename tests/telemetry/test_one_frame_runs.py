"""A run that is one whole frame takes telemetry's one-frame lane and reports what the general run path reports.

While the relay reads frames as fast as they come, a run it hands over is one frame (a SEND,
or a receipt read alone).  ``TelemetryObserver.on_run`` gives those to ``Telemetry.passed_send`` /
``Telemetry.passed_receipt`` instead of cutting the run and walking it with
``Telemetry.passed_run``.  Fed the same runs — random traffic cut at random into runs,
mostly one frame each, some longer, some cut inside frames, some dropped (the hub's queue
was full) — the lane and the general path must leave the same metrics, the same spans
(the same sampling draws), the same counts of frames seen, spans skipped and frames lost.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.hooks import ConnectionEvent, RunEvent
from proxy.core.run_cutter import RunCutter
from proxy.protocol.frame import frame_from_bytes
from proxy.protocol.session import Direction
from proxy.telemetry import TelemetryPipeline
from proxy.telemetry.observer import TelemetryObserver

from .test_data_path import BROKER, TRAFFIC, Wire, _info, _opened, _otlp_points, _pipeline, _spans

TO_BROKER = Direction.TO_BROKER


class GeneralPath(TelemetryObserver):
    """on_run the way every run went before the lane: cut by the RunCutter, walked by passed_run."""

    def on_run(self, event: RunEvent) -> None:
        conn_id, direction, data = event.connection.conn_id, event.direction, event.data
        cutter = self._cutters.setdefault((conn_id, direction), RunCutter())
        completed, pos = cutter.begin(data, event.lead, event.stream_pos)
        origin = "client" if direction is TO_BROKER else "broker"
        broker = event.connection.broker_url
        if completed is not None:
            self.telemetry.passed_run(conn_id, direction, completed, 0, event.ts_ns, event.forwarded_ns, origin,
                                      broker)
        cutter.end(data, self.telemetry.passed_run(conn_id, direction, data, pos, event.ts_ns, event.forwarded_ns,
                                                   origin, broker))


def random_runs(wires: list[Wire], rng: random.Random) -> list[RunEvent | Wire]:
    """The passed-through frames as RunEvents (each frame mostly a run of its own; dropped runs left out, their
    stream bytes counted), the proxy's own frames and the closes as the wires they are."""
    out: list[RunEvent | Wire] = []
    positions: dict[tuple[int, Direction], int] = {}
    leads: dict[tuple[int, Direction], int] = {}  # bytes of a frame cut at the previous run's end
    pending: list[Wire] = []

    def flush() -> None:
        if not pending:
            return
        first = pending[0]
        key = (first.conn, first.direction)
        data = b"".join(wire.raw for wire in pending)
        pending.clear()
        pos = 0
        while pos < len(data):
            take = rng.choice((len(data), len(data), len(data), 3, 9, 40, 700))
            piece = data[pos:pos + take]
            stream_pos = positions.get(key, 0)
            lead = leads.get(key, 0)
            if rng.random() >= 0.05:  # else dropped: a full queue
                out.append(RunEvent(_info(first.conn), first.direction, first.ts_ns, piece, min(lead, len(piece)),
                                    stream_pos, first.ts_ns + 7))
            positions[key] = stream_pos + len(piece)
            # (where the next run starts inside a frame: its lead; only the cutter's gap handling reads it)
            leads[key] = _rest_of_cut_frame(data, pos + len(piece))
            pos += len(piece)

    for wire in wires:
        if pending and (wire.close or wire.origin is not None or (wire.conn, wire.direction) !=
                        (pending[0].conn, pending[0].direction) or rng.random() < 0.8):
            flush()
        if wire.close or wire.origin is not None:
            out.append(wire)
        else:
            pending.append(wire)
    flush()
    return out


def _rest_of_cut_frame(data: bytes, cut: int) -> int:
    """Bytes from ``cut`` to the end of the frame it falls inside (0: it falls between frames)."""
    pos = 0
    while pos < cut:
        pos += int.from_bytes(data[pos:pos + 4], "big") + 4 if len(data) - pos >= 4 else len(data) - pos
    return pos - cut


def feed(events: list[RunEvent | Wire], wires: list[Wire], built: TelemetryPipeline,
         observer: TelemetryObserver) -> None:
    for conn, ts in _opened(wires):
        observer.on_connection(ConnectionEvent(_info(conn), ts, closed=False))
    for event in events:
        if isinstance(event, RunEvent):
            # as the observer hub hands runs over: views of memory reused once on_run returns
            scratch = bytearray(event.data)
            observer.on_run(RunEvent(event.connection, event.direction, event.ts_ns,
                                     memoryview(scratch),  # type: ignore[arg-type]
                                     event.lead, event.stream_pos, event.forwarded_ns))
            scratch[:] = b"\xff" * len(scratch)
        elif event.close:
            observer.on_connection(ConnectionEvent(_info(event.conn), event.ts_ns, closed=True, reason="done"))
        else:
            built.telemetry.frame(event.conn, event.direction, frame_from_bytes(event.raw, strict=False),
                                  event.ts_ns, forwarded_ns=event.ts_ns + 7, origin=event.origin, broker=BROKER)


def _lost(observer: TelemetryObserver) -> list[tuple[Any, ...]]:
    return sorted((key, cutter.lost, cutter.cut_short) for key, cutter in observer._cutters.items())


@settings(max_examples=25, deadline=None)
@given(traffic=st.sampled_from(sorted(TRAFFIC)), mode=st.sampled_from(["metrics", "traces-1%", "traces-30%"]),
       seed=st.integers(0, 2**32))
def test_one_frame_runs_report_what_the_general_run_path_reports(traffic: str, mode: str, seed: int) -> None:
    wires = TRAFFIC[traffic](seed % 7 + 1)
    events = random_runs(wires, random.Random(seed))
    lane, lane_spans = _pipeline(mode)
    general, general_spans = _pipeline(mode)
    general_observer = GeneralPath(general.telemetry)
    taken: list[int] = []
    for name in ("passed_send", "passed_receipt"):
        method = getattr(lane.telemetry, name)

        def counting(*args: Any, _method: Any = method) -> None:
            taken.append(len(args[1]))
            _method(*args)

        setattr(lane.telemetry, name, counting)
    feed(events, wires, lane, lane.observer)
    feed(events, wires, general, general_observer)
    lane.force_flush()
    general.force_flush()
    one_frame_runs = sum(1 for event in events if isinstance(event, RunEvent) and event.lead == 0
                         and len(event.data) >= 8 and int.from_bytes(event.data[:4], "big") + 4 == len(event.data))
    assert len(taken) >= one_frame_runs * 0.8 > 0  # (a run after a frame cut short is no lane's)
    assert lane.telemetry.frames_seen == general.telemetry.frames_seen
    assert lane.prometheus_text() == general.prometheus_text()
    assert lane.metrics is not None and general.metrics is not None
    assert _otlp_points(lane.metrics) == _otlp_points(general.metrics)
    assert _spans(lane_spans) == _spans(general_spans)
    if lane.telemetry.spans is not None and general.telemetry.spans is not None:
        assert lane.telemetry.spans.spans_skipped == general.telemetry.spans.spans_skipped
        assert lane.telemetry.spans.draw() == general.telemetry.spans.draw()  # the same draws so far
    assert _lost(lane.observer) == _lost(general_observer)
    lane.shutdown()
    general.shutdown()


@pytest.mark.parametrize(("lead", "carried", "taken"), [(0, b"", True), (5, b"", False), (0, b"\x00\x00", False)])
def test_the_cutter_passes_a_whole_run_as_begin_and_end_would(lead: int, carried: bytes, taken: bool) -> None:
    """passes_whole moves past a run only when begin would read it from its start with nothing carried, and
    leaves the cutter where begin and end would: the next run (the rest of a frame) is no gap to either."""
    frame = (8).to_bytes(4, "big") + (4).to_bytes(4, "big") + b"\x08\x12\x00\x00"
    lane, general = RunCutter(), RunCutter()
    for cutter in (lane, general):
        cutter.begin(b"", 0, 100)
        cutter.end(carried, 0)
    assert lane.passes_whole(lead, 100, len(frame)) is taken
    cutters = (general,) if taken else (lane, general)
    results = []
    for cutter in cutters:
        completed, pos = cutter.begin(frame, lead, 100)
        results.append((completed, pos))
        cutter.end(frame, len(frame))  # (whatever frames lay from pos were walked)
    if taken:
        assert results == [(None, 0)]
    else:
        assert results[0] == results[1]
    following = b"xyz" + frame
    assert lane.begin(following, 3, 100 + len(frame)) == general.begin(following, 3, 100 + len(frame))
    assert (lane.lost, lane.cut_short) == (general.lost, general.cut_short)
