"""Rules cost only where they can fire: per-connection interest and draws made before decoding.

A rule scoped to a topic looks only at the data-path frames of connections with a
producer or consumer on that topic; a probability rule that needs nothing of the frame
has its hits drawn before decoding.  These tests drive one pipeline with the rules
hook, without sockets, and check that the rules still fire on exactly what they match:
a producer registering later (even in the same read as its SENDs), a rule set
replaced on a live connection, the rate and the reproducibility of seeded draws, and
reads split anywhere.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_proxy_pipeline import connected, pipeline, rules_hook, sent

from proxy.core.hooks import ConnectionInfo, FrameEvent
from proxy.core.interest import ConnectionInterest
from proxy.core.pipeline import ConnectionPipeline, Send
from proxy.core.scanner import FrameScanner
from proxy.errors import ProtocolError
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, FrameDecoder, encode_command, encode_payload_command
from proxy.protocol.session import Direction, SessionTracker
from proxy.rules.engine import RulesEngine, RuleState
from proxy.rules.hook import RulesHook
from proxy.rules.loader import load_rules_text
from proxy.rules.sampling import RuleSampler, SampleDraw

T = api.BaseCommand.Type
TO_BROKER, TO_CLIENT = Direction.TO_BROKER, Direction.TO_CLIENT
WATCHED = "persistent://public/default/watched"
OTHER = "persistent://public/default/other"

DROP_WATCHED_SENDS = f"""\
seed: 1
rules:
  - name: watched
    match: {{command: [SEND], topic: '{WATCHED}'}}
    action: drop
