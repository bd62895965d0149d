"""The session machine: handshake table, id attribution and request/response pairing."""

from __future__ import annotations

import pytest

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.commands import DATA_PATH_TYPES
from proxy.protocol.frame import Frame, encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import (
    TRANSITIONS,
    ConnectionState,
    Direction,
    IllegalFrame,
    SessionTracker,
    accounted_types,
)

B, C = Direction.TO_BROKER, Direction.TO_CLIENT
T = api.BaseCommand


def f(sub: object) -> Frame:
    return frame_from_bytes(encode_command(sub))


def send(producer_id: int, sequence_id: int, num: int = 1) -> Frame:
    md = api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1)
    return frame_from_bytes(encode_payload_command(
        api.CommandSend(producer_id=producer_id, sequence_id=sequence_id, num_messages=num), md, b"x"))


def connected() -> SessionTracker:
    s = SessionTracker()
    s.observe(f(api.CommandConnect(client_version="c", protocol_version=21)), B, 0)
    s.observe(f(api.CommandConnected(server_version="s", protocol_version=19, max_message_size=1 << 20)), C, 50)
    return s


def test_handshake_moves_through_the_table_and_pairs_connect() -> None:
    s = SessionTracker()
    assert s.state is ConnectionState.AWAITING_CONNECT
    s.observe(f(api.CommandConnect(client_version="c", protocol_version=21)), B, 100)
    assert s.state is ConnectionState.CONNECTING
    obs = s.observe(f(api.CommandConnected(server_version="s", protocol_version=19, max_message_size=1024)), C, 350)
    assert s.state is ConnectionState.CONNECTED
    assert s.protocol_version == 19 and s.max_message_size == 1024
    assert obs.completed is not None
    assert (obs.completed.request_command, obs.completed.latency_ns) == ("CONNECT", 250)


def test_auth_challenge_round_trips_during_the_handshake() -> None:
    s = SessionTracker()
    s.observe(f(api.CommandConnect(client_version="c", auth_method_name="token", auth_data=b"t")), B, 0)
    s.observe(f(api.CommandAuthChallenge(challenge=api.AuthData(auth_method_name="token", auth_data=b"?"))), C, 1)
    s.observe(f(api.CommandAuthResponse(response=api.AuthData(auth_method_name="token", auth_data=b"t"))), B, 2)
    s.observe(f(api.CommandConnected(server_version="s")), C, 3)
    assert s.state is ConnectionState.CONNECTED


def test_frames_outside_the_table_are_protocol_errors() -> None:
    with pytest.raises(IllegalFrame, match="SEND from the client"):
        SessionTracker().observe(send(1, 1), B, 0)
    s = connected()
    with pytest.raises(IllegalFrame, match="CONNECT from the client"):
        s.observe(f(api.CommandConnect(client_version="again")), B, 1)
    with pytest.raises(IllegalFrame, match="MESSAGE from the client"):
        s.observe(frame_from_bytes(encode_payload_command(
            api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(ledgerId=1, entryId=1)),
            api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1), b"")), B, 2)
    lenient = SessionTracker(strict=False)
    lenient.observe(send(1, 1), B, 0)  # counted, not raised


def test_every_transition_keeps_each_side_to_its_own_commands() -> None:
    for (state, direction, kind), _next in TRANSITIONS.items():
        if state is ConnectionState.CONNECTED and kind not in (T.PING, T.PONG, T.CLOSE_PRODUCER, T.CLOSE_CONSUMER):
            assert (ConnectionState.CONNECTED, Direction.TO_CLIENT if direction is B else B, kind) not in TRANSITIONS


def test_producer_ids_attribute_sends_and_receipts_to_their_topic() -> None:
    s = connected()
    topic = "persistent://public/default/orders"
    s.observe(f(api.CommandProducer(topic=topic, producer_id=7, request_id=1)), B, 1000)
    obs = s.observe(f(api.CommandProducerSuccess(request_id=1, producer_name="gen-1", producer_ready=True)), C, 1500)
    assert obs.completed is not None and obs.completed.request_command == "PRODUCER"
    assert obs.completed.topic == topic and obs.completed.outcome == "ok"
    assert s.producers[7].producer_name == "gen-1"
    obs = s.observe(send(7, 0, num=3), B, 2000)
    assert obs.topic == topic
    obs = s.observe(f(api.CommandSendReceipt(producer_id=7, sequence_id=0,
                                             message_id=api.MessageIdData(ledgerId=1, entryId=0))), C, 2600)
    assert obs.completed is not None
    assert (obs.completed.request_command, obs.completed.latency_ns, obs.completed.sequence_id,
            obs.completed.num_messages, obs.completed.topic) == ("SEND", 600, 0, 3, topic)


