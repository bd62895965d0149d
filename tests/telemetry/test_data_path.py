"""Telemetry's fast path for SEND / SEND_RECEIPT reports exactly what the full path reports.

Frames the proxy passed through unchanged reach telemetry in runs; a canonical SEND or
SEND_RECEIPT among them is read without decoding (:mod:`proxy.telemetry.data_path`).
The same frames fed one by one through :meth:`Telemetry.frame` (the full path: protobuf
decoding and the session machine) must give the same /metrics text, the same OTLP
metrics and the same spans — for traffic the official client made (recorded) and for
synthetic sessions with batches, receipts out of order, sends never answered, send
errors, a geo-replicator, trace context, compressed payloads, odd encodings and
connections closed with requests pending.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.core.hooks import ConnectionEvent, ConnectionInfo, RunEvent
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import compression
from proxy.protocol.frame import encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import MAX_PENDING_REQUESTS, Direction
from proxy.recording.reader import open_recordings
from proxy.telemetry import ExportSettings, TelemetryPipeline, build_telemetry
from proxy.telemetry.data_path import receipt_fields, send_fields
from proxy.telemetry.metrics import ProxyMetrics

from .scripted import padded_varint
from .scripted import send as scripted_send

TO_BROKER, TO_CLIENT = Direction.TO_BROKER, Direction.TO_CLIENT
ROOT = Path(__file__).resolve().parents[2]
BROKER = "pulsar://127.0.0.1:6650"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass(frozen=True)
class Wire:
    """One frame as the relay saw it (``close`` instead: the connection closed then)."""

    conn: int
    direction: Direction
    ts_ns: int
    raw: bytes = b""
    origin: str | None = None
    close: bool = False


def _receipt(producer_id: int, sequence_id: int) -> bytes:
    return encode_command(api.CommandSendReceipt(producer_id=producer_id, sequence_id=sequence_id,
                                                 message_id=api.MessageIdData(ledgerId=7, entryId=sequence_id)))


def _plain_send(producer_id: int, sequence_id: int, **fields: int) -> bytes:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1)
    return encode_payload_command(api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, **fields),
                                  metadata, b"payload-%d" % sequence_id)


def synthetic(seed: int) -> list[Wire]:
    """Two producer connections with everything the fast path must get right or hand over."""
    rng = random.Random(seed)
    out: list[Wire] = []
    ts = 1_000_000

    def put(conn: int, direction: Direction, raw: bytes) -> None:
        nonlocal ts
        ts += rng.choice((1_000, 20_000, 300_000, 2_000_000))
        out.append(Wire(conn, direction, ts, raw))

    # a SEND before the handshake: the table refuses it (counted), nothing is paired
    put(2, TO_BROKER, _plain_send(1, 99))
    for conn in (1, 2):
        put(conn, TO_BROKER, encode_command(api.CommandConnect(client_version="t", protocol_version=21)))
        put(conn, TO_CLIENT, encode_command(api.CommandConnected(server_version="b", protocol_version=21)))
        put(conn, TO_BROKER, encode_command(api.CommandProducer(
            topic=f"persistent://public/default/t{conn}", producer_id=1, request_id=1)))
        put(conn, TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=1, producer_name=f"p{conn}")))
    put(1, TO_BROKER, encode_command(api.CommandProducer(topic="persistent://public/default/geo", producer_id=2,
                                                         request_id=2, producer_name="pulsar.repl.east")))
    put(1, TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=2, producer_name="pulsar.repl.east")))
    pending: dict[int, list[tuple[int, int]]] = {1: [], 2: []}
    sequence = 0
    for _ in range(400):
        conn = rng.choice((1, 2))
        sequence += 1
        kind = rng.random()
        producer = 2 if conn == 1 and kind < 0.05 else 1
        if kind < 0.6:
            raw = _plain_send(producer, sequence)
        elif kind < 0.7:
            raw = scripted_send(producer, sequence, batch=[{} for _ in range(rng.randint(2, 9))]).raw
        elif kind < 0.75:
            raw = scripted_send(producer, sequence, properties={"traceparent": TRACEPARENT}).raw
        elif kind < 0.8:
            raw = scripted_send(producer, sequence, batch=[{"traceparent": TRACEPARENT}, {}],
                                compression_type=compression.LZ4).raw
        elif kind < 0.85:
            raw = scripted_send(producer, sequence, compression_type=compression.ZLIB).raw
        elif kind < 0.9:  # fields telemetry does not read, a message_id (length-delimited), num_messages 0
            raw = rng.choice((_plain_send(producer, sequence, txnid_least_bits=5, highest_sequence_id=sequence),
                              _plain_send(producer, sequence, num_messages=0),
                              encode_payload_command(api.CommandSend(
                                  producer_id=producer, sequence_id=sequence,
                                  message_id=api.MessageIdData(ledgerId=1, entryId=2)),
                                  api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1), b"x")))
        elif kind < 0.93:  # a SEND from a producer never created
            raw = _plain_send(9, sequence)
        else:  # a SEND whose sequence id repeats one still pending
            earlier = pending[conn][0][1] if pending[conn] else sequence
            raw = _plain_send(1, earlier)
        put(conn, TO_BROKER, raw)
        pending[conn].append((producer, sequence))
        if rng.random() < 0.4 and pending[conn]:
            # answer a few, out of order; some never
            rng.shuffle(pending[conn])
            for _ in range(rng.randint(1, len(pending[conn]))):
                producer_id, seq = pending[conn].pop()
                roll = rng.random()
                if roll < 0.1:
                    continue  # unanswered
                if roll < 0.15:
                    put(conn, TO_CLIENT, encode_command(api.CommandSendError(
                        producer_id=producer_id, sequence_id=seq, error=api.ServerError.PersistenceError,
                        message="disk")))
                elif roll < 0.2:
                    put(conn, TO_CLIENT, encode_command(api.CommandSendReceipt(producer_id=producer_id,
                                                                               sequence_id=seq)))
                elif roll < 0.23:
                    put(conn, TO_CLIENT, _receipt(producer_id, seq + 100_000))  # answers nothing pending
                else:
                    put(conn, TO_CLIENT, _receipt(producer_id, seq))
    ts += 1_000
    out.append(Wire(2, TO_BROKER, ts, close=True))  # closes with requests pending
    for producer_id, seq in pending[1][:5]:
        put(1, TO_CLIENT, _receipt(producer_id, seq))
    ts += 1_000
    out.append(Wire(1, TO_BROKER, ts, close=True))
    return out


def _reframed(raw: bytes, sub_command: bytes) -> bytes:
    """``raw`` (a SEND or SEND_RECEIPT frame) with its sub-command's bytes replaced, sizes adjusted."""
    kind = raw[9]
    command = bytes((0x08, kind, ((6 if kind == 6 else 7) << 3) | 2)) + padded_varint(len(sub_command)) + sub_command
    rest = raw[8 + int.from_bytes(raw[4:8], "big"):]  # the payload section: its checksum does not cover the command
    return (4 + len(command) + len(rest)).to_bytes(4, "big") + len(command).to_bytes(4, "big") + command + rest