"""


def producer(producer_id: int, topic: str) -> bytes:
    return encode_command(api.CommandProducer(topic=topic, producer_id=producer_id, request_id=100 + producer_id))


def send(producer_id: int, sequence_id: int) -> bytes:
    return encode_payload_command(api.CommandSend(producer_id=producer_id, sequence_id=sequence_id),
                                  api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1),
                                  b"payload")


def sends(producer_id: int, first: int, count: int) -> bytes:
    return b"".join(send(producer_id, sequence_id) for sequence_id in range(first, first + count))


def forwarded_sequence_ids(data: bytes) -> list[int]:
    decoder = FrameDecoder()
    decoder.feed(data)
    return [frame.command.send.sequence_id for frame in decoder.frames() if frame.type == T.SEND]


class CountingHook(RulesHook):
    """The rules hook, counting the frames the relay showed it."""

    def __init__(self, text: str) -> None:
        super().__init__(rules_hook(text).engine)
        self.shown = 0

    def on_frame(self, ctx, frame):  # type: ignore[no-untyped-def]
        self.shown += 1
        return super().on_frame(ctx, frame)


def test_sends_of_a_connection_with_no_producer_on_the_rules_topic_pass_through_undecoded() -> None:
    hook = CountingHook(DROP_WATCHED_SENDS)
    p = pipeline(hook=hook)
    connected(p)
    p.receive(TO_BROKER, producer(1, OTHER), 0)
    data = sends(1, 0, 50)
    assert p.receive(TO_BROKER, data, 0) == [Send(TO_BROKER, [data])]  # one slice of the read: nothing looked at
    assert hook.shown == 0


def test_a_producer_registered_later_on_the_rules_topic_has_its_sends_matched() -> None:
    """The connection streamed without the rule looking; a producer on its topic arrives later."""
    p = pipeline(hook=rules_hook(DROP_WATCHED_SENDS))
    connected(p)
    p.receive(TO_BROKER, producer(1, OTHER), 0)
    assert forwarded_sequence_ids(sent(p.receive(TO_BROKER, sends(1, 0, 20), 0), TO_BROKER)) == list(range(20))
    p.receive(TO_BROKER, producer(2, WATCHED), 0)
    mixed = sends(1, 20, 5) + sends(2, 0, 5) + sends(1, 25, 5)
    assert forwarded_sequence_ids(sent(p.receive(TO_BROKER, mixed, 0), TO_BROKER)) == list(range(20, 30))
    assert p.hook is not None and p.hook.engine.hits() == {"watched": 5}  # type: ignore[attr-defined]


@pytest.mark.parametrize("chunk", [None, 1, 9, 50])
def test_sends_in_the_same_read_as_their_producers_registration_are_matched(chunk: int | None) -> None:
    """PRODUCER and its SENDs in one read (or split anywhere): the SENDs after the registration are looked at."""
    p = pipeline(hook=rules_hook(DROP_WATCHED_SENDS))
    connected(p)
    data = producer(1, OTHER) + sends(1, 0, 3) + producer(2, WATCHED) + sends(2, 0, 4) + sends(1, 3, 2)
    step = chunk or len(data)
    out = b"".join(sent(p.receive(TO_BROKER, data[start:start + step], 0), TO_BROKER)
                   for start in range(0, len(data), step))
    assert forwarded_sequence_ids(out) == [0, 1, 2, 3, 4]
    assert out.startswith(producer(1, OTHER))


def test_a_rule_set_replaced_on_a_live_connection_applies_to_its_next_frames() -> None:
    hook = rules_hook("seed: 1\nrules: []\n")
    p = pipeline(hook=hook)
    connected(p)
    p.receive(TO_BROKER, producer(1, WATCHED), 0)
    assert forwarded_sequence_ids(sent(p.receive(TO_BROKER, sends(1, 0, 5), 0), TO_BROKER)) == list(range(5))
    hook.engine.replace(load_rules_text(DROP_WATCHED_SENDS))
    assert forwarded_sequence_ids(sent(p.receive(TO_BROKER, sends(1, 5, 5), 0), TO_BROKER)) == []
    assert hook.engine.remove("watched")
    assert forwarded_sequence_ids(sent(p.receive(TO_BROKER, sends(1, 10, 5), 0), TO_BROKER)) == list(range(10, 15))


def test_a_receipt_rule_follows_the_producer_named_by_the_broker() -> None:
    """A producer_name criterion met only once PRODUCER_SUCCESS names the producer."""
    hook = rules_hook("seed: 1\nrules:\n  - name: r\n    match: {command: [SEND_RECEIPT], producer_name: given-*}\n"
                      "    action: drop\n")
    p = pipeline(hook=hook)
    connected(p)
    p.receive(TO_BROKER, producer(1, OTHER), 0)
    receipts = b"".join(encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=i)) for i in range(3))
    success = encode_command(api.CommandProducerSuccess(request_id=101, producer_name="given-7"))
    out = sent(p.receive(TO_CLIENT, success + receipts, 0), TO_CLIENT)
    assert out == success  # the receipts in the same read as the name are matched, and dropped
    assert hook.engine.hits() == {"r": 3}


SAMPLED = """\
seed: {seed}
rules:
  - name: one-in-a-hundred
    match: {{command: [SEND], probability: 0.01{extra}}}
    action: drop
