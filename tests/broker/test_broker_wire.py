"""The embedded broker on the wire, frame by frame, with the project's own codec (no client library)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ClusterRunner, open_cluster
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, encode_command, encode_payload_command

T = api.BaseCommand.Type


class WireClient:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder(64 * 1024 * 1024)
        self.frames: list[Frame] = []

    async def send(self, sub: Any) -> None:
        await self.stream.send_all(encode_command(sub))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def next(self, wait_s: float = 5.0) -> Frame:
        with trio.fail_after(wait_s):
            while not self.frames:
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError("broker closed the connection")
                self.frames.extend(self.decoder.receive(data))
            return self.frames.pop(0)

    async def expect(self, type_name: str, wait_s: float = 5.0) -> Frame:
        frame = await self.next(wait_s)
        assert frame.type_name == type_name, f"expected {type_name}, got {frame.type_name}: {frame.sub}"
        return frame

    async def closed(self, wait_s: float = 5.0) -> bool:
        try:
            while True:
                await self.next(wait_s)
        except (EOFError, trio.BrokenResourceError):
            return True

    async def connect(self, **fields: Any) -> Frame:
        await self.send(api.CommandConnect(client_version="wire-test", protocol_version=21, **fields))
        return await self.next()


running = open_cluster


@asynccontextmanager
async def wire(runner: ClusterRunner, index: int = 0) -> AsyncIterator[WireClient]:
    info = runner.nodes[index].info
    stream = await trio.open_tcp_stream(info.host, info.port)
    async with stream:
        yield WireClient(stream)


def send_frame(producer_id: int, sequence_id: int, payload: bytes, *, batch: int = 0,
               key: str | None = None) -> bytes:
    metadata = api.MessageMetadata(producer_name="wire", sequence_id=sequence_id, publish_time=1)
    if batch:
        metadata.num_messages_in_batch = batch
    if key is not None:
        metadata.partition_key = key
    return encode_payload_command(api.CommandSend(producer_id=producer_id, sequence_id=sequence_id,
                                                  num_messages=max(batch, 1)), metadata, payload)


async def test_connected_negotiates_version_and_announces_max_message_size() -> None:
    async with running(ClusterConfig(max_message_size=1 << 20)) as runner, wire(runner) as client:
        connected = (await client.connect()).command.connected
        assert connected.protocol_version == 21
        assert connected.max_message_size == 1 << 20
        await client.send(api.CommandPing())
        await client.expect("PONG")


async def test_a_command_before_connect_closes_the_connection() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        await client.send(api.CommandLookupTopic(topic="t", request_id=1))
        assert await client.closed()


async def test_a_malformed_frame_closes_the_connection() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        await client.connect()
        await client.send_raw(b"\x00\x00\x00\x05\x00\x00\x00\x09\x08")
        assert await client.closed()


async def test_unsupported_commands_get_the_error_a_broker_sends() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        await client.connect()
        await client.send(api.CommandNewTxn(request_id=42, tc_id=0))
        error = (await client.expect("ERROR")).command.error
        assert error.request_id == 42
        assert error.error == api.ServerError.NotAllowedError


async def test_lookup_on_a_non_owner_redirects_to_the_owner_authoritatively() -> None:
    async with running(ClusterConfig(brokers=2)) as runner:
        topic = "persistent://public/default/where"
        owner = runner.cluster.owner(topic)
        other = 1 - owner.index
        async with wire(runner, other) as client:
            await client.connect()
            await client.send(api.CommandLookupTopic(topic=topic, request_id=1))
            response = (await client.expect("LOOKUP_RESPONSE")).command.lookupTopicResponse
            assert response.response == api.CommandLookupTopicResponse.Redirect
            assert response.authoritative
            assert response.brokerServiceUrl == owner.service_url
            # a producer on the wrong broker is told to look up again
            await client.send(api.CommandProducer(topic=topic, producer_id=1, request_id=2))
            error = (await client.expect("ERROR")).command.error
            assert error.error == api.ServerError.ServiceNotReady


async def test_idle_client_is_pinged_and_closed_without_pong() -> None:
    async with running(ClusterConfig(keepalive_seconds=0.2)) as runner:
        async with wire(runner) as answering:
            await answering.connect()
            for _ in range(3):
                await answering.expect("PING", wait_s=2)
                await answering.send(api.CommandPong())
        async with wire(runner) as silent:
            await silent.connect()
            await silent.expect("PING", wait_s=2)
            assert await silent.closed(wait_s=3)


async def test_a_client_that_never_finishes_the_handshake_is_closed_at_the_first_tick_unpinged() -> None:
    """PulsarHandler's keepalive tick closes a connection whose handshake is not completed ("Pulsar Handshake
    was not completed within timeout") rather than pinging it; the embedded broker used to ping it."""
    async with running(ClusterConfig(keepalive_seconds=0.2)) as runner, wire(runner) as mute:
        frames: list[str] = []
        with trio.fail_after(3):
            try:
                while True:
                    frames.append((await mute.next(wait_s=3)).type_name)
            except (EOFError, trio.BrokenResourceError):
                pass
        assert frames == []
        # a client that did connect, at the same interval, is pinged and stays open while it answers
        async with wire(runner) as answering:
            await answering.connect()
            await answering.expect("PING", wait_s=2)
            await answering.send(api.CommandPong())
            await answering.expect("PING", wait_s=2)


