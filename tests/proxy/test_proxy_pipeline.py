"""The per-connection proxy logic, without sockets: bytes in, actions out."""

from __future__ import annotations

import itertools

import pytest
from pipeline_playbook import Playbook, Receive, ReleaseDue, Tick

from proxy.config.proxy_config import HostPort, ServiceUrl
from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameContext, FrameEvent, Origin
from proxy.core.lookup import BrokerDirectory, UnroutableBroker
from proxy.core.pipeline import (
    MAX_PROTOCOL_VERSION,
    Close,
    ConnectionPipeline,
    FollowRedirect,
    Hold,
    OpenUpstream,
    PipelineSettings,
    Send,
)
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import Direction
from proxy.rules.engine import RulesEngine
from proxy.rules.hook import RulesHook
from proxy.rules.loader import load_rules_text
from proxy.rules.verdict import DROP, Verdict

T = api.BaseCommand.Type
TO_BROKER, TO_CLIENT = Direction.TO_BROKER, Direction.TO_CLIENT
UPSTREAM = ServiceUrl.parse("pulsar://10.9.9.1:6650")
LookupType = api.CommandLookupTopicResponse.LookupType
SECOND = 1_000_000_000

CONNECT = encode_command(api.CommandConnect(client_version="test", protocol_version=21))
CONNECTED = encode_command(api.CommandConnected(server_version="broker", protocol_version=21,
                                                max_message_size=8 * 1024 * 1024))
PING = encode_command(api.CommandPing())
PONG = encode_command(api.CommandPong())


def directory(mode_tls: bool = False, allowed: tuple[HostPort, ...] = ()) -> BrokerDirectory:
    ports = itertools.count(40001)
    return BrokerDirectory("proxy.example", upstream_tls=mode_tls, open_listener=lambda broker: next(ports),
                           allowed=allowed)


def pipeline(mode: str = "rewrite", *, hook: object = None, events: list[FrameEvent] | None = None,
             verify: bool = False, d: BrokerDirectory | None = None) -> ConnectionPipeline:
    return ConnectionPipeline(
        ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None),
        settings=PipelineSettings(lookup_mode=mode, verify_checksums=verify, keepalive_ns=10 * SECOND),
        directory=d or directory(), default_broker=UPSTREAM, now_ns=0, hook=hook,  # type: ignore[arg-type]
        publish=events.append if events is not None else None)


def sent(actions: list, direction: Direction) -> bytes:  # type: ignore[type-arg]
    return b"".join(bytes(piece) for a in actions if isinstance(a, Send) and a.direction is direction
                    for piece in a.data)


def connected(p: ConnectionPipeline) -> None:
    p.receive(TO_BROKER, CONNECT, 0)
    p.receive(TO_CLIENT, CONNECTED, 0)


def lookup(response: int, plain: str = "pulsar://10.0.0.7:6650", tls: str = "pulsar+ssl://10.0.0.7:6651") -> bytes:
    return encode_command(api.CommandLookupTopicResponse(
        request_id=3, response=response, brokerServiceUrl=plain, brokerServiceUrlTls=tls, authoritative=True))


def test_connect_opens_the_listeners_broker_and_is_forwarded_byte_for_byte() -> None:
    p = pipeline()
    actions = p.receive(TO_BROKER, CONNECT, 0)
    assert actions[0] == OpenUpstream(UPSTREAM)
    assert sent(actions, TO_BROKER) == CONNECT


def test_a_first_frame_other_than_connect_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        pipeline().receive(TO_BROKER, PING, 0)


def test_connect_protocol_version_is_lowered_never_raised() -> None:
    newer = encode_command(api.CommandConnect(client_version="x", protocol_version=MAX_PROTOCOL_VERSION + 5))
    out = sent(pipeline().receive(TO_BROKER, newer, 0), TO_BROKER)
    assert frame_from_bytes(out).command.connect.protocol_version == MAX_PROTOCOL_VERSION
    older = encode_command(api.CommandConnect(client_version="x", protocol_version=6))
    assert sent(pipeline().receive(TO_BROKER, older, 0), TO_BROKER) == older


def test_connected_raises_the_frame_limit_to_the_brokers_max_message_size() -> None:
    p = pipeline()
    connected(p)
    assert p.scanners[TO_BROKER].max_frame_bytes == 8 * 1024 * 1024 + 10 * 1024


@pytest.mark.parametrize("kind", [LookupType.Connect, LookupType.Redirect])
def test_rewrite_mode_points_lookups_at_a_stable_proxy_listener(kind: int) -> None:
    p = pipeline()
    connected(p)
    first = frame_from_bytes(sent(p.receive(TO_CLIENT, lookup(kind), 0), TO_CLIENT)).command.lookupTopicResponse
    again = frame_from_bytes(sent(p.receive(TO_CLIENT, lookup(kind), 0), TO_CLIENT)).command.lookupTopicResponse
    assert first.brokerServiceUrl == "pulsar://proxy.example:40001" == again.brokerServiceUrl
    assert first.brokerServiceUrlTls == "pulsar+ssl://proxy.example:40001"
    assert first.response == kind and first.authoritative and not first.proxy_through_service_url