"""


def run_sends(text: str, count: int, *, chunk: int | None = None, verify: bool = False,
              batch: int = 1000) -> tuple[list[int], CountingHook, ConnectionPipeline]:
    """Sequence ids of ``count`` SENDs the rule dropped, read ``batch`` frames at a time or ``chunk`` bytes."""
    hook = CountingHook(text)
    p = pipeline(hook=hook, verify=verify)
    connected(p)
    p.receive(TO_BROKER, producer(1, OTHER), 0)
    out = bytearray()
    for first in range(0, count, batch):
        data = sends(1, first, min(batch, count - first))
        step = chunk or len(data)
        for start in range(0, len(data), step):
            out += sent(p.receive(TO_BROKER, data[start:start + step], 0), TO_BROKER)
    forwarded = set(forwarded_sequence_ids(bytes(out)))
    return [i for i in range(count) if i not in forwarded], hook, p


def test_a_one_percent_rule_fires_at_its_rate_and_only_the_frames_it_fires_on_are_decoded() -> None:
    dropped, hook, _ = run_sends(SAMPLED.format(seed=7, extra=""), 30_000)
    assert 210 <= len(dropped) <= 390  # 300 expected; 5 standard deviations either way
    assert hook.engine.hits() == {"one-in-a-hundred": len(dropped)}
    assert hook.shown == len(dropped)


def test_seeded_draws_repeat_and_another_seed_draws_others() -> None:
    first, _, _ = run_sends(SAMPLED.format(seed=7, extra=""), 5000)
    again, _, _ = run_sends(SAMPLED.format(seed=7, extra=""), 5000)
    other, _, _ = run_sends(SAMPLED.format(seed=8, extra=""), 5000)
    assert first == again and first != other


def test_draws_do_not_depend_on_how_the_bytes_were_read_or_on_frames_decoded_anyway() -> None:
    """Split reads (frames carried across them) and SENDs decoded for checksums count each frame once."""
    text = SAMPLED.format(seed=3, extra="").replace("0.01", "0.05")
    whole, _, _ = run_sends(text, 1500)
    verified, _, _ = run_sends(text, 1500, verify=True)
    assert whole and whole == verified
    for chunk in (1, 7, 37, 4099):
        assert run_sends(text, 1500, chunk=chunk)[0] == whole, chunk


def test_after_and_times_still_hold_for_drawn_rules() -> None:
    dropped, hook, _ = run_sends(SAMPLED.format(seed=5, extra=", after: 400, times: 3").replace("0.01", "0.2"),
                                 3000, batch=100)
    assert len(dropped) == 3 and min(dropped) >= 400
    assert hook.engine.hits() == {"one-in-a-hundred": 3}
    assert hook.shown < 700  # the first 400 (after) were looked at, then only the draws until times ran out


def test_a_drawn_rule_and_a_topic_rule_on_the_same_frames_each_fire_as_they_match() -> None:
    """A producer on the topic rule's topic registers mid-stream: both rules go on firing."""
    text = SAMPLED.format(seed=11, extra="").replace("action: drop", "action: mark") + \
        f"  - name: watched\n    match: {{command: [SEND], topic: '{WATCHED}'}}\n    action: drop\n"
    hook = rules_hook(text)
    p = pipeline(hook=hook)
    connected(p)
    p.receive(TO_BROKER, producer(1, OTHER), 0)
    p.receive(TO_BROKER, sends(1, 0, 5000), 0)
    marked = hook.engine.hits()["one-in-a-hundred"]
    assert 15 <= marked <= 85 and hook.engine.hits()["watched"] == 0
    out = sent(p.receive(TO_BROKER, producer(2, WATCHED) + sends(2, 0, 50) + sends(1, 5000, 5000), 0), TO_BROKER)
    assert forwarded_sequence_ids(out) == list(range(5000, 10_000))
    hits = hook.engine.hits()
    assert hits["watched"] == 50 and 30 <= hits["one-in-a-hundred"] <= 170


def test_frames_a_rule_only_marks_leave_in_the_same_write_as_the_rest_of_their_read() -> None:
    hook = rules_hook("seed: 1\nrules:\n  - name: every-third\n    match: {command: [SEND], probability: 0.3}\n"
                      "    action: {mark: {label: some}}\n")
    p = pipeline(hook=hook)
    connected(p)
    data = sends(1, 0, 100)
    actions = p.receive(TO_BROKER, data, 0)
    assert len(actions) == 1 and isinstance(actions[0], Send) and sent(actions, TO_BROKER) == data
    assert hook.engine.hits()["every-third"] > 10


#: the SENDs (of 2000) a 2 % rule with seed 7 fires on: pinned, so that a change of how draws are
#: made (or counted) shows; the same before and after hits were settled without the frame
SEED_7_AT_2_PERCENT = [16, 22, 60, 64, 116, 144, 257, 294, 296, 312, 390, 454, 499, 533, 682, 706, 731, 778, 814,
                       839, 885, 1021, 1124, 1204, 1275, 1337, 1358, 1539, 1549, 1563, 1596, 1674, 1716, 1773, 1802,
                       1851, 1929, 1932, 1946]


