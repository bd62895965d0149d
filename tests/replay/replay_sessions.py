"""Recorded sessions built from frames, for the sans-IO replay tests (no recorder, no sockets)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import compression
from proxy.protocol.frame import encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.message import encode_payload
from proxy.recording.reader import RecordedFrame
from proxy.recording.writer import RecorderStats

TOPIC = "persistent://public/default/orders"
SUB = "audit"
T = api.BaseCommand.Type


def batched_send(producer_id: int, sequence_id: int, count: int) -> bytes:
    metadata = api.MessageMetadata(producer_name="standalone-0-7", sequence_id=sequence_id, publish_time=1)
    messages = []
    for i in range(count):
        payload = f"payload-{sequence_id + i}".encode()
        messages.append((payload, api.SingleMessageMetadata(payload_size=len(payload), partition_key=f"k{i}")))
    payload = encode_payload(messages, metadata, compression.LZ4, batched=True)
    return encode_payload_command(api.CommandSend(producer_id=producer_id, sequence_id=sequence_id,
                                                  num_messages=count), metadata, payload)


def message(consumer_id: int, entry: int, count: int) -> bytes:
    metadata = api.MessageMetadata(producer_name="standalone-0-7", sequence_id=entry, publish_time=1,
                                   num_messages_in_batch=count)
    messages = []
    for i in range(count):
        payload = f"payload-{entry * 10 + i}".encode()
        messages.append((payload, api.SingleMessageMetadata(payload_size=len(payload))))
    payload = encode_payload(messages, metadata, compression.NONE, batched=True)
    return encode_payload_command(api.CommandMessage(consumer_id=consumer_id, message_id=api.MessageIdData(
        ledgerId=9, entryId=entry)), metadata, payload)


class SessionBuilder:
    """Appends frames of one connection with increasing capture times."""

    def __init__(self, frames: list[RecordedFrame], conn: int, start_ns: int = 1_000_000_000) -> None:
        self.frames = frames
        self.conn = conn
        self.ts = start_ns + conn * 1000

    def add(self, direction: str, raw: bytes, origin: str | None = None) -> SessionBuilder:
        self.ts += 1_000_000
        origin = origin or ("client" if direction == "to_broker" else "broker")
        self.frames.append(RecordedFrame(self.conn, direction, origin, self.ts, raw, len(raw)))
        return self

    def client(self, sub: object) -> SessionBuilder:
        return self.add("to_broker", encode_command(sub))  # type: ignore[arg-type]

    def broker(self, sub: object, origin: str | None = None) -> SessionBuilder:
        return self.add("to_client", encode_command(sub), origin)  # type: ignore[arg-type]


def produce_and_consume_session(*, producer_error: bool = False) -> list[RecordedFrame]:
    """Connection 1 looks up; connection 2 subscribes, produces 3 batches, receives 2 MESSAGEs, acks, closes.

    With ``producer_error`` the proxy answered the PRODUCER with an injected ERROR.
    """
    frames: list[RecordedFrame] = []
    lookup = SessionBuilder(frames, 1)
    lookup.client(api.CommandConnect(client_version="Pulsar-CPP-v3.7", protocol_version=20))
    lookup.broker(api.CommandConnected(server_version="pulsar-tap-broker", protocol_version=20,
                                       max_message_size=5 << 20))
    lookup.client(api.CommandPartitionedTopicMetadata(topic=TOPIC, request_id=1))
    lookup.broker(api.CommandPartitionedTopicMetadataResponse(request_id=1, partitions=0))
    lookup.client(api.CommandLookupTopic(topic=TOPIC, request_id=2))
    answer = api.CommandLookupTopicResponse(request_id=2, brokerServiceUrl="pulsar://10.0.0.9:6650",
                                            response=api.CommandLookupTopicResponse.Connect, authoritative=True)
    lookup.broker(answer)
    answer.brokerServiceUrl = "pulsar://127.0.0.1:7001"
    lookup.broker(answer, origin="proxy")
    data = SessionBuilder(frames, 2)
    data.client(api.CommandConnect(client_version="Pulsar-CPP-v3.7", protocol_version=20))
    data.broker(api.CommandConnected(server_version="pulsar-tap-broker", protocol_version=20))
    data.client(api.CommandSubscribe(topic=TOPIC, subscription=SUB, subType=api.CommandSubscribe.Shared,
                                     consumer_id=0, request_id=0))
    data.broker(api.CommandSuccess(request_id=0))
    data.client(api.CommandFlow(consumer_id=0, messagePermits=1000))
    data.client(api.CommandProducer(topic=TOPIC, producer_id=0, request_id=1))
    if producer_error:
        data.broker(api.CommandError(request_id=1, error=api.ServerError.ServiceNotReady, message="injected"),
                    origin="proxy")
        return frames
    data.broker(api.CommandProducerSuccess(request_id=1, producer_name="standalone-0-7"))
    for i in range(3):
        data.add("to_broker", batched_send(0, i * 5, 5))
        data.broker(api.CommandSendReceipt(producer_id=0, sequence_id=i * 5,
                                           message_id=api.MessageIdData(ledgerId=9, entryId=i)))
    data.add("to_client", message(0, 0, 5))
    data.add("to_client", message(0, 1, 5))
    data.add("to_client", message(0, 1, 5))  # a redelivery: replayed once
    data.client(api.CommandAck(consumer_id=0, ack_type=api.CommandAck.Individual,
                               message_id=[api.MessageIdData(ledgerId=9, entryId=0)]))
    data.client(api.CommandCloseProducer(producer_id=0, request_id=2))
    data.broker(api.CommandSuccess(request_id=2))
    return frames


def frame(raw: bytes):  # type: ignore[no-untyped-def]
    return frame_from_bytes(raw)


@dataclass(frozen=True)
class OfficialRecording:
    """A recording of the official client made through the recording proxy (see conftest.py)."""

    path: Path
    payloads: list[bytes]
    topic: str
    subscription: str
    stats: RecorderStats
    #: (direction, origin, command) -> frames the proxy saw, counted by an observer of its own
    sent: dict[tuple[str, str, str], int]
