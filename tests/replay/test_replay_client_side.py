"""Client-side replay's account and diff, with no broker: outcomes in, DIFF lines out."""

from __future__ import annotations

from pathlib import Path

from proxy.replay.client_side import ReplayScore, load_conversations, steps_in_order
from proxy.replay.conversation import OK, UNANSWERED

SAMPLE = Path(__file__).resolve().parents[2] / "recordings" / "sample"


def test_steps_come_in_capture_order_across_connections() -> None:
    conversations, _ = load_conversations(str(SAMPLE))
    steps = list(steps_in_order(conversations))
    assert len(steps) == sum(len(conv.steps) for conv in conversations.values())
    times = [step.ts_ns for _, step in steps]
    assert times == sorted(times)


def test_only_a_different_outcome_is_a_diff_and_a_stopped_replay_compares_only_what_it_issued() -> None:
    conversations, _ = load_conversations(str(SAMPLE))
    exchanges = [e for conv in sorted(conversations.values(), key=lambda c: c.conn) for e in conv.exchanges
                 if not e.proxy_handled and e.outcome == OK]
    assert len(exchanges) > 2
    score = ReplayScore(conversations)
    for conv in conversations.values():
        for exchange in conv.exchanges:
            score.issued(exchange)
            score.answered(exchange, exchange.outcome)
    assert score.diffs() == []
    changed = exchanges[1]
    score.answered(changed, "error:ServiceNotReady")
    [diff] = score.diffs()
    assert (diff.command, diff.recorded, diff.replayed) == (changed.command, OK, "error:ServiceNotReady")
    assert diff.format().startswith(f"DIFF conn={diff.conn} {changed.command} topic=")

    stopped = ReplayScore(conversations)
    stopped.result.stopped = True
    stopped.issued(exchanges[0])  # issued, never answered: unanswered
    assert [(d.recorded, d.replayed) for d in stopped.diffs()] == [(OK, UNANSWERED)]
    assert stopped.result.requests == 1
