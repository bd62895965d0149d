"""The engine's verdict for every action, matching, counters, seeds, throttling and hot replace."""

from __future__ import annotations

import time

import pytest
from rules_helpers import (
    OTHER_TOPIC,
    TO_BROKER,
    TO_CLIENT,
    TOPIC,
    Session,
    engine_for,
    frame,
    message_frame,
    send_frame,
)

import proxy.rules.engine as engine_module
from proxy.core.holding import HoldQueue
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import frame_from_bytes
from proxy.rules.actions import BROKER_INITIATED_REQUEST_ID
from proxy.rules.engine import PROXY_REQUEST_IDS_START
from proxy.rules.loader import load_rules_text
from proxy.rules.matcher import FrameFacts, criteria_met
from proxy.rules.model import Match
from proxy.rules.throttle import FairShare, TokenBucket
from proxy.rules.verdict import FORWARD, Verdict

T = api.BaseCommand.Type


def decode(data: bytes) -> api.BaseCommand:
    return frame_from_bytes(data).command


def one_rule(action: str, match: str = "{}") -> Session:
    session = Session(engine_for(f"seed: 1\nrules:\n  - name: r\n    match: {match}\n    action: {action}\n"))
    session.add_producer()
    session.add_consumer()
    return session


def test_no_rules_pass_everything() -> None:
    session = Session(engine_for("rules: []\n"))
    assert session.decide(frame(api.CommandPing()), TO_BROKER) is FORWARD


def test_delay_holds_the_frame_with_jitter_within_bounds() -> None:
    session = one_rule("{delay: {ms: 200, jitter_ms: 50}}", "{command: [SEND_RECEIPT]}")
    delays = [session.decide(frame(api.CommandSendReceipt(producer_id=1, sequence_id=i)), TO_CLIENT).delay_s
              for i in range(50)]
    assert all(0.150 <= d <= 0.250 for d in delays)
    assert len(set(delays)) > 1
    assert session.engine.hits() == {"r": 50}


def test_drop_swallows_the_frame() -> None:
    decision = one_rule("drop", "{command: [SEND_RECEIPT]}").decide(
        frame(api.CommandSendReceipt(producer_id=1, sequence_id=1)), TO_CLIENT)
    assert not decision.forward and not decision.to_client and not decision.to_broker
    assert decision.fired == ("r",)


@pytest.mark.parametrize(("request_sub", "reply_type"), [
    (api.CommandProducer(topic=TOPIC, producer_id=5, request_id=77), T.ERROR),
    (api.CommandSubscribe(topic=TOPIC, subscription="s", consumer_id=6, request_id=77,
                          subType=api.CommandSubscribe.Exclusive), T.ERROR),
    (api.CommandLookupTopic(topic=TOPIC, request_id=77), T.LOOKUP_RESPONSE),
    (api.CommandPartitionedTopicMetadata(topic=TOPIC, request_id=77), T.PARTITIONED_METADATA_RESPONSE),
    (api.CommandGetLastMessageId(consumer_id=2, request_id=77), T.ERROR),
])
def test_error_answers_each_request_with_the_reply_it_expects(request_sub: object, reply_type: int) -> None:
    session = one_rule("{error: {code: ServiceNotReady, message: try later}}")
    decision = session.decide(frame(request_sub), TO_BROKER)
    assert not decision.forward and not decision.to_broker
    (reply,) = decision.to_client
    cmd = decode(reply)
    assert cmd.type == reply_type
    if reply_type == T.ERROR:
        assert (cmd.error.request_id, cmd.error.error, cmd.error.message) == (77, api.ServiceNotReady, "try later")
    elif reply_type == T.LOOKUP_RESPONSE:
        assert cmd.lookupTopicResponse.response == api.CommandLookupTopicResponse.Failed
        assert cmd.lookupTopicResponse.request_id == 77
        assert cmd.lookupTopicResponse.error == api.ServiceNotReady
    else:
        assert cmd.partitionMetadataResponse.response == api.CommandPartitionedTopicMetadataResponse.Failed
        assert cmd.partitionMetadataResponse.error == api.ServiceNotReady


def test_error_on_send_is_a_send_error_and_other_frames_are_not_hit() -> None:
    session = one_rule("{error: {code: NotAllowedError}}")
    decision = session.decide(send_frame(1, 9), TO_BROKER)
    cmd = decode(decision.to_client[0])
    assert cmd.type == T.SEND_ERROR
    assert (cmd.send_error.producer_id, cmd.send_error.sequence_id, cmd.send_error.error) == (1, 9, api.NotAllowedError)
    # not requests: FLOW and an ACK without request_id pass untouched and are not hits
    assert session.decide(frame(api.CommandFlow(consumer_id=2, messagePermits=10)), TO_BROKER) is FORWARD
    ack = api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual,
                         message_id=[api.MessageIdData(ledgerId=1, entryId=1)])
    assert session.decide(frame(ack), TO_BROKER) is FORWARD
    assert session.engine.hits() == {"r": 1}


