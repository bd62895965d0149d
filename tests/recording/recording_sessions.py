"""Frames of realistic Pulsar sessions, built with the project's own encoders, for recording tests."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import compression
from proxy.protocol.frame import encode_command, encode_payload_command
from proxy.protocol.message import encode_payload
from proxy.recording.writer import RecordConfig
from proxy.server.recorder import Recorder

TOPIC = "persistent://public/default/orders"
BASE_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z


@dataclass(frozen=True)
class SentFrame:
    conn: int
    direction: str
    origin: str
    ts_ns: int
    raw: bytes
    command: str
    rules: tuple[str, ...] = ()


def batched_send(producer_id: int, sequence_id: int, count: int) -> bytes:
    metadata = api.MessageMetadata(producer_name="prod-1", sequence_id=sequence_id, publish_time=1)
    messages = [(f"message-{sequence_id + i}".encode() * 4, api.SingleMessageMetadata(payload_size=0))
                for i in range(count)]
    for payload, single in messages:
        single.payload_size = len(payload)
    payload = encode_payload(messages, metadata, compression.LZ4, batched=True)
    send = api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=count)
    return encode_payload_command(send, metadata, payload)


def session(conn: int = 1, start_ns: int = BASE_NS, sends: int = 3,
            auth: bytes = b"token-secret-123") -> list[SentFrame]:
    """One client's session: handshake with auth, lookup, produce (batched, LZ4), consume, close."""
    frames: list[SentFrame] = []
    t = start_ns

    def add(direction: str, raw: bytes, command: str, origin: str | None = None, rules: tuple[str, ...] = ()) -> None:
        nonlocal t
        t += 150_000
        frames.append(SentFrame(conn, direction, origin or ("client" if direction == "to_broker" else "broker"),
                                t, raw, command, rules))

    add("to_broker", encode_command(api.CommandConnect(client_version="Pulsar-CPP-v3.7", auth_method_name="token",
                                                       auth_data=auth, protocol_version=21)), "CONNECT")
    add("to_client", encode_command(api.CommandConnected(server_version="pulsar-tap-broker", protocol_version=21,
                                                         max_message_size=5 * 1024 * 1024)), "CONNECTED")
    add("to_broker", encode_command(api.CommandLookupTopic(topic=TOPIC, request_id=1)), "LOOKUP")
    lookup_response = api.CommandLookupTopicResponse(request_id=1, brokerServiceUrl="pulsar://127.0.0.1:6651",
                                                     response=api.CommandLookupTopicResponse.Connect)
    add("to_client", encode_command(lookup_response), "LOOKUP_RESPONSE")
    lookup_response.brokerServiceUrl = "pulsar://127.0.0.1:7001"
    add("to_client", encode_command(lookup_response), "LOOKUP_RESPONSE", origin="proxy", rules=("rewrite-lookup",))
    add("to_broker", encode_command(api.CommandProducer(topic=TOPIC, producer_id=0, request_id=2)), "PRODUCER")
    add("to_client", encode_command(api.CommandProducerSuccess(request_id=2, producer_name="prod-1")),
        "PRODUCER_SUCCESS")
    for i in range(sends):
        add("to_broker", batched_send(0, i * 10, 10), "SEND")
        add("to_client", encode_command(api.CommandSendReceipt(
            producer_id=0, sequence_id=i * 10, message_id=api.MessageIdData(ledgerId=7, entryId=i))), "SEND_RECEIPT")
    subscribe = api.CommandSubscribe(topic=TOPIC, subscription="sub", subType=api.CommandSubscribe.Shared,
                                     consumer_id=0, request_id=3)
    add("to_broker", encode_command(subscribe), "SUBSCRIBE")
    add("to_client", encode_command(api.CommandSuccess(request_id=3)), "SUCCESS")
    add("to_broker", encode_command(api.CommandFlow(consumer_id=0, messagePermits=1000)), "FLOW")
    message_meta = api.MessageMetadata(producer_name="prod-1", sequence_id=0, publish_time=1)
    add("to_client", encode_payload_command(api.CommandMessage(consumer_id=0, message_id=api.MessageIdData(
        ledgerId=7, entryId=0)), message_meta, b"hello world"), "MESSAGE")
    add("to_broker", encode_command(api.CommandAck(consumer_id=0, ack_type=api.CommandAck.Individual,
                                                   message_id=[api.MessageIdData(ledgerId=7, entryId=0)])), "ACK")
    add("to_client", encode_command(api.CommandPing()), "PING")
    add("to_broker", encode_command(api.CommandPong()), "PONG")
    add("to_broker", encode_command(api.CommandCloseProducer(producer_id=0, request_id=4)), "CLOSE_PRODUCER")
    add("to_client", encode_command(api.CommandSuccess(request_id=4)), "SUCCESS")
    return frames


async def record_sessions(directory: str, sessions: list[list[SentFrame]], **config: object) -> Recorder:
    """Record the sessions (connections opened/closed around them) with a real recorder."""
    with trio.fail_after(10):
        async with Recorder(RecordConfig(dir=directory, **config)) as recorder:  # type: ignore[arg-type]
            for frames in sessions:
                conn = frames[0].conn
                recorder.open_connection(conn, ("127.0.0.1", 50000 + conn), ("127.0.0.1", 6650), "rewrite",
                                         frames[0].ts_ns - 1000)
            for frame in sorted((f for s in sessions for f in s), key=lambda f: f.ts_ns):
                assert recorder.record(frame.conn, frame.direction, frame.origin, frame.ts_ns, frame.raw, frame.rules)
                await trio.lowlevel.checkpoint()
            for frames in sessions:
                recorder.close_connection(frames[0].conn, frames[-1].ts_ns + 1000)
    return recorder