async def test_a_busy_client_is_pinged_at_every_interval_as_pulsars_broker_does() -> None:
    """PulsarHandler pings on a fixed-rate timer whatever the traffic; a client can see it, so the embedded
    broker does the same (it used to ping only a silent client)."""
    async with running(ClusterConfig(keepalive_seconds=0.2)) as runner, wire(runner) as busy:
        await busy.connect()
        pings = pongs = 0
        deadline = trio.current_time() + 1.0
        while trio.current_time() < deadline:
            await busy.send(api.CommandPing())  # never silent: a frame every 50 ms
            with trio.move_on_after(0.05):
                while True:
                    frame = await busy.next()  # (EOFError if the broker closed the connection)
                    if frame.type_name == "PING":
                        pings += 1
                        await busy.send(api.CommandPong())
                    else:
                        pongs += frame.type_name == "PONG"
        assert pings >= 3 and pongs >= 10, (pings, pongs)


async def test_token_auth_challenge_and_response() -> None:
    async with running(ClusterConfig(auth_token="tok")) as runner:
        async with wire(runner) as client:
            challenge = await client.connect(auth_method_name="token")
            assert challenge.type_name == "AUTH_CHALLENGE"
            await client.send(api.CommandAuthResponse(
                response=api.AuthData(auth_method_name="token", auth_data=b"tok")))
            await client.expect("CONNECTED")
        async with wire(runner) as client:
            refused = await client.connect(auth_method_name="token", auth_data=b"nope")
            assert refused.command.error.error == api.ServerError.AuthenticationError
            assert await client.closed()


async def test_batches_cost_one_permit_per_message_and_messages_carry_partition_and_redelivery_count() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        runner.cluster.create_topic("batched", 1)
        topic = "persistent://public/default/batched-partition-0"
        await client.connect()
        await client.send(api.CommandProducer(topic=topic, producer_id=1, request_id=1))
        assert (await client.expect("PRODUCER_SUCCESS")).command.producer_success.producer_ready
        await client.send(api.CommandSubscribe(topic=topic, subscription="s", subType=api.CommandSubscribe.Shared,
                                               consumer_id=7, request_id=2))
        await client.expect("SUCCESS")
        for seq in range(3):
            await client.send_raw(send_frame(1, seq, b"x" * 10, batch=5))
            receipt = (await client.expect("SEND_RECEIPT")).command.send_receipt
            assert receipt.message_id.entryId == seq
        await client.send(api.CommandFlow(consumer_id=7, messagePermits=6))
        first = (await client.expect("MESSAGE")).command.message
        second = (await client.expect("MESSAGE")).command.message
        assert (first.message_id.entryId, second.message_id.entryId) == (0, 1)
        assert first.message_id.partition == 0
        with trio.move_on_after(0.3):  # 6 permits - 2 batches of 5 < 0: the third waits
            extra = await client.next()
            raise AssertionError(f"unexpected {extra}")
        await client.send(api.CommandRedeliverUnacknowledgedMessages(
            consumer_id=7, message_ids=[api.MessageIdData(ledgerId=first.message_id.ledgerId, entryId=0)]))
        await client.send(api.CommandFlow(consumer_id=7, messagePermits=10))
        again = (await client.expect("MESSAGE")).command.message
        assert (again.message_id.entryId, again.redelivery_count) == (0, 1)
        third = (await client.expect("MESSAGE")).command.message
        assert third.message_id.entryId == 2