def _ids(producer_id: int, sequence_id: int, padding: int = 0) -> bytes:
    return b"\x08" + padded_varint(producer_id, padding) + b"\x10" + padded_varint(sequence_id, padding)


def odd_encodings(seed: int) -> list[Wire]:
    """SENDs and receipts in every encoding the bulk patterns must take or leave to the per-frame path.

    Non-minimal varints on either side (the raw ids then differ though the values agree),
    multi-byte and 9- and 10-byte ids, num_messages of 1 to 5 bytes, receipts with and
    without a message id, with partition -1, batch fields, highest_sequence_id -1, an
    ack_set or a repeated sequence_id, a producer closed and its id reused for another topic while SENDs are
    pending, a SEND repeating a pending id, long runs of SENDs answered out of order.
    """
    rng = random.Random(seed)
    out: list[Wire] = []
    ts = 5_000_000

    def put(direction: Direction, raw: bytes, conn: int = 1) -> None:
        nonlocal ts
        ts += rng.choice((0, 0, 0, 1_000, 90_000))  # often 0: neighbours share a run
        out.append(Wire(conn, direction, ts, raw))

    def producer(producer_id: int, topic: str, request_id: int) -> None:
        put(TO_BROKER, encode_command(api.CommandProducer(topic=f"persistent://public/default/{topic}",
                                                          producer_id=producer_id, request_id=request_id)))
        put(TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=request_id, producer_name=topic)))

    put(TO_BROKER, encode_command(api.CommandConnect(client_version="t", protocol_version=21)))
    put(TO_CLIENT, encode_command(api.CommandConnected(server_version="b", protocol_version=21)))
    for producer_id, topic in ((0, "zero"), (1, "one"), (300, "three-hundred"), (2**40, "big")):
        producer(producer_id, topic, producer_id % 1000 + 1)
    base = _plain_send(1, 1)
    pending: list[tuple[int, int, int]] = []  # (producer id, sequence id, padding of the SEND)
    for index in range(600):
        producer_id = rng.choice((0, 1, 1, 1, 300, 2**40, 77))  # 77: never created
        sequence_id = rng.choice((index, index + 2**20, 2**62 + index, 2**63 + index, 2**64 - 1 - index))
        padding = 1 if rng.random() < 0.1 else 0
        sub = _ids(producer_id, sequence_id, padding)
        roll = rng.random()
        if roll < 0.3:
            sub += b"\x18" + padded_varint(rng.choice((0, 1, 127, 128, 200, 2**21, 2**28 + 5, 2**31 - 1)))
        elif roll < 0.35:
            sub += b"\x18" + padded_varint(3, 1)  # a padded count
        elif roll < 0.4 and pending:
            earlier = rng.choice(pending)  # the same ids as a SEND still pending
            sub = _ids(earlier[0], earlier[1])
            producer_id, sequence_id = earlier[:2]
        put(TO_BROKER, _reframed(base, sub))
        pending.append((producer_id, sequence_id, padding))
        if index == 300:  # producer 1 goes away and comes back on another topic, SENDs of both pending
            put(TO_BROKER, encode_command(api.CommandCloseProducer(producer_id=1, request_id=900)))
            put(TO_CLIENT, encode_command(api.CommandSuccess(request_id=900)))
            producer(1, "one-again", 901)
        if rng.random() < 0.15:  # answer a batch, out of order
            rng.shuffle(pending)
            for _ in range(rng.randint(1, len(pending))):
                producer_id, sequence_id, padding = pending.pop()
                receipt = rng.random()
                if receipt < 0.1:
                    continue
                ids = _ids(producer_id, sequence_id, 1 if receipt < 0.2 else 0)
                message_id = rng.choice((b"", b"\x1a\x04\x08\x07\x10\x05",
                                         b"\x1a" + bytes([15]) + b"\x08\x07\x10\x05\x18" + padded_varint(2**64 - 1),
                                         b"\x1a\x08\x08\x07\x10\x05\x20\x02\x30\x09",
                                         b"\x1a\x06\x08\x07\x10\x05\x28\x01",  # an ack_set
                                         b"\x1a\x04\x10\x05\x08\x07",  # fields out of order
                                         # a message id of 2 bytes, then sequence_id again (the last counts)
                                         b"\x1a\x02\x08\x07\x10" + padded_varint(sequence_id + 1)))
                highest = rng.choice((b"", b"\x20" + padded_varint(2**64 - 1), b"\x20\x05"))
                put(TO_CLIENT, _reframed(_receipt(1, 1), ids + message_id + highest))
    ts += 1_000
    out.append(Wire(1, TO_BROKER, ts, close=True))
    return out


