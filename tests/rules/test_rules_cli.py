"""``pulsar-tap rules check``, and every ready rule file in rules/ passes it and does what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
from rules_helpers import TO_BROKER, TO_CLIENT, Session, frame, send_frame

from proxy.cli import main
from proxy.core.holding import HoldQueue
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import frame_from_bytes
from proxy.rules.engine import RulesEngine
from proxy.rules.loader import load_rules_file

RULES_DIR = Path(__file__).resolve().parents[2] / "rules"
RULE_FILES = sorted(RULES_DIR.glob("*.yaml"))
T = api.BaseCommand.Type


def test_check_prints_every_error_on_stderr_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - name: a\n    match: {command: [SND]}\n    action: {delay: {ms: -1}}\n")
    assert main(["rules", "check", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [f"{bad}:3: rules[0].match.command[0]: unknown command type 'SND'",
                                f"{bad}:4: rules[0].action.delay.ms: must be >= 0, not -1"]


def test_check_summarises_a_valid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("rules:\n  - name: a\n    action: drop\n  - name: b\n    action: {delay: {ms: 5}}\n")
    assert main(["rules", "check", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: 2 rules OK\n"


def test_check_unreadable_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.yaml"
    assert main(["rules", "check", str(missing)]) == 2
    assert capsys.readouterr().err == f"{missing}: cannot read: No such file or directory\n"


def test_check_yaml_syntax_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("rules: [\n")
    assert main(["rules", "check", str(broken)]) == 1
    assert capsys.readouterr().err.startswith(f"{broken}:2: yaml: ")


def test_there_is_a_ready_file_for_each_scenario() -> None:
    assert {p.stem for p in RULE_FILES} >= {"slow-broker", "flaky-producer-creation", "topic-unload-storm",
                                            "consumer-throttling", "lossy-topic", "broken-lookups"}


@pytest.mark.parametrize("path", RULE_FILES, ids=[p.name for p in RULE_FILES])
def test_ready_file_passes_check_and_says_what_it_simulates(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "check", str(path)]) == 0
    assert capsys.readouterr().out.endswith("rules OK\n")
    # every file opens with a comment on what it simulates (demo.yaml: what the demo shows)
    assert path.read_text().startswith("# Simulates " if path.stem != "demo" else "# ")
    assert load_rules_file(path).seed is not None


def session_for(name: str) -> Session:
    session = Session(RulesEngine(load_rules_file(RULES_DIR / name)))
    session.add_producer(1, "persistent://public/default/orders")
    return session


def test_slow_broker_delays_receipts() -> None:
    decision = session_for("slow-broker.yaml").decide(frame(api.CommandSendReceipt(producer_id=1, sequence_id=0)),
                                                      TO_CLIENT)
    assert 0.15 <= decision.delay_s <= 0.25


def test_flaky_producer_creation_refuses_the_first_two() -> None:
    session = session_for("flaky-producer-creation.yaml")
    first = [session.decide(frame(api.CommandProducer(topic="persistent://public/default/t", producer_id=7,
                                                      request_id=i)), TO_BROKER) for i in range(2)]
    assert all(frame_type(d.to_client[0]) == T.ERROR for d in first)


def test_topic_unload_storm_closes_producers_sometimes() -> None:
    session = session_for("topic-unload-storm.yaml")
    session.add_producer(1, "persistent://public/default/orders")
    closes = 0
    for i in range(1000):
        decision = session.decide(send_frame(1, i), TO_BROKER)
        if decision.to_broker:  # an unload: the broker answers it, the client re-creates the producer
            closes += 1
            request_id = frame_from_bytes(decision.to_broker[0]).command.close_producer.request_id
            assert session.decide(frame(api.CommandSuccess(request_id=request_id)), TO_CLIENT).to_client
            session.decide(frame(api.CommandProducer(topic="persistent://public/default/orders", producer_id=1,
                                                     request_id=10_000 + i)), TO_BROKER)
    assert 5 <= closes <= 50


def test_consumer_throttling_rations_flow() -> None:
    session = session_for("consumer-throttling.yaml")
    session.add_consumer(2, "persistent://public/default/orders")
    decision = session.decide(frame(api.CommandFlow(consumer_id=2, messagePermits=1000)), TO_BROKER, now_s=0)
    assert decision.replacement is not None and frame_from_bytes(decision.replacement).command.flow.messagePermits == 1
    held = HoldQueue()
    for later in decision.deferred:
        assert later.poll is not None
        held.add_poll(int(later.after_s * 1e9), TO_BROKER, later.poll)
    released = [(tick / 10, frame_from_bytes(data).command.flow.messagePermits)
                for tick in range(1, 220) for entry in held.pop_due(tick * 100_000_000) for data in entry.frames]
    # the other 999 at 50/s: the last ones paid for at 19.98 s, sent at the next poll
    assert sum(permits for _, permits in released) == 999 and not held
    assert all(1 + sum(p for t, p in released if t <= at) <= 1 + 50 * at + 1e-6 for at, _ in released)
    assert released[-1][0] == pytest.approx(20.0)


def test_lossy_topic_only_touches_telemetry() -> None:
    session = session_for("lossy-topic.yaml")
    session.add_producer(3, "persistent://public/default/telemetry")
    receipts = [session.decide(frame(api.CommandSendReceipt(producer_id=3, sequence_id=i)), TO_CLIENT)
                for i in range(400)]
    assert any(not d.forward for d in receipts) and any(d.to_client for d in receipts)
    assert all(d.marks == ("lossy",) for d in receipts)
    assert not session.decide(frame(api.CommandSendReceipt(producer_id=1, sequence_id=0)), TO_CLIENT).fired


def test_broken_lookups_fail_three_times_then_delay() -> None:
    session = session_for("broken-lookups.yaml")
    lookups = [session.decide(frame(api.CommandLookupTopic(topic="persistent://public/default/x", request_id=i)),
                              TO_BROKER) for i in range(4)]
    failed = [api.BaseCommand.FromString(d.to_client[0][8:]).lookupTopicResponse.response for d in lookups[:3]]
    assert failed == [api.CommandLookupTopicResponse.Failed] * 3
    assert lookups[3].forward
    response = frame(api.CommandLookupTopicResponse(request_id=3, response=api.CommandLookupTopicResponse.Connect,
                                                    brokerServiceUrl="pulsar://127.0.0.1:6650"))
    assert session.decide(response, TO_CLIENT).delay_s == pytest.approx(0.5)


def frame_type(data: bytes) -> int:
    return api.BaseCommand.FromString(data[8:]).type
