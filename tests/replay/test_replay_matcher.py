"""The replay core without sockets: the client's view of a recording, the matcher, the served session."""

from __future__ import annotations

from typing import Any

import pytest
from replay_sessions import SUB, TOPIC, batched_send, frame, produce_and_consume_session

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import FrameDecoder, encode_command
from proxy.replay.conversation import build_conversations, client_view, with_command
from proxy.replay.matcher import AnswerBook
from proxy.replay.served import NOT_IN_RECORDING, Close, Forward, Reply, ServedSession

T = api.BaseCommand.Type
OWN_URL = "pulsar://127.0.0.1:7777"


def _book(**kwargs: Any) -> AnswerBook:
    return AnswerBook.from_conversations(build_conversations(produce_and_consume_session(**kwargs)).values())


def _replies(outputs: list[Any]) -> list[Any]:
    """Decode every Reply into frames; anything else is a test failure."""
    decoder = FrameDecoder()
    for output in outputs:
        assert isinstance(output, Reply), output
        decoder.feed(output.data)
    return list(decoder.frames())


def _connected_session(book: AnswerBook, unmatched: str = "error") -> ServedSession:
    session = ServedSession(book, OWN_URL, unmatched)
    [connected] = _replies(session.receive(frame(encode_command(api.CommandConnect(
        client_version="Pulsar-CPP-v4", protocol_version=21)))))
    assert connected.type == T.CONNECTED
    return session


def test_client_view_prefers_the_proxy_s_replacement_and_drops_nothing_the_client_saw() -> None:
    recorded = produce_and_consume_session()
    view = list(client_view(recorded))
    assert len(view) == len(recorded) - 1  # only the broker's LOOKUP answer the proxy rewrote is left out
    lookups = [f for f in view if f.frame.type == T.LOOKUP_RESPONSE]
    assert [f.origin for f in lookups] == ["proxy"]
    assert lookups[0].frame.command.lookupTopicResponse.brokerServiceUrl == "pulsar://127.0.0.1:7001"
    assert sum(1 for f in view if f.direction == "to_broker") == 12


def test_conversations_pair_requests_with_answers_and_key_them_without_ids() -> None:
    conversations = build_conversations(produce_and_consume_session())
    assert set(conversations) == {1, 2}
    data = conversations[2]
    summary = [(e.command, e.key[1:], e.outcome) for e in data.exchanges]
    assert summary[:2] == [("SUBSCRIBE", (TOPIC, SUB), "ok"), ("PRODUCER", (TOPIC, None), "ok")]
    assert [s for s in summary if s[0] == "SEND"] == [("SEND", (TOPIC, None), "ok")] * 3
    assert summary[-1] == ("CLOSE_PRODUCER", (TOPIC, None), "ok")
    assert [len(v) for v in data.messages.values()] == [3]


def test_an_injected_error_is_the_recorded_outcome() -> None:
    conversations = build_conversations(produce_and_consume_session(producer_error=True))
    producer = next(e for e in conversations[2].exchanges if e.command == "PRODUCER")
    assert producer.outcome == "error:ServiceNotReady"


def test_with_command_keeps_the_payload_section_and_its_checksum() -> None:
    original = frame(batched_send(0, 7, 3))
    cmd = api.BaseCommand()
    cmd.CopyFrom(original.command)
    cmd.send.producer_id = 123456
    changed = frame(with_command(original, cmd))
    assert changed.command.send.producer_id == 123456
    assert changed.payload is not None and changed.payload.checksum_ok()
    assert changed.payload.payload == original.payload.payload  # type: ignore[union-attr]


def test_served_session_answers_lookups_with_its_own_address_and_remaps_ids() -> None:
    session = _connected_session(_book())
    [meta] = _replies(session.receive(frame(encode_command(api.CommandPartitionedTopicMetadata(
        topic=TOPIC, request_id=41)))))
    assert meta.command.partitionMetadataResponse.request_id == 41
    assert meta.command.partitionMetadataResponse.partitions == 0
    [lookup] = _replies(session.receive(frame(encode_command(api.CommandLookupTopic(topic=TOPIC, request_id=42)))))
    answer = lookup.command.lookupTopicResponse
    assert (answer.request_id, answer.brokerServiceUrl, answer.response) == (
        42, OWN_URL, api.CommandLookupTopicResponse.Connect)
    [producer] = _replies(session.receive(frame(encode_command(api.CommandProducer(
        topic=TOPIC, producer_id=17, request_id=43)))))
    assert producer.type == T.PRODUCER_SUCCESS
    assert producer.command.producer_success.request_id == 43
    assert producer.command.producer_success.producer_name == "standalone-0-7"


