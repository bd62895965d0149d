"""AdminClient and ``pulsar-tap rules list|add|rm|reset`` against a live tap's admin API (loopback only).

The taps here front an address where nothing listens: the admin API needs no broker.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.testing import (
    AdminClient,
    AdminUnauthorized,
    AdminUnreachable,
    InvalidRule,
    RuleConflict,
    RuleNotFound,
    Tap,
    delay,
    error,
)

NOWHERE = "pulsar://127.0.0.1:1"


@pytest.fixture(scope="module")
def module_tap() -> Iterator[Tap]:
    with Tap(NOWHERE, seed=7) as tap:
        yield tap


@pytest.fixture
def tap(module_tap: Tap) -> Iterator[Tap]:
    yield module_tap
    module_tap.reset()


@pytest.fixture(scope="module")
def locked_tap() -> Iterator[Tap]:
    with Tap(NOWHERE, token="let-me-in") as tap:
        yield tap


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_rules_round_trip_through_the_admin_api(tap: Tap) -> None:
    admin = AdminClient(tap.admin_url)
    assert admin.healthy()
    added = admin.add_rule(error("ServiceNotReady").on("PRODUCER").times(2), name="refuse")
    assert (added.name, added.action_name, added.hits) == ("refuse", "error", 0)
    admin.add_rule({"name": "slow", "action": {"delay": {"ms": 5}}})
    assert [r.name for r in admin.rules()] == ["refuse", "slow"]
    assert admin.rule("slow").match["direction"] == "any"  # normalised, defaults filled in
    assert admin.hits() == {"refuse": 0, "slow": 0}
    assert admin.seed() == 7
    admin.remove_rule("refuse")
    assert [r.name for r in admin.rules()] == ["slow"]
    replaced = admin.replace_rules([delay(ms=1).named("a"), delay(ms=2).named("b")])
    assert [r.name for r in replaced] == ["a", "b"]
    assert admin.seed() == 7  # replacing without a seed keeps it
    admin.reset()
    assert admin.rules() == []
    assert admin.connections() == []
    assert "pulsar_tap_rule_hits_total" in admin.metrics()


def test_refusals_are_typed_with_one_line_messages(tap: Tap) -> None:
    admin = AdminClient(tap.admin_url.removeprefix("http://"))  # HOST:PORT works too
    admin.add_rule(delay(ms=1).named("taken"))
    with pytest.raises(RuleConflict) as conflict:
        admin.add_rule(delay(ms=2).named("taken"))
    assert conflict.value.status == 409 and "already exists" in str(conflict.value)
    with pytest.raises(RuleNotFound) as missing:
        admin.remove_rule("nope")
    assert missing.value.status == 404
    with pytest.raises(InvalidRule) as invalid:
        admin.add_rule({"name": "bad", "match": {"colour": "red"}, "action": {"delay": {"ms": "soon"}}})
    assert invalid.value.status == 400
    assert len(invalid.value.errors) == 2
    assert any("match.colour" in e for e in invalid.value.errors)
    assert any("action.delay.ms" in e for e in invalid.value.errors)
    with pytest.raises(AdminUnreachable, match=r"cannot reach the admin API at http://127\.0\.0\.1:"):
        AdminClient(f"127.0.0.1:{_free_port()}", timeout=2).rules()
    with pytest.raises(ValueError, match="not an admin URL"):
        AdminClient("ftp://x:1")


def test_a_token_is_required_when_the_tap_has_one(locked_tap: Tap) -> None:
    with pytest.raises(AdminUnauthorized) as refused:
        AdminClient(locked_tap.admin_url).rules()
    assert refused.value.status == 401
    with pytest.raises(AdminUnauthorized):
        AdminClient(locked_tap.admin_url, token="wrong").rules()
    assert AdminClient(locked_tap.admin_url, token="let-me-in").rules() == []
    assert locked_tap.rules() == []  # the tap's own client carries the token
    assert AdminClient(locked_tap.admin_url).healthy()  # /healthz needs none


# -- the CLI ------------------------------------------------------------------------------------------------
def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["rules", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_add_list_rm_reset(tap: Tap, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    admin = ["--admin", tap.admin_url]
    status, out, _ = _cli(capsys, "add", *admin, "--name", "slow", "delay", "ms=200", "jitter_ms=50",
                          "--command", "send_receipt", "--topic", "orders-*")
    assert status == 0 and out.startswith("added rule slow: delay ms=200 jitter_ms=50")
    assert tap.admin.rule("slow").match["topic"] == "persistent://public/default/orders-*"
    status, out, _ = _cli(capsys, "add", *admin, "error", "code=ServiceNotReady", "--command", "PRODUCER",
                          "--times", "2")
    assert status == 0
    generated = out.split()[2].rstrip(":")
    assert generated.startswith("error-")
    status, out, _ = _cli(capsys, "list", *admin)
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "seed 7, 2 rules"
    assert lines[1].split() == ["NAME", "ACTION", "MATCH", "HITS"]
    assert lines[2].startswith("slow ") and lines[2].rstrip().endswith(" 0")
    assert "command=PRODUCER" in lines[3] and "times=2" in lines[3]
    status, out, _ = _cli(capsys, "list", *admin, "--json")
    assert [r["name"] for r in json.loads(out)["rules"]] == ["slow", generated]
    status, out, _ = _cli(capsys, "rm", *admin, "slow")
    assert (status, out) == (0, "removed rule slow\n")
    rule_file = tmp_path / "chaos.yaml"
    rule_file.write_text("seed: 3\nrules:\n  - name: a\n    action: drop\n  - name: b\n    action: {delay: {ms: 1}}\n")
    status, out, _ = _cli(capsys, "reset", *admin, "--file", str(rule_file))
    assert (status, out) == (0, f"2 rules of {rule_file} in force\n")
    assert [r.name for r in tap.rules()] == ["a", "b"] and tap.admin.seed() == 3
    status, out, _ = _cli(capsys, "reset", *admin)
    assert (status, out) == (0, "removed 2 rules\n")
    status, out, _ = _cli(capsys, "add", *admin, "--file", str(rule_file))
    assert (status, out) == (0, "added rule a\nadded rule b\n")


@pytest.mark.parametrize(("args", "expected"), [
    (["rm", "ghost"], "pulsar-tap rules rm: error: 404 no rule named 'ghost'"),
    (["add", "--name", "dup", "drop"], "pulsar-tap rules add: error: 409 a rule named 'dup' already exists"),
    (["add", "delay", "ms=soon"], "pulsar-tap rules add: error: 400 action.delay.ms: must be a number"),
    (["add", "wobble"], "pulsar-tap rules add: error: 400 action.wobble: unknown action 'wobble'"),
], ids=["404", "409", "400-param", "400-action"])
def test_cli_refusals_are_one_line_with_exit_2(tap: Tap, capsys: pytest.CaptureFixture[str], args: list[str],
                                               expected: str) -> None:
    tap.admin.add_rule(delay(ms=1).named("dup"))
    status, out, err = _cli(capsys, args[0], "--admin", tap.admin_url, *args[1:])
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith(expected), err


def test_cli_unreachable_and_unauthorized(locked_tap: Tap, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    port = _free_port()
    status, _, err = _cli(capsys, "list", "--admin", f"127.0.0.1:{port}")
    assert status == 2
    assert err == f"pulsar-tap rules list: error: cannot reach the admin API at http://127.0.0.1:{port}: " \
                  "Connection refused\n"
    status, _, err = _cli(capsys, "list", "--admin", locked_tap.admin_url)
    assert (status, err) == (2, "pulsar-tap rules list: error: 401 missing or wrong bearer token "
                                "(give --token-file)\n")
    token = tmp_path / "token"
    token.write_text("let-me-in\n")
    status, out, _ = _cli(capsys, "list", "--admin", locked_tap.admin_url, "--token-file", str(token))
    assert (status, out) == (0, "seed " + str(locked_tap.admin.seed()) + ", 0 rules\n")
    status, _, err = _cli(capsys, "list", "--admin", locked_tap.admin_url, "--token-file", str(tmp_path / "none"))
    assert status == 2 and err.startswith("pulsar-tap rules list: error: --token-file ") and "cannot read" in err


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                          tmp_path: Path) -> None:
    monkeypatch.delenv("PULSAR_TAP_ADMIN", raising=False)
    status, _, err = _cli(capsys, "list")
    assert (status, err) == (2, "pulsar-tap rules: error: give --admin HOST:PORT (or set $PULSAR_TAP_ADMIN)\n")
    status, _, err = _cli(capsys, "add", "--admin", "127.0.0.1:9")
    assert status == 2 and "give ACTION" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - name: x\n    action: {delay: {ms: -1}}\n")
    status, _, err = _cli(capsys, "reset", "--admin", "127.0.0.1:9", "--file", str(bad))
    assert status == 2 and err.startswith(f"{bad}:3: rules[0].action.delay.ms:")


def test_rules_check_still_validates_files(capsys: pytest.CaptureFixture[str]) -> None:
    rule_file = Path(__file__).resolve().parents[2] / "rules" / "demo.yaml"
    status, out, _ = _cli(capsys, "check", str(rule_file))
    assert status == 0 and out.endswith("rules OK\n")