async def test_terminated_topic_tells_a_caught_up_consumer_reached_end_of_topic() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        topic = "persistent://public/default/finite"
        await client.connect()
        await client.send(api.CommandProducer(topic=topic, producer_id=1, request_id=1))
        await client.expect("PRODUCER_SUCCESS")
        await client.send_raw(send_frame(1, 0, b"only"))
        await client.expect("SEND_RECEIPT")
        await client.send(api.CommandSubscribe(topic=topic, subscription="s", subType=api.CommandSubscribe.Exclusive,
                                               consumer_id=1, request_id=2,
                                               initialPosition=api.CommandSubscribe.Earliest))
        await client.expect("SUCCESS")
        runner.cluster.terminate(topic)
        await client.send_raw(send_frame(1, 1, b"late"))
        error = (await client.expect("SEND_ERROR")).command.send_error
        assert error.error == api.ServerError.TopicTerminatedError
        await client.send(api.CommandFlow(consumer_id=1, messagePermits=10))
        await client.expect("MESSAGE")
        await client.expect("REACHED_END_OF_TOPIC")


async def test_unload_sends_close_producer_and_close_consumer() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        topic = "persistent://public/default/moving"
        await client.connect()
        await client.send(api.CommandProducer(topic=topic, producer_id=3, request_id=1))
        await client.expect("PRODUCER_SUCCESS")
        await client.send(api.CommandSubscribe(topic=topic, subscription="s", subType=api.CommandSubscribe.Failover,
                                               consumer_id=4, request_id=2))
        await client.expect("SUCCESS")
        change = (await client.expect("ACTIVE_CONSUMER_CHANGE")).command.active_consumer_change
        assert change.is_active
        runner.cluster.unload(topic)
        kinds = {(await client.next()).type_name for _ in range(2)}
        assert kinds == {"CLOSE_PRODUCER", "CLOSE_CONSUMER"}