@pytest.mark.parametrize("how", ["close", "reset"])
def test_disconnect_swallows_and_closes(how: str) -> None:
    decision = one_rule(f"{{disconnect: {{how: {how}}}}}", "{command: [SEND]}").decide(send_frame(1, 1), TO_BROKER)
    assert not decision.forward and decision.close == how


def test_close_on_send_unloads_the_producer_as_a_broker_does() -> None:
    """The SEND is not taken; receipts the broker still sends arrive; the client hears CLOSE_PRODUCER
    only when the broker answered the proxy's close; nothing more for the id until it is re-created."""
    session = one_rule("close", "{command: [SEND]}")
    session.add_producer(producer_id=1)
    decision = session.decide(send_frame(1, 3), TO_BROKER)
    assert not decision.forward and decision.to_client == ()
    upstream = decode(decision.to_broker[0])
    assert upstream.type == T.CLOSE_PRODUCER and upstream.close_producer.producer_id == 1
    request_id = upstream.close_producer.request_id
    assert request_id >= PROXY_REQUEST_IDS_START
    interest = session.engine.interest(TO_CLIENT) or ()
    assert T.SUCCESS in interest and T.SEND_RECEIPT in interest
    # closing: the client's later SENDs for the id are not taken; the broker's receipts still arrive
    assert not session.decide(send_frame(1, 4), TO_BROKER).forward
    assert session.decide(frame(api.CommandSendReceipt(producer_id=1, sequence_id=2)), TO_CLIENT).forward
    # the broker's SUCCESS for the proxy's close becomes the client's CLOSE_PRODUCER
    answered = session.decide(frame(api.CommandSuccess(request_id=request_id)), TO_CLIENT)
    assert not answered.forward
    to_client = decode(answered.to_client[0])
    assert to_client.type == T.CLOSE_PRODUCER
    assert (to_client.close_producer.producer_id, to_client.close_producer.request_id) == \
        (1, BROKER_INITIATED_REQUEST_ID)
    # closed: nothing for the id in either direction; the client's own SUCCESS passes
    assert not session.decide(send_frame(1, 5), TO_BROKER).forward
    assert not session.decide(frame(api.CommandSendReceipt(producer_id=1, sequence_id=3)), TO_CLIENT).forward
    assert session.decide(frame(api.CommandSuccess(request_id=request_id)), TO_CLIENT) is FORWARD
    # the client re-creates the producer (same id): its frames pass again, and the rule may fire again
    assert session.decide(frame(api.CommandProducer(topic=TOPIC, producer_id=1, request_id=7)), TO_BROKER) is FORWARD
    again = session.decide(send_frame(1, 3), TO_BROKER)
    assert not again.forward and decode(again.to_broker[0]).type == T.CLOSE_PRODUCER


def test_close_on_a_receipt_lets_it_arrive_and_unloads_behind_it() -> None:
    session = one_rule("close", "{command: [SEND_RECEIPT]}")
    session.add_producer(producer_id=1)
    decision = session.decide(frame(api.CommandSendReceipt(producer_id=1, sequence_id=0)), TO_CLIENT)
    assert decision.forward and decode(decision.to_broker[0]).type == T.CLOSE_PRODUCER


def test_a_producer_re_created_while_closing_is_not_closed_again() -> None:
    session = one_rule("close", "{command: [SEND], times: 1}")
    session.add_producer(producer_id=1)
    request_id = decode(session.decide(send_frame(1, 0), TO_BROKER).to_broker[0]).close_producer.request_id
    assert session.decide(frame(api.CommandCloseProducer(producer_id=1, request_id=9)), TO_BROKER) is FORWARD
    late = session.decide(frame(api.CommandSuccess(request_id=request_id)), TO_CLIENT)
    assert not late.forward and late.to_client == ()  # swallowed, and the client hears nothing


def test_close_on_flow_unloads_the_consumer() -> None:
    session = one_rule("close", "{command: [FLOW]}")
    session.add_consumer(consumer_id=2)
    decision = session.decide(frame(api.CommandFlow(consumer_id=2, messagePermits=100)), TO_BROKER)
    upstream = decode(decision.to_broker[0]).close_consumer
    assert not decision.forward and upstream.consumer_id == 2
    assert session.decide(message_frame(2), TO_CLIENT).forward  # dispatched before the unload
    assert not session.decide(frame(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual)),
                              TO_BROKER).forward
    answered = session.decide(frame(api.CommandSuccess(request_id=upstream.request_id)), TO_CLIENT)
    assert decode(answered.to_client[0]).close_consumer.consumer_id == 2
    assert not session.decide(message_frame(2), TO_CLIENT).forward