def test_each_broker_gets_its_own_listener_and_tls_upstreams_dial_the_tls_url() -> None:
    d = directory(mode_tls=True)
    p = pipeline(d=d)
    connected(p)
    p.receive(TO_CLIENT, lookup(LookupType.Connect, "pulsar://a:6650", "pulsar+ssl://a:6651"), 0)
    p.receive(TO_CLIENT, lookup(LookupType.Connect, "pulsar://b:6650", "pulsar+ssl://b:6651"), 0)
    assert {str(url): str(addr) for url, addr in d.brokers.items()} == {
        "pulsar+ssl://a:6651": "proxy.example:40001", "pulsar+ssl://b:6651": "proxy.example:40002"}


def test_proxy_through_sets_the_flag_and_routes_the_alias_back_to_the_broker() -> None:
    d = directory()
    p = pipeline("proxy-through", d=d)
    connected(p)
    answer = frame_from_bytes(sent(p.receive(TO_CLIENT, lookup(LookupType.Connect), 0), TO_CLIENT))
    sub = answer.command.lookupTopicResponse
    assert sub.proxy_through_service_url
    assert "10.0.0.7" not in sub.brokerServiceUrl + sub.brokerServiceUrlTls
    # The client reconnects to the service URL naming the broker as C++ and Java clients do: HOST:PORT.
    follow = pipeline("proxy-through", d=d)
    named = encode_command(api.CommandConnect(client_version="x", protocol_version=21,
                                              proxy_to_broker_url="proxy.example:40001"))
    actions = follow.receive(TO_BROKER, named, 0)
    assert actions[0] == OpenUpstream(ServiceUrl.parse("pulsar://10.0.0.7:6650"))
    assert not frame_from_bytes(sent(actions, TO_BROKER)).command.connect.HasField("proxy_to_broker_url")


def _behind_pulsar_proxy(mode: str) -> tuple[BrokerDirectory, ConnectionPipeline]:
    """A directory whose upstream is Apache Pulsar's proxy, after its Connect answer naming 10.0.0.7:6650 with
    ``proxy_through_service_url`` (how Pulsar's proxy answers every lookup) crossed a connection."""
    d = BrokerDirectory("proxy.example", upstream_tls=False, open_listener=lambda broker: 40001, upstream=UPSTREAM)
    p = pipeline(mode, d=d)
    connected(p)
    answer = api.CommandLookupTopicResponse(request_id=3, response=LookupType.Connect, authoritative=True,
                                            brokerServiceUrl="pulsar://10.0.0.7:6650", proxy_through_service_url=True)
    p.receive(TO_CLIENT, encode_command(answer), 0)
    return d, p


@pytest.mark.parametrize("mode", ["rewrite", "proxy-through"])
def test_a_broker_behind_an_upstream_proxy_is_reached_through_it_naming_the_broker(mode: str) -> None:
    d, _ = _behind_pulsar_proxy(mode)
    assert d.hop(ServiceUrl.parse("pulsar://10.0.0.7:6650")) == (UPSTREAM, "10.0.0.7:6650")
    # a broker an answer without the flag named is dialled itself
    plain = pipeline(mode, d=d)
    connected(plain)
    plain.receive(TO_CLIENT, lookup(LookupType.Connect, "pulsar://10.0.0.8:6650", ""), 0)
    assert d.hop(ServiceUrl.parse("pulsar://10.0.0.8:6650")) == (ServiceUrl.parse("pulsar://10.0.0.8:6650"), None)


@pytest.mark.parametrize("alias", ["proxy.example:40001", None])
def test_a_connection_to_a_broker_behind_an_upstream_proxy_dials_the_upstream_naming_the_broker(
        alias: str | None) -> None:
    """Through the per-broker listener (alias None) or the service URL naming the listener: the upstream is
    dialled and the CONNECT names the real broker to it, as a client of Pulsar's proxy does."""
    d, _ = _behind_pulsar_proxy("proxy-through")
    follow = ConnectionPipeline(
        ConnectionInfo(2, "127.0.0.1:5556", "127.0.0.1:40001", None),
        settings=PipelineSettings(lookup_mode="proxy-through", keepalive_ns=10 * SECOND), directory=d,
        default_broker=ServiceUrl.parse("pulsar://10.0.0.7:6650") if alias is None else UPSTREAM, now_ns=0)
    actions = follow.receive(TO_BROKER, encode_command(api.CommandConnect(
        client_version="x", protocol_version=21, **({"proxy_to_broker_url": alias} if alias else {}))), 0)
    assert actions[0] == OpenUpstream(UPSTREAM)
    assert frame_from_bytes(sent(actions, TO_BROKER)).command.connect.proxy_to_broker_url == "10.0.0.7:6650"
    assert str(follow.broker) == "pulsar://10.0.0.7:6650"


