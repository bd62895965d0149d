"""Unit tests of the client's protocol decisions: no sockets, no Trio."""

from __future__ import annotations

import random

import pytest

from proxy.client.acks import BatchAckTracker, NegativeAckTracker
from proxy.client.backoff import Backoff
from proxy.client.batching import BatchContainer
from proxy.client.chunking import chunk_bounds, encode_chunks
from proxy.client.flow import FlowControl
from proxy.client.message import EARLIEST, LATEST, MessageId
from proxy.client.names import complete_topic_name, parse_service_url, partition_index, partition_name
from proxy.client.outgoing import OutgoingMessage, encode_batch, encode_single
from proxy.client.pending import PendingQueue, PendingSend, ReceiptMatch
from proxy.client.producer import java_string_hash
from proxy.errors import UsageError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.chunks import ChunkAssembler
from proxy.protocol.frame import frame_from_bytes
from proxy.protocol.message import decode_messages


def test_backoff_doubles_from_100ms_to_60s_with_at_most_10_percent_jitter() -> None:
    backoff = Backoff(rng=random.Random(7))
    delays = [backoff.next() for _ in range(14)]
    nominal = [min(0.1 * 2**i, 60.0) for i in range(14)]
    for delay, expected in zip(delays, nominal, strict=True):
        assert expected * 0.9 <= delay <= expected
    assert delays[-1] > 50
    backoff.reset()
    assert 0.09 <= backoff.next() <= 0.1


def test_service_urls_and_topic_names_parse_as_the_clients_do() -> None:
    [plain] = parse_service_url("pulsar://127.0.0.1:6650")
    assert (plain.host, plain.port, plain.tls) == ("127.0.0.1", 6650, False)
    hosts = parse_service_url("pulsar+ssl://a,b:7000")
    assert [(h.host, h.port, h.tls) for h in hosts] == [("a", 6651, True), ("b", 7000, True)]
    for bad in ("http://x:1", "pulsar://", "pulsar://h:notaport", "pulsar://h:70000"):
        with pytest.raises(UsageError):
            parse_service_url(bad)
    assert complete_topic_name("orders") == "persistent://public/default/orders"
    assert complete_topic_name("t/n/orders") == "persistent://t/n/orders"
    assert partition_name("persistent://a/b/c", 3) == "persistent://a/b/c-partition-3"
    assert partition_index("persistent://a/b/c-partition-3") == 3
    assert partition_index("persistent://a/b/c") == -1


def test_message_ids_order_by_ledger_entry_batch_index_and_round_trip() -> None:
    a, b, c = MessageId(1, 5), MessageId(1, 5, 2, batch_size=4), MessageId(2, 0)
    assert EARLIEST < a < b < c < LATEST
    assert MessageId.deserialize(b.serialize()) == b
    assert b.entry == MessageId(1, 5)


def test_batch_container_flushes_at_the_message_count_and_byte_limits() -> None:
    container: BatchContainer[int] = BatchContainer(max_messages=3, max_bytes=100)
    assert not container.add(OutgoingMessage(b"x" * 10, 1))
    assert not container.add(OutgoingMessage(b"x" * 10, 2))
    assert container.add(OutgoingMessage(b"x" * 10, 3))  # third message: full by count
    assert [m.receipt for m in container.drain()] == [1, 2, 3]
    container.add(OutgoingMessage(b"x" * 60, 4))
    big = OutgoingMessage(b"x" * 60, 5)
    assert not container.has_space_for(big)  # would exceed 100 bytes: flush first
    with pytest.raises(ValueError):
        container.add(big)
    container.drain()
    assert container.add(OutgoingMessage(b"x" * 500, 6))  # alone it may exceed the limit


@pytest.mark.parametrize("compression", [api.NONE, api.LZ4, api.ZLIB, api.ZSTD, api.SNAPPY])
def test_a_batch_frame_decodes_to_its_messages_with_keys_properties_and_sequence_ids(compression: int) -> None:
    messages = [OutgoingMessage(f"payload-{i}".encode() * 20, i, key=f"k{i}", properties={"i": str(i)},
                                event_time=1000 + i, sequence_id=40 + i) for i in range(5)]
    frame = frame_from_bytes(encode_batch(7, "prod", messages, compression, 123))
    send = frame.command.send
    assert (send.producer_id, send.sequence_id, send.highest_sequence_id, send.num_messages) == (7, 40, 44, 5)
    section = frame.payload
    assert section is not None and section.checksum_ok()
    assert section.metadata.num_messages_in_batch == 5
    assert section.metadata.compression == compression
    decoded = decode_messages(section.metadata, section.payload)
    assert [m.payload for m in decoded] == [m.payload for m in messages]
    assert [m.key for m in decoded] == [f"k{i}" for i in range(5)]
    assert [m.properties for m in decoded] == [{"i": str(i)} for i in range(5)]
    assert [m.sequence_id for m in decoded] == [40, 41, 42, 43, 44]
    assert decoded[4].event_time == 1004 and decoded[0].producer_name == "prod"


def test_a_single_message_frame_is_not_a_batch() -> None:
    frame = frame_from_bytes(encode_single(1, "p", OutgoingMessage(b"hello", 0, key="k", sequence_id=9),
                                           api.ZSTD, 5))
    section = frame.payload
    assert section is not None
    assert not section.metadata.HasField("num_messages_in_batch")
    [msg] = decode_messages(section.metadata, section.payload)
    assert (msg.payload, msg.key, msg.sequence_id) == (b"hello", "k", 9)


