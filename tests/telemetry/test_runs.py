"""Telemetry fed in bulk: frames the proxy passed through unchanged come as runs of bytes.

The relay hands observers that take runs (``on_run``) one RunEvent per stretch of
passed-through bytes instead of a Frame and a FrameEvent per frame; telemetry cuts
them back into frames.  The spans and metrics must be those of frames one by one.
"""

from __future__ import annotations

import random

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.config.proxy_config import ServiceUrl
from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, RunEvent
from proxy.core.lookup import BrokerDirectory
from proxy.core.pipeline import ConnectionPipeline, PipelineSettings
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.protocol.session import Direction
from proxy.telemetry import TelemetryPipeline, build_telemetry

TO_BROKER, TO_CLIENT = Direction.TO_BROKER, Direction.TO_CLIENT
TOPIC = "persistent://public/default/runs"


def traffic() -> list[tuple[Direction, bytes]]:
    """A producer session as the wire carries it: handshake, PRODUCER, SENDs and receipts interleaved."""
    frames = [(TO_BROKER, encode_command(api.CommandConnect(client_version="t", protocol_version=21))),
              (TO_CLIENT, encode_command(api.CommandConnected(server_version="b", protocol_version=21))),
              (TO_BROKER, encode_command(api.CommandProducer(topic=TOPIC, producer_id=1, request_id=1))),
              (TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=1, producer_name="p")))]
    metadata = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    for seq in range(300):
        frames.append((TO_BROKER, encode_payload_command(api.CommandSend(producer_id=1, sequence_id=seq),
                                                         metadata, b"x" * (10 + seq * 7 % 3000))))
        if seq % 3 == 2:
            for answered in range(seq - 2, seq + 1):
                frames.append((TO_CLIENT, encode_command(api.CommandSendReceipt(
                    producer_id=1, sequence_id=answered, message_id=api.MessageIdData(ledgerId=1, entryId=answered)))))
    return frames


def sends_and_receipts(first: int, count: int) -> list[tuple[Direction, bytes]]:
    """``count`` SENDs of producer 1 from sequence id ``first``, each answered before the next."""
    metadata = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    frames = []
    for seq in range(first, first + count):
        frames.append((TO_BROKER, encode_payload_command(api.CommandSend(producer_id=1, sequence_id=seq),
                                                         metadata, b"x" * 20)))
        frames.append((TO_CLIENT, encode_command(api.CommandSendReceipt(
            producer_id=1, sequence_id=seq, message_id=api.MessageIdData(ledgerId=1, entryId=seq)))))
    return frames


def run_through_pipeline(runs: bool, frames: list[tuple[Direction, bytes]] | None = None,
                         ) -> tuple[TelemetryPipeline, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    built = build_telemetry(span_exporter=exporter, seed=1)
    observer = built.observer
    events: list[FrameEvent | RunEvent | ConnectionEvent] = []
    info = ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None)
    pipeline = ConnectionPipeline(
        info, settings=PipelineSettings(), default_broker=ServiceUrl.parse("pulsar://10.9.9.1:6650"),
        directory=BrokerDirectory("proxy.example", upstream_tls=False, open_listener=lambda broker: 40001),
        now_ns=0, publish=events.append, observations=False, runs=runs)
    rng = random.Random(3)
    now = 1_000
    for direction, raw in traffic() if frames is None else frames:
        # each frame arrives in a few reads cut anywhere (the clock moves between them)
        pos = 0
        while pos < len(raw):
            take = rng.choice([1, 5, 64, 2000, len(raw)])
            pipeline.receive(direction, raw[pos:pos + take], now)
            pos += take
            now += 1_000
    pipeline.announce()
    for event in events:
        if isinstance(event, RunEvent):
            observer.on_run(event)
        elif isinstance(event, FrameEvent):
            observer.on_frame(event)
        else:
            observer.on_connection(event)
    observer.on_connection(ConnectionEvent(pipeline.info, now, closed=True, reason="done"))
    built.force_flush()
    return built, exporter


def test_runs_give_the_same_spans_and_metrics_as_frames_one_by_one() -> None:
    by_frame, frame_spans = run_through_pipeline(runs=False)
    by_run, run_spans = run_through_pipeline(runs=True)
    assert by_run.prometheus_text() == by_frame.prometheus_text()
    assert 'command="SEND",outcome="ok"' in by_run.prometheus_text()

    def described(exporter: InMemorySpanExporter) -> list[tuple[str, int, int | None, object]]:
        return sorted((span.name, span.start_time or 0, span.end_time, span.attributes.get("messaging.message.id"))
                      for span in exporter.get_finished_spans() if span.attributes is not None)

    assert described(run_spans) == described(frame_spans)
    assert sum(1 for span in run_spans.get_finished_spans() if span.name.startswith("SEND")) == 300
    by_frame.shutdown()
    by_run.shutdown()


def test_a_producer_id_reused_on_another_topic_counts_its_sends_there_in_runs_too() -> None:
    """The bulk path keeps each producer's topic between runs: a producer closed and its id
    opened again on another topic must count the later SENDs on the new topic, as frames one by
    one do (the topic of the id looked up again once the session has seen other frames)."""
    other = "persistent://public/default/runs-other"
    frames = [*traffic()[:4], *sends_and_receipts(0, 5),
              (TO_BROKER, encode_command(api.CommandCloseProducer(producer_id=1, request_id=2))),
              (TO_CLIENT, encode_command(api.CommandSuccess(request_id=2))),
              (TO_BROKER, encode_command(api.CommandProducer(topic=other, producer_id=1, request_id=3))),
              (TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=3, producer_name="p2"))),
              *sends_and_receipts(5, 7)]
    by_frame, _ = run_through_pipeline(runs=False, frames=frames)
    by_run, _ = run_through_pipeline(runs=True, frames=frames)
    text = by_run.prometheus_text()
    assert text == by_frame.prometheus_text()
    assert f'pulsar_tap_messages_total{{command="SEND",topic="{TOPIC}"}} 5' in text
    assert f'pulsar_tap_messages_total{{command="SEND",topic="{other}"}} 7' in text
    by_frame.shutdown()
    by_run.shutdown()