def test_a_seed_fires_a_drawn_rule_on_the_same_frames_as_ever() -> None:
    dropped, hook, _ = run_sends(SAMPLED.format(seed=7, extra="").replace("0.01", "0.02"), 2000)
    assert dropped == SEED_7_AT_2_PERCENT
    assert hook.shown == len(dropped)


def marked_sequence_ids(observed: bool, count: int = 2000) -> tuple[list[int], CountingHook, list[Send]]:
    """The SENDs a 2 % ``mark`` rule (seed 7) fired on, read one per ``receive``; with ``observed`` an
    observer takes the frame events (their ``fired``), else only the rule's hit count tells."""
    hook = CountingHook(SAMPLED.format(seed=7, extra="").replace("0.01", "0.02").replace("action: drop",
                                                                                            "action: mark"))
    events: list[object] = []
    p = pipeline(hook=hook, events=events if observed else None)
    connected(p)
    p.receive(TO_BROKER, producer(1, OTHER), 0)
    marked: list[int] = []
    writes: list[Send] = []
    for sequence_id in range(count):
        data = send(1, sequence_id)
        before = hook.engine.hits()["one-in-a-hundred"]
        actions = p.receive(TO_BROKER, data, 0)
        writes += [action for action in actions if isinstance(action, Send)]
        assert sent(actions, TO_BROKER) == data
        if hook.engine.hits()["one-in-a-hundred"] > before:
            marked.append(sequence_id)
    if observed:
        fired = [event.frame.command.send.sequence_id for event in events
                 if isinstance(event, FrameEvent) and event.fired]
        assert fired == marked
    return marked, hook, writes


def test_a_mark_rule_nobody_observes_counts_its_hits_on_the_same_frames_without_decoding_them() -> None:
    """Unobserved, a pick of a rule that only takes note is settled at the pick: same frames, nothing decoded."""
    settled, hook, writes = marked_sequence_ids(observed=False)
    assert settled == SEED_7_AT_2_PERCENT
    assert hook.shown == 0
    assert all(len(write.data) == 1 and not isinstance(write.data[0], Frame) for write in writes)  # the read, whole
    observed, _, _ = marked_sequence_ids(observed=True)  # (the frame events carry the marks)
    assert observed == SEED_7_AT_2_PERCENT


@pytest.mark.parametrize("times", [3, 5])
def test_a_settled_mark_rule_still_stops_at_times_in_reads_split_anywhere(times: int) -> None:
    """(Seed 7 picks 5 SENDs of the first row of one size, 4 of them settled at once.)"""
    text = SAMPLED.format(seed=7, extra=f", times: {times}").replace("0.01", "0.02").replace("action: drop",
                                                                                              "action: mark")
    data = sends(1, 0, 2000)
    for chunk in (37, 4099, len(data)):  # picks carried across reads too, and many in one row
        hook = CountingHook(text)
        p = pipeline(hook=hook)
        connected(p)
        p.receive(TO_BROKER, producer(1, OTHER), 0)
        out = b"".join(sent(p.receive(TO_BROKER, data[start:start + chunk], 0), TO_BROKER)
                       for start in range(0, len(data), chunk))
        assert out == data
        assert hook.engine.hits() == {"one-in-a-hundred": times} and hook.shown == 0


def test_a_settled_mark_rule_counts_its_hits_on_the_same_frames_in_rows_of_one_size() -> None:
    """Many SENDs of one size per read (checked as rows): after every read the hits are those of the
    pinned frames read so far, as when the SENDs came one per read, however the rows are cut."""
    text = SAMPLED.format(seed=7, extra="").replace("0.01", "0.02").replace("action: drop", "action: mark")
    frames = [send(1, sequence_id) for sequence_id in range(2000)]  # two sizes: sequence ids of 1 and 2 bytes
    for batch in (7, 37, 128, 129, 500, 2000):
        hook = CountingHook(text)
        p = pipeline(hook=hook)
        connected(p)
        p.receive(TO_BROKER, producer(1, OTHER), 0)
        for first in range(0, len(frames), batch):
            data = b"".join(frames[first:first + batch])
            actions = p.receive(TO_BROKER, data, 0)
            assert len(actions) == 1 and sent(actions, TO_BROKER) == data  # the read, whole
            read = first + len(frames[first:first + batch])
            assert hook.engine.hits()["one-in-a-hundred"] == sum(1 for i in SEED_7_AT_2_PERCENT if i < read), batch
        assert hook.shown == 0
        state = next(hook.engine.states())
        assert state.matches == state.hits  # each pick a match, as when evaluated