def test_a_large_message_is_cut_into_chunks_that_reassemble() -> None:
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(0, 4) == [(0, 0)]
    payload = random.Random(3).randbytes(10_000)
    msg = OutgoingMessage(payload, 0, key="big", sequence_id=12)
    frames = [frame_from_bytes(f) for f in encode_chunks(3, "prod", msg, api.NONE, payload, 99, 3000)]
    assert len(frames) == 4
    assembler = ChunkAssembler()
    result = None
    for index, frame in enumerate(frames):
        assert frame.command.send.is_chunk and frame.command.send.sequence_id == 12
        assert len(frame.raw) < 3000 + 200
        section = frame.payload
        assert section is not None and section.metadata.chunk_id == index
        result = assembler.add(section.metadata, section.payload)
    assert result is not None and result.payload == payload
    assert result.uuid == "prod-12" and result.metadata.partition_key == "big"


def test_receipts_match_the_head_duplicates_are_ignored_and_gaps_are_reported() -> None:
    queue: PendingQueue[str] = PendingQueue()
    for seq in range(3):
        queue.append(PendingSend(seq, seq, b"", 1, deadline=10.0 + seq, receipts=[f"m{seq}"]))
    assert queue.messages == 3
    outcome, send = queue.match_receipt(0)
    assert outcome is ReceiptMatch.MATCHED and send is not None and send.receipts == ["m0"]
    assert queue.match_receipt(0)[0] is ReceiptMatch.DUPLICATE  # a resend answered twice
    assert queue.match_receipt(2)[0] is ReceiptMatch.UNEXPECTED  # 1 is missing: reconnect
    assert len(queue) == 2
    assert [s.sequence_id for s in queue.expire(11.5)] == [1]
    assert queue.next_deadline() == 12.0
    assert [s.sequence_id for s in queue.unwritten(epoch=1)] == [2]


def test_flow_permits_are_refilled_once_half_the_queue_is_consumed() -> None:
    flow = FlowControl(1000)
    assert flow.initial_permits() == 1000
    assert [flow.consumed() for _ in range(499)] == [0] * 499
    assert flow.consumed() == 500
    assert flow.consumed(3) == 0
    assert flow.initial_permits() == 1000  # a re-subscription starts afresh
    assert flow.consumed(499) == 0
    assert FlowControl(1).consumed() == 1


def test_a_batch_is_acknowledged_only_when_all_its_messages_are() -> None:
    tracker = BatchAckTracker()
    ids = [MessageId(3, 7, i, batch_size=3) for i in range(3)]
    assert tracker.individual(ids[2]) is None
    assert tracker.individual(ids[0]) is None
    assert tracker.individual(ids[1]) == MessageId(3, 7)
    assert len(tracker) == 0
    assert tracker.individual(MessageId(3, 8)) == MessageId(3, 8)
    # cumulative ack inside a batch acknowledges up to the previous entry
    assert tracker.cumulative(MessageId(3, 9, 0, batch_size=2)) == MessageId(3, 8)
    assert tracker.cumulative(MessageId(3, 9, 1, batch_size=2)) == MessageId(3, 9)


def test_negative_acks_come_due_after_the_delay() -> None:
    tracker = NegativeAckTracker(delay=1.0)
    tracker.add(MessageId(1, 2, 0, batch_size=2), now=0.0)
    tracker.add(MessageId(1, 1), now=0.5)
    assert tracker.pop_due(0.9) == []
    assert tracker.pop_due(1.0) == [MessageId(1, 2)]
    assert tracker.next_due() == 1.5
    assert tracker.pop_due(2.0) == [MessageId(1, 1)]
    assert len(tracker) == 0


def test_key_routing_uses_javas_string_hash() -> None:
    assert java_string_hash("") == 0
    assert java_string_hash("a") == 97
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("polygenelubricants") == (-2147483648) & 0xFFFFFFFF


def test_latency_histogram_percentiles_are_within_one_percent() -> None:
    from proxy.client.latency import LatencyHistogram

    hist = LatencyHistogram()
    for ms in range(1, 1001):
        hist.record(ms / 1000)
    assert hist.count == 1000
    assert hist.percentile(50) == pytest.approx(0.5, rel=0.02)
    assert hist.percentile(99) == pytest.approx(0.99, rel=0.02)
    assert hist.percentile(100) == pytest.approx(1.0)
    other = LatencyHistogram()
    other.record(5.0)
    hist.merge(other)
    assert hist.max == 5.0 and hist.count == 1001


def test_acks_are_grouped_and_only_the_furthest_cumulative_ack_is_kept() -> None:
    from proxy.client.acks import AckGroup

    group = AckGroup(max_size=3)
    assert not group.add_individual(MessageId(1, 1))
    assert not group.add_individual(MessageId(1, 1))  # the same entry twice is one ack
    assert not group.add_individual(MessageId(1, 2))
    group.add_cumulative(MessageId(1, 9))
    group.add_cumulative(MessageId(1, 5))
    assert len(group) == 3
    assert group.take() == ([MessageId(1, 1), MessageId(1, 2)], MessageId(1, 9))
    assert group.take() == ([], None)
    assert not group.add_individual(MessageId(2, 0))
    assert not group.add_individual(MessageId(2, 1))
    assert group.add_individual(MessageId(2, 2))  # full: send now