def test_waiting_for_exclusive_access_keeps_the_producer_request_open() -> None:
    s = connected()
    s.observe(f(api.CommandProducer(topic="t", producer_id=1, request_id=4)), B, 0)
    assert s.observe(f(api.CommandProducerSuccess(request_id=4, producer_name="p", producer_ready=False)), C,
                     1).completed is None
    assert s.observe(f(api.CommandProducerSuccess(request_id=4, producer_name="p", producer_ready=True)), C,
                     9).completed is not None


def test_errors_carry_the_server_error_name_and_forget_the_failed_consumer() -> None:
    s = connected()
    s.observe(f(api.CommandSubscribe(topic="t", subscription="s", subType=api.CommandSubscribe.Exclusive,
                                     consumer_id=3, request_id=5)), B, 0)
    obs = s.observe(f(api.CommandError(request_id=5, error=api.ConsumerBusy, message="busy")), C, 10)
    assert obs.completed is not None
    assert (obs.completed.outcome, obs.completed.error_code, obs.completed.error_message) == (
        "error", "ConsumerBusy", "busy")
    assert 3 not in s.consumers


def test_consumer_frames_are_attributed_and_acks_with_request_ids_pair() -> None:
    s = connected()
    s.observe(f(api.CommandSubscribe(topic="t1", subscription="sub", subType=api.CommandSubscribe.Shared,
                                     consumer_id=2, request_id=1, consumer_name="c")), B, 0)
    s.observe(f(api.CommandSuccess(request_id=1)), C, 5)
    assert s.consumers[2].sub_type == "Shared" and s.consumers[2].ready
    assert s.observe(f(api.CommandFlow(consumer_id=2, messagePermits=10)), B, 6).topic == "t1"
    batch = frame_from_bytes(encode_payload_command(
        api.CommandMessage(consumer_id=2, message_id=api.MessageIdData(ledgerId=1, entryId=1)),
        api.MessageMetadata(producer_name="p", sequence_id=1, publish_time=1, num_messages_in_batch=3), b"x"))
    s.observe(batch, C, 7)
    assert s.consumers[2].permits == 7  # a batch uses one permit per message in it
    s.observe(f(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual,
                               message_id=[api.MessageIdData(ledgerId=1, entryId=1)], request_id=9)), B, 10)
    obs = s.observe(f(api.CommandAckResponse(consumer_id=2, request_id=9)), C, 30)
    assert obs.completed is not None and obs.completed.request_command == "ACK" and obs.completed.topic == "t1"
    # a broker-initiated close (topic unload) forgets the consumer
    s.observe(f(api.CommandCloseConsumer(consumer_id=2, request_id=77)), C, 40)
    assert 2 not in s.consumers


def test_lookup_failures_are_errors_and_ping_pairs_with_pong() -> None:
    s = connected()
    s.observe(f(api.CommandLookupTopic(topic="t", request_id=3)), B, 0)
    obs = s.observe(f(api.CommandLookupTopicResponse(request_id=3, response=api.CommandLookupTopicResponse.Failed,
                                                     error=api.ServiceNotReady)), C, 4)
    assert obs.completed is not None and obs.completed.error_code == "ServiceNotReady"
    s.observe(f(api.CommandPing()), C, 100)
    obs = s.observe(f(api.CommandPong()), B, 130)
    assert obs.completed is not None and obs.completed.latency_ns == 30


def test_closing_ends_pending_requests_unanswered() -> None:
    s = connected()
    s.observe(f(api.CommandLookupTopic(topic="t", request_id=3)), B, 0)
    s.observe(send(1, 1), B, 1)
    ended = s.close(99)
    assert sorted(p.request_command for p in ended) == ["LOOKUP", "SEND"]
    assert all(p.outcome == "unanswered" for p in ended)
    assert s.pending_requests == 0


def test_pending_requests_are_bounded() -> None:
    s = SessionTracker(max_pending=10)
    s.observe(f(api.CommandConnect(client_version="c")), B, 0)
    s.observe(f(api.CommandConnected(server_version="s")), C, 0)
    for i in range(25):
        s.observe(f(api.CommandLookupTopic(topic="t", request_id=i)), B, i)
    assert s.pending_requests == 10
    assert s.forgotten_requests == 15


