"""Compression, batches, chunks and replication markers, as Pulsar clients produce them."""

from __future__ import annotations

import random
import zlib

import cramjam
import pytest

from proxy.errors import BatchError, ChunkError, CompressionError, MarkerError
from proxy.pb import PulsarApi_pb2 as api
from proxy.pb import PulsarMarkers_pb2 as pm
from proxy.protocol import batch, compression, markers
from proxy.protocol.chunks import ChunkAssembler, is_chunk, split_into_chunks
from proxy.protocol.frame import encode_payload_command, frame_from_bytes
from proxy.protocol.message import decode_messages, encode_payload

KINDS = [compression.NONE, compression.LZ4, compression.ZLIB, compression.ZSTD, compression.SNAPPY]
DATA = b"The quick brown fox jumps over the lazy dog. " * 50
NOISE = random.Random(7).randbytes(5000)  # does not compress: several chunks


@pytest.mark.parametrize("kind", KINDS, ids=compression.compression_name)
def test_compression_round_trips(kind: int) -> None:
    packed = compression.compress(kind, DATA)
    assert compression.decompress(kind, packed, len(DATA)) == DATA


def test_compressed_formats_are_the_raw_forms_pulsar_uses() -> None:
    # LZ4 and SNAPPY are raw blocks, ZLIB is a zlib stream, ZSTD a zstd frame
    lz4 = compression.compress(compression.LZ4, DATA)
    assert bytes(cramjam.lz4.decompress_block(lz4, output_len=len(DATA))) == DATA
    assert not lz4.startswith(b"\x04\x22\x4d\x18")  # not the LZ4 frame format
    assert zlib.decompress(compression.compress(compression.ZLIB, DATA)) == DATA
    assert compression.compress(compression.ZSTD, DATA).startswith(b"\x28\xb5\x2f\xfd")
    snappy = compression.compress(compression.SNAPPY, DATA)
    assert bytes(cramjam.snappy.decompress_raw(snappy)) == DATA


@pytest.mark.parametrize("kind", KINDS[1:], ids=compression.compression_name)
def test_garbage_or_wrong_size_is_a_compression_error(kind: int) -> None:
    with pytest.raises(CompressionError):
        compression.decompress(kind, b"\xff\x00garbage\x17", 100)
    packed = compression.compress(kind, DATA)
    with pytest.raises(CompressionError):
        compression.decompress(kind, packed, len(DATA) - 1)


def test_names_and_values() -> None:
    assert compression.compression_value("lz4") == compression.LZ4
    assert compression.compression_name(compression.SNAPPY) == "SNAPPY"
    with pytest.raises(ValueError, match="unknown compression"):
        compression.compression_value("brotli")


@pytest.mark.parametrize("kind", KINDS, ids=compression.compression_name)
def test_batch_of_messages_round_trips_through_a_send_frame(kind: int) -> None:
    singles = [
        (f"value-{i}".encode(), api.SingleMessageMetadata(
            partition_key=f"key-{i}", properties=[api.KeyValue(key="i", value=str(i))],
            event_time=1000 + i, sequence_id=10 + i, payload_size=0))
        for i in range(5)
    ]
    metadata = api.MessageMetadata(producer_name="prod", sequence_id=10, publish_time=99)
    payload = encode_payload(singles, metadata, kind, batched=True)
    raw = encode_payload_command(api.CommandSend(producer_id=1, sequence_id=10, num_messages=5), metadata, payload)
    section = frame_from_bytes(raw).payload
    assert section is not None
    messages = decode_messages(section.metadata, section.payload)
    assert [m.payload for m in messages] == [p for p, _ in singles]
    assert [m.key for m in messages] == [f"key-{i}" for i in range(5)]
    assert [m.properties for m in messages] == [{"i": str(i)} for i in range(5)]
    assert [m.sequence_id for m in messages] == list(range(10, 15))
    assert [m.batch_index for m in messages] == list(range(5))


def test_a_batch_of_one_is_still_a_batch() -> None:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1)
    payload = encode_payload([(b"x", api.SingleMessageMetadata(payload_size=0))], metadata, compression.NONE,
                             batched=True)
    assert batch.is_batch(metadata)
    assert decode_messages(metadata, payload)[0].batch_size == 1


def test_non_batched_message_keeps_metadata_key_and_properties() -> None:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=4, publish_time=1, partition_key="k",
                                   properties=[api.KeyValue(key="a", value="b")])
    payload = encode_payload([(b"body", api.SingleMessageMetadata(payload_size=0))], metadata, compression.LZ4,
                             batched=False)
    (message,) = decode_messages(metadata, payload)
    assert (message.payload, message.key, message.properties, message.batch_index) == (b"body", "k", {"a": "b"}, -1)


