"""Synthetic recordings of a chosen size, for the analytics tests and benchmark.

Writes a real recording directory (segments and index, recordings/FORMAT.md) of
many connections: producer connections (CONNECT, LOOKUP, PRODUCER, batched SENDs
with every compression type and their receipts, a few errors) and consumer
connections (SUBSCRIBE, FLOW, MESSAGEs, ACKs).  Every frame is encoded by the
protocol core, so the pipeline decodes exactly what a proxy would have recorded.

Options add what real recordings hold now and then: ``chunked`` (every fifth producer
also sends large messages in chunks, Pulsar's PIP-37, each chunk receipted; at segment
boundaries they span segments), ``replication`` (every sixth producer is a
geo-replicator: its messages carry ``replicated_from`` and a publish time some
milliseconds before capture, with replicated-subscription snapshot markers between
them), and ``include_payloads=False`` (payloads stripped as the recorder does).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import PulsarMarkers_pb2 as markers_pb
from proxy.pb import recording_pb2 as rpb
from proxy.protocol import markers
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.protocol.message import encode_payload
from proxy.recording.redaction import strip_payload
from proxy.recording.segment import FORMAT_VERSION, SEGMENT_MAGIC, encode_frame_record, encode_record
from proxy.recording.writer import INDEX_NAME

_COMPRESSIONS = (api.NONE, api.LZ4, api.ZLIB, api.ZSTD, api.SNAPPY)
#: emit(direction, frame bytes) -> capture time: record one frame of the connection being written
Emit = Callable[[int, bytes], int]


@dataclass
class SyntheticStats:
    """What was written: the truth the tests compare the pipeline's tables with."""

    path: Path
    bytes: int = 0
    frames: int = 0
    sends: int = 0
    messages: int = 0
    connections: int = 0
    errors: int = 0
    #: chunked messages (each counted once in ``messages``) and their chunks (each a SEND)
    chunked: int = 0
    chunks: int = 0
    replicated: int = 0
    markers: int = 0


class _Writer:
    def __init__(self, path: Path, recording_id: str, segment_bytes: int, start_ns: int) -> None:
        self.path = path
        self.recording_id = recording_id
        self.segment_bytes = segment_bytes
        self.start_ns = start_ns
        self.segments: list[str] = []
        self.size = 0
        self._handle: BinaryIO | None = None
        self._written = 0
        self.last_ts = start_ns
        self._open()

    def _open(self) -> None:
        if self._handle is not None:
            self._handle.close()
        name = f"segment-{len(self.segments) + 1:06d}.ptap"
        self.segments.append(name)
        self._handle = open(self.path / name, "wb")  # noqa: SIM115 - closed in _open / close
        header = rpb.Record(header=rpb.SegmentHeader(
            format_version=FORMAT_VERSION, recording_id=self.recording_id, segment_index=len(self.segments),
            created_ns=self.start_ns, include_payloads=True, redact=True))
        self._write(SEGMENT_MAGIC + encode_record(header))
        self._written = 0

    def _write(self, data: bytes) -> None:
        assert self._handle is not None
        self._handle.write(data)
        self._written += len(data)
        self.size += len(data)

    def record(self, data: bytes) -> None:
        if self._written >= self.segment_bytes:
            self._open()
        self._write(data)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


@dataclass(frozen=True)
class Features:
    """The optional kinds of traffic (module docstring)."""

    chunked: bool = False
    replication: bool = False
    include_payloads: bool = True


