"""The broker side of a connection with no sockets: frames in, frames out."""

from __future__ import annotations

import pytest

from proxy.broker.cluster import Cluster, ClusterConfig
from proxy.broker.connection import BrokerConnection
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, crc32c, encode_command, encode_payload_command, frame_from_bytes


def make(brokers: int = 2) -> tuple[Cluster, list[BrokerConnection]]:
    cluster = Cluster(ClusterConfig(brokers=brokers))
    for port in range(brokers):
        cluster.add_broker("127.0.0.1", 6650 + port).alive = True
    connections = [BrokerConnection(cluster, i, i, "test", lambda: 0) for i in range(brokers)]
    return cluster, connections


def roundtrip(conn: BrokerConnection, sub: object) -> list[Frame]:
    conn.handle(frame_from_bytes(encode_command(sub)))  # type: ignore[arg-type]
    decoder = FrameDecoder()
    return [f for chunk in conn.take_output() for f in decoder.receive(chunk)]


def test_handshake_then_lookup_connect_on_the_owner_and_redirect_elsewhere() -> None:
    cluster, (first, second) = make()
    for conn in (first, second):
        [connected] = roundtrip(conn, api.CommandConnect(client_version="t", protocol_version=25))
        assert connected.type_name == "CONNECTED"
        assert connected.command.connected.protocol_version == 21
    topic = "persistent://public/default/sans-io"
    owner = cluster.owner(topic).index
    answers = {}
    for conn in (first, second):
        [reply] = roundtrip(conn, api.CommandLookupTopic(topic=topic, request_id=9))
        answers[conn.broker_index] = reply.command.lookupTopicResponse.response
    assert answers[owner] == api.CommandLookupTopicResponse.Connect
    assert answers[1 - owner] == api.CommandLookupTopicResponse.Redirect


def test_frames_the_transition_table_forbids_are_protocol_errors() -> None:
    _, (conn, _) = make()
    with pytest.raises(ProtocolError):
        roundtrip(conn, api.CommandProducer(topic="t", producer_id=1, request_id=1))


def test_partitioned_metadata_auto_creates_partitioned_topics_when_configured() -> None:
    cluster = Cluster(ClusterConfig(auto_partitions=3))
    cluster.add_broker("127.0.0.1", 6650).alive = True
    conn = BrokerConnection(cluster, 0, 1, "test", lambda: 0)
    roundtrip(conn, api.CommandConnect(client_version="t", protocol_version=21))
    [reply] = roundtrip(conn, api.CommandPartitionedTopicMetadata(topic="auto", request_id=1))
    assert reply.command.partitionMetadataResponse.partitions == 3
    assert cluster.topics_of_namespace("public/default") == [
        f"persistent://public/default/auto-partition-{i}" for i in range(3)]
    [again] = roundtrip(conn, api.CommandPartitionedTopicMetadata(topic="auto-partition-1", request_id=2))
    assert again.command.partitionMetadataResponse.partitions == 0


def test_topic_list_polls_carry_pulsars_hash_and_nothing_when_the_client_holds_the_list() -> None:
    """GET_TOPICS_OF_NAMESPACE as Pulsar's ServerCnx answers it (pattern consumers poll with it)."""
    cluster, (conn, _) = make()
    roundtrip(conn, api.CommandConnect(client_version="t", protocol_version=21))
    cluster.get_topic("persistent://public/default/listed-a")
    ask = api.CommandGetTopicsOfNamespace(namespace="public/default", request_id=1)
    [first] = roundtrip(conn, ask)
    answer = first.command.getTopicsOfNamespaceResponse
    assert list(answer.topics) == ["persistent://public/default/listed-a"] and answer.changed
    # TopicList.calculateHash: CRC32C over the sorted names joined by ",", printed as Guava does
    expected = crc32c(b"persistent://public/default/listed-a").to_bytes(4, "little").hex()
    assert answer.topics_hash == expected and not answer.filtered
    ask.request_id, ask.topics_hash = 2, answer.topics_hash
    [again] = roundtrip(conn, ask)
    assert not again.command.getTopicsOfNamespaceResponse.changed
    assert list(again.command.getTopicsOfNamespaceResponse.topics) == []
    cluster.get_topic("persistent://public/default/listed-b")
    ask.request_id = 3
    [grown] = roundtrip(conn, ask)
    assert grown.command.getTopicsOfNamespaceResponse.changed
    assert len(grown.command.getTopicsOfNamespaceResponse.topics) == 2