def _respelled_send(producer_id: int, sequence_id: int, metadata: bytes, payload: bytes, count: int = 1,
                    broker_entry: bool = False) -> bytes:
    """A SEND carrying ``metadata`` exactly as spelled (protobuf would write it otherwise, or not read it)."""
    return encode_payload_command(api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=count),
                                  metadata, payload,
                                  broker_entry_metadata=api.BrokerEntryMetadata(index=sequence_id) if broker_entry
                                  else None)


def metadata_spellings(seed: int) -> list[Wire]:
    """SENDs whose metadata the data path decides on without protobuf, or hands to it, in every spelling.

    The data path parses a SEND's metadata (to tell whether a byte search rules trace context
    out) only when its bytes could hold ``compression``'s tag (a 40, or the 00 a padded tag ends
    in): metadata with neither is taken as is, readable or not; a compression named with a padded
    tag (``c0 00``) must still be found, with a trace context in the compressed batch behind it.
    """
    rng = random.Random(seed)
    out: list[Wire] = []
    ts = 9_000_000

    def put(direction: Direction, raw: bytes) -> None:
        nonlocal ts
        ts += rng.choice((0, 0, 1_000, 50_000))
        out.append(Wire(1, direction, ts, raw))

    put(TO_BROKER, encode_command(api.CommandConnect(client_version="t", protocol_version=21)))
    put(TO_CLIENT, encode_command(api.CommandConnected(server_version="b", protocol_version=21)))
    put(TO_BROKER, encode_command(api.CommandProducer(topic="persistent://public/default/spelt", producer_id=1,
                                                      request_id=1)))
    put(TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=1, producer_name="spelt")))
    traced_batch = scripted_send(1, 1, batch=[{"traceparent": TRACEPARENT}, {}], compression_type=compression.LZ4)
    plain_batch = scripted_send(1, 1, batch=[{}, {}], compression_type=compression.ZLIB)
    pending: list[int] = []
    for sequence_id in range(1, 400):
        simple = api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1).SerializeToString()
        kind = rng.randrange(8)
        if kind == 0:  # no 00 or 40 anywhere unless the sequence id has them: taken as is
            raw = _respelled_send(1, sequence_id, simple, b"payload")
        elif kind == 1:  # a 40 in the producer name ('@'): parsed, uncompressed
            raw = _respelled_send(1, sequence_id, api.MessageMetadata(
                producer_name="p@host", sequence_id=sequence_id, publish_time=1).SerializeToString(), b"payload")
        elif kind == 2:  # compression NONE spelt out (40 00)
            raw = _respelled_send(1, sequence_id, simple + b"\x40\x00", b"payload")
        elif kind in (3, 4):  # a compressed batch, its compression's tag padded (c0 00): protobuf reads LZ4/ZLIB
            template = traced_batch if kind == 3 else plain_batch
            section = template.payload
            assert section is not None
            named = api.MessageMetadata()
            named.CopyFrom(section.metadata)
            compression_type = named.compression
            named.ClearField("compression")
            named.sequence_id = sequence_id
            raw = _respelled_send(1, sequence_id, named.SerializeToString() + b"\xc0\x00" + bytes([compression_type]),
                                  section.payload, count=2)
        elif kind == 5:  # metadata protobuf cannot read, with neither byte: taken as is (the full path finds nothing)
            raw = _respelled_send(1, sequence_id, simple + b"\xff\xff", b"payload")
        elif kind == 6:  # metadata protobuf cannot read, with a 40: sent to protobuf, which fails: the full path
            raw = _respelled_send(1, sequence_id, simple + b"\x40\xff", b"payload")
        else:  # broker entry metadata before the checksum: the layout read the long way
            raw = _respelled_send(1, sequence_id, simple, b"payload", broker_entry=True)
        put(TO_BROKER, raw)
        pending.append(sequence_id)
        if rng.random() < 0.3:
            rng.shuffle(pending)
            for _ in range(rng.randint(1, len(pending))):
                put(TO_CLIENT, _receipt(1, pending.pop()))
    ts += 1_000
    out.append(Wire(1, TO_BROKER, ts, close=True))
    return out