@pytest.mark.parametrize("what", ["checksum", "payload", "metadata"])
def test_corrupt_damages_exactly_what_it_says(what: str) -> None:
    session = one_rule(f"{{corrupt: {{what: {what}}}}}")
    original = send_frame(1, 1, payload=b"payload-bytes")
    decision = session.decide(original, TO_BROKER)
    assert decision.forward and decision.replacement is not None
    damaged = frame_from_bytes(decision.replacement)
    assert damaged.payload is not None and original.payload is not None
    assert damaged.payload.checksum_ok() is (what != "checksum")
    assert (damaged.payload.payload != original.payload.payload) is (what == "payload")
    assert (damaged.payload.metadata_raw != original.payload.metadata_raw) is (what == "metadata")
    assert damaged.command == original.command


def test_corrupt_reaches_messages_to_the_consumer() -> None:
    session = one_rule("{corrupt: {what: payload}}", "{topic: 'persistent://public/default/orders-*'}")
    decision = session.decide(message_frame(2), TO_CLIENT)
    assert decision.replacement is not None


def test_duplicate_sends_the_frame_twice_towards_its_receiver() -> None:
    session = one_rule("duplicate", "{command: [SEND_RECEIPT]}")
    receipt = frame(api.CommandSendReceipt(producer_id=1, sequence_id=4))
    decision = session.decide(receipt, TO_CLIENT)
    assert decision.forward and decision.to_client == (receipt.raw,) and not decision.to_broker


def test_rewrite_sets_fields_and_keeps_the_rest() -> None:
    session = one_rule("{rewrite: {max_message_size: 1024}}", "{command: [CONNECTED]}")
    connected = frame(api.CommandConnected(server_version="b", protocol_version=21, max_message_size=5242880))
    decision = session.engine.evaluate(connected, TO_CLIENT, 0)
    assert decision.replacement is not None
    cmd = decode(decision.replacement)
    assert cmd.connected.max_message_size == 1024 and cmd.connected.server_version == "b"


def test_rewrite_keeps_the_payload_of_a_send() -> None:
    session = one_rule("{rewrite: {sequence_id: 99}}", "{command: [SEND]}")
    original = send_frame(1, 5, payload=b"abc")
    decision = session.decide(original, TO_BROKER)
    assert decision.replacement is not None
    rewritten = frame_from_bytes(decision.replacement)
    assert rewritten.command.send.sequence_id == 99
    assert rewritten.payload is not None and rewritten.payload.payload == b"abc" and rewritten.payload.checksum_ok()


def test_redirect_answers_lookups_with_another_broker() -> None:
    session = one_rule("{redirect: {url: 'pulsar://127.0.0.1:6651', authoritative: true}}")
    decision = session.decide(frame(api.CommandLookupTopic(topic=TOPIC, request_id=12)), TO_BROKER)
    assert not decision.forward
    response = decode(decision.to_client[0]).lookupTopicResponse
    assert response.response == api.CommandLookupTopicResponse.Redirect
    assert (response.brokerServiceUrl, response.request_id, response.authoritative) == \
        ("pulsar://127.0.0.1:6651", 12, True)


def test_slice_asks_for_small_writes() -> None:
    decision = one_rule("{slice: {bytes: 3}}", "{command: [MESSAGE]}").decide(message_frame(2), TO_CLIENT)
    assert decision.forward and decision.slice_bytes == 3


def test_record_and_mark_compose_and_the_first_action_bearing_rule_wins() -> None:
    session = Session(engine_for("""\
rules:
  - name: rec
    match: {command: [SEND]}
    action: record
  - name: slow
    match: {command: [SEND]}
    action: {delay: {ms: 10}}
  - name: never
    match: {command: [SEND]}
    action: drop
  - name: tag
    match: {topic: "persistent://public/default/orders-*"}
    action: {mark: {label: orders}}
"""))
    session.add_producer()
    decision = session.decide(send_frame(1, 1), TO_BROKER)
    assert decision.forward and decision.delay_s == pytest.approx(0.010)
    assert decision.record and decision.marks == ("orders",)
    assert decision.fired == ("rec", "slow", "tag")
    assert session.engine.hits() == {"rec": 1, "slow": 1, "never": 0, "tag": 1}


