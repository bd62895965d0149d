"""Frames and sessions for the rules tests: real encoders, a real SessionTracker."""

from __future__ import annotations

from typing import Any

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import Direction, Observation, SessionTracker
from proxy.rules.engine import RulesEngine
from proxy.rules.loader import load_rules_text
from proxy.rules.verdict import Verdict

TO_BROKER = Direction.TO_BROKER
TO_CLIENT = Direction.TO_CLIENT
TOPIC = "persistent://public/default/orders-1"
OTHER_TOPIC = "persistent://public/default/other"


def frame(sub: Any) -> Frame:
    return frame_from_bytes(encode_command(sub))


def send_frame(producer_id: int, sequence_id: int, payload: bytes = b"hello", num_messages: int = 1) -> Frame:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1)
    if num_messages > 1:
        metadata.num_messages_in_batch = num_messages
    cmd = api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=num_messages)
    return frame_from_bytes(encode_payload_command(cmd, metadata, payload))


def message_frame(consumer_id: int, payload: bytes = b"world") -> Frame:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1)
    cmd = api.CommandMessage(consumer_id=consumer_id, message_id=api.MessageIdData(ledgerId=1, entryId=2))
    return frame_from_bytes(encode_payload_command(cmd, metadata, payload))


def engine_for(text: str, seed: int | None = None) -> RulesEngine:
    return RulesEngine(load_rules_text(text, "test.yaml"), seed=seed)


class Session:
    """A connected session with producer 1 on TOPIC and consumer 2 on TOPIC (subscription 'sub')."""

    def __init__(self, engine: RulesEngine, conn_id: int = 1, client: str = "127.0.0.1:40000") -> None:
        self.engine = engine
        self.conn_id = conn_id
        self.client = client
        self.tracker = SessionTracker()
        self.now_ns = 0
        self.observe(frame(api.CommandConnect(client_version="t", protocol_version=21)), TO_BROKER)
        self.observe(frame(api.CommandConnected(server_version="b", protocol_version=21)), TO_CLIENT)

    def observe(self, f: Frame, direction: Direction) -> Observation:
        return self.tracker.observe(f, direction, self.now_ns)

    def add_producer(self, producer_id: int = 1, topic: str = TOPIC, name: str = "prod-a") -> None:
        self.observe(frame(api.CommandProducer(topic=topic, producer_id=producer_id, request_id=100 + producer_id,
                                               producer_name=name)), TO_BROKER)
        self.observe(frame(api.CommandProducerSuccess(request_id=100 + producer_id, producer_name=name)),
                     TO_CLIENT)

    def add_consumer(self, consumer_id: int = 2, topic: str = TOPIC, subscription: str = "sub") -> None:
        self.observe(frame(api.CommandSubscribe(topic=topic, subscription=subscription, consumer_id=consumer_id,
                                                request_id=200 + consumer_id, subType=api.CommandSubscribe.Shared,
                                                consumer_name="cons-a")), TO_BROKER)
        self.observe(frame(api.CommandSuccess(request_id=200 + consumer_id)), TO_CLIENT)

    def decide(self, f: Frame, direction: Direction, now_s: float | None = None) -> Verdict:
        if now_s is not None:
            self.now_ns = int(now_s * 1e9)
        observation = self.observe(f, direction)
        return self.engine.evaluate(f, direction, self.now_ns, conn_id=self.conn_id, client=self.client,
                                    observation=observation)