def recorded(path: Path) -> list[Wire]:
    """A recording of the official client, as the relay saw it."""
    wires = []
    for recorded_frame in open_recordings(path).frames():
        direction = Direction(recorded_frame.direction)
        default = "client" if direction is TO_BROKER else "broker"
        origin = None if recorded_frame.origin == default else recorded_frame.origin
        wires.append(Wire(recorded_frame.conn, direction, recorded_frame.ts_ns, recorded_frame.raw, origin))
    last = max(wire.ts_ns for wire in wires)
    return wires + [Wire(conn, TO_BROKER, last + 1, close=True) for conn in sorted({w.conn for w in wires})]


def official_client_traffic() -> list[Wire]:
    sample = recorded(ROOT / "recordings" / "sample")
    cassette = recorded(ROOT / "tests" / "examples" / "cassettes" / "orders-roundtrip")
    shift = max(wire.ts_ns for wire in sample)
    return sample + [Wire(wire.conn + 100, wire.direction, wire.ts_ns + shift, wire.raw, wire.origin, wire.close)
                     for wire in cassette]


def _info(conn: int) -> ConnectionInfo:
    return ConnectionInfo(conn, f"127.0.0.1:{50000 + conn}", "127.0.0.1:6650", BROKER)


def _opened(wires: list[Wire]) -> Iterator[tuple[int, int]]:
    seen: set[int] = set()
    for wire in wires:
        if wire.conn not in seen:
            seen.add(wire.conn)
            yield wire.conn, wire.ts_ns