def scanned_by(reads: list[tuple[bytes, bool]]) -> tuple[bytes, list[int], int, int]:
    """What a scanner with a 2 % sampler (seed 7) makes of ``reads``, each with whether the picks in it
    can be settled (as the engine's cannot while the connection unloads): the bytes it let through, the
    frames it handed out (sequence ids, each with the sampler's note), the picks it counted and the
    frames it scanned."""
    rule = load_rules_text(SAMPLED.format(seed=7, extra="").replace("0.01", "0.02")).rules[0]
    counted = [0]
    settling = [True]

    def settle(draw: SampleDraw, picks: int) -> bool:
        assert draw.due and picks >= 0  # (0: asked only whether picks can be settled now)
        if settling[0]:
            counted[0] += picks
        return settling[0]

    scanner = FrameScanner()
    scanner.set_wanted((), sampler=RuleSampler(frozenset({T.SEND}), (RuleState(rule, 7),), settle), settle=True)
    passed = bytearray()
    handed: list[int] = []
    for data, settling[0] in reads:
        for piece in scanner.feed(data):
            if isinstance(piece, Frame):
                assert isinstance(piece.draw, SampleDraw) and piece.draw.due
                handed.append(piece.command.send.sequence_id)
                passed += piece.raw
            else:
                passed += piece
    return bytes(passed), handed, counted[0], scanner.frames_scanned


def reads_of(frames: list[bytes], per_read: int, every: int, split: int | None = None) -> list[tuple[bytes, bool]]:
    """``frames`` in reads of ``per_read`` frames (cut again every ``split`` bytes, or each frame its own
    read with ``split`` 0); the picks of every ``every``-th read cannot be settled."""
    reads: list[tuple[bytes, bool]] = []
    for index, first in enumerate(range(0, len(frames), per_read)):
        settles = index % every != every - 1
        group = frames[first:first + per_read]
        if split == 0:
            reads += [(frame, settles) for frame in group]
            continue
        data = b"".join(group)
        step = split or len(data)
        reads += [(data[start:start + step], settles) for start in range(0, len(data), step)]
    return reads


@pytest.mark.parametrize("every", [1, 2, 3, 1000])
def test_picks_that_cannot_be_settled_end_their_rows_with_their_frames_as_frame_by_frame(every: int) -> None:
    """Rows cut at any pick the sampler does not settle: the same frames handed out, the same picks
    counted, every byte passed in order, as when each frame is read alone."""
    frames = [send(1, sequence_id) for sequence_id in range(3000)]
    data = b"".join(frames)
    passed, handed, counted, scanned = scanned_by(reads_of(frames, 250, every, split=0))
    assert passed == data and scanned == 3000
    assert 30 < counted + len(handed) < 100 and (handed == []) == (every == 1000) and (counted == 0) == (every == 1)
    for split in (None, 4099, 37):
        assert scanned_by(reads_of(frames, 250, every, split)) == (data, handed, counted, 3000), split


@pytest.mark.parametrize("at", [5, 60, 130, 900, "a pick handed out"])
def test_a_bad_frame_in_a_row_with_settled_picks_reports_the_decoders_error(at: int | str) -> None:
    """Also when the bad frame is a pick that ends its row (its command is checked with the row's)."""
    frames = [send(1, sequence_id) for sequence_id in range(1000)]
    if not isinstance(at, int):
        at = next(seq for seq in scanned_by(reads_of(frames, 1000, 1))[1] if seq > 140)
    spoilt = bytearray(frames[at])
    spoilt[spoilt.index(0x10, 12)] = 0x17  # sequence_id's tag made an undecodable wire type: still in its row
    frames[at] = bytes(spoilt)
    for every in (1, 1000):
        with pytest.raises(ProtocolError) as whole:
            scanned_by(reads_of(frames, 1000, every))
        with pytest.raises(ProtocolError) as single:
            scanned_by(reads_of(frames, 1000, every, split=0))
        assert str(whole.value) == str(single.value) and "undecodable SEND" in str(whole.value)