def test_a_batch_that_lies_about_its_contents_is_a_batch_error() -> None:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1, num_messages_in_batch=3)
    two = batch.build_batch([(api.SingleMessageMetadata(payload_size=0), b"a"),
                             (api.SingleMessageMetadata(payload_size=0), b"b")])
    with pytest.raises(BatchError):
        batch.split_batch(metadata, two)
    metadata.num_messages_in_batch = 1
    with pytest.raises(BatchError, match="stray"):
        batch.split_batch(metadata, two)
    with pytest.raises(BatchError):
        batch.split_batch(metadata, b"\x00\x00\x00\x05ab")


def _chunks(payload: bytes, size: int, uuid: str = "prod-1") -> list[tuple[api.MessageMetadata, bytes]]:
    parts = split_into_chunks(payload, size)
    out = []
    for i, part in enumerate(parts):
        md = api.MessageMetadata(producer_name="prod", sequence_id=1, publish_time=1, uuid=uuid, chunk_id=i,
                                 num_chunks_from_msg=len(parts), total_chunk_msg_size=len(payload),
                                 compression=api.ZSTD, uncompressed_size=len(NOISE))
        out.append((md, part))
    return out


def test_chunks_reassemble_and_then_decompress() -> None:
    packed = compression.compress(compression.ZSTD, NOISE)
    assembler = ChunkAssembler()
    results = [assembler.add(md, part) for md, part in _chunks(packed, 1000)]
    assert len(results) > 3
    assert all(r is None for r in results[:-1])
    whole = results[-1]
    assert whole is not None
    assert not is_chunk(whole.metadata)
    assert whole.uuid == "prod-1"
    assert whole.payload == packed
    assert decode_messages(whole.metadata, whole.payload)[0].payload == NOISE
    assert compression.decompress(whole.metadata.compression, whole.payload, whole.metadata.uncompressed_size) == NOISE
    assert assembler.pending == 0


def test_a_repeated_chunk_is_ignored_and_a_missing_one_is_an_error() -> None:
    chunks = _chunks(b"x" * 1000, 100)
    assembler = ChunkAssembler()
    assembler.add(*chunks[0])
    assert assembler.add(*chunks[0]) is None  # the producer started over: fine
    assembler.add(*chunks[1])
    assert assembler.add(*chunks[1]) is None  # duplicate after resend
    with pytest.raises(ChunkError, match="missing"):
        assembler.add(*chunks[3])
    assert assembler.pending == 0
    with pytest.raises(ChunkError, match="without its first"):
        assembler.add(*chunks[5])


def test_partial_messages_are_bounded() -> None:
    assembler = ChunkAssembler(max_pending_messages=2)
    for n in range(5):
        assembler.add(*_chunks(b"y" * 300, 100, uuid=f"prod-{n}")[0])
    assert assembler.pending == 2
    assert assembler.discarded == 3


def test_replication_markers_decode() -> None:
    request = pm.ReplicatedSubscriptionsSnapshotRequest(snapshot_id="s-1", source_cluster="us-east")
    kind, payload = markers.encode_marker(request)
    metadata = api.MessageMetadata(producer_name="pulsar.repl", sequence_id=0, publish_time=1, marker_type=kind,
                                   replicated_from="us-east", replicate_to=["eu-west"])
    marker = markers.decode_marker(metadata, payload)
    assert marker.name == "REPLICATED_SUBSCRIPTION_SNAPSHOT_REQUEST"
    assert marker.body == request
    assert markers.replication_of(metadata) == markers.Replication("us-east", ("eu-west",))
    snapshot = pm.ReplicatedSubscriptionsSnapshot(
        snapshot_id="s-1", local_message_id=pm.MarkersMessageIdData(ledger_id=1, entry_id=2),
        clusters=[pm.ClusterMessageId(cluster="eu", message_id=pm.MarkersMessageIdData(ledger_id=3, entry_id=4))])
    kind, payload = markers.encode_marker(snapshot)
    metadata.marker_type = kind
    assert markers.decode_marker(metadata, payload).body == snapshot
    with pytest.raises(MarkerError):
        markers.decode_marker(metadata, b"\xff\xff")
    metadata.marker_type = 99
    with pytest.raises(MarkerError):
        markers.decode_marker(metadata, b"")