def one_by_one(wires: list[Wire], built: TelemetryPipeline) -> None:
    """The full path: every frame decoded and handed to Telemetry.frame."""
    telemetry = built.telemetry
    for conn, ts in _opened(wires):
        telemetry.connection_opened(conn, ts, _info(conn).client, BROKER)
    for wire in wires:
        if wire.close:
            telemetry.connection_closed(wire.conn, wire.ts_ns, "done")
        else:
            telemetry.frame(wire.conn, wire.direction, frame_from_bytes(wire.raw, strict=False), wire.ts_ns,
                            forwarded_ns=wire.ts_ns + 7, origin=wire.origin, broker=BROKER)


def in_runs(wires: list[Wire], built: TelemetryPipeline, seed: int) -> None:
    """The relay's way: passed-through frames in runs (cut anywhere; with an odd seed as views of memory reused
    after each), the proxy's own frames one by one."""
    rng = random.Random(seed)
    observer, telemetry = built.observer, built.telemetry
    for conn, ts in _opened(wires):
        observer.on_connection(ConnectionEvent(_info(conn), ts, closed=False))
    positions: dict[tuple[int, Direction], int] = {}
    run: list[Wire] = []

    def flush() -> None:
        if not run:
            return
        first = run[0]
        data = b"".join(wire.raw for wire in run)
        key = (first.conn, first.direction)
        pos = 0
        while pos < len(data):  # a run may reach telemetry in pieces cut inside frames
            take = rng.choice((len(data), len(data), 3, 700, 5000))
            piece = data[pos:pos + take]
            if seed % 2:  # as the observer hub hands runs over: views of memory reused once on_run returns
                scratch = bytearray(piece)
                observer.on_run(RunEvent(_info(first.conn), first.direction, first.ts_ns,
                                         memoryview(scratch),  # type: ignore[arg-type]
                                         0, positions.get(key, 0), first.ts_ns + 7))
                scratch[:] = b"\xff" * len(scratch)
            else:
                observer.on_run(RunEvent(_info(first.conn), first.direction, first.ts_ns, piece,
                                         0, positions.get(key, 0), first.ts_ns + 7))
            positions[key] = positions.get(key, 0) + len(data[pos:pos + take])
            pos += take
        run.clear()

    for wire in wires:
        if run and (wire.close or wire.origin is not None or (wire.conn, wire.direction, wire.ts_ns) !=
                    (run[0].conn, run[0].direction, run[0].ts_ns)):
            flush()
        if wire.close:
            observer.on_connection(ConnectionEvent(_info(wire.conn), wire.ts_ns, closed=True, reason="done"))
        elif wire.origin is not None:
            telemetry.frame(wire.conn, wire.direction, frame_from_bytes(wire.raw, strict=False), wire.ts_ns,
                            forwarded_ns=wire.ts_ns + 7, origin=wire.origin, broker=BROKER)
        else:
            run.append(wire)
    flush()


def _batched(wires: list[Wire], seed: int) -> list[Wire]:
    """Neighbouring frames of one direction given one timestamp, as a run shares its event's."""
    rng = random.Random(seed)
    out: list[Wire] = []
    for wire in wires:
        if out and not wire.close and not out[-1].close and out[-1].conn == wire.conn and \
                out[-1].direction == wire.direction and rng.random() < 0.7:
            wire = Wire(wire.conn, wire.direction, out[-1].ts_ns, wire.raw, wire.origin)
        out.append(wire)
    return out