def test_proxy_through_hands_a_redirect_to_the_relay_to_follow_and_the_client_sees_only_connect() -> None:
    p = pipeline("proxy-through")
    connected(p)
    p.receive(TO_BROKER, encode_command(api.CommandLookupTopic(topic="persistent://public/default/t",
                                                               request_id=3)), 0)
    actions = p.receive(TO_CLIENT, lookup(LookupType.Redirect), 0)
    assert sent(actions, TO_CLIENT) == b""
    [follow] = [a for a in actions if isinstance(a, FollowRedirect)]
    redirected = follow.redirected
    assert (redirected.lookup.topic, redirected.lookup.request_id) == ("persistent://public/default/t", 3)
    assert str(redirected.broker) == "pulsar://10.0.0.7:6650" and redirected.authoritative
    owner = lookup(LookupType.Connect, "pulsar://10.0.0.8:6650", "pulsar+ssl://10.0.0.8:6651")
    answer = frame_from_bytes(sent(p.lookup_answered(owner, 1), TO_CLIENT)).command.lookupTopicResponse
    assert answer.response == LookupType.Connect and answer.proxy_through_service_url and answer.request_id == 3
    assert "10.0.0.8" not in answer.brokerServiceUrl
    # a Redirect answering no LOOKUP the proxy saw cannot be followed: Failed, never the Redirect
    stray = frame_from_bytes(sent(p.receive(TO_CLIENT, lookup(LookupType.Redirect), 2), TO_CLIENT))
    assert stray.command.lookupTopicResponse.response == LookupType.Failed


def test_proxy_through_refuses_brokers_neither_seen_nor_allowed() -> None:
    named = encode_command(api.CommandConnect(client_version="x", proxy_to_broker_url="evil.example:6650"))
    with pytest.raises(UnroutableBroker):
        pipeline("proxy-through").receive(TO_BROKER, named, 0)
    allowed = pipeline("proxy-through", d=directory(allowed=(HostPort("evil.example", 6650),)))
    assert allowed.receive(TO_BROKER, named, 0)[0] == OpenUpstream(ServiceUrl.parse("pulsar://evil.example:6650"))


def test_failed_lookups_and_partition_metadata_pass_through_unchanged() -> None:
    p = pipeline()
    connected(p)
    failed = encode_command(api.CommandLookupTopicResponse(request_id=1, response=LookupType.Failed,
                                                           error=api.ServerError.TopicNotFound))
    metadata = encode_command(api.CommandPartitionedTopicMetadataResponse(request_id=2, partitions=4))
    assert sent(p.receive(TO_CLIENT, failed + metadata, 0), TO_CLIENT) == failed + metadata


def test_keepalive_pings_a_silent_side_swallows_its_pong_and_closes_a_dead_one() -> None:
    p = pipeline()
    connected(p)
    assert p.tick(5 * SECOND) == []
    actions = p.tick(10 * SECOND)
    assert sent(actions, TO_CLIENT) == PING and sent(actions, TO_BROKER) == PING
    assert p.receive(TO_CLIENT, PONG, 11 * SECOND) == []           # the broker's answer to the proxy
    assert p.tick(15 * SECOND) == []
    closing = p.tick(20 * SECOND)                                 # the client never answered
    assert len(closing) == 1 and isinstance(closing[0], Close) and "client" in closing[0].reason


def test_pongs_answering_a_peers_ping_are_forwarded() -> None:
    p = pipeline()
    connected(p)
    assert sent(p.receive(TO_BROKER, PING, 1), TO_BROKER) == PING
    assert sent(p.receive(TO_CLIENT, PONG, 2), TO_CLIENT) == PONG


def test_verify_checksums_answers_a_corrupt_send_with_send_error() -> None:
    p = pipeline(verify=True)
    connected(p)
    frame = bytearray(encode_payload_command(api.CommandSend(producer_id=4, sequence_id=9),
                                             api.MessageMetadata(producer_name="p", sequence_id=9, publish_time=1),
                                             b"payload"))
    frame[-1] ^= 0xFF
    actions = p.receive(TO_BROKER, bytes(frame), 0)
    assert sent(actions, TO_BROKER) == b""
    error = frame_from_bytes(sent(actions, TO_CLIENT)).command.send_error
    assert (error.producer_id, error.sequence_id, error.error) == (4, 9, api.ServerError.ChecksumError)