# -- receipts: a rule on SEND_RECEIPT with a topic sees every receipt of a producer on it -----------------
DROP_WATCHED_RECEIPTS = """\
seed: 1
rules:
  - name: receipts
    match: {command: [SEND_RECEIPT], topic: 'persistent://public/default/watch*'}
    action: drop
"""


def producer_success(producer_id: int) -> bytes:
    return encode_command(api.CommandProducerSuccess(request_id=100 + producer_id, producer_name=f"p-{producer_id}"))


def receipts(producer_ids: tuple[int, ...], first: int, count: int) -> list[bytes]:
    """Receipts of one size (three-byte sequence ids), the producers' in turn."""
    return [encode_command(api.CommandSendReceipt(producer_id=producer_id, sequence_id=(1 << 14) + sequence_id))
            for sequence_id in range(first, first + count) for producer_id in producer_ids]


def forwarded_receipts(data: bytes) -> list[tuple[int, int]]:
    decoder = FrameDecoder()
    decoder.feed(data)
    return [(frame.command.send_receipt.producer_id, frame.command.send_receipt.sequence_id - (1 << 14))
            for frame in decoder.frames() if frame.type == T.SEND_RECEIPT]


def receive_all(p: ConnectionPipeline, direction: Direction, frames: list[bytes], split: int | None) -> bytes:
    """``frames`` in one read (``split`` None), cut every ``split`` bytes, or each its own read (0)."""
    data = b"".join(frames)
    reads = frames if split == 0 else [data[start:start + (split or len(data))]
                                       for start in range(0, len(data), split or len(data))]
    return b"".join(sent(p.receive(direction, chunk, 0), direction) for chunk in reads)


def register(p: ConnectionPipeline, producer_id: int, topic: str) -> None:
    p.receive(TO_BROKER, producer(producer_id, topic), 0)
    p.receive(TO_CLIENT, producer_success(producer_id), 0)


def close_producer(p: ConnectionPipeline, producer_id: int) -> None:
    p.receive(TO_BROKER, encode_command(api.CommandCloseProducer(producer_id=producer_id, request_id=900)), 0)
    p.receive(TO_CLIENT, encode_command(api.CommandSuccess(request_id=900)), 0)


@pytest.mark.parametrize("split", [None, 37, 4099, 0], ids=["whole", "split-37", "split-4099", "frame-by-frame"])
def test_a_receipt_rule_on_a_producers_topic_fires_on_every_one_of_its_receipts(split: int | None) -> None:
    """Thousands of receipts of one size (rows), of a producer on the rule's topic and one on another:
    each of the first is dropped, each of the others forwarded, however the reads are cut."""
    hook = rules_hook(DROP_WATCHED_RECEIPTS)
    p = pipeline(hook=hook)
    connected(p)
    register(p, 1, WATCHED)
    register(p, 2, OTHER)
    out = receive_all(p, TO_CLIENT, receipts((1, 2), 0, 1500) + receipts((2,), 1500, 600) + receipts((1,), 1500, 600),
                      split)
    assert forwarded_receipts(out) == [(2, sequence_id) for sequence_id in range(2100)]
    assert hook.engine.hits() == {"receipts": 2100}