def _pipeline(mode: str) -> tuple[TelemetryPipeline, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    sample = {"metrics": 0.0, "traces-1%": 0.01, "traces-30%": 0.3, "traces-100%": 1.0}[mode]
    if mode == "metrics":
        return build_telemetry(ExportSettings(), seed=5), exporter
    return build_telemetry(ExportSettings(sample=sample), span_exporter=exporter, seed=5), exporter


def _spans(exporter: InMemorySpanExporter) -> list[tuple[object, ...]]:
    by_id = {span.context.span_id: span for span in exporter.get_finished_spans() if span.context is not None}

    def parent_name(span: ReadableSpan) -> str | None:
        parent = by_id.get(span.parent.span_id) if span.parent is not None else None
        return parent.name if parent is not None else None

    return sorted((span.name, span.start_time, span.end_time, sorted((span.attributes or {}).items()),
                   span.status.status_code.name, span.status.description,
                   [(event.name, sorted((event.attributes or {}).items())) for event in span.events],
                   len(span.links), parent_name(span), span.kind.name) for span in exporter.get_finished_spans())


def _otlp_points(metrics: ProxyMetrics) -> list[tuple[str, list[str]]]:
    """The metrics as the OTLP exporter would send them (collection timestamps left out)."""
    data = metrics.reader.get_metrics_data()
    assert data is not None
    request = encode_metrics(data)
    out = []
    for resource_metrics in request.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                points = []
                for point in getattr(metric, kind).data_points:
                    point.start_time_unix_nano = point.time_unix_nano = 0
                    points.append(str(point))
                out.append((f"{metric.name} {metric.unit} {kind}", sorted(points)))
    return sorted(out)


TRAFFIC = {
    "official client (recorded)": lambda seed: _batched(official_client_traffic(), seed),
    "synthetic": lambda seed: _batched(synthetic(seed), seed),
    "odd encodings": odd_encodings,
    "metadata spellings": metadata_spellings,
}


@pytest.mark.parametrize("mode", ["metrics", "traces-1%", "traces-30%", "traces-100%"])
@pytest.mark.parametrize("traffic", sorted(TRAFFIC))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_runs_through_the_fast_path_report_what_frames_one_by_one_report(traffic: str, mode: str,
                                                                         seed: int) -> None:
    wires = TRAFFIC[traffic](seed)
    full, full_spans = _pipeline(mode)
    fast, fast_spans = _pipeline(mode)
    one_by_one(wires, full)
    one_frame: list[bytes] = []
    per_frame = fast.telemetry._one_frame

    def counting(*args: Any) -> None:
        one_frame.append(args[2])
        per_frame(*args)

    fast.telemetry._one_frame = counting  # type: ignore[method-assign]
    in_runs(wires, fast, seed)
    if traffic == "synthetic":  # most SENDs and receipts were accounted in bulk, the unusual ones one by one
        data_path = sum(1 for wire in wires if not wire.close and wire.origin is None and wire.raw[9] in (6, 7))
        in_bulk = data_path - sum(1 for raw in one_frame if raw[9] in (6, 7))
        assert in_bulk > 300 and len(one_frame) > 10
    full.force_flush()
    fast.force_flush()
    assert fast.telemetry.frames_seen == full.telemetry.frames_seen
    assert fast.prometheus_text() == full.prometheus_text()
    assert full.metrics is not None and fast.metrics is not None
    assert _otlp_points(fast.metrics) == _otlp_points(full.metrics)
    assert _spans(fast_spans) == _spans(full_spans)
    if traffic == "synthetic":
        assert 'command="SEND",outcome="ok"' in fast.prometheus_text()
        assert 'command="SEND",outcome="error"' in fast.prometheus_text()
        assert 'command="SEND",outcome="unanswered"' in fast.prometheus_text()
    full.shutdown()
    fast.shutdown()


def test_the_fast_path_takes_the_common_frames_and_hands_over_the_rest() -> None:
    """Canonical SENDs and receipts are read; anything the reader does not follow goes to the full path."""
    assert send_fields(_plain_send(3, 2**40)) == (3, 2**40, 1)
    assert send_fields(_plain_send(3, 4, num_messages=12, txnid_most_bits=9)) == (3, 4, 12)
    with_message_id = encode_payload_command(
        api.CommandSend(producer_id=1, sequence_id=1, message_id=api.MessageIdData(ledgerId=1, entryId=2)),
        api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1), b"x")
    assert send_fields(with_message_id) is None
    assert receipt_fields(_receipt(3, 4)) == (3, 4)
    assert receipt_fields(encode_command(api.CommandSendReceipt(producer_id=3, sequence_id=4))) == (3, 4)
    chunked_id = api.MessageIdData(ledgerId=1, entryId=2, first_chunk_message_id=api.MessageIdData(ledgerId=1,
                                                                                                   entryId=1))
    assert receipt_fields(encode_command(api.CommandSendReceipt(producer_id=3, sequence_id=4,
                                                                message_id=chunked_id))) is None
    # a receipt whose command is not whole protobuf: the full path decides (and counts it not understood)
    good = _receipt(3, 4)
    cmd_size = int.from_bytes(good[4:8], "big")
    truncated = (len(good) - 5).to_bytes(4, "big") + (cmd_size - 1).to_bytes(4, "big") + good[8:-1]
    assert receipt_fields(truncated) is None
    assert send_fields(_receipt(3, 4)) is None and receipt_fields(_plain_send(3, 4)) is None