def test_served_session_answers_sends_with_recorded_receipts_in_order_then_continues_them() -> None:
    session = _connected_session(_book())
    session.receive(frame(encode_command(api.CommandProducer(topic=TOPIC, producer_id=5, request_id=1))))
    receipts = []
    for sequence_id in (100, 101, 102, 103, 104):
        [receipt] = _replies(session.receive(frame(batched_send(5, sequence_id, 1))))
        receipts.append(receipt.command.send_receipt)
    assert [(r.producer_id, r.sequence_id) for r in receipts] == [(5, s) for s in (100, 101, 102, 103, 104)]
    assert [r.message_id.entryId for r in receipts] == [0, 1, 2, 3, 4]
    assert {r.message_id.ledgerId for r in receipts} == {9}


def test_served_session_pushes_recorded_messages_within_flow_permits() -> None:
    session = _connected_session(_book())
    [success] = _replies(session.receive(frame(encode_command(api.CommandSubscribe(
        topic=TOPIC, subscription=SUB, subType=api.CommandSubscribe.Shared, consumer_id=77, request_id=9)))))
    assert success.type == T.SUCCESS and success.command.success.request_id == 9
    # 3 permits: the first batch (5 messages) goes, then nothing until more permits come
    first = _replies(session.receive(frame(encode_command(api.CommandFlow(consumer_id=77, messagePermits=3)))))
    assert [(m.command.message.consumer_id, m.command.message.message_id.entryId) for m in first] == [(77, 0)]
    assert first[0].payload is not None and first[0].payload.checksum_ok()
    second = _replies(session.receive(frame(encode_command(api.CommandFlow(consumer_id=77, messagePermits=100)))))
    assert [m.command.message.message_id.entryId for m in second] == [1]  # the redelivery is not repeated
    assert session.receive(frame(encode_command(api.CommandFlow(consumer_id=77, messagePermits=100)))) == []


@pytest.mark.parametrize("request_frame", [
    api.CommandSubscribe(topic=TOPIC, subscription="unknown-sub", subType=api.CommandSubscribe.Shared,
                         consumer_id=1, request_id=5),
    api.CommandProducer(topic="persistent://public/default/elsewhere", producer_id=1, request_id=5),
    api.CommandGetTopicsOfNamespace(namespace="public/default", request_id=5),
])
def test_unmatched_requests_get_unknown_error_not_in_recording(request_frame: Any) -> None:
    session = _connected_session(_book())
    [error] = _replies(session.receive(frame(encode_command(request_frame))))
    assert error.type == T.ERROR
    assert (error.command.error.request_id, error.command.error.error, error.command.error.message) == (
        5, api.ServerError.UnknownError, NOT_IN_RECORDING)


def test_unmatched_lookup_fails_as_a_lookup_answer() -> None:
    session = _connected_session(_book())
    [lookup] = _replies(session.receive(frame(encode_command(api.CommandLookupTopic(
        topic="persistent://public/default/elsewhere", request_id=3)))))
    answer = lookup.command.lookupTopicResponse
    assert (answer.response, answer.error, answer.message) == (
        api.CommandLookupTopicResponse.Failed, api.ServerError.UnknownError, NOT_IN_RECORDING)


def test_unmatched_close_and_forward_policies() -> None:
    request = frame(encode_command(api.CommandSubscribe(topic=TOPIC, subscription="x", subType=0, consumer_id=3,
                                                         request_id=5)))
    closing = _connected_session(_book(), "close")
    [close] = closing.receive(request)
    assert isinstance(close, Close)
    forwarding = _connected_session(_book(), "forward")
    assert forwarding.receive(request) == [Forward(request)]
    flow = frame(encode_command(api.CommandFlow(consumer_id=3, messagePermits=10)))
    assert forwarding.receive(flow) == [Forward(flow)]  # the forwarded consumer's frames follow it


def test_a_recorded_failure_is_replayed_as_that_failure() -> None:
    session = _connected_session(_book(producer_error=True))
    [error] = _replies(session.receive(frame(encode_command(api.CommandProducer(
        topic=TOPIC, producer_id=2, request_id=8)))))
    assert error.type == T.ERROR
    assert (error.command.error.request_id, error.command.error.error) == (8, api.ServerError.ServiceNotReady)


def test_anything_before_connect_closes_the_connection() -> None:
    session = ServedSession(_book(), OWN_URL)
    [close] = session.receive(frame(encode_command(api.CommandLookupTopic(topic=TOPIC, request_id=1))))
    assert isinstance(close, Close)


def test_the_replay_core_is_sans_io() -> None:
    """The matcher, the conversations and the served session import no trio and no recorder or server."""
    import subprocess
    import sys

    code = ("import sys, proxy.replay.matcher, proxy.replay.served, proxy.replay.conversation; "
            "print(sorted(m for m in ('trio', 'proxy.server.recorder', 'proxy.server.app') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