async def test_a_partitioned_topics_partitions_share_one_schema_history_and_get_schema_answers_as_pulsar() -> None:
    """Pulsar keeps schemas by schema name (tenant/namespace/local of the partitioned topic, either domain): a
    schema added on one partition versions and refuses on the others, and GET_SCHEMA answers for the topic's
    name, a partition's, the other domain's, with the real broker's errors (FIDELITY.md)."""
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        base = runner.cluster.create_topic("persistent://public/default/shared-schema", 3)
        await client.connect()

        def json_schema(fields: bytes) -> api.Schema:
            return api.Schema(name="client-name", type=api.Schema.Json,
                              schema_data=b'{"type": "record", "name": "s", "fields": [' + fields + b"]}")

        def version(answer: api.CommandGetOrCreateSchemaResponse | api.CommandGetSchemaResponse) -> int:
            return int.from_bytes(answer.schema_version, "big")

        async def get_or_create(request_id: int, topic: str, schema: api.Schema
                                ) -> api.CommandGetOrCreateSchemaResponse:
            await client.send(api.CommandGetOrCreateSchema(request_id=request_id, topic=topic, schema=schema))
            return (await client.expect("GET_OR_CREATE_SCHEMA_RESPONSE")).command.getOrCreateSchemaResponse

        async def get(request_id: int, topic: str, schema_version: bytes | None = None) -> api.CommandGetSchemaResponse:
            await client.send(api.CommandGetSchema(request_id=request_id, topic=topic, schema_version=schema_version))
            return (await client.expect("GET_SCHEMA_RESPONSE")).command.getSchemaResponse

        assert version(await get_or_create(1, f"{base}-partition-0", json_schema(b""))) == 0
        # partition 2 adds a field with a default: the topic's second version, not its own first
        evolved = await get_or_create(2, f"{base}-partition-2", json_schema(b'{"name": "a", "type": "int", '
                                                                            b'"default": 0}'))
        assert (evolved.error_code, version(evolved)) == (0, 1)
        # partition 1 cannot read what the latest wrote (no default): refused against its siblings' history
        refused = await get_or_create(3, f"{base}-partition-1", json_schema(b'{"name": "b", "type": "int"}'))
        assert refused.error_code == api.ServerError.IncompatibleSchema
        for request_id, topic in enumerate((base, f"{base}-partition-1", "non-persistent://public/default/"
                                            "shared-schema", "public/default/shared-schema"), start=10):
            latest = await get(request_id, topic)
            assert (latest.error_code, version(latest)) == (0, 1), topic
            assert latest.schema.name == "public/default/shared-schema"
            assert b'"name": "a"' in latest.schema.schema_data
        first = await get(20, base, (0).to_bytes(8, "big"))
        assert (version(first), first.schema.schema_data) == (0, json_schema(b"").schema_data)
        errors = [await get(21, base, (7).to_bytes(8, "big")), await get(22, "persistent://public/default/none"),
                  await get(23, base, b""), await get(24, "persistent://no-namespace")]
        assert [(answer.error_code, answer.error_message) for answer in errors[:3]] == [
            (api.ServerError.TopicNotFound, f"Topic not found or no-schema {base}"),
            (api.ServerError.TopicNotFound, "Topic not found or no-schema persistent://public/default/none"),
            (api.ServerError.IncompatibleSchema, "Empty schema version")]
        assert errors[3].error_code == api.ServerError.InvalidTopicName