def write_synthetic_recording(parent: Path, target_bytes: int, *, connections: int = 40, seed: int = 1,
                              segment_bytes: int = 16 * 1024 * 1024, start_ns: int = 1_763_800_000_000_000_000,
                              name: str | None = None, features: Features | None = None) -> SyntheticStats:
    """Write a recording of about ``target_bytes`` under ``parent``; returns what it holds."""
    features = features or Features()
    rng = random.Random(seed)
    recording_id = name or f"20251122T083320Z-{seed}"
    path = parent / recording_id
    path.mkdir(parents=True, exist_ok=True)
    stats = SyntheticStats(path)
    writer = _Writer(path, recording_id, segment_bytes, start_ns)
    index = rpb.RecordingIndex(format_version=FORMAT_VERSION, recording_id=recording_id, start_ns=start_ns, pid=1,
                               include_payloads=True, redact=True)
    now = start_ns
    per_conn = max(1, target_bytes // connections)
    for conn_id in range(1, connections + 1):
        topic = f"persistent://public/default/synthetic-{conn_id % 7}"
        info = index.connections.add(conn_id=conn_id, start_ns=now, protocol_version=21)
        info.client.host, info.client.port = "127.0.0.1", 40000 + conn_id
        info.broker.host, info.broker.port = "127.0.0.1", 6650
        writer.record(encode_record(rpb.Record(opened=rpb.ConnectionOpened(
            conn_id=conn_id, ts_ns=now, client=info.client, broker=info.broker))))
        conn_start = writer.size

        def emit(direction: int, raw: bytes, *, _conn: int = conn_id) -> int:
            nonlocal now
            now += rng.randint(2_000, 400_000)
            writer.last_ts = now
            record = rpb.FrameRecord(conn_id=_conn, direction=direction,
                                     origin=rpb.CLIENT if direction == rpb.TO_BROKER else rpb.BROKER, ts_ns=now,
                                     data=raw)
            stripped = None if features.include_payloads else strip_payload(raw)
            if stripped is not None:
                record.data, record.payload_stripped, record.original_size = stripped, True, len(raw)
            writer.record(encode_frame_record(record))
            stats.frames += 1
            return now

        emit(rpb.TO_BROKER, encode_command(api.CommandConnect(client_version="synthetic", protocol_version=21)))
        emit(rpb.TO_CLIENT, encode_command(api.CommandConnected(server_version="synthetic", protocol_version=21,
                                                                max_message_size=5 << 20)))
        emit(rpb.TO_BROKER, encode_command(api.CommandLookupTopic(topic=topic, request_id=1)))
        emit(rpb.TO_CLIENT, encode_command(api.CommandLookupTopicResponse(
            request_id=1, response=api.CommandLookupTopicResponse.Connect, brokerServiceUrl="pulsar://b:6650",
            authoritative=True)))
        if conn_id % 4:
            _producer_connection(emit, rng, topic, conn_id, stats, conn_start, per_conn, writer, features)
        else:
            _consumer_connection(emit, rng, topic, conn_id, conn_start, per_conn, writer)
        info.end_ns = now
        writer.record(encode_record(rpb.Record(closed=rpb.ConnectionClosed(conn_id=conn_id, ts_ns=now))))
        stats.connections += 1
    writer.close()
    index.segments.extend(writer.segments)
    index.end_ns = now
    index.frames_recorded = stats.frames
    (path / INDEX_NAME).write_bytes(index.SerializeToString())
    stats.bytes = writer.size
    return stats


def _producer_connection(send: Emit, rng: random.Random, topic: str, conn_id: int, stats: SyntheticStats,
                         conn_start: int, per_conn: int, writer: _Writer, features: Features) -> None:
    send(rpb.TO_BROKER, encode_command(api.CommandProducer(topic=topic, producer_id=1, request_id=2)))
    name = f"synthetic-{conn_id}"
    send(rpb.TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=2, producer_name=name,
                                                                  producer_ready=True)))
    kind = _COMPRESSIONS[conn_id % len(_COMPRESSIONS)]
    replicator = features.replication and conn_id % 6 == 1
    chunker = features.chunked and conn_id % 5 == 0
    sequence = 0
    while writer.size - conn_start < per_conn:
        if chunker and sequence % 7 == 3:
            _chunked_message(send, rng, name, sequence, kind, stats)
            sequence += 1
            continue
        if replicator and sequence % 11 == 5:
            _marker(send, rng, name, sequence, stats, (writer.last_ts + 200_000) // 1_000_000 - rng.randint(50, 500))
            sequence += 1
            continue
        count = rng.randint(1, 20)
        singles = [(rng.randbytes(rng.randint(50, 400)),
                    api.SingleMessageMetadata(payload_size=0, partition_key=f"k{rng.randint(0, 9)}",
                                              sequence_id=sequence + i)) for i in range(count)]
        metadata = api.MessageMetadata(producer_name=name, sequence_id=sequence, publish_time=1_763_800_000_000)
        if replicator:
            # publish time filled in below, once the capture time is known: a lag of 50..500 ms
            metadata.replicated_from = "cluster-b"
            stats.replicated += 1
        body = encode_payload(singles, metadata, kind, batched=True)
        metadata.highest_sequence_id = sequence + count - 1
        command = api.CommandSend(producer_id=1, sequence_id=sequence, num_messages=count,
                                  highest_sequence_id=sequence + count - 1)
        if replicator:
            metadata.publish_time = (writer.last_ts + 200_000) // 1_000_000 - rng.randint(50, 500)
        send(rpb.TO_BROKER, encode_payload_command(command, metadata, body))
        stats.sends += 1
        stats.messages += count
        _answer(send, rng, conn_id, sequence, count, stats)
        sequence += count
    send(rpb.TO_BROKER, encode_command(api.CommandCloseProducer(producer_id=1, request_id=3)))
    send(rpb.TO_CLIENT, encode_command(api.CommandSuccess(request_id=3)))


def _answer(send: Emit, rng: random.Random, conn_id: int, sequence: int, count: int, stats: SyntheticStats) -> None:
    if rng.random() < 0.01:
        send(rpb.TO_CLIENT, encode_command(api.CommandSendError(
            producer_id=1, sequence_id=sequence, error=api.PersistenceError, message="synthetic failure")))
        stats.errors += 1
    else:
        send(rpb.TO_CLIENT, encode_command(api.CommandSendReceipt(
            producer_id=1, sequence_id=sequence, highest_sequence_id=sequence + count - 1,
            message_id=api.MessageIdData(ledgerId=conn_id, entryId=sequence))))


def _chunked_message(send: Emit, rng: random.Random, name: str, sequence: int, kind: int,
                     stats: SyntheticStats) -> None:
    """One large message in chunks of at most 4 KiB, each chunk a SEND with the same sequence id."""
    payload = rng.randbytes(rng.randint(9_000, 20_000))
    metadata = api.MessageMetadata(producer_name=name, sequence_id=sequence, publish_time=1_763_800_000_000,
                                   partition_key="chunky", uuid=f"{name}-{sequence}")
    metadata.properties.add(key="kind", value="chunked")
    body = encode_payload([(payload, api.SingleMessageMetadata(payload_size=0))], metadata, kind, batched=False)
    parts = [body[i:i + 4096] for i in range(0, len(body), 4096)]
    metadata.num_chunks_from_msg, metadata.total_chunk_msg_size = len(parts), len(body)
    for chunk_id, part in enumerate(parts):
        metadata.chunk_id = chunk_id
        send(rpb.TO_BROKER, encode_payload_command(api.CommandSend(producer_id=1, sequence_id=sequence,
                                                                   is_chunk=True), metadata, part))
        stats.sends += 1
        stats.chunks += 1
        send(rpb.TO_CLIENT, encode_command(api.CommandSendReceipt(
            producer_id=1, sequence_id=sequence, message_id=api.MessageIdData(ledgerId=9, entryId=sequence))))
    stats.chunked += 1
    stats.messages += 1
    del rng


def _marker(send: Emit, rng: random.Random, name: str, sequence: int, stats: SyntheticStats,
            publish_time: int) -> None:
    """A replicated-subscription snapshot marker, as a replicator forwards it."""
    body = markers_pb.ReplicatedSubscriptionsSnapshot(snapshot_id=f"snap-{sequence}-{rng.randint(0, 999)}")
    body.local_message_id.ledger_id, body.local_message_id.entry_id = 7, sequence
    marker_type, payload = markers.encode_marker(body)
    metadata = api.MessageMetadata(producer_name=name, sequence_id=sequence, publish_time=publish_time,
                                   marker_type=marker_type, replicated_from="cluster-b")
    send(rpb.TO_BROKER, encode_payload_command(api.CommandSend(producer_id=1, sequence_id=sequence, marker=True),
                                               metadata, payload))
    stats.sends += 1
    stats.markers += 1
    send(rpb.TO_CLIENT, encode_command(api.CommandSendReceipt(
        producer_id=1, sequence_id=sequence, message_id=api.MessageIdData(ledgerId=7, entryId=sequence))))


def _consumer_connection(send: Emit, rng: random.Random, topic: str, conn_id: int, conn_start: int,
                         per_conn: int, writer: _Writer) -> None:
    send(rpb.TO_BROKER, encode_command(api.CommandSubscribe(
        topic=topic, subscription="synthetic-sub", subType=api.CommandSubscribe.Shared, consumer_id=1, request_id=2)))
    send(rpb.TO_CLIENT, encode_command(api.CommandSuccess(request_id=2)))
    entry = 0
    while writer.size - conn_start < per_conn:
        send(rpb.TO_BROKER, encode_command(api.CommandFlow(consumer_id=1, messagePermits=100)))
        for _ in range(rng.randint(5, 30)):
            payload = rng.randbytes(rng.randint(100, 2000))
            metadata = api.MessageMetadata(producer_name="remote", sequence_id=entry, publish_time=1_763_800_000_000,
                                           uncompressed_size=len(payload))
            send(rpb.TO_CLIENT, encode_payload_command(api.CommandMessage(
                consumer_id=1, message_id=api.MessageIdData(ledgerId=conn_id, entryId=entry)), metadata, payload))
            entry += 1
        send(rpb.TO_BROKER, encode_command(api.CommandAck(
            consumer_id=1, ack_type=api.CommandAck.Cumulative,
            message_id=[api.MessageIdData(ledgerId=conn_id, entryId=entry - 1)])))
