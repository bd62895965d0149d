"""A watched rule file: a valid change is put in force (counters kept), an invalid one is ignored."""

from __future__ import annotations

import functools
from pathlib import Path

import trio
from rules_helpers import TO_BROKER, Session, frame

from proxy.pb import PulsarApi_pb2 as api
from proxy.rules.engine import RulesEngine
from proxy.rules.loader import load_rules_file
from proxy.rules.reload import RuleFileWatch
from proxy.server.rule_watch import watch_rule_file

FIRST = "seed: 2\nrules:\n  - name: tag\n    match: {command: [PING]}\n    action: mark\n"
SECOND = FIRST + "  - name: drop-pings\n    match: {command: [PING]}\n    action: drop\n"


async def test_watched_file_reloads_valid_changes_and_ignores_invalid_ones(tmp_path: Path) -> None:
    """Each change is waited for by the watcher's own report of its poll, never by a sleep.

    (Real time, not autojump_clock: the watcher reads the file in a thread, and a virtual
    clock jumps to the test's deadline while a thread works.)
    """
    path = tmp_path / "chaos.yaml"
    path.write_text(FIRST)
    engine = RulesEngine(load_rules_file(path))
    session = Session(engine)
    assert session.decide(frame(api.CommandPing()), TO_BROKER).forward
    send, receive = trio.open_memory_channel[bool | None](100)  # polls while the test waits: few
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(watch_rule_file, path, engine, 0.02, polled=send.send_nowait))
        with trio.fail_after(5):
            assert await receive.receive() is None  # the watcher looked: nothing changed
        path.write_text(SECOND)
        with trio.fail_after(5):
            while (outcome := await receive.receive()) is None:
                pass
        assert outcome is True
        assert len(engine.rules) == 2
        assert engine.hits() == {"tag": 1, "drop-pings": 0}
        assert not session.decide(frame(api.CommandPing()), TO_BROKER).forward
        path.write_text(SECOND.replace("action: drop", "action: {delay: {ms: -1}}"))
        with trio.fail_after(5):
            while (outcome := await receive.receive()) is None:
                pass
        assert outcome is False  # the watcher saw the change, and refused it
        assert [rule.name for rule in engine.rules] == ["tag", "drop-pings"]
        assert engine.hits() == {"tag": 2, "drop-pings": 1}
        nursery.cancel_scope.cancel()


def test_a_watch_reloads_only_what_changed_and_keeps_the_old_rules_for_a_bad_change(tmp_path: Path) -> None:
    """The watcher's decisions, with no task and no clock: each poll's digest in, an outcome out."""
    path = tmp_path / "chaos.yaml"
    path.write_text(FIRST)
    engine = RulesEngine(load_rules_file(path))
    watch = RuleFileWatch(path, engine)
    watch.start(watch.read_digest())
    assert watch.saw(watch.read_digest()) is None  # unchanged
    path.write_text(SECOND)
    assert watch.saw(watch.read_digest()) is True
    assert [rule.name for rule in engine.rules] == ["tag", "drop-pings"]
    assert watch.saw(watch.read_digest()) is None  # seen already
    path.write_text(SECOND.replace("action: drop", "action: {delay: {ms: -1}}"))
    assert watch.saw(watch.read_digest()) is False
    assert [rule.name for rule in engine.rules] == ["tag", "drop-pings"]
    path.unlink()
    assert watch.read_digest() is None and watch.saw(None) is None  # unreadable: nothing changes
    path.write_text(FIRST)
    assert watch.saw(watch.read_digest()) is True
    assert [rule.name for rule in engine.rules] == ["tag"]