class RecordingHook:
    """A hook that answers each frame with a fixed verdict and remembers what it saw."""

    def __init__(self, verdict: Verdict, types: frozenset[int]) -> None:
        self.verdict = verdict
        self.types = types
        self.seen: list[tuple[str, str | None]] = []

    def interest(self, direction: Direction) -> frozenset[int] | None:
        return self.types

    def on_frame(self, ctx: FrameContext, frame: Frame) -> Verdict:
        if frame.type not in self.types:
            return Verdict()
        topic = ctx.observation.topic if ctx.observation else None
        self.seen.append((frame.type_name, topic))
        return self.verdict


def producer_frames() -> tuple[bytes, bytes]:
    producer = encode_command(api.CommandProducer(topic="persistent://public/default/t", producer_id=1,
                                                  request_id=1))
    send = encode_payload_command(api.CommandSend(producer_id=1, sequence_id=0),
                                  api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1), b"hi")
    return producer, send


def test_hooks_see_frames_attributed_to_their_topic_and_can_drop_them() -> None:
    hook = RecordingHook(DROP, frozenset({T.SEND}))
    p = pipeline(hook=hook)
    connected(p)
    producer, send = producer_frames()
    actions = p.receive(TO_BROKER, producer + send, 0)
    assert sent(actions, TO_BROKER) == producer
    assert hook.seen == [("SEND", "persistent://public/default/t")]