@pytest.mark.parametrize("split", [None, 4099, 0], ids=["whole", "split-4099", "frame-by-frame"])
def test_a_producer_id_registered_again_on_another_topic_has_its_receipts_judged_by_the_new_topic(
        split: int | None) -> None:
    """Other topic, then the rule's, then another again, under the same producer id."""
    hook = rules_hook(DROP_WATCHED_RECEIPTS)
    p = pipeline(hook=hook)
    connected(p)
    register(p, 1, OTHER)
    assert forwarded_receipts(receive_all(p, TO_CLIENT, receipts((1,), 0, 1000), split)) == \
        [(1, sequence_id) for sequence_id in range(1000)]
    close_producer(p, 1)
    register(p, 1, WATCHED)
    assert forwarded_receipts(receive_all(p, TO_CLIENT, receipts((1,), 1000, 1000), split)) == []
    close_producer(p, 1)
    register(p, 1, f"{OTHER}-again")
    assert forwarded_receipts(receive_all(p, TO_CLIENT, receipts((1,), 2000, 1000), split)) == \
        [(1, sequence_id) for sequence_id in range(2000, 3000)]
    assert hook.engine.hits() == {"receipts": 1000}


def test_a_client_reconnecting_has_its_new_producers_receipts_judged_afresh() -> None:
    """One rules engine, three connections in turn: on the rule's topic, on another, on the rule's again."""
    hook = rules_hook(DROP_WATCHED_RECEIPTS)
    forwarded = []
    for conn_id, topic in ((1, WATCHED), (2, OTHER), (3, WATCHED)):
        p = pipeline(hook=hook)
        p.info = replace(p.info, conn_id=conn_id)
        connected(p)
        register(p, 1, topic)
        forwarded.append(len(forwarded_receipts(receive_all(p, TO_CLIENT, receipts((1,), 0, 1000), None))))
        hook.connection_closed(conn_id)  # as the relay does when the connection ends
    assert forwarded == [0, 1000, 0]
    assert hook.engine.hits() == {"receipts": 2000}


SETTLED_AND_OTHERS = """\
seed: {seed}
rules:
  - name: elsewhere
    match: {{command: [SEND], topic: '{watched}'}}
    action: drop
  - name: sampled
    match: {{command: [SEND], probability: {probability:.3e}{times}}}
    action: {{mark: {{label: sampled}}}}
"""


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), probability=st.sampled_from([1e-300, 0.003, 0.02, 0.2, 0.7]),
       times=st.none() | st.integers(1, 40),
       groups=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 300)), min_size=1, max_size=6),
       cuts=st.lists(st.integers(1, 6000), min_size=1, max_size=25))
# (the spending pick cut across reads, the observed generator four draws on: frames 4 to 8 each drew)
@example(seed=0, probability=0.7, times=4, groups=[(0, 9)], cuts=[125])
def test_picks_settled_in_rows_draw_count_and_forward_as_the_frame_by_frame_path(
        seed: int, probability: float, times: int | None, groups: list[tuple[int, int]], cuts: list[int]) -> None:
    """Unobserved, a drawn ``mark`` rule's picks are settled in rows of one size (``settle_row``), read
    off one loop of draws; observed, every pick is handed out and evaluated alone (``choose``).  Over
    random rules, rows of random sizes and reads cut anywhere (mid-frame too), both forward the same
    bytes, count the same hits and leave the rule's generator at the same draw (a spent rule's aside, see
    below).  (Not the same matches: observed, the frames the sampler passes over are evaluated too, and
    counted as matches.)"""
    text = SETTLED_AND_OTHERS.format(seed=seed, watched=WATCHED, probability=probability,
                                     times=f", times: {times}" if times is not None else "")
    frames = [encode_payload_command(api.CommandSend(producer_id=1, sequence_id=index),
                                     api.MessageMetadata(producer_name="p", sequence_id=index, publish_time=1),
                                     b"x" * size)
              for index, (size, count) in enumerate(groups) for _ in range(count)]
    data = b"".join(frames)
    ends = sorted({min(cut * (index + 1), len(data)) for index, cut in enumerate(cuts)} | {len(data)})
    outcomes = []
    for observed in (False, True):
        hook = CountingHook(text)
        events: list[FrameEvent] = []
        p = pipeline(hook=hook, events=events if observed else None)
        connected(p)
        p.receive(TO_BROKER, producer(1, OTHER), 0)
        out = b"".join(sent(p.receive(TO_BROKER, data[start:end], 0), TO_BROKER)
                       for start, end in zip([0, *ends], ends, strict=False) if end > start)
        states = {state.rule.name: state for state in hook.engine.states()}
        sampled = states["sampled"]
        if observed:  # (every pick evaluated: its frame event names the rule)
            assert sum("sampled" in event.fired for event in events
                       if isinstance(event, FrameEvent) and event.direction is TO_BROKER) == sampled.hits
        else:
            assert hook.shown == 0
        outcomes.append((out, sampled.hits, sampled.rng, states["elsewhere"].matches))
    (settled_out, settled_hits, settled_rng, settled_matches), (out, hits, rng, matches) = outcomes
    assert settled_out == out == data
    assert (settled_hits, settled_matches) == (hits, matches)
    if times is not None and hits == times and settled_rng.getstate() != rng.getstate():
        # The pick that used up ``times`` was a frame cut across two reads: observed, it is counted
        # when the next read completes it, and that read's scan has drawn for the picks after it
        # already; settled, it was counted in the row before, and the rule (spent) left that read
        # alone.  A spent rule never draws for anything again: the observed one is on by at most a draw
        # for each frame after the spending pick (its ``times``-th, so no earlier than frame ``times``).
        ahead = random.Random()
        ahead.setstate(settled_rng.getstate())
        steps = 0
        while ahead.getstate() != rng.getstate():
            ahead.random()
            steps += 1
            assert steps <= len(frames) - times, "observed: more than a draw a frame past settled"
    else:
        assert settled_rng.getstate() == rng.getstate()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), probability=st.sampled_from([0.003, 0.02, 0.3]),
       counts=st.lists(st.integers(1, 1500), min_size=1, max_size=4))