def test_topic_is_resolved_through_ids_and_names_match() -> None:
    session = Session(engine_for("""\
rules:
  - name: orders-sends
    match: {command: [SEND], topic: "persistent://public/default/orders-*", producer_name: "prod-*"}
    action: drop
  - name: sub-flows
    match: {command: [FLOW], subscription: {regex: "s.b"}, consumer_name: cons-a}
    action: drop
"""))
    session.add_producer(1, TOPIC)
    session.add_producer(3, OTHER_TOPIC)
    session.add_consumer(2, TOPIC)
    assert not session.decide(send_frame(1, 1), TO_BROKER).forward
    assert session.decide(send_frame(3, 1), TO_BROKER) is FORWARD
    assert not session.decide(frame(api.CommandFlow(consumer_id=2, messagePermits=5)), TO_BROKER).forward
    assert session.decide(frame(api.CommandFlow(consumer_id=9, messagePermits=5)), TO_BROKER) is FORWARD


def test_direction_and_client_cidr() -> None:
    engine = engine_for("""\
rules:
  - name: r
    match: {direction: to_broker, client: 10.1.0.0/16}
    action: drop
""")
    inside = Session(engine, conn_id=1, client="10.1.2.3:5555")
    outside = Session(engine, conn_id=2, client="127.0.0.1:5555")
    ping = frame(api.CommandPing())
    assert not inside.decide(ping, TO_BROKER).forward
    assert inside.decide(frame(api.CommandPing()), TO_CLIENT) is FORWARD
    assert outside.decide(frame(api.CommandPing()), TO_BROKER) is FORWARD


def test_after_and_times_count_across_connections() -> None:
    engine = engine_for("""\
rules:
  - name: r
    match: {command: [PING], after: 2, times: 3}
    action: drop
""")
    sessions = [Session(engine, conn_id=i) for i in range(4)]
    results = [not sessions[i % 4].decide(frame(api.CommandPing()), TO_BROKER).forward for i in range(8)]
    assert results == [False, False, True, True, True, False, False, False]
    assert engine.hits() == {"r": 3}


def hit_pattern(seed: int | None, engine_seed: int | None = None) -> list[bool]:
    text = "rules:\n  - name: coin\n    match: {command: [PING], probability: 0.3}\n    action: drop\n"
    if seed is not None:
        text = f"seed: {seed}\n" + text
    session = Session(engine_for(text, seed=engine_seed))
    return [not session.decide(frame(api.CommandPing()), TO_BROKER).forward for _ in range(200)]


def test_same_seed_same_hits_and_probability_is_honoured() -> None:
    first, second = hit_pattern(7), hit_pattern(7)
    assert first == second
    assert 35 <= sum(first) <= 85
    assert hit_pattern(8) != first


def test_a_seed_is_chosen_and_reported_when_the_file_has_none() -> None:
    session = Session(engine_for("rules: []\n"))
    assert isinstance(session.engine.seed, int)
    assert hit_pattern(None, engine_seed=7) == hit_pattern(7)


def test_throttle_paces_sends_at_the_rate_per_producer_lane() -> None:
    session = one_rule("{throttle: {messages_per_second: 100}}", "{command: [SEND]}")
    waits = [session.decide(send_frame(1, i), TO_BROKER, now_s=0.0) for i in range(5)]
    assert [round(d.delay_s, 3) for d in waits] == [0.0, 0.01, 0.02, 0.03, 0.04]
    assert waits[0].lane == ("producer", 1, 1)
    # a second later the bucket has refilled to its burst of 1 only
    later = [session.decide(send_frame(1, 10 + i), TO_BROKER, now_s=1.0).delay_s for i in range(2)]
    assert [round(w, 3) for w in later] == [0.0, 0.01]


def test_throttle_counts_batched_messages_and_bytes() -> None:
    session = one_rule("{throttle: {messages_per_second: 10, burst: 10}}", "{command: [SEND]}")
    assert session.decide(send_frame(1, 1, num_messages=10), TO_BROKER, now_s=0).delay_s == 0.0
    assert session.decide(send_frame(1, 2, num_messages=5), TO_BROKER, now_s=0).delay_s == pytest.approx(0.5)
    by_bytes = one_rule("{throttle: {bytes_per_second: 1000}}", "{command: [SEND]}")
    big = send_frame(1, 1, payload=b"x" * 500)
    assert by_bytes.decide(big, TO_BROKER, now_s=0).delay_s == pytest.approx((big.size - 1) / 1000)


