"""Replication traffic in recordings, ``show`` and spans: markers named by type and cluster, lag per message."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import PulsarMarkers_pb2 as pm
from proxy.protocol import markers
from proxy.protocol.frame import encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import Direction
from proxy.recording.reader import RecordedFrame
from proxy.recording.replication import lag_table, replicated_sends
from proxy.recording.show import format_entry, replication_text
from proxy.recording.timeline import build_timeline
from proxy.telemetry import TelemetryPipeline, build_telemetry

TOPIC = "persistent://public/default/geo"
REPLICATOR = "pulsar.repl.A-->B"
T0_MS = 1_767_225_600_000
MS = 1_000_000


def recorded(conn: int, direction: str, ts_ms: float, data: bytes) -> RecordedFrame:
    origin = "client" if direction == "to_broker" else "broker"
    return RecordedFrame(conn, direction, origin, int(ts_ms * MS), data, len(data))


def command(sub: object) -> bytes:
    return encode_command(sub)  # type: ignore[arg-type]


def replicated(sequence_id: int, publish_ms: int, original: tuple[str, int], marker: pm.ReplicatedSubscriptionsUpdate
               | pm.ReplicatedSubscriptionsSnapshotRequest | None = None) -> bytes:
    metadata = api.MessageMetadata(producer_name=original[0], sequence_id=original[1], publish_time=publish_ms,
                                   replicated_from="A")
    payload = b"data"
    if marker is not None:
        kind, payload = markers.encode_marker(marker)
        metadata = markers.marker_metadata(kind, publish_ms)
        metadata.replicated_from = "A"
    return encode_payload_command(api.CommandSend(producer_id=1, sequence_id=sequence_id, num_messages=1),
                                  metadata, payload)


def receipt(sequence_id: int, entry_id: int) -> bytes:
    return command(api.CommandSendReceipt(producer_id=1, sequence_id=sequence_id,
                                          message_id=api.MessageIdData(ledgerId=7, entryId=entry_id)))


UPDATE = pm.ReplicatedSubscriptionsUpdate(subscription_name="orders", clusters=[pm.ClusterMessageId(
    cluster="B", message_id=pm.MarkersMessageIdData(ledger_id=7, entry_id=41))])


def link_recording() -> list[RecordedFrame]:
    """A replicator's session: three data messages (one sent twice after a cut) and an update marker."""
    frames = [
        recorded(1, "to_broker", T0_MS, command(api.CommandProducer(topic=TOPIC, producer_id=1, request_id=1,
                                                                    producer_name=REPLICATOR))),
        recorded(1, "to_client", T0_MS + 1, command(api.CommandProducerSuccess(request_id=1,
                                                                               producer_name=REPLICATOR))),
        recorded(1, "to_broker", T0_MS + 10, replicated(0, T0_MS, ("app", 0))),
        recorded(1, "to_broker", T0_MS + 20, replicated(1, T0_MS + 500, ("app", 1))),
        recorded(1, "to_client", T0_MS + 2010, receipt(0, 40)),
        # the link is cut before the second receipt; the replicator sends it again on a new connection
        recorded(2, "to_broker", T0_MS + 3000, command(api.CommandProducer(topic=TOPIC, producer_id=1,
                                                                           request_id=1, producer_name=REPLICATOR))),
        recorded(2, "to_client", T0_MS + 3001, command(api.CommandProducerSuccess(request_id=1,
                                                                                  producer_name=REPLICATOR))),
        recorded(2, "to_broker", T0_MS + 3010, replicated(1, T0_MS + 500, ("app", 1))),
        recorded(2, "to_broker", T0_MS + 3020, replicated(2, T0_MS + 1200, ("app", 2), UPDATE)),
        recorded(2, "to_client", T0_MS + 5010, receipt(1, 41)),
        recorded(2, "to_client", T0_MS + 5020, receipt(2, 42)),
    ]
    return frames