def test_attribute_gives_observes_attribution_of_data_path_frames_and_changes_nothing() -> None:
    s = connected()
    s.observe(f(api.CommandProducer(topic="persistent://public/default/a", producer_id=1, request_id=1,
                                    producer_name="p")), B, 0)
    s.observe(f(api.CommandSubscribe(topic="persistent://public/default/b", subscription="sub", consumer_id=2,
                                     request_id=2, subType=api.CommandSubscribe.Shared)), B, 0)
    s.observe(f(api.CommandSuccess(request_id=2)), C, 0)
    s.observe(f(api.CommandFlow(consumer_id=2, messagePermits=5)), B, 0)
    frames = [(send(1, 0), B), (f(api.CommandSendReceipt(producer_id=1, sequence_id=0)), C),
              (f(api.CommandFlow(consumer_id=2, messagePermits=3)), B),
              (f(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual, request_id=7,
                                message_id=[api.MessageIdData(ledgerId=1, entryId=1)])), B),
              (f(api.CommandSendReceipt(producer_id=9, sequence_id=0)), C)]
    producer, consumer = s.producers[1], s.consumers[2]
    a, b = "persistent://public/default/a", "persistent://public/default/b"
    expected = [(a, producer, None), (a, producer, None), (b, None, consumer), (b, None, consumer),
                (None, None, None)]
    pending, permits = s.pending_requests, consumer.permits
    for (frame, direction), wanted in zip(frames, expected, strict=True):
        attributed = s.attribute(frame, direction)
        assert (attributed.topic, attributed.producer, attributed.consumer) == wanted
        assert attributed.completed is None
    assert (s.pending_requests, s.consumers[2].permits) == (pending, permits)
    with pytest.raises(ValueError, match="data-path"):
        s.attribute(f(api.CommandSuccess(request_id=2)), C)


def test_accounted_types_leave_out_the_data_path_unless_a_response_needs_its_request() -> None:
    assert not accounted_types(frozenset({T.SEND_RECEIPT})) & DATA_PATH_TYPES
    assert T.PRODUCER in accounted_types(frozenset()) and T.CLOSE_CONSUMER in accounted_types(frozenset())
    for seen in (frozenset({T.ERROR}), frozenset({T.ACK_RESPONSE}), None):
        assert accounted_types(seen) & DATA_PATH_TYPES == {T.ACK, T.ACK_RESPONSE}


def test_a_batch_refused_under_its_highest_sequence_id_ends_its_send() -> None:
    """The broker answers a refused transactional batch with SEND_ERROR under the batch's highest sequence id
    (the real broker without a coordinator: NotAllowedError "Transaction buffer disable!"): it ends that SEND,
    not another producer's, and a SEND without highest_sequence_id is matched by the span of its messages."""
    s = connected()
    s.observe(f(api.CommandProducer(topic="t", producer_id=1, request_id=1)), B, 0)
    s.observe(f(api.CommandProducerSuccess(request_id=1, producer_name="p", producer_ready=True)), C, 1)
    s.observe(f(api.CommandProducer(topic="u", producer_id=2, request_id=2)), B, 2)
    s.observe(f(api.CommandProducerSuccess(request_id=2, producer_name="q", producer_ready=True)), C, 3)
    md = api.MessageMetadata(producer_name="p", sequence_id=10, publish_time=1)
    batched = frame_from_bytes(encode_payload_command(api.CommandSend(
        producer_id=1, sequence_id=10, num_messages=3, highest_sequence_id=12, txnid_least_bits=1,
        txnid_most_bits=0), md, b"x"))
    s.observe(send(2, 12), B, 5)  # another producer's SEND under the same id
    s.observe(batched, B, 10)
    s.observe(send(1, 20, num=4), B, 20)
    refused = s.observe(f(api.CommandSendError(producer_id=1, sequence_id=12, error=api.NotAllowedError,
                                               message="Transaction buffer disable!")), C, 110)
    assert refused.completed is not None
    assert (refused.completed.request_command, refused.completed.sequence_id, refused.completed.latency_ns,
            refused.completed.outcome, refused.completed.error_code) == ("SEND", 10, 100, "error", "NotAllowedError")
    spanned = s.observe(f(api.CommandSendError(producer_id=1, sequence_id=22, error=api.NotAllowedError,
                                               message="no")), C, 120)
    assert spanned.completed is not None and spanned.completed.sequence_id == 20
    outside = s.observe(f(api.CommandSendError(producer_id=1, sequence_id=30, error=api.NotAllowedError,
                                               message="no")), C, 130)
    assert outside.completed is None
    assert s.observe(f(api.CommandSendReceipt(producer_id=2, sequence_id=12)), C, 140).completed is not None