def test_throttle_per_topic_keeps_topics_apart() -> None:
    session = one_rule("{throttle: {messages_per_second: 10, per: topic}}", "{command: [SEND]}")
    session.add_producer(3, OTHER_TOPIC)
    assert session.decide(send_frame(1, 1), TO_BROKER, now_s=0).delay_s == 0.0
    assert session.decide(send_frame(1, 2), TO_BROKER, now_s=0).delay_s == pytest.approx(0.1)
    assert session.decide(send_frame(3, 1), TO_BROKER, now_s=0).delay_s == 0.0


def test_throttle_rations_flow_permits_and_releases_the_rest_over_time() -> None:
    """A lone consumer (``per: consumer``): what the bucket holds passes now, the rest at the rate, none lost."""
    engine = engine_for("""\
rules:
  - name: ration
    match: {command: [FLOW]}
    action: {throttle: {messages_per_second: 50, burst: 10, per: consumer}}
""")
    session = Session(engine)
    session.add_consumer()
    held = HoldQueue()
    decision = session.decide(frame(api.CommandFlow(consumer_id=2, messagePermits=100)), TO_BROKER, now_s=0)
    assert decision.replacement is not None
    assert decode(decision.replacement).flow.messagePermits == 10
    assert all(d.to_broker and d.poll is not None for d in decision.deferred)
    for later in decision.deferred:
        assert later.poll is not None
        held.add_poll(int(later.after_s * 1e9), TO_BROKER, later.poll)
    assert engine.permits_held(1) == {2: 90}
    released, now_s = 10, 0.0
    while now_s < 3.0:
        now_s += 0.01
        released += released_permits(held, int(now_s * 1e9))
        # never faster than 50/s after the burst of 10
        assert released <= 10 + 50 * now_s + 1e-9
    assert released == 100 and not held and engine.permits_held(1) == {}


def released_permits(held: HoldQueue, now_ns: int) -> int:
    return sum(decode(data).flow.messagePermits for entry in held.pop_due(now_ns) for data in entry.frames)


class TwoConsumers:
    """Two consumers' FLOWs of 1000 permits decided by the engine; what it holds back released as the relay would."""

    def __init__(self, lanes: list[tuple[Session, int]]) -> None:
        self.lanes = lanes
        self.held = [HoldQueue(), HoldQueue()]
        self.granted = [0, 0]

    def flow(self, index: int, now_s: float) -> None:
        session, consumer_id = self.lanes[index]
        verdict = session.decide(frame(api.CommandFlow(consumer_id=consumer_id, messagePermits=1000)), TO_BROKER,
                                 now_s=now_s)
        passed = decode(verdict.replacement).flow.messagePermits if verdict.replacement else 0
        self.granted[index] += 1000 if verdict is FORWARD else passed
        for later in verdict.deferred:
            assert later.poll is not None  # (a FLOW throttle's permits wait in a poll, as the pipeline holds it)
            self.held[index].add_poll(int((now_s + later.after_s) * 1e9), TO_BROKER, later.poll)

    def second_joins_later(self) -> float:
        """At 50/s: the first consumer alone for 1 s has the whole rate, then both wait and get 25/s each for 2 s;
        the time reached."""
        granted = self.granted
        self.flow(0, 0.0)
        now_s = self.run(1.0, 0.0)
        assert 45 <= granted[0] <= 51 and granted[1] == 0
        self.flow(1, now_s)
        before = list(granted)
        now_s = self.run(3.0, now_s)
        shares = [granted[0] - before[0], granted[1] - before[1]]
        assert all(45 <= share <= 55 for share in shares), shares  # 25/s each
        assert sum(granted) <= 1 + 50 * now_s
        return now_s

    def run(self, until_s: float, now_s: float) -> float:
        """Release what is due every 10 ms until ``until_s``; the time reached."""
        while now_s < until_s - 1e-9:
            now_s += 0.01
            for index in (0, 1):
                self.granted[index] += released_permits(self.held[index], int(now_s * 1e9))
        return now_s


def test_one_shared_flow_bucket_splits_its_rate_between_the_consumers_waiting_and_forgets_a_closed_one() -> None:
    """A later consumer is not held behind an earlier one's permits; the total never beats the rate."""
    engine = engine_for("""\
rules:
  - name: shared
    match: {command: [FLOW]}
    action: {throttle: {messages_per_second: 50}}
""")
    sessions = [Session(engine, conn_id=conn_id) for conn_id in (1, 2)]
    for session in sessions:
        session.add_consumer()
        engine.connection_interest(TO_BROKER, session.conn_id, session.client, session.tracker)
    consumers = TwoConsumers([(sessions[0], 2), (sessions[1], 2)])
    run, granted, held = consumers.run, consumers.granted, consumers.held
    now_s = consumers.second_joins_later()
    # the broker closes the first consumer: its waiting permits go nowhere, the other gets the whole rate
    sessions[0].decide(frame(api.CommandCloseConsumer(consumer_id=2, request_id=7)), TO_CLIENT)
    before = list(granted)
    now_s = run(4.0, now_s)
    assert granted[0] - before[0] <= 3 and 45 <= granted[1] - before[1] <= 55
    assert sum(granted) <= 1 + 50 * now_s
    # a connection closed: its consumers' permits are forgotten, nothing else waits
    engine.connection_closed(2)
    share = next(engine.states()).flow_shares[("rule", None, api.BaseCommand.FLOW)]
    assert run(5.0, now_s) and not held[0] and not share.lanes