def test_hook_verdicts_answer_delay_replace_and_close() -> None:
    receipt = encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=0))
    verdict = Verdict(forward=True, replacement=PING, to_client=(receipt,), delay_s=0.2, close="reset")
    p = pipeline(hook=RecordingHook(verdict, frozenset({T.SEND})))
    connected(p)
    producer, send = producer_frames()
    actions = p.receive(TO_BROKER, producer + send, 0)
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ["Send", "Send", "Hold", "Close"]
    assert actions[-1].reset  # type: ignore[union-attr]
    assert sent(actions, TO_CLIENT) == receipt and sent(actions, TO_BROKER) == producer
    assert p.release_due(SECOND // 5 - 1) == []
    assert sent(p.release_due(SECOND // 5), TO_BROKER) == PING


class DelayEvery:
    """A hook that delays every SEND_RECEIPT by ``delays`` in turn (the rules engine's delay, jitter included)."""

    def __init__(self, *delays: float) -> None:
        self.delays = list(delays)

    def interest(self, direction: Direction) -> frozenset[int] | None:
        return frozenset({T.SEND_RECEIPT}) if direction is TO_CLIENT else frozenset()

    def on_frame(self, ctx: FrameContext, frame: Frame) -> Verdict:
        return Verdict(delay_s=self.delays.pop(0)) if self.delays else Verdict()


def receipt(sequence_id: int) -> bytes:
    return encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=sequence_id))


def test_each_delayed_frame_leaves_at_its_own_arrival_plus_its_delay_not_after_the_one_before() -> None:
    p = pipeline(hook=DelayEvery(*[0.2] * 10))
    connected(p)
    arrivals = [i * SECOND // 1000 for i in range(10)]  # ten receipts within 10 ms
    for i, now in enumerate(arrivals):
        actions = p.receive(TO_CLIENT, receipt(i), now)
        assert sent(actions, TO_CLIENT) == b"" and any(isinstance(a, Hold) for a in actions)
    for i, now in enumerate(arrivals):
        due = now + SECOND // 5
        assert sent(p.release_due(due - 1), TO_CLIENT) == b""
        assert sent(p.release_due(due), TO_CLIENT) == receipt(i)  # 200 ms after its own arrival


def test_a_frame_never_overtakes_a_delayed_one_before_it_in_its_direction() -> None:
    # 300 ms, then 0 (jitter can make a later frame's own time earlier), then no rule at all
    p = pipeline(hook=DelayEvery(0.3, 0.0))
    connected(p)
    message = encode_payload_command(api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(ledgerId=1,
                                                                                                    entryId=2)),
                                     api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1),
                                     b"m" * 5000)
    assert sent(p.receive(TO_CLIENT, receipt(0), 0), TO_CLIENT) == b""
    assert sent(p.receive(TO_CLIENT, receipt(1) + message[:100], 1), TO_CLIENT) == b""
    assert sent(p.receive(TO_CLIENT, message[100:], 2), TO_CLIENT) == b""
    assert sent(p.receive(TO_BROKER, PING, 3), TO_BROKER) == PING   # the other direction is not held
    assert sent(p.release_due(3 * SECOND // 10 - 1), TO_CLIENT) == b""
    assert sent(p.release_due(3 * SECOND // 10), TO_CLIENT) == receipt(0) + receipt(1) + message
    # once the lane is empty, frames pass at once again
    assert sent(p.receive(TO_CLIENT, receipt(2), SECOND), TO_CLIENT) == receipt(2)


def test_observers_hear_the_routed_connection_open_then_every_frame_and_what_the_proxy_changed() -> None:
    events: list[FrameEvent | ConnectionEvent] = []
    p = pipeline(events=events)  # type: ignore[arg-type]
    connected(p)
    p.receive(TO_CLIENT, lookup(LookupType.Connect), 0)
    opened, *frames = events
    assert isinstance(opened, ConnectionEvent) and not opened.closed
    assert opened.connection.broker_url == str(UPSTREAM)  # the broker CONNECT routed it to
    assert [(e.frame.type_name, e.origin) for e in frames] == [  # type: ignore[union-attr]
        ("CONNECT", Origin.CLIENT), ("CONNECTED", Origin.BROKER),
        ("LOOKUP_RESPONSE", Origin.BROKER), ("LOOKUP_RESPONSE", Origin.PROXY)]
    assert all(e.connection.broker_url == str(UPSTREAM) for e in frames)
    assert frames[3].frame.command.lookupTopicResponse.brokerServiceUrl == "pulsar://proxy.example:40001"  # type: ignore[union-attr]


def test_proxy_frames_are_never_spliced_into_a_frame_passing_through() -> None:
    p = pipeline()
    connected(p)
    message = encode_payload_command(api.CommandMessage(consumer_id=1, message_id=api.MessageIdData(ledgerId=1,
                                                                                                    entryId=2)),
                                     api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1),
                                     b"m" * 5000)
    first = p.receive(TO_CLIENT, message[:1000], 0)
    assert sent(first, TO_CLIENT) == message[:1000]
    ping_now = p.tick(10 * SECOND)
    assert sent(ping_now, TO_CLIENT) == b""              # the client's stream is inside a MESSAGE
    assert sent(ping_now, TO_BROKER) == PING             # the broker's stream is between frames
    rest = p.receive(TO_CLIENT, message[1000:], 10 * SECOND)
    assert sent(rest, TO_CLIENT) == message[1000:] + PING


def test_relay_read_says_none_only_for_a_read_that_goes_on_as_it_came() -> None:
    """The reactor's hop writes the read itself when ``relay_read`` answers None: only for a read the pipeline
    hands on whole and alone — never for the rest of a frame whose head an earlier read left behind."""
    p = pipeline()
    connected(p)
    send = encode_payload_command(api.CommandSend(producer_id=1, sequence_id=0), api.MessageMetadata(
        producer_name="p", sequence_id=0, publish_time=1), b"x" * 60)
    assert p.relay_read(TO_BROKER, send, 0) is None
    assert p.receive(TO_BROKER, send, 0) == [Send(TO_BROKER, [send])]
    # the rest of a frame passing through, then the first bytes of the next: only the rest goes on now
    assert p.relay_read(TO_BROKER, send[:40], 0) is None  # (its head checked: it streams through)
    rest = p.relay_read(TO_BROKER, send[40:] + send[:6], 0)
    assert rest is not None and sent(rest, TO_BROKER) == send[40:]
    last = p.relay_read(TO_BROKER, send[6:], 0)
    assert last is not None and sent(last, TO_BROKER) == send
    assert p.bytes_in[TO_BROKER] == len(CONNECT) + 4 * len(send)


def test_observers_that_read_no_observation_get_every_frame_without_the_session_tracker() -> None:
    """``observations=False`` (no observer reads FrameEvent.observation, no hook): frames still
    reach observers as received, but nothing is decoded for an Observation."""
    events: list[FrameEvent] = []
    p = ConnectionPipeline(
        ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None),
        settings=PipelineSettings(keepalive_ns=10 * SECOND), directory=directory(), default_broker=UPSTREAM,
        now_ns=0, publish=events.append, observations=False)
    connected(p)
    producer = encode_command(api.CommandProducer(topic="persistent://t/n/a", producer_id=1, request_id=2))
    assert sent(p.receive(TO_BROKER, producer, 0), TO_BROKER) == producer
    assert p.tracker is None
    frames = [e for e in events if isinstance(e, FrameEvent)]
    assert [e.frame.type for e in frames] == [T.CONNECT, T.CONNECTED, T.PRODUCER]
    assert all(e.observation is None and e.frame._command is None for e in frames[2:])


def test_observers_by_default_get_the_session_trackers_observation() -> None:
    events: list[FrameEvent] = []
    p = pipeline(events=events)
    connected(p)
    p.receive(TO_BROKER, encode_command(api.CommandProducer(topic="persistent://t/n/a", producer_id=1,
                                                            request_id=2)), 0)
    assert events[-1].observation is not None and events[-1].observation.topic == "persistent://t/n/a"


def test_the_hub_asks_for_observations_unless_every_observer_declines() -> None:
    from proxy.recording.observer import RecordingObserver
    from proxy.server.observer_hub import ObserverHub

    class Plain:
        def on_frame(self, event: FrameEvent) -> None: ...
        def on_connection(self, event: object) -> None: ...

    assert ObserverHub([Plain()]).needs_observation
    assert not ObserverHub([RecordingObserver.__new__(RecordingObserver)]).needs_observation
    assert ObserverHub([RecordingObserver.__new__(RecordingObserver), Plain()]).needs_observation


def rules_hook(text: str) -> RulesHook:
    return RulesHook(RulesEngine(load_rules_text(text)))


def consumer_frames() -> tuple[bytes, bytes, bytes, bytes, bytes]:
    subscribe = encode_command(api.CommandSubscribe(topic="persistent://public/default/t", subscription="s",
                                                    consumer_id=2, request_id=2, subType=api.CommandSubscribe.Shared))
    success = encode_command(api.CommandSuccess(request_id=2))
    flow = encode_command(api.CommandFlow(consumer_id=2, messagePermits=10))
    message = encode_payload_command(api.CommandMessage(consumer_id=2, message_id=api.MessageIdData(ledgerId=1,
                                                                                                    entryId=1)),
                                     api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1), b"m")
    ack = encode_command(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual,
                                        message_id=[api.MessageIdData(ledgerId=1, entryId=1)]))
    return subscribe, success, flow, message, ack