def test_replicated_sends_pair_each_send_with_its_receipt_per_connection() -> None:
    sends = replicated_sends(link_recording())
    assert [(s.conn, s.sequence_id, s.marker) for s in sends] == [
        (1, 0, None), (1, 1, None), (2, 1, None), (2, 2, "REPLICATED_SUBSCRIPTION_UPDATE")]
    first, lost, again, update = sends
    assert first.lag_ms == pytest.approx(2010) and first.stored_at == "7:40" and first.source_cluster == "A"
    assert lost.receipt_ns is None and lost.lag_ms is None
    assert again.lag_ms == pytest.approx(4510)
    assert update.label == "UPDATE orders B@7:41" and update.topic == TOPIC


def test_lag_table_counts_a_message_sent_twice_once_by_its_first_receipt() -> None:
    rows = lag_table(replicated_sends(link_recording()))
    assert [(r.start_ms - T0_MS, r.messages, r.confirmed) for r in rows] == [(0, 2, 2)]
    assert rows[0].p50_ms == pytest.approx(4510) and rows[0].max_ms == pytest.approx(4510)


def test_show_labels_markers_by_type_and_cluster_and_json_carries_them() -> None:
    entries = list(build_timeline(link_recording()))
    update = entries[8]
    assert update.replication is not None
    assert update.replication["marker"] == "REPLICATED_SUBSCRIPTION_UPDATE"
    assert update.replication["replicated_from"] == "A"
    assert update.replication["marker_fields"] == {"subscription_name": "orders", "clusters": [
        {"cluster": "B", "message_id": {"ledger_id": 7, "entry_id": 41}}]}
    line = format_entry(update, color=False)
    assert "marker UPDATE orders B@7:41 from A" in line
    assert json.loads(json.dumps(update.to_json()))["replication"]["label"] == "UPDATE orders B@7:41"
    data = entries[2]
    assert data.replication == {"publish_time": T0_MS, "replicated_from": "A"}
    assert "replicated from A" in format_entry(data, color=False)
    assert entries[0].replication is None and entries[4].replication is None


def test_a_marker_without_its_payload_is_still_named() -> None:
    assert replication_text({"marker": "REPLICATED_SUBSCRIPTION_SNAPSHOT", "replicate_to": ["A"]}) == \
        "marker REPLICATED_SUBSCRIPTION_SNAPSHOT to A"


@pytest.fixture
def pipeline() -> Iterator[tuple[TelemetryPipeline, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    built = build_telemetry(span_exporter=exporter, seed=1)
    yield built, exporter
    built.shutdown()


def test_spans_of_replicator_sends_say_replication_source_and_marker(
        pipeline: tuple[TelemetryPipeline, InMemorySpanExporter]) -> None:
    built, exporter = pipeline
    telemetry = built.telemetry
    telemetry.connection_opened(1, T0_MS * MS, "127.0.0.1:50000", "pulsar://127.0.0.1:6650")
    for item in link_recording():
        if item.conn == 1 and item.ts_ns < (T0_MS + 3000) * MS:
            telemetry.frame(1, Direction(item.direction), frame_from_bytes(item.data), item.ts_ns)
    telemetry.connection_closed(1, (T0_MS + 2500) * MS, "test")
    telemetry.connection_opened(2, (T0_MS + 2999) * MS, "127.0.0.1:50001", "pulsar://127.0.0.1:6650")
    for item in link_recording():
        if item.conn == 2:
            telemetry.frame(2, Direction(item.direction), frame_from_bytes(item.data), item.ts_ns)
    assert built.force_flush(5_000)
    sends = [span for span in exporter.get_finished_spans() if span.name == "SEND"]
    assert sends and all(span.attributes is not None and span.attributes["pulsar.replication"] for span in sends)
    assert {span.attributes["pulsar.replication.source_cluster"] for span in sends  # type: ignore[index]
            if span.attributes} == {"A"}
    marked = [span.attributes.get("pulsar.replication.marker") for span in sends if span.attributes]
    assert "REPLICATED_SUBSCRIPTION_UPDATE" in marked
