"""Rule patterns run on RE2, in time linear in the text: no client-chosen topic can stall the proxy.

Issue #12, item 4: ``topic: {regex: "(a+)+$"}`` was accepted, and a LOOKUP for
``"a" * 28 + "!"`` blocked the event loop 10.7 s (x4 per two more characters).
"""

from __future__ import annotations

import fnmatch
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.cli import main
from proxy.rules.loader import load_rules_text
from proxy.rules.model import TextPattern


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging when a match backtracks (the old engine: hours for this text)."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"a match ran for more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("regex", ["(a+)+$", "(a|a)*$", "(a|aa)+$", "(.*a){20}"])
def test_a_catastrophic_pattern_matches_in_linear_time(regex: str) -> None:
    ruleset = load_rules_text(f"rules:\n  - {{name: r, match: {{topic: {{regex: '{regex}'}}}}, action: drop}}\n")
    pattern = ruleset.rules[0].match.topic
    assert pattern is not None
    with deadline(5):
        assert not pattern.matches("a" * 40 + "!")
        assert pattern.matches("a" * 40)


@pytest.mark.parametrize(("regex", "reason"), [
    (r"(a)\1", "invalid escape sequence"),
    ("(?=a)b", "invalid perl operator"),
    ("a++", "bad repetition operator"),
    ("((", "missing )"),
])
def test_rules_check_names_file_line_and_key_of_a_pattern_re2_cannot_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], regex: str, reason: str) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(f"rules:\n  - name: r\n    match:\n      topic: {{regex: '{regex}'}}\n    action: drop\n")
    assert main(["rules", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:4: rules[0].match.topic.regex: bad regular expression ")
    assert reason in err and len(err.splitlines()) == 1


def test_re2_writes_nothing_of_its_own_on_stderr(tmp_path: Path) -> None:
    """RE2 logs refused patterns to stderr by default; the one-line error must stay alone."""
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - {name: r, match: {topic: {regex: '(a)\\1'}}, action: drop}\n")
    done = subprocess.run([sys.executable, "-m", "proxy", "rules", "check", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr


GLOB_CHARS = "ab/-.*?[]!^\\"


@given(st.text(GLOB_CHARS, max_size=8), st.text("ab/-.[]!^\\", max_size=8))
@settings(max_examples=500, deadline=None)
def test_globs_match_as_fnmatch_matches(glob: str, text: str) -> None:
    if glob.count("[") != glob.count("]"):
        return
    try:
        pattern = TextPattern.of_glob(glob)
    except ValueError:
        return  # a reversed range such as [b-*] is refused, not silently dropped
    assert pattern.matches(text) == fnmatch.fnmatchcase(text, glob)


def test_common_topic_globs() -> None:
    pattern = TextPattern.of_glob("persistent://public/default/orders-*")
    assert pattern.matches("persistent://public/default/orders-1")
    assert pattern.matches("persistent://public/default/orders-")
    assert not pattern.matches("persistent://public/default/order")
    assert TextPattern.of_glob("t?-[0-9]").matches("t1-5")
    assert TextPattern.of_glob("*").matches("any\nthing")