@pytest.mark.parametrize("per", ["topic", "connection"])
def test_a_split_flow_bucket_shared_by_two_consumers_splits_its_rate_and_shows_what_it_holds(per: str) -> None:
    """``per: topic`` (two subscriptions of one topic) or ``per: connection`` (two consumers on one
    connection): a consumer whose FLOW comes later is not held behind the first one's permits."""
    engine = engine_for(f"""\
rules:
  - name: split
    match: {{command: [FLOW]}}
    action: {{throttle: {{messages_per_second: 50, per: {per}}}}}
""")
    # per topic: two connections on one topic; per connection: two consumers on one connection
    first = Session(engine, conn_id=1)
    first.add_consumer(2, subscription="a")
    if per == "topic":
        second = Session(engine, conn_id=2)
        second.add_consumer(2, subscription="b")
        lanes = [(first, 2), (second, 2)]
    else:
        first.add_consumer(3, subscription="b")
        lanes = [(first, 2), (first, 3)]
    for session in {session.conn_id: session for session, _ in lanes}.values():
        engine.connection_interest(TO_BROKER, session.conn_id, session.client, session.tracker)
    consumers = TwoConsumers(lanes)
    run, granted, held = consumers.run, consumers.granted, consumers.held
    now_s = consumers.second_joins_later()
    # what the proxy still holds back of each consumer's 1000 permits
    held_now = {(s.conn_id, c): engine.permits_held(s.conn_id).get(c) for s, c in lanes}
    assert [held_now[(s.conn_id, c)] for s, c in lanes] == [1000 - granted[0], 1000 - granted[1]]
    # the first consumer's connection ends (per connection: both end): its waiting permits are gone
    engine.connection_closed(1)
    assert engine.permits_held(1) == {}
    before = list(granted)
    now_s = run(4.0, now_s)
    assert granted[0] == before[0]
    if per == "topic":
        assert 45 <= granted[1] - before[1] <= 55  # the other consumer has the whole rate
    else:
        assert granted[1] == before[1] and not held[0] and not held[1]


@pytest.mark.parametrize("per", ["consumer", "topic"])
def test_a_closed_consumers_waiting_permits_never_reach_the_broker_under_a_split_bucket(per: str) -> None:
    engine = engine_for(f"""\
rules:
  - name: split
    match: {{command: [FLOW]}}
    action: {{throttle: {{messages_per_second: 50, per: {per}}}}}
""")
    session = Session(engine)
    session.add_consumer()
    engine.connection_interest(TO_BROKER, session.conn_id, session.client, session.tracker)
    held = HoldQueue()
    verdict = session.decide(frame(api.CommandFlow(consumer_id=2, messagePermits=1000)), TO_BROKER, now_s=0)
    for later in verdict.deferred:
        if later.poll is not None:
            held.add_poll(int(later.after_s * 1e9), TO_BROKER, later.poll)
        else:  # (a grant fixed when the FLOW came)
            held.add(int(later.after_s * 1e9), TO_BROKER, [later.data])
    released = sum(released_permits(held, tick * 10_000_000) for tick in range(1, 101))
    assert 45 <= released <= 51
    session.decide(frame(api.CommandCloseConsumer(consumer_id=2, request_id=7)), TO_CLIENT)
    after = sum(released_permits(held, tick * 10_000_000) for tick in range(101, 301))
    assert after <= 3 and not held  # at most what was paid for before its poll saw it closed


SHARED_FLOW_THROTTLE = """\
rules:
  - name: shared
    match: {command: [FLOW]}
    action: {throttle: {messages_per_second: 50}}
"""