async def test_schemas_are_stored_and_versioned_and_stats_and_ack_responses_answer() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        topic = "persistent://public/default/schemas"
        await client.connect()
        json_v0 = api.Schema(name="s", schema_data=b'{"type": "record", "name": "s", "fields": []}',
                             type=api.Schema.Json)
        json_v1 = api.Schema(name="s", type=api.Schema.Json,  # a field with a default: FULL compatible
                             schema_data=b'{"type": "record", "name": "s", "fields": '
                                         b'[{"name": "a", "type": "int", "default": 0}]}')
        string_schema = api.Schema(name="s", schema_data=b"", type=api.Schema.String)
        await client.send(api.CommandGetOrCreateSchema(request_id=1, topic=topic, schema=json_v0))
        first = (await client.expect("GET_OR_CREATE_SCHEMA_RESPONSE")).command.getOrCreateSchemaResponse
        await client.send(api.CommandGetOrCreateSchema(request_id=2, topic=topic, schema=json_v1))
        second = (await client.expect("GET_OR_CREATE_SCHEMA_RESPONSE")).command.getOrCreateSchemaResponse
        assert int.from_bytes(first.schema_version, "big") == 0
        assert int.from_bytes(second.schema_version, "big") == 1
        # another type is refused, as Pulsar's compatibility check refuses it
        await client.send(api.CommandGetOrCreateSchema(request_id=10, topic=topic, schema=string_schema))
        refused = (await client.expect("GET_OR_CREATE_SCHEMA_RESPONSE")).command.getOrCreateSchemaResponse
        assert refused.error_code == api.ServerError.IncompatibleSchema
        assert "exists schema type JSON, new schema type STRING" in refused.error_message
        await client.send(api.CommandGetSchema(request_id=3, topic=topic, schema_version=first.schema_version))
        got = (await client.expect("GET_SCHEMA_RESPONSE")).command.getSchemaResponse
        assert got.schema.type == api.Schema.Json
        await client.send(api.CommandGetSchema(request_id=4, topic="persistent://public/default/none"))
        missing = (await client.expect("GET_SCHEMA_RESPONSE")).command.getSchemaResponse
        assert missing.error_code == api.ServerError.TopicNotFound

        await client.send(api.CommandProducer(topic=topic, producer_id=1, request_id=5))
        await client.expect("PRODUCER_SUCCESS")
        await client.send(api.CommandSubscribe(topic=topic, subscription="s", subType=api.CommandSubscribe.Shared,
                                               consumer_id=2, request_id=6, consumer_name="me"))
        await client.expect("SUCCESS")
        await client.send_raw(send_frame(1, 0, b"m"))
        await client.expect("SEND_RECEIPT")
        await client.send(api.CommandFlow(consumer_id=2, messagePermits=5))
        message = (await client.expect("MESSAGE")).command.message
        await client.send(api.CommandConsumerStats(request_id=7, consumer_id=2))
        stats = (await client.expect("CONSUMER_STATS_RESPONSE")).command.consumerStatsResponse
        assert (stats.consumerName, stats.availablePermits, stats.unackedMessages, stats.msgBacklog) == ("me", 4, 1, 1)
        await client.send(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual,
                                         message_id=[message.message_id], request_id=8))
        ack = (await client.expect("ACK_RESPONSE")).command.ackResponse
        assert ack.request_id == 8 and not ack.HasField("error")
        await client.send(api.CommandConsumerStats(request_id=9, consumer_id=2))
        stats = (await client.expect("CONSUMER_STATS_RESPONSE")).command.consumerStatsResponse
        assert (stats.unackedMessages, stats.msgBacklog) == (0, 0)
        await client.send(api.CommandGetLastMessageId(consumer_id=2, request_id=10))
        last = (await client.expect("GET_LAST_MESSAGE_ID_RESPONSE")).command.getLastMessageIdResponse
        assert last.last_message_id.entryId == 0


async def test_shared_consumer_stops_at_the_unacked_limit() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        topic = "persistent://public/default/limited"
        await client.connect()
        await client.send(api.CommandProducer(topic=topic, producer_id=1, request_id=1))
        await client.expect("PRODUCER_SUCCESS")
        await client.send(api.CommandSubscribe(topic=topic, subscription="s", subType=api.CommandSubscribe.Shared,
                                               consumer_id=2, request_id=2))
        await client.expect("SUCCESS")
        runner.cluster.topics[topic].subscriptions["s"].max_unacked = 2
        for seq in range(4):
            await client.send_raw(send_frame(1, seq, b"m"))
            await client.expect("SEND_RECEIPT")
        await client.send(api.CommandFlow(consumer_id=2, messagePermits=100))
        first = (await client.expect("MESSAGE")).command.message
        await client.expect("MESSAGE")
        with trio.move_on_after(0.3):
            extra = await client.next()
            raise AssertionError(f"unexpected {extra}")
        await client.send(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual,
                                         message_id=[first.message_id]))
        assert (await client.expect("MESSAGE")).command.message.message_id.entryId == 2


async def test_a_send_with_a_bad_checksum_gets_send_error_checksum_error() -> None:
    async with running(ClusterConfig()) as runner, wire(runner) as client:
        await client.connect()
        await client.send(api.CommandProducer(topic="persistent://public/default/crc", producer_id=1, request_id=1))
        await client.expect("PRODUCER_SUCCESS")
        frame = bytearray(send_frame(1, 0, b"payload"))
        frame[-1] ^= 0xFF
        await client.send_raw(bytes(frame))
        error = (await client.expect("SEND_ERROR")).command.send_error
        assert error.error == api.ServerError.ChecksumError
        assert len(runner.cluster.topics["persistent://public/default/crc"].ledger) == 0
