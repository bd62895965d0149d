"""Capture golden frames from the official Pulsar client against a loopback stand-in broker.

``GoldenBroker`` plays just enough of a broker (Pulsar binary protocol: connection
handshake, partitioned metadata, lookup, producer, send/receipt, subscribe, flow,
message push, ack, close, ping) for the official ``pulsar`` client (pulsar-client
3.13.0) to produce and consume.  It records every frame that crosses each
connection, both directions, as exact bytes.  ``capture()`` runs a fixed list of
scenarios, each with a fresh client, and returns a manifest: per scenario the
messages the test produced (payload, key, properties) and the recorded frames.

Run ``.venv/bin/python tests/golden/capture.py`` to regenerate
``tests/golden/vectors.json`` and ``proxy/data/sample_client_frames.bin``
(see ``tests/golden/README.md``).  Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import argparse
import base64
import json
import queue
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, encode_command, encode_payload_command

HOST = "127.0.0.1"
MAX_MESSAGE_SIZE = 5 * 1024 * 1024
MAX_PROTOCOL_VERSION = 21
SERVER_VERSION = "pulsar-tap-golden"
#: connections of a finished scenario must be gone within this many seconds
DRAIN_TIMEOUT = 5.0

HERE = Path(__file__).resolve().parent
VECTORS_PATH = HERE / "vectors.json"
SAMPLE_PATH = HERE.parent.parent / "proxy" / "data" / "sample_client_frames.bin"
#: the scenario whose client frames become the demo's bundled sample
SAMPLE_SCENARIO = "session"


@dataclass
class RecordedFrame:
    connection: int
    direction: str  # "to_broker" (sent by the client) or "to_client" (sent by the stand-in broker)
    raw: bytes
    type_name: str


@dataclass
class ScenarioRecord:
    name: str
    frames: list[RecordedFrame] = field(default_factory=list)
    connections: dict[int, int] = field(default_factory=dict)  # server connection id -> per-scenario index

    def connection_index(self, connection_id: int) -> int:
        return self.connections.setdefault(connection_id, len(self.connections))


@dataclass
class _Entry:
    ledger_id: int
    entry_id: int
    metadata_raw: bytes
    payload: bytes
    num_messages: int


@dataclass
class _Consumer:
    topic: str
    subscription: str
    cursor: int = 0
    permits: int = 0


class GoldenBroker:
    """The stand-in broker's protocol logic: one frame in, reply frames out (no I/O here)."""

    def __init__(self, port: int) -> None:
        self.port = port
        #: announced in CONNECTED; a scenario lowers it to make the client chunk
        self.max_message_size = MAX_MESSAGE_SIZE
        self.topics: dict[str, list[_Entry]] = {}
        self.producer_topics: dict[tuple[int, int], str] = {}
        self.consumers: dict[tuple[int, int], _Consumer] = {}
        self.unhandled: list[str] = []
        self._ledgers: dict[str, int] = {}

    def _ledger(self, topic: str) -> int:
        return self._ledgers.setdefault(topic, 100 + len(self._ledgers))

    def respond(self, connection: int, frame: Frame) -> list[bytes]:
        handler: Callable[[int, Frame], list[bytes]] | None = getattr(
            self, f"_on_{frame.type_name.lower()}", None)
        if handler is None:
            self.unhandled.append(frame.type_name)
            return []
        return handler(connection, frame)

    def _on_connect(self, connection: int, frame: Frame) -> list[bytes]:
        connect = frame.command.connect
        version = min(connect.protocol_version, MAX_PROTOCOL_VERSION)
        return [encode_command(api.CommandConnected(
            server_version=SERVER_VERSION, protocol_version=version, max_message_size=self.max_message_size))]

    def _on_ping(self, connection: int, frame: Frame) -> list[bytes]:
        return [encode_command(api.CommandPong())]

    def _on_pong(self, connection: int, frame: Frame) -> list[bytes]:
        return []

    def _on_partitioned_metadata(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.partitionMetadata
        return [encode_command(api.CommandPartitionedTopicMetadataResponse(
            partitions=0, request_id=req.request_id,
            response=api.CommandPartitionedTopicMetadataResponse.Success))]

    def _on_lookup(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.lookupTopic
        return [encode_command(api.CommandLookupTopicResponse(
            brokerServiceUrl=f"pulsar://{HOST}:{self.port}", response=api.CommandLookupTopicResponse.Connect,
            request_id=req.request_id, authoritative=True, proxy_through_service_url=False))]

    def _on_producer(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.producer
        self.producer_topics[(connection, req.producer_id)] = req.topic
        name = req.producer_name if req.HasField("producer_name") else f"golden-{connection}-{req.producer_id}"
        return [encode_command(api.CommandProducerSuccess(
            request_id=req.request_id, producer_name=name, last_sequence_id=-1, producer_ready=True))]

    def _on_send(self, connection: int, frame: Frame) -> list[bytes]:
        send = frame.command.send
        section = frame.payload
        assert section is not None
        topic = self.producer_topics[(connection, send.producer_id)]
        entries = self.topics.setdefault(topic, [])
        entry = _Entry(self._ledger(topic), len(entries), section.metadata_raw, section.payload,
                       section.metadata.num_messages_in_batch if section.metadata.HasField(
                           "num_messages_in_batch") else 1)
        entries.append(entry)
        receipt = api.CommandSendReceipt(
            producer_id=send.producer_id, sequence_id=send.sequence_id,
            message_id=api.MessageIdData(ledgerId=entry.ledger_id, entryId=entry.entry_id))
        if send.HasField("highest_sequence_id"):
            receipt.highest_sequence_id = send.highest_sequence_id
        replies = [encode_command(receipt)]
        for key, consumer in self.consumers.items():
            if key[0] == connection and consumer.topic == topic:
                replies += self._deliver(connection, key[1], consumer)
        return replies

    def _on_close_producer(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.close_producer
        self.producer_topics.pop((connection, req.producer_id), None)
        return [encode_command(api.CommandSuccess(request_id=req.request_id))]

    def _on_subscribe(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.subscribe
        self.consumers[(connection, req.consumer_id)] = _Consumer(req.topic, req.subscription)
        return [encode_command(api.CommandSuccess(request_id=req.request_id))]

    def _on_flow(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.flow
        consumer = self.consumers[(connection, req.consumer_id)]
        consumer.permits += req.messagePermits
        return self._deliver(connection, req.consumer_id, consumer)

    def _deliver(self, connection: int, consumer_id: int, consumer: _Consumer) -> list[bytes]:
        entries = self.topics.get(consumer.topic, [])
        out: list[bytes] = []
        while consumer.permits > 0 and consumer.cursor < len(entries):
            entry = entries[consumer.cursor]
            consumer.cursor += 1
            consumer.permits -= entry.num_messages
            message = api.CommandMessage(
                consumer_id=consumer_id,
                message_id=api.MessageIdData(ledgerId=entry.ledger_id, entryId=entry.entry_id))
            # A BrokerEntryMetadata section (0x0e02) ahead of the checksum, as brokers
            # with entry metadata interceptors send it, so the vectors cover that layout.
            bem = api.BrokerEntryMetadata(broker_timestamp=1_700_000_000_000 + entry.entry_id,
                                          index=entry.entry_id)
            out.append(encode_payload_command(message, entry.metadata_raw, entry.payload,
                                              broker_entry_metadata=bem))
        return out

    def _on_ack(self, connection: int, frame: Frame) -> list[bytes]:
        ack = frame.command.ack
        if ack.HasField("request_id"):
            return [encode_command(api.CommandAckResponse(consumer_id=ack.consumer_id, request_id=ack.request_id))]
        return []

    def _on_close_consumer(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.close_consumer
        self.consumers.pop((connection, req.consumer_id), None)
        return [encode_command(api.CommandSuccess(request_id=req.request_id))]

    def _on_unsubscribe(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.unsubscribe
        self.consumers.pop((connection, req.consumer_id), None)
        return [encode_command(api.CommandSuccess(request_id=req.request_id))]

    def _on_get_last_message_id(self, connection: int, frame: Frame) -> list[bytes]:
        req = frame.command.getLastMessageId
        consumer = self.consumers.get((connection, req.consumer_id))
        entries = self.topics.get(consumer.topic, []) if consumer else []
        last = (api.MessageIdData(ledgerId=entries[-1].ledger_id, entryId=entries[-1].entry_id) if entries
                else api.MessageIdData(ledgerId=0xFFFFFFFFFFFFFFFF, entryId=0xFFFFFFFFFFFFFFFF))
        return [encode_command(api.CommandGetLastMessageIdResponse(last_message_id=last, request_id=req.request_id))]

    def _on_redeliver_unacknowledged_messages(self, connection: int, frame: Frame) -> list[bytes]:
        return []


class GoldenServer:
    """The Trio side: accepts loopback connections, feeds the broker, records frames."""

    def __init__(self) -> None:
        self.broker: GoldenBroker | None = None
        self.port = 0
        self.scenario: ScenarioRecord | None = None
        self.active_connections = 0
        self._next_connection = 0
        self.errors: list[BaseException] = []
        self._idle = trio.Event()

    async def wait_idle(self) -> None:
        """Return once no client connection is open (a finished scenario's have all closed)."""
        while self.active_connections:
            self._idle = trio.Event()
            await self._idle.wait()

    async def serve(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        self.port = listeners[0].socket.getsockname()[1]
        self.broker = GoldenBroker(self.port)
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        assert self.broker is not None
        connection = self._next_connection
        self._next_connection += 1
        self.active_connections += 1
        decoder = FrameDecoder()
        try:
            async with stream:
                while data := await stream.receive_some(65536):
                    for frame in decoder.receive(data):
                        self._record(connection, "to_broker", frame.raw, frame.type_name)
                        for reply in self.broker.respond(connection, frame):
                            self._record(connection, "to_client", reply, _type_name_of(reply))
                            await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:  # surfaced by capture() so a broken stand-in fails loudly
            self.errors.append(exc)
        finally:
            self.active_connections -= 1
            if not self.active_connections:
                self._idle.set()

    def _record(self, connection: int, direction: str, raw: bytes, type_name: str) -> None:
        if self.scenario is not None:
            index = self.scenario.connection_index(connection)
            self.scenario.frames.append(RecordedFrame(index, direction, raw, type_name))


def _type_name_of(raw: bytes) -> str:
    decoder = FrameDecoder()
    decoder.feed(raw)
    frame = decoder.next_frame()
    assert frame is not None
    return frame.type_name


# ---------------------------------------------------------------- scenarios (run in a worker thread)

def _text_payload(i: int, size: int) -> bytes:
    line = f"golden message {i}: the quick brown fox jumps over the lazy dog. "
    return (line * (size // len(line) + 1)).encode()[:size]


def _messages(prefix: str, count: int, size: int) -> list[dict[str, Any]]:
    return [
        {"payload": _text_payload(i, size + 7 * i), "key": f"{prefix}-key-{i}",
         "properties": {"index": str(i), "scenario": prefix}, "event_timestamp": 1_700_000_000_000 + i}
        for i in range(count)
    ]


def _client(pulsar: Any, port: int) -> Any:
    return pulsar.Client(f"pulsar://{HOST}:{port}", operation_timeout_seconds=5, connection_timeout_ms=3000,
                         io_threads=1, message_listener_threads=1,
                         logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))


def _produce(pulsar: Any, client: Any, topic: str, name: str, messages: list[dict[str, Any]],
             *, batching: bool, compression: Any, chunking: bool = False) -> None:
    producer = client.create_producer(
        topic, producer_name=name, compression_type=compression, batching_enabled=batching,
        chunking_enabled=chunking,
        batching_max_messages=len(messages) if batching else 1000,
        batching_max_publish_delay_ms=60_000 if batching else 10, send_timeout_millis=5000)
    if batching:
        # Callbacks run on the client's own thread, possibly after flush() has returned.
        outcomes: queue.Queue[Any] = queue.Queue()
        for m in messages:
            producer.send_async(m["payload"], lambda res, _id: outcomes.put(res), properties=m["properties"],
                                partition_key=m["key"], event_timestamp=m["event_timestamp"])
        producer.flush()
        results = [outcomes.get(timeout=DRAIN_TIMEOUT) for _ in messages]
        if results != [pulsar.Result.Ok] * len(messages):
            raise RuntimeError(f"batched sends on {topic} did not all succeed: {results}")
    else:
        for m in messages:
            producer.send(m["payload"], properties=m["properties"], partition_key=m["key"],
                          event_timestamp=m["event_timestamp"])
    producer.close()


def _consume(client: Any, topic: str, subscription: str, count: int) -> list[dict[str, Any]]:
    consumer = client.subscribe(topic, subscription, consumer_name=f"{subscription}-consumer",
                                receiver_queue_size=10)
    received = []
    for _ in range(count):
        msg = consumer.receive(timeout_millis=5000)
        received.append({"payload": msg.data(), "key": msg.partition_key(), "properties": msg.properties(),
                         "event_timestamp": msg.event_timestamp()})
        consumer.acknowledge(msg)
    consumer.close()
    return received


@dataclass
class Scenario:
    name: str
    description: str
    topic: str
    messages: list[dict[str, Any]]
    batching: bool = False
    compression: str = "NONE"
    consume_from: str | None = None  # a topic produced earlier in the run
    consume_count: int = 0
    chunking: bool = False
    #: max_message_size the stand-in announces in CONNECTED (chunk size for a chunking producer)
    max_message_size: int = MAX_MESSAGE_SIZE


_COMPRESSIONS = ("NONE", "LZ4", "ZLIB", "ZSTD", "SNAPPY")


def _compression(pulsar: Any, name: str) -> Any:
    return getattr(pulsar.CompressionType, "ZLib" if name == "ZLIB" else name)


def scenarios() -> list[Scenario]:
    plain_topic = "persistent://public/default/golden-plain"
    batch_topics = {c: f"persistent://public/default/golden-batch-{c.lower()}" for c in _COMPRESSIONS}
    out = [Scenario("send_plain", "CONNECT, PARTITIONED_METADATA, LOOKUP, PRODUCER and SEND without batching",
                    plain_topic, _messages("plain", 3, 100))]
    for c in _COMPRESSIONS:
        out.append(Scenario(f"send_batch_{c.lower()}",
                            f"PRODUCER and one batched SEND of several keyed messages with properties, {c}",
                            batch_topics[c], _messages(f"batch-{c.lower()}", 4, 300), batching=True, compression=c))
    out.append(Scenario("consume", "SUBSCRIBE, FLOW, MESSAGE (with broker entry metadata) and ACK "
                        "for the messages of send_plain", plain_topic, [], consume_from=plain_topic,
                        consume_count=3))
    out.append(Scenario("send_chunked", "a 5000-byte message split into chunks (CONNECTED announces "
                        "max_message_size 2048), then consumed and reassembled by the client",
                        "persistent://public/default/golden-chunked", _messages("chunked", 1, 5000), chunking=True,
                        consume_from="persistent://public/default/golden-chunked", consume_count=1,
                        max_message_size=2048))
    out.append(Scenario(SAMPLE_SCENARIO, "one client session: a plain producer, a batching LZ4 producer, "
                        "then a consumer receiving and acking everything", "persistent://public/default/golden-session",
                        _messages("session", 6, 120), batching=True, compression="LZ4",
                        consume_from="persistent://public/default/golden-session", consume_count=8))
    return out


def _run_scenario(pulsar: Any, port: int, scenario: Scenario) -> list[dict[str, Any]]:
    client = _client(pulsar, port)
    received: list[dict[str, Any]] = []
    try:
        if scenario.name == SAMPLE_SCENARIO:
            plain = _messages("session-plain", 2, 60)
            _produce(pulsar, client, scenario.topic, "session-plain-producer", plain, batching=False,
                     compression=_compression(pulsar, "NONE"))
            _produce(pulsar, client, scenario.topic, "session-batch-producer", scenario.messages, batching=True,
                     compression=_compression(pulsar, scenario.compression))
            scenario.messages = plain + scenario.messages
        elif scenario.messages:
            _produce(pulsar, client, scenario.topic, f"{scenario.name}-producer", scenario.messages,
                     batching=scenario.batching, compression=_compression(pulsar, scenario.compression),
                     chunking=scenario.chunking)
        if scenario.consume_from is not None:
            received = _consume(client, scenario.consume_from, f"{scenario.name}-sub", scenario.consume_count)
    finally:
        client.close()
    return received


async def capture(names: list[str] | None = None) -> dict[str, Any]:
    """Run the scenarios (all, or those named) against a live official client; return the manifest."""
    import pulsar

    server = GoldenServer()
    chosen = [s for s in scenarios() if names is None or s.name in names]
    manifest: dict[str, Any] = {"client": f"pulsar-client {pulsar.__version__}", "scenarios": []}
    produced: dict[str, list[dict[str, Any]]] = {}
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        for scenario in chosen:
            record = ScenarioRecord(scenario.name)
            server.scenario = record
            assert server.broker is not None
            server.broker.max_message_size = scenario.max_message_size
            received = await trio.to_thread.run_sync(_run_scenario, pulsar, port, scenario)
            with trio.fail_after(DRAIN_TIMEOUT):
                await server.wait_idle()
            server.scenario = None
            if server.errors:
                raise RuntimeError(f"stand-in broker failed in {scenario.name}") from server.errors[0]
            produced.setdefault(scenario.topic, []).extend(scenario.messages)
            expected_received = produced.get(scenario.consume_from or "", [])[:scenario.consume_count]
            if [_canonical(m) for m in received] != [_canonical(m) for m in expected_received]:
                raise RuntimeError(f"{scenario.name}: the client received other messages than were produced")
            manifest["scenarios"].append(_scenario_json(scenario, record, expected_received))
        nursery.cancel_scope.cancel()
    return manifest


def _canonical(m: dict[str, Any]) -> tuple[bytes, str, tuple[tuple[str, str], ...], int]:
    return m["payload"], m["key"], tuple(sorted(m["properties"].items())), m["event_timestamp"]


def _message_json(m: dict[str, Any]) -> dict[str, Any]:
    return {"payload_b64": base64.b64encode(m["payload"]).decode(), "key": m["key"],
            "properties": m["properties"], "event_timestamp": m["event_timestamp"]}


def _scenario_json(scenario: Scenario, record: ScenarioRecord, received: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": scenario.name,
        "description": scenario.description,
        "topic": scenario.topic,
        "batching": scenario.batching,
        "compression": scenario.compression,
        "produced": [_message_json(m) for m in scenario.messages],
        "received": [_message_json(m) for m in received],
        "frames": [{"connection": f.connection, "direction": f.direction, "type": f.type_name,
                    "raw_b64": base64.b64encode(f.raw).decode()} for f in record.frames],
    }


def sample_stream(manifest: dict[str, Any]) -> bytes:
    """The client frames of the sample scenario, concatenated as they crossed the wire."""
    for scenario in manifest["scenarios"]:
        if scenario["name"] == SAMPLE_SCENARIO:
            return b"".join(base64.b64decode(f["raw_b64"]) for f in scenario["frames"]
                            if f["direction"] == "to_broker")
    raise LookupError(f"no {SAMPLE_SCENARIO} scenario in the manifest")


def write(manifest: dict[str, Any], vectors: Path, sample: Path | None) -> None:
    vectors.write_text(json.dumps(manifest, indent=1) + "\n")
    if sample is not None:
        sample.write_bytes(sample_stream(manifest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", type=Path, default=VECTORS_PATH)
    parser.add_argument("--sample", type=Path, default=SAMPLE_PATH)
    args = parser.parse_args(argv)
    manifest = trio.run(capture)
    write(manifest, args.vectors, args.sample)
    for scenario in manifest["scenarios"]:
        kinds = ", ".join(f["type"] for f in scenario["frames"] if f["direction"] == "to_broker")
        print(f"{scenario['name']}: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