def test_a_hook_on_receipts_decodes_no_message_flow_or_ack_but_still_attributes_receipts() -> None:
    """Only what the rules can match is decoded, plus the control frames that attribute ids to topics."""
    hook = rules_hook("seed: 1\nrules:\n  - name: r\n    match: {command: [SEND_RECEIPT], "
                      "topic: 'persistent://public/default/t'}\n    action: drop\n")
    p = pipeline(hook=hook)
    connected(p)
    for scanner in p.scanners.values():
        assert not scanner.want_all
    # (each side's data path; the other side's commands are wanted: from there they are violations)
    assert not p.scanners[TO_BROKER].wanted & {T.SEND, T.FLOW, T.ACK}
    assert not p.scanners[TO_CLIENT].wanted & {T.MESSAGE}
    # no producer on the rule's topic yet: the receipts pass through too
    assert T.SEND_RECEIPT not in p.scanners[TO_CLIENT].wanted and T.PRODUCER in p.scanners[TO_BROKER].wanted
    producer, send = producer_frames()
    subscribe, success, flow, message, ack = consumer_frames()
    p.receive(TO_BROKER, producer + subscribe, 0)
    p.receive(TO_CLIENT, encode_command(api.CommandProducerSuccess(request_id=1, producer_name="p")) + success, 0)
    assert T.SEND_RECEIPT in p.scanners[TO_CLIENT].wanted  # once the producer registered on it
    # the data path passes through as bytes: one slice of what was received, nothing decoded
    for direction, data in ((TO_BROKER, send + flow + ack), (TO_CLIENT, message)):
        actions = p.receive(direction, data, 0)
        assert actions == [Send(direction, [data])]
    receipt = encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=0))
    assert sent(p.receive(TO_CLIENT, receipt, 0), TO_CLIENT) == b""  # attributed to the topic, dropped
    assert p.tracker is not None and set(p.tracker.producers) == {1} and set(p.tracker.consumers) == {2}
    assert p.tracker.pending_requests == 0  # no SEND waits for its receipt
    assert not p.permits_exact  # FLOW and MESSAGE were not counted


def test_permits_are_exact_when_observers_read_observations() -> None:
    p = pipeline(hook=rules_hook("rules: []\n"), events=[])
    connected(p)
    subscribe, success, flow, message, _ = consumer_frames()
    p.receive(TO_BROKER, subscribe, 0)
    p.receive(TO_CLIENT, success, 0)
    p.receive(TO_BROKER, flow, 0)
    p.receive(TO_CLIENT, message, 0)
    assert p.permits_exact and p.tracker is not None and p.tracker.consumers[2].permits == 9


def test_rules_added_at_run_time_reach_open_connections() -> None:
    hook = rules_hook("seed: 1\nrules: []\n")
    p = pipeline(hook=hook)
    connected(p)
    producer, send = producer_frames()
    assert sent(p.receive(TO_BROKER, producer + send, 0), TO_BROKER) == producer + send
    hook.engine.replace(load_rules_text("seed: 1\nrules:\n  - name: r\n    match: {command: [SEND], "
                                        "topic: 'persistent://public/default/t'}\n    action: drop\n"))
    assert sent(p.receive(TO_BROKER, send, 0), TO_BROKER) == b""