def test_picks_counted_later_are_counted_when_their_connection_closes_first(
        seed: int, probability: float, counts: list[int]) -> None:
    """One engine, connections in turn, each closed after its SENDs: a ``mark`` rule's picks that its
    rows left uncounted (nobody observes) are counted all the same, as when every pick is evaluated."""
    text = f"seed: {seed}\nrules:\n  - name: sampled\n" \
           f"    match: {{command: [SEND], probability: {probability}}}\n    action: mark\n"
    outcomes = []
    for observed in (False, True):
        hook = CountingHook(text)
        for conn_id, count in enumerate(counts, start=1):
            events: list[FrameEvent] = []
            p = pipeline(hook=hook, events=events if observed else None)
            p.info = replace(p.info, conn_id=conn_id)
            connected(p)
            p.receive(TO_BROKER, producer(1, OTHER), 0)
            data = sends(1, 0, count)
            assert sent(p.receive(TO_BROKER, data, 0), TO_BROKER) == data
            hook.connection_closed(conn_id)  # as the relay does when the connection ends
        if not observed:
            assert hook.shown == 0
        state = next(iter(hook.engine.states()))
        outcomes.append((state.hits, state.rng.getstate()))
    assert outcomes[0] == outcomes[1]


class AskCountingHook(RulesHook):
    """The rules hook, counting how often a connection's interest is asked."""

    def __init__(self, text: str) -> None:
        super().__init__(RulesEngine(load_rules_text(text)))
        self.asked = 0

    def connection_interest(self, direction: Direction, info: ConnectionInfo,
                            session: SessionTracker | None) -> ConnectionInterest:
        self.asked += 1
        return super().connection_interest(direction, info, session)


def test_the_rules_are_asked_a_connections_interest_again_only_when_their_answer_can_change() -> None:
    """Once per direction at set-up; the handshake moving the session alone asks nothing (a reconnect storm
    paid for six asks a connection); a producer registering, or the rules changing, asks again."""
    hook = AskCountingHook(DROP_WATCHED_SENDS)
    p = pipeline(hook=hook)
    assert hook.asked == 2
    connected(p)
    assert hook.asked == 2
    p.receive(TO_BROKER, producer(1, WATCHED), 0)
    assert hook.asked == 4
    hook.engine.replace(load_rules_text(DROP_WATCHED_SENDS.replace("watched", "renamed", 1)))
    p.receive(TO_BROKER, sends(1, 0, 1), 0)
    assert hook.asked == 6
