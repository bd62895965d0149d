"""Frames of scripted Pulsar sessions, built with the project's encoders, for telemetry tests."""

from __future__ import annotations

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import compression
from proxy.protocol.frame import Frame, encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.message import encode_payload
from proxy.protocol.session import Direction
from proxy.telemetry.observer import Telemetry

TOPIC = "persistent://public/default/orders"
BASE_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z
MS = 1_000_000
TO_BROKER, TO_CLIENT = Direction.TO_BROKER, Direction.TO_CLIENT


def padded_varint(value: int, padding: int = 0) -> bytes:
    """``value`` as a varint, ``padding`` bytes longer than it needs (protobuf reads either)."""
    out = bytearray()
    while True:
        out.append(value & 0x7F)
        value >>= 7
        if not value:
            break
        out[-1] |= 0x80
    for _ in range(padding):
        out[-1] |= 0x80
        out.append(0)
    return bytes(out)


def frame(sub: object) -> Frame:
    return frame_from_bytes(encode_command(sub))  # type: ignore[arg-type]


def send(producer_id: int, sequence_id: int, *, properties: dict[str, str] | None = None,
         batch: list[dict[str, str]] | None = None, compression_type: int = compression.NONE) -> Frame:
    """A SEND: one message with ``properties``, or a batch whose entries carry the given properties."""
    metadata = api.MessageMetadata(producer_name="prod-1", sequence_id=sequence_id, publish_time=1)
    for key, value in (properties or {}).items():
        metadata.properties.add(key=key, value=value)
    if batch is None:
        payload = encode_payload([(b"hello", api.SingleMessageMetadata(payload_size=5))], metadata,
                                 compression_type, batched=False)
        count = 1
    else:
        entries = []
        for i, props in enumerate(batch):
            body = f"message-{i}".encode()
            single = api.SingleMessageMetadata(payload_size=len(body))
            for key, value in props.items():
                single.properties.add(key=key, value=value)
            entries.append((body, single))
        payload = encode_payload(entries, metadata, compression_type, batched=True)
        count = len(batch)
    command = api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=count)
    return frame_from_bytes(encode_payload_command(command, metadata, payload))


def message(consumer_id: int, entry_id: int, batch: int = 1) -> Frame:
    metadata = api.MessageMetadata(producer_name="prod-1", sequence_id=entry_id, publish_time=1)
    entries = [(f"m{i}".encode(), api.SingleMessageMetadata(payload_size=2)) for i in range(batch)]
    payload = encode_payload(entries, metadata, compression.NONE, batched=batch > 1) if batch > 1 else \
        encode_payload(entries[:1], metadata, compression.NONE, batched=False)
    command = api.CommandMessage(consumer_id=consumer_id,
                                 message_id=api.MessageIdData(ledgerId=1, entryId=entry_id))
    return frame_from_bytes(encode_payload_command(command, metadata, payload))


def connect(telemetry: Telemetry, conn: int, ts: int, *, client: str = "127.0.0.1:50000",
            broker: str = "pulsar://127.0.0.1:6650") -> int:
    """Open a connection and complete the handshake; returns the next free timestamp."""
    telemetry.connection_opened(conn, ts, client, broker)
    telemetry.frame(conn, TO_BROKER, frame(api.CommandConnect(client_version="test", protocol_version=21)), ts)
    telemetry.frame(conn, TO_CLIENT, frame(api.CommandConnected(server_version="b", protocol_version=21)),
                    ts + MS)
    return ts + 2 * MS


def create_producer(telemetry: Telemetry, conn: int, ts: int, producer_id: int = 1, request_id: int = 10,
                    topic: str = TOPIC) -> int:
    telemetry.frame(conn, TO_BROKER, frame(api.CommandProducer(topic=topic, producer_id=producer_id,
                                                               request_id=request_id)), ts)
    telemetry.frame(conn, TO_CLIENT, frame(api.CommandProducerSuccess(request_id=request_id,
                                                                      producer_name="prod-1")), ts + MS)
    return ts + 2 * MS


def produce(telemetry: Telemetry, conn: int, ts: int, count: int, producer_id: int = 1) -> int:
    for sequence_id in range(count):
        telemetry.frame(conn, TO_BROKER, send(producer_id, sequence_id), ts)
        telemetry.frame(conn, TO_CLIENT, frame(api.CommandSendReceipt(
            producer_id=producer_id, sequence_id=sequence_id,
            message_id=api.MessageIdData(ledgerId=1, entryId=sequence_id))), ts + MS)
        ts += 2 * MS
    return ts