def test_an_error_rule_on_responses_tracks_acks_so_their_errors_keep_their_topic() -> None:
    hook = rules_hook("seed: 1\nrules:\n  - name: r\n    match: {command: [ERROR], "
                      "topic: 'persistent://public/default/t'}\n    action: drop\n")
    p = pipeline(hook=hook)
    connected(p)
    subscribe, success, _, _, _ = consumer_frames()
    p.receive(TO_BROKER, subscribe, 0)
    p.receive(TO_CLIENT, success, 0)
    assert T.ACK in p.scanners[TO_BROKER].wanted
    p.receive(TO_BROKER, encode_command(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual,
                                                       message_id=[api.MessageIdData(ledgerId=1, entryId=1)],
                                                       request_id=9)), 0)
    error = encode_command(api.CommandError(request_id=9, error=api.ServerError.UnknownError, message="x"))
    assert sent(p.receive(TO_CLIENT, error, 0), TO_CLIENT) == b""


def test_connections_rows_take_permits_from_telemetry_and_else_only_from_an_exact_tracker() -> None:
    """With telemetry (the admin API always has it) permits are counted whatever the relay tracks;
    without it, the relay's tracker is used only when it sees every FLOW and MESSAGE."""
    from types import SimpleNamespace

    from proxy.server.stack import connection_rows
    from proxy.telemetry import build_telemetry

    rows = {}
    for name, events, with_telemetry in (("rules only", None, False), ("observers", [], False),
                                         ("rules only, telemetry", None, True)):
        p = pipeline(hook=rules_hook("rules: []\n"), events=events)
        telemetry = build_telemetry() if with_telemetry else None
        frames = [(TO_BROKER, CONNECT), (TO_CLIENT, CONNECTED)]
        subscribe, success, flow, _, _ = consumer_frames()
        frames += [(TO_BROKER, subscribe), (TO_CLIENT, success), (TO_BROKER, flow)]
        for direction, data in frames:
            p.receive(direction, data, 0)
            if telemetry is not None:
                telemetry.telemetry.frame(p.info.conn_id, direction, frame_from_bytes(data), 0)
        server = SimpleNamespace(relays=[SimpleNamespace(pipeline=p, upstream_local_address=None)])
        (rows[name],) = connection_rows(server, telemetry)  # type: ignore[arg-type]
        if telemetry is not None:
            telemetry.shutdown()
    for row in rows.values():
        assert [c["consumer_id"] for c in row["consumers"]] == [2] and row["topics"] == ["persistent://public/default/t"]
        assert row["phase"] == "connected" and row["violations"] == 0
    assert rows["rules only"]["permits"] is None and rows["rules only"]["consumers"][0]["permits"] is None
    assert rows["observers"]["permits"] == 10 and rows["observers"]["consumers"][0]["permits"] == 10
    assert rows["rules only, telemetry"]["permits"] == 10
    assert rows["rules only, telemetry"]["consumers"][0]["permits"] == 10


# -- the same behaviour written as playbooks (pipeline_playbook.py) ---------------------------------
def test_playbook_handshake_keepalive_and_a_dead_client() -> None:
    """Every action is named: an extra Close or Hold anywhere would fail the playbook."""
    p = pipeline()
    assert (Playbook(p)
            >> Receive(TO_BROKER, CONNECT) << OpenUpstream(UPSTREAM) << Send(TO_BROKER, [CONNECT])
            >> Receive(TO_CLIENT, CONNECTED) << Send(TO_CLIENT, [CONNECTED])
            >> Tick(5 * SECOND)
            >> Tick(10 * SECOND) << Send(TO_CLIENT, [PING]) << Send(TO_BROKER, [PING])
            >> Receive(TO_CLIENT, PONG, 11 * SECOND)
            >> Tick(15 * SECOND)
            >> Tick(20 * SECOND) << Close("client silent for 20.0s and no PONG: peer is dead"))