@pytest.mark.parametrize(("replacement", "paced_at"), [
    ("rules: []\n", None),                                                    # removed: the held permits go
    (SHARED_FLOW_THROTTLE.replace("50}", "200}"), 200),                       # a new rate paces them
    (SHARED_FLOW_THROTTLE.replace("50}", "200, per: consumer}"), None),       # other buckets: they go
    (SHARED_FLOW_THROTTLE.replace("[FLOW]", "[SEND]"), None),                 # no longer on FLOW: they go
], ids=["removed", "new-rate", "new-per", "send-only"])
def test_a_flow_throttle_replaced_or_removed_at_run_time_no_longer_paces_by_its_old_rate(
        replacement: str, paced_at: int | None) -> None:
    """Two consumers wait on a shared 50/s bucket; a hot reload removes the rule (or replaces it): the permits
    it holds back go out at each consumer's next poll, or are paced by the replacing rule's rate."""
    engine = engine_for(SHARED_FLOW_THROTTLE)
    sessions = [Session(engine, conn_id=conn_id) for conn_id in (1, 2)]
    for session in sessions:
        session.add_consumer()
        engine.connection_interest(TO_BROKER, session.conn_id, session.client, session.tracker)
    consumers = TwoConsumers([(sessions[0], 2), (sessions[1], 2)])
    consumers.flow(0, 0.0)
    consumers.flow(1, 0.0)
    now_s = consumers.run(1.0, 0.0)
    granted = consumers.granted
    assert 45 <= sum(granted) <= 51
    engine.replace(load_rules_text(replacement, "test.yaml"))
    before = list(granted)
    if paced_at is None:
        consumers.run(now_s + 0.11, now_s)  # (a poll every 0.1 s)
        assert granted == [1000, 1000] and not consumers.held[0] and not consumers.held[1]
        assert engine.permits_held(1) == engine.permits_held(2) == {}
    else:
        now_s = consumers.run(now_s + 1.0, now_s)
        shares = [granted[0] - before[0], granted[1] - before[1]]
        assert 0.9 * paced_at <= sum(shares) <= 1.05 * paced_at, shares
        assert all(0.4 * paced_at <= share <= 0.6 * paced_at for share in shares), shares  # still split
        assert engine.permits_held(1) == {2: 1000 - granted[0]}  # (what GET /connections shows)