@pytest.mark.parametrize("request_", [
    api.CommandTcClientConnectRequest(request_id=5, tc_id=0),
    api.CommandNewTxn(request_id=5, tc_id=0),
    api.CommandAddPartitionToTxn(request_id=5, txnid_least_bits=1, partitions=["persistent://public/default/t"]),
    api.CommandAddSubscriptionToTxn(request_id=5, txnid_least_bits=1),
    api.CommandEndTxn(request_id=5, txnid_least_bits=1, txn_action=api.COMMIT),
], ids=lambda sub: type(sub).__name__)
def test_transaction_requests_get_the_refusal_of_a_broker_without_a_coordinator(request_: object) -> None:
    """As a real broker with transactionCoordinatorEnabled=false (ServerCnx, measured against Pulsar 4.0.7):
    ERROR NotAllowedError "Transactions are not enabled." for the request."""
    _, [conn] = make(1)
    roundtrip(conn, api.CommandConnect(client_version="t", protocol_version=21))
    [reply] = roundtrip(conn, request_)
    error = reply.command.error
    assert (reply.type_name, error.request_id, api.ServerError.Name(error.error), error.message) == \
        ("ERROR", 5, "NotAllowedError", "Transactions are not enabled.")


def test_sends_and_acks_in_a_transaction_are_refused_as_without_a_coordinator() -> None:
    """Measured against Pulsar 4.0.7 with transactionCoordinatorEnabled=false: a SEND naming a transaction gets
    SEND_ERROR NotAllowedError under the batch's highest sequence id, an ACK naming one an ACK_RESPONSE
    NotAllowedError."""
    _, [conn] = make(1)
    roundtrip(conn, api.CommandConnect(client_version="t", protocol_version=21))
    topic = "persistent://public/default/txn"
    [created] = roundtrip(conn, api.CommandProducer(topic=topic, producer_id=1, request_id=1))
    assert created.type_name == "PRODUCER_SUCCESS"
    txn = {"txnid_most_bits": 0, "txnid_least_bits": 7}
    send = api.CommandSend(producer_id=1, sequence_id=0, highest_sequence_id=2, num_messages=3, **txn)
    metadata = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1, num_messages_in_batch=3, **txn)
    conn.handle(frame_from_bytes(encode_payload_command(send, metadata, b"batch")))
    [refused] = [f for chunk in conn.take_output() for f in FrameDecoder().receive(chunk)]
    error = refused.command.send_error
    assert (refused.type_name, error.sequence_id, api.ServerError.Name(error.error), error.message) == \
        ("SEND_ERROR", 2, "NotAllowedError", "Transaction buffer disable!")
    roundtrip(conn, api.CommandSubscribe(topic=topic, subscription="s", subType=api.CommandSubscribe.Exclusive,
                                         consumer_id=1, request_id=2))
    [answer] = roundtrip(conn, api.CommandAck(consumer_id=1, ack_type=api.CommandAck.Individual, request_id=3,
                                              message_id=[api.MessageIdData(ledgerId=0, entryId=0)], **txn))
    response = answer.command.ackResponse
    assert (answer.type_name, response.request_id, api.ServerError.Name(response.error)) == \
        ("ACK_RESPONSE", 3, "NotAllowedError")
    assert response.message.endswith("Server don't support transaction ack!")