def test_playbook_a_delay_rule_holds_the_frame_and_what_follows_until_its_time() -> None:
    engine = RulesEngine(load_rules_text("rules:\n  - name: slow\n    match: {command: [PING]}\n"
                                         "    action: {delay: {ms: 200}}\n"))
    p = pipeline(hook=RulesHook(engine))
    connected(p)
    assert (Playbook(p)
            >> Receive(TO_BROKER, PING, SECOND) << Hold(SECOND + SECOND // 5)
            >> Receive(TO_BROKER, PONG, SECOND + 1) << Hold(SECOND + SECOND // 5)
            >> ReleaseDue(SECOND + SECOND // 5 - 1)
            >> ReleaseDue(SECOND + SECOND // 5) << Send(TO_BROKER, [PING + PONG]))


def test_a_playbook_fails_on_an_action_it_was_not_told_of() -> None:
    engine = RulesEngine(load_rules_text("rules:\n  - name: slow\n    match: {command: [PING]}\n"
                                         "    action: {delay: {ms: 200}}\n"))
    p = pipeline(hook=RulesHook(engine))
    connected(p)
    with pytest.raises(AssertionError, match="Hold"):
        assert Playbook(p) >> Receive(TO_BROKER, PING) << Send(TO_BROKER, [PING])  # a Hold nobody expected
    p = pipeline()
    connected(p)
    with pytest.raises(AssertionError, match="Close"):
        assert Playbook(p) >> Tick(30 * SECOND) << Send(TO_CLIENT, [PING]) << Send(TO_BROKER, [PING]) \
            >> Tick(60 * SECOND)  # the peers never answered: a Close nobody expected


# -- the shared session machine, lenient: refused frames forwarded and counted ----------------------
LOOKUP = encode_command(api.CommandLookupTopic(topic="persistent://public/default/t", request_id=9))


@pytest.mark.parametrize("config", ["plain", "rules", "observers"])
def test_playbook_frames_the_session_table_refuses_are_forwarded_unchanged_and_counted(config: str) -> None:
    """As before the table ran here: the peers see the same bytes; now each refused frame is counted."""
    _, success, _, message, _ = consumer_frames()
    producer, send = producer_frames()
    p = pipeline(hook=rules_hook("rules: []\n") if config == "rules" else None,
                 events=[] if config == "observers" else None)
    assert (Playbook(p)
            >> Receive(TO_BROKER, CONNECT) << OpenUpstream(UPSTREAM) << Send(TO_BROKER, [CONNECT])
            >> Receive(TO_BROKER, LOOKUP) << Send(TO_BROKER, [LOOKUP])           # before CONNECTED: refused
            >> Receive(TO_CLIENT, CONNECTED) << Send(TO_CLIENT, [CONNECTED])
            >> Receive(TO_BROKER, producer + send) << Send(TO_BROKER, [producer + send])   # allowed
            >> Receive(TO_BROKER, message + send) << Send(TO_BROKER, [message + send])     # MESSAGE: the broker's
            >> Receive(TO_CLIENT, send + success) << Send(TO_CLIENT, [send + success]))    # SEND: the client's
    assert p.session.violations == 3 and p.session.state.value == "connected"


def test_a_broker_refusing_connect_closes_the_session_and_what_follows_is_counted_not_dropped() -> None:
    p = pipeline()
    refused = encode_command(api.CommandError(request_id=0, error=api.ServerError.AuthenticationError,
                                              message="no"))
    assert (Playbook(p)
            >> Receive(TO_BROKER, CONNECT) << OpenUpstream(UPSTREAM) << Send(TO_BROKER, [CONNECT])
            >> Receive(TO_CLIENT, refused) << Send(TO_CLIENT, [refused])
            >> Receive(TO_BROKER, PING) << Send(TO_BROKER, [PING])
            >> Tick(20 * SECOND)
            >> Tick(20 * SECOND + 1) << Close("no handshake within 20s"))
    assert p.session.state.value == "closed" and p.session.violations == 1


@pytest.mark.parametrize("script", ["ping first", "second connect", "connected twice", "after a challenge"])
@pytest.mark.parametrize("observed", [False, True], ids=["plain", "observers"])
def test_the_handshake_out_of_turn_is_a_protocol_error_naming_the_table(script: str, observed: bool) -> None:
    """The proxy routes by CONNECT and sizes frames by CONNECTED: these end the connection."""
    p = pipeline(events=[] if observed else None)
    if script == "ping first":
        last = (TO_BROKER, PING)
    elif script == "second connect":
        connected(p)
        last = (TO_BROKER, CONNECT)
    elif script == "connected twice":
        connected(p)
        last = (TO_CLIENT, CONNECTED)
    else:
        p.receive(TO_BROKER, CONNECT, 0)
        p.receive(TO_CLIENT, encode_command(api.CommandAuthChallenge(server_version="b")), 0)
        p.receive(TO_CLIENT, CONNECTED, 0)
        last = (TO_CLIENT, CONNECTED)
    with pytest.raises(ProtocolError, match="is not allowed while the connection is"):
        p.receive(*last, 0)
    assert p.session.violations == 1


def test_handshake_commands_from_the_wrong_side_are_forwarded_and_counted() -> None:
    p = pipeline()
    p.receive(TO_BROKER, CONNECT, 0)
    assert (Playbook(p)
            >> Receive(TO_BROKER, CONNECTED) << Send(TO_BROKER, [CONNECTED])
            >> Receive(TO_CLIENT, CONNECTED) << Send(TO_CLIENT, [CONNECTED])
            >> Receive(TO_CLIENT, CONNECT) << Send(TO_CLIENT, [CONNECT]))
    assert p.session.violations == 2 and p.session.state.value == "connected"