def test_a_poll_of_a_shared_flow_bucket_costs_no_more_with_thousands_of_consumers_waiting() -> None:
    """A poll pays the lanes it serves, not every lane waiting: with 2000 consumers on one bucket a poll
    costs about what it costs with 50 (it used to walk every waiting lane each time: quadratic in all)."""
    def seconds_per_poll(lanes: int, polls: int = 4000) -> float:
        share = FairShare(TokenBucket(1000, 1, 0))
        waiting = [share.request(lane, 10**9, 0)[1] for lane in range(lanes)]
        interval_ns = int(share.interval_s * 1e9)
        started = time.perf_counter()
        for index in range(polls):  # each lane polled every interval, the polls spread over it
            lane = index % lanes
            lane_waiting = waiting[lane]
            assert lane_waiting is not None
            share.poll(lane, lane_waiting, (index // lanes + 1) * interval_ns + lane * interval_ns // lanes)
        return (time.perf_counter() - started) / polls

    few = min(seconds_per_poll(50) for _ in range(3))
    many = min(seconds_per_poll(2000) for _ in range(3))
    assert many < 3 * few, (many, few)


def test_replace_keeps_counters_of_unchanged_rules_only() -> None:
    engine = engine_for("""\
seed: 3
rules:
  - name: keep
    match: {command: [PING]}
    action: mark
  - name: change
    match: {command: [PING]}
    action: record
""")
    session = Session(engine)
    for _ in range(3):
        session.decide(frame(api.CommandPing()), TO_BROKER)
    engine.replace(load_rules_text("""\
seed: 3
rules:
  - name: new
    action: {mark: {}}
  - name: change
    match: {command: [PING, PONG]}
    action: record
  - name: keep
    match: {command: [PING]}
    action: mark
"""))
    assert engine.hits() == {"new": 0, "change": 0, "keep": 3}
    assert [rule.name for rule in engine.rules] == ["new", "change", "keep"]
    engine.add(load_rules_text("rules:\n  - name: extra\n    action: drop\n").rules[0])
    with pytest.raises(ValueError, match="already exists"):
        engine.add(engine.rules[0])
    assert engine.remove("keep") and not engine.remove("keep")
    assert engine.interest(TO_BROKER) is None


def test_the_hook_hands_the_engines_verdict_to_the_relay_as_it_is() -> None:
    """One decision type from engine to relay: frames stay addressed by side, nothing translates them."""
    from proxy.core.hooks import ConnectionInfo, FrameContext
    from proxy.rules.hook import RulesHook

    session = one_rule("{error: {code: ServiceNotReady}}", "{command: [LOOKUP]}")
    lookup = frame(api.CommandLookupTopic(topic=TOPIC, request_id=5))
    info = ConnectionInfo(session.conn_id, session.client or "127.0.0.1:1", "127.0.0.1:6650", None)
    verdict = RulesHook(session.engine).on_frame(FrameContext(info, TO_BROKER, session.now_ns, None), lookup)
    assert type(verdict) is Verdict
    assert not verdict.forward and verdict.fired == ("r",) and len(verdict.to_client) == 1 and not verdict.to_broker
    session = one_rule("close", "{command: [MESSAGE]}")
    verdict = session.decide(message_frame(2), TO_CLIENT)
    assert verdict.forward and verdict.fired == ("r",) and len(verdict.to_broker) == 1 and not verdict.to_client
    assert RulesHook(session.engine).on_frame(FrameContext(info, TO_BROKER, 0, None), frame(api.CommandPing())) \
        is FORWARD


def test_rules_are_visited_only_for_their_direction_and_command_and_criteria_once_per_fact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """100 rules for other topics: each frame looks up which rules meet their criteria, once per topic."""
    lines = ["seed: 1", "rules:"]
    for index in range(100):
        command = ["SEND", "SEND_RECEIPT", "MESSAGE", "FLOW"][index % 4]
        direction = "to_broker" if command in ("SEND", "FLOW") else "to_client"
        lines += [f"  - name: r{index}",
                  f"    match: {{command: [{command}], direction: {direction}, topic: 'nomatch-{index}-*'}}",
                  "    action: drop"]
    session = Session(engine_for("\n".join(lines) + "\n"))
    session.add_producer()
    calls = 0
    real = criteria_met

    def counting(match: Match, commands: frozenset[int] | None, facts: FrameFacts) -> bool:
        nonlocal calls
        calls += 1
        return real(match, commands, facts)

    monkeypatch.setattr(engine_module, "criteria_met", counting)
    for sequence_id in range(200):
        assert session.decide(send_frame(1, sequence_id), TO_BROKER) is FORWARD
        # the wrong direction: no rule is even looked at
        assert session.engine.evaluate(frame(api.CommandSendReceipt(producer_id=1, sequence_id=sequence_id)),
                                       TO_BROKER, 0) is FORWARD
    assert calls == 25  # the 25 SEND rules, tried once for TOPIC
    assert session.engine.interest(TO_BROKER) == frozenset({T.SEND, T.FLOW})
    assert session.engine.interest(TO_CLIENT) == frozenset({T.SEND_RECEIPT, T.MESSAGE})


def test_after_and_times_still_count_every_match_when_criteria_are_remembered() -> None:
    session = Session(engine_for(
        "seed: 1\nrules:\n  - name: r\n    match: {command: [SEND], topic: 'persistent://public/default/orders-*',"
        " after: 2, times: 3}\n    action: drop\n"))
    session.add_producer(1, TOPIC)
    session.add_producer(3, OTHER_TOPIC)
    dropped = []
    for sequence_id in range(10):
        for producer_id in (1, 3):
            decision = session.decide(send_frame(producer_id, sequence_id), TO_BROKER)
            dropped.append((producer_id, sequence_id, not decision.forward))
    assert [(p, s) for p, s, gone in dropped if gone] == [(1, 2), (1, 3), (1, 4)]
    assert session.engine.hits() == {"r": 3}


def test_replacing_the_rules_forgets_the_remembered_criteria() -> None:
    session = Session(engine_for("seed: 1\nrules:\n  - name: r\n    match: {command: [SEND], topic: 'x-*'}\n"
                                 "    action: drop\n"))
    session.add_producer()
    assert session.decide(send_frame(1, 0), TO_BROKER) is FORWARD
    session.engine.replace(load_rules_text(
        "seed: 1\nrules:\n  - name: r\n    match: {command: [SEND], topic: 'persistent://public/default/orders-*'}\n"
        "    action: drop\n"))
    assert not session.decide(send_frame(1, 1), TO_BROKER).forward


def test_answers_to_the_proxys_close_requests_stay_of_interest_after_the_close_rule_goes() -> None:
    session = one_rule("close", "{command: [SEND]}")
    decision = session.decide(send_frame(1, 0), TO_BROKER)
    request_id = decode(decision.to_broker[0]).close_producer.request_id
    session.engine.replace(load_rules_text("seed: 1\nrules: []\n"))
    assert T.SUCCESS in (session.engine.interest(TO_CLIENT) or ())
    assert not session.engine.evaluate(frame(api.CommandSuccess(request_id=request_id)), TO_CLIENT, 0,
                                       conn_id=1).forward
