"""The codec against golden frames the official Pulsar client sent (tests/golden/vectors.json).

The vectors are shipped, so these tests need no client; the last test reruns part of
the capture against the live official client to show the capture itself still works.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio

from proxy.errors import ChecksumMismatch
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol import compression
from proxy.protocol.batch import build_batch, is_batch, split_batch
from proxy.protocol.chunks import ChunkAssembler, is_chunk
from proxy.protocol.frame import (
    Frame,
    FrameDecoder,
    encode_command,
    encode_payload_command,
    frame_from_bytes,
    reencode,
)
from proxy.protocol.message import decode_messages

GOLDEN = Path(__file__).parent / "golden"
SAMPLE = Path(__file__).parent.parent / "proxy" / "data" / "sample_client_frames.bin"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "vectors.json").read_text())
SCENARIOS: dict[str, dict[str, Any]] = {s["name"]: s for s in MANIFEST["scenarios"]}
BATCH_COMPRESSIONS = ("NONE", "LZ4", "ZLIB", "ZSTD", "SNAPPY")


def load_capture_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("golden_capture", GOLDEN / "capture.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    module = sys.modules[spec.name]
    return module


@dataclass(frozen=True)
class Golden:
    scenario: str
    index: int
    connection: int
    direction: str
    type_name: str
    raw: bytes

    @property
    def frame(self) -> Frame:
        return frame_from_bytes(self.raw)


def golden_frames(scenario: str | None = None, *, direction: str | None = None,
                  type_name: str | None = None) -> list[Golden]:
    out = []
    for s in MANIFEST["scenarios"]:
        if scenario is not None and s["name"] != scenario:
            continue
        for i, f in enumerate(s["frames"]):
            if (direction is None or f["direction"] == direction) and (type_name is None or f["type"] == type_name):
                out.append(Golden(s["name"], i, f["connection"], f["direction"], f["type"],
                                  base64.b64decode(f["raw_b64"])))
    return out


def produced(scenario: str) -> list[tuple[bytes, str, dict[str, str], int]]:
    return [(base64.b64decode(m["payload_b64"]), m["key"], m["properties"], m["event_timestamp"])
            for m in SCENARIOS[scenario]["produced"]]


def client_stream(scenario: str, connection: int = 0) -> bytes:
    return b"".join(g.raw for g in golden_frames(scenario, direction="to_broker") if g.connection == connection)


ALL = golden_frames()
IDS = [f"{g.scenario}-{g.index}-{g.type_name}" for g in ALL]


def test_vectors_cover_every_command_the_acceptance_names() -> None:
    """The shipped vectors hold client frames for each command and compression the issue asks for."""
    client_types = {g.type_name for g in ALL if g.direction == "to_broker"}
    assert {"CONNECT", "PARTITIONED_METADATA", "LOOKUP", "PRODUCER", "SEND", "SUBSCRIBE", "FLOW", "ACK",
            "CLOSE_PRODUCER", "CLOSE_CONSUMER"} <= client_types
    batch_compressions = {
        compression.compression_name(g.frame.payload.metadata.compression)  # type: ignore[union-attr]
        for g in golden_frames(type_name="SEND") if is_batch(g.frame.payload.metadata)  # type: ignore[union-attr]
    }
    assert batch_compressions == set(BATCH_COMPRESSIONS)
    assert MANIFEST["client"] == "pulsar-client 3.13.0"


@pytest.mark.parametrize("golden", ALL, ids=IDS)
def test_golden_frame_decodes_to_its_recorded_type_with_a_valid_checksum(golden: Golden) -> None:
    frame = golden.frame
    assert frame.type_name == golden.type_name
    assert frame.raw == golden.raw
    assert frame.command.type == frame.type
    if frame.type_name in ("SEND", "MESSAGE"):
        assert frame.payload is not None
        frame.payload.verify_checksum()
        assert frame.payload.metadata.IsInitialized()
    else:
        assert frame.payload is None


@pytest.mark.parametrize("golden", ALL, ids=IDS)
def test_reencoding_an_unchanged_golden_frame_gives_identical_bytes(golden: Golden) -> None:
    frame = golden.frame
    assert reencode(frame) == golden.raw
    section = frame.payload
    if section is None:
        assert encode_command(frame.command) == golden.raw
        assert encode_command(frame.sub) == golden.raw
    else:
        # From the decoded objects, not the raw slices: protobuf must re-serialise the same bytes.
        assert encode_payload_command(frame.command, section.metadata, section.payload,
                                      broker_entry_metadata=section.broker_entry_metadata) == golden.raw


def test_corrupting_one_payload_byte_of_a_golden_send_fails_the_checksum() -> None:
    raw = bytearray(golden_frames("send_plain", type_name="SEND")[0].raw)
    raw[-1] ^= 0x01
    frame = frame_from_bytes(bytes(raw))
    assert frame.payload is not None
    with pytest.raises(ChecksumMismatch):
        frame.payload.verify_checksum()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_client_stream_decodes_identically_whatever_the_chunking(scenario: str) -> None:
    """Byte at a time, split at every single point, and random chunks all give the same frames."""
    stream = client_stream(scenario)
    expected = [g.raw for g in golden_frames(scenario, direction="to_broker") if g.connection == 0]

    def decode(chunks: list[bytes]) -> list[bytes]:
        decoder = FrameDecoder()
        out = [f.raw for chunk in chunks for f in decoder.receive(chunk)]
        decoder.close()
        return out

    assert decode([stream]) == expected
    assert decode([stream[i:i + 1] for i in range(len(stream))]) == expected
    step = max(1, len(stream) // 300)
    for cut in range(0, len(stream) + 1, step):
        assert decode([stream[:cut], stream[cut:]]) == expected
    rng = random.Random(scenario)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(stream)), 12))
        assert decode([stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]) == expected


def test_handshake_frames_carry_the_clients_key_fields() -> None:
    frames = [g.frame for g in golden_frames("send_plain", direction="to_broker")]
    connect, partitioned, lookup, producer = (f.command for f in frames[:4])
    topic = SCENARIOS["send_plain"]["topic"]
    assert connect.connect.client_version.startswith("Pulsar-CPP-")
    assert connect.connect.protocol_version == 20
    assert connect.connect.feature_flags.supports_broker_entry_metadata
    assert partitioned.partitionMetadata.topic == topic
    assert lookup.lookupTopic.topic == topic
    assert lookup.lookupTopic.request_id != partitioned.partitionMetadata.request_id
    assert producer.producer.topic == topic
    assert producer.producer.producer_name == "send_plain-producer"
    sends = [f for f in frames if f.type_name == "SEND"]
    assert [f.command.send.sequence_id for f in sends] == [0, 1, 2]
    assert {f.command.send.producer_id for f in sends} == {producer.producer.producer_id}
    assert frames[-1].command.close_producer.producer_id == producer.producer.producer_id


def test_stand_in_replies_match_the_requests_they_answer() -> None:
    """Every request_id the client used is answered exactly once by the stand-in."""
    for scenario in SCENARIOS:
        asked: list[int] = []
        answered: list[int] = []
        for g in golden_frames(scenario):
            sub = g.frame.sub
            if sub.DESCRIPTOR.fields_by_name.get("request_id") is None or not sub.HasField("request_id"):
                continue
            (asked if g.direction == "to_broker" else answered).append(sub.request_id)  # type: ignore[attr-defined]
        assert sorted(asked) == sorted(answered), scenario


def test_unbatched_sends_hold_exactly_the_produced_payloads_keys_and_properties() -> None:
    sends = [g.frame for g in golden_frames("send_plain", type_name="SEND")]
    got = []
    for frame in sends:
        assert frame.payload is not None
        meta = frame.payload.metadata
        assert not is_batch(meta)
        assert meta.compression == compression.NONE
        assert meta.producer_name == "send_plain-producer"
        assert meta.sequence_id == frame.command.send.sequence_id
        got.append((frame.payload.payload, meta.partition_key, {p.key: p.value for p in meta.properties},
                    meta.event_time))
    assert got == produced("send_plain")


@pytest.mark.parametrize("codec", BATCH_COMPRESSIONS)
def test_batched_send_decompresses_and_splits_into_the_produced_messages(codec: str) -> None:
    scenario = f"send_batch_{codec.lower()}"
    [golden] = golden_frames(scenario, type_name="SEND")
    frame = golden.frame
    assert frame.payload is not None
    meta, wire_payload = frame.payload.metadata, frame.payload.payload
    expected = produced(scenario)
    assert compression.compression_name(meta.compression) == codec
    assert frame.command.send.num_messages == meta.num_messages_in_batch == len(expected)

    raw_batch = compression.decompress(meta.compression, wire_payload, meta.uncompressed_size)
    entries = split_batch(meta, raw_batch)
    assert [(e.payload, e.metadata.partition_key, {p.key: p.value for p in e.metadata.properties},
             e.metadata.event_time) for e in entries] == expected
    assert [e.metadata.sequence_id for e in entries] == list(range(len(expected)))

    # Our encoders reproduce the client's bytes exactly: the batch layout and the compressed block.
    assert build_batch(entries) == raw_batch
    assert compression.compress(meta.compression, raw_batch) == wire_payload
    if codec != "NONE":
        assert len(wire_payload) < len(raw_batch)

    messages = decode_messages(meta, wire_payload)
    assert [(m.payload, m.key, m.properties, m.event_time) for m in messages] == expected
    assert [m.batch_index for m in messages] == list(range(len(expected)))
    assert {m.producer_name for m in messages} == {f"{scenario}-producer"}


def test_consumer_frames_subscribe_flow_and_ack_what_was_delivered() -> None:
    frames = golden_frames("consume")
    client = [g.frame for g in frames if g.direction == "to_broker"]
    subscribe = next(f.command.subscribe for f in client if f.type_name == "SUBSCRIBE")
    assert subscribe.topic == SCENARIOS["consume"]["topic"]
    assert subscribe.subscription == "consume-sub"
    assert subscribe.consumer_name == "consume-sub-consumer"
    assert subscribe.subType == api.CommandSubscribe.Exclusive
    flow = next(f.command.flow for f in client if f.type_name == "FLOW")
    assert (flow.consumer_id, flow.messagePermits) == (subscribe.consumer_id, 10)

    delivered = [g.frame for g in frames if g.type_name == "MESSAGE"]
    delivered_ids = [(f.command.message.message_id.ledgerId, f.command.message.message_id.entryId)
                     for f in delivered]
    acked = [(m.ledgerId, m.entryId) for f in client if f.type_name == "ACK" for m in f.command.ack.message_id]
    assert sorted(acked) == sorted(delivered_ids)
    assert all(f.command.ack.ack_type == api.CommandAck.Individual for f in client if f.type_name == "ACK")
    assert client[-1].command.close_consumer.consumer_id == subscribe.consumer_id


def test_served_messages_carry_broker_entry_metadata_and_the_produced_payloads() -> None:
    delivered = [g.frame for g in golden_frames("consume", type_name="MESSAGE")]
    for entry_id, frame in enumerate(delivered):
        section = frame.payload
        assert section is not None
        assert section.broker_entry_metadata is not None
        assert section.broker_entry_metadata.index == entry_id
        assert section.broker_entry_metadata.broker_timestamp == 1_700_000_000_000 + entry_id
    got = [(m.payload, m.key, m.properties, m.event_time)
           for f in delivered for m in decode_messages(f.payload.metadata, f.payload.payload)]  # type: ignore[union-attr]
    assert got == produced("send_plain")


@pytest.mark.parametrize("direction", ["to_broker", "to_client"])
def test_chunks_reassemble_into_the_produced_message(direction: str) -> None:
    chunks = [g.frame.payload for g in golden_frames("send_chunked", direction=direction)
              if g.type_name in ("SEND", "MESSAGE")]
    assert len(chunks) == 3
    assembler = ChunkAssembler()
    results = []
    for section in chunks:
        assert section is not None
        assert is_chunk(section.metadata)
        assert section.metadata.num_chunks_from_msg == 3
        results.append(assembler.add(section.metadata, section.payload))
    assert results[:2] == [None, None]
    whole = results[2]
    assert whole is not None
    assert assembler.pending == 0
    [(payload, key, properties, event_time)] = produced("send_chunked")
    assert whole.payload == payload
    [message] = decode_messages(whole.metadata, whole.payload)
    assert (message.payload, message.key, message.properties, message.event_time) == (
        payload, key, properties, event_time)


def test_session_scenario_consumer_receives_both_producers_messages() -> None:
    received = [(base64.b64decode(m["payload_b64"]), m["key"], m["properties"], m["event_timestamp"])
                for m in SCENARIOS["session"]["received"]]
    assert received == produced("session")
    delivered = [g.frame for g in golden_frames("session", type_name="MESSAGE")]
    got = [(m.payload, m.key, m.properties, m.event_time)
           for f in delivered for m in decode_messages(f.payload.metadata, f.payload.payload)]  # type: ignore[union-attr]
    assert got == received


def test_bundled_sample_is_the_session_scenarios_client_stream() -> None:
    assert SAMPLE.read_bytes() == client_stream("session")
    capture = load_capture_module()
    assert capture.sample_stream(MANIFEST) == SAMPLE.read_bytes()


def command_sequence(scenario: dict[str, Any]) -> list[tuple[str, str]]:
    """(direction, type) of each frame; consecutive ACKs count once (the client's ack grouping timer may split them)."""
    out: list[tuple[str, str]] = []
    for f in scenario["frames"]:
        item = (f["direction"], f["type"])
        if not (item[1] == "ACK" and out and out[-1] == item):
            out.append(item)
    return out


async def test_capture_still_works_against_the_live_official_client(tmp_path: Path) -> None:
    """A few scenarios rerun against pulsar-client: same command sequence as the shipped vectors."""
    pytest.importorskip("pulsar")
    capture = load_capture_module()
    names = ["send_plain", "send_batch_zstd", "consume"]
    with trio.fail_after(10):
        manifest = await capture.capture(names)
    capture.write(manifest, tmp_path / "vectors.json", None)
    fresh = {s["name"]: s for s in json.loads((tmp_path / "vectors.json").read_text())["scenarios"]}
    assert list(fresh) == names
    for name in names:
        assert command_sequence(fresh[name]) == command_sequence(SCENARIOS[name]), name
        for f in fresh[name]["frames"]:
            raw = base64.b64decode(f["raw_b64"])
            assert reencode(frame_from_bytes(raw)) == raw
    assert fresh["consume"]["received"] == SCENARIOS["consume"]["received"]


def test_pulsar_tap_demo_prints_the_bundled_sample_as_a_table() -> None:
    """The console script decodes the bundled sample: one row per client frame, then a summary."""
    script = Path(sys.executable).with_name("pulsar-tap")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "proxy"]
    command += ["demo", "--sample"]
    # (PYTHONPATH: the console script imports the tree under test, not the venv's editable install's)
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    session = golden_frames("session", direction="to_broker")
    rows = [line.split() for line in lines[:-1] if line[:3].strip().isdigit()]
    assert [(int(r[0]), r[1], int(r[2])) for r in rows] == [(i, g.type_name, len(g.raw)) for i, g in enumerate(session)]
    assert any("compression=LZ4" in line and "num_messages=6" in line for line in lines)
    assert any("producer_name=session-batch-producer" in line for line in lines)
    assert sum("message key=" in line for line in lines) == len(produced("session"))
    assert lines[-1].startswith(f"{len(session)} frames, {len(SAMPLE.read_bytes())} bytes, 8 messages in 3 SENDs")


def test_codec_benchmark_runs_every_mode_for_both_payload_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/codec.py still runs (one pass per mode) and reports a rate for every mode and size."""
    spec = importlib.util.spec_from_file_location("bench_codec", Path(__file__).parent.parent / "bench" / "codec.py")
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--seconds", "0"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.lstrip()[:1].isdigit()]
    modes = [name for name, _ in bench.MODES]
    assert [(r[0] + " " + r[1], r[3]) for r in rows] == [(size, m) for size in ("100 B", "64 KiB") for m in modes]
    assert all(float(r[4].replace(",", "")) > 0 for r in rows)