def test_more_sends_pending_than_the_session_keeps_are_forgotten_alike() -> None:
    """Past the session's limit of pending requests the oldest are forgotten, whichever path filed them.

    The book stops taking SENDs before the session or the timings would overflow, so the
    forgetting happens in the session's order: the same requests end unanswered at close.
    """
    wires = [Wire(1, TO_BROKER, 1, encode_command(api.CommandConnect(client_version="t", protocol_version=21))),
             Wire(1, TO_CLIENT, 2, encode_command(api.CommandConnected(server_version="b", protocol_version=21))),
             Wire(1, TO_BROKER, 3, encode_command(api.CommandProducer(topic="persistent://public/default/t",
                                                                      producer_id=1, request_id=1))),
             Wire(1, TO_CLIENT, 4, encode_command(api.CommandProducerSuccess(request_id=1, producer_name="p")))]
    template = _plain_send(1, 1)
    count = MAX_PENDING_REQUESTS + 500
    wires += [Wire(1, TO_BROKER, 10 + index // 1000, _reframed(template, _ids(1, index))) for index in range(count)]
    # receipts for the first (forgotten) and the last (kept) SENDs, then the close: the rest unanswered
    wires += [Wire(1, TO_CLIENT, 10_000, _receipt(1, index)) for index in (*range(300), *range(count - 300, count))]
    wires.append(Wire(1, TO_BROKER, 10_001, close=True))
    full, _ = _pipeline("metrics")
    fast, _ = _pipeline("metrics")
    one_by_one(wires, full)
    in_runs(wires, fast, 1)
    assert fast.prometheus_text() == full.prometheus_text()
    assert 'outcome="unanswered"' in full.prometheus_text()
    full.shutdown()
    fast.shutdown()


def test_plain_metadata_answers_each_payload_alike_across_the_renewals_of_its_reused_message() -> None:
    """plain_metadata parses into one message kept (a fresh one every RENEW parses): every answer is the
    payload's own, whatever the parses before it held (a compressed payload, unreadable metadata)."""
    from proxy.telemetry.data_path import _ReusedMetadata, plain_metadata

    frames = {
        True: scripted_send(1, 1).raw,
        False: scripted_send(1, 2, compression_type=compression.ZLIB).raw,
    }
    broken = bytearray(frames[True])
    cmd_end = 8 + int.from_bytes(broken[4:8], "big")
    broken[cmd_end + 10:] = b"\xff" * (len(broken) - cmd_end - 10)  # metadata protobuf cannot read
    rng = random.Random(5)
    for _ in range(2 * _ReusedMetadata.RENEW + 10):
        kind = rng.choice((True, False, None))
        raw = bytes(broken) if kind is None else frames[kind]
        assert plain_metadata(raw, 8 + int.from_bytes(raw[4:8], "big")) is kind


def test_traced_sends_whose_metadata_cannot_name_a_compression_are_not_parsed() -> None:
    """While tracing, a SEND's metadata goes through protobuf only when its bytes could hold ``compression``'s
    tag: an unsampled request costs next to nothing (the parse was ~0.6 us of the ~2 us a traced SEND cost)."""
    from proxy.telemetry import data_path

    wires = metadata_spellings(1)[:4]  # the handshake and the producer
    for sequence_id in range(1, 60):
        metadata = api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1).SerializeToString()
        assert 0x00 not in metadata and 0x40 not in metadata
        wires.append(Wire(1, TO_BROKER, 20_000_000 + sequence_id // 10, _respelled_send(1, sequence_id, metadata,
                                                                                       b"payload")))
    wires += [Wire(1, TO_CLIENT, 30_000_000, _receipt(1, sequence_id)) for sequence_id in range(1, 60)]
    parses: list[int] = []
    take = data_path._metadata.take

    def counting() -> api.MessageMetadata:
        parses.append(1)
        return take()

    full, full_spans = _pipeline("traces-30%")
    fast, fast_spans = _pipeline("traces-30%")
    one_by_one(wires, full)
    data_path._metadata.take = counting  # type: ignore[method-assign]
    try:
        in_runs(wires, fast, 2)
    finally:
        del data_path._metadata.take
    assert parses == []
    full.force_flush()
    fast.force_flush()
    assert fast.prometheus_text() == full.prometheus_text()
    assert _spans(fast_spans) == _spans(full_spans) and len(_spans(fast_spans)) > 5
    full.shutdown()
    fast.shutdown()
