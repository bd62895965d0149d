"""Every sub-command as a new user meets it: no arguments, --help, a nonexistent input; every error at once in
configs and rule files; output paths checked before the work; show's filters and short topic names."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from tap_process import ROOT, TapProcess, no_traceback

from proxy.analytics.synthetic import write_synthetic_recording
from proxy.cli import build_parser, main

SAMPLE = str(ROOT / "recordings" / "sample")
MISSING = "/nonexistent/pulsar-tap"
PERF_MODES = ("produce", "consume", "roundtrip")

#: argv -> the documented exit status; every command with no arguments, --help, and a nonexistent input
WALK: list[tuple[list[str], int]] = [
    ([], 2), (["--help"], 0),
    (["rules"], 2), (["rules", "--help"], 0), (["rules", "check", "--help"], 0),
    (["rules", "check", f"{MISSING}/rules.yaml"], 2),
    (["demo", "--help"], 0), (["demo", "--rules", f"{MISSING}/rules.yaml"], 2),
    (["run"], 2), (["run", "--help"], 0), (["run", "-c", f"{MISSING}/proxy.yaml"], 2),
    (["broker", "--help"], 0), (["broker", "--auth-token", f"{MISSING}/token"], 2),
    (["show"], 2), (["show", "--help"], 0), (["show", MISSING], 2),
    (["export"], 2), (["export", "--help"], 0), (["export", MISSING, "--pcap", "/tmp/never.pcapng"], 2),
    (["replay"], 2), (["replay", "--help"], 0), (["replay", MISSING, "--upstream", "pulsar://127.0.0.1:1"], 2),
    (["replay", MISSING, "--serve", "--listen", "127.0.0.1:0"], 2),
    (["perf"], 2), (["perf", "--help"], 0), (["perf", "produce", "--help"], 0), (["perf", "consume", "--help"], 0),
    (["perf", "roundtrip", "--help"], 0),
    (["perf", "produce", "--url", "pulsar://127.0.0.1:1", "--topic", "t", "--messages", "1"], 2),
    (["analyze"], 2), (["analyze", "--help"], 0), (["analyze", MISSING, "--out", "/tmp/never-analysis"], 2),
]


def test_every_command_with_no_arguments_help_and_a_missing_input_exits_as_documented(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A missing input runs as a real process (in parallel); no arguments and --help, which argparse answers
    before any command code runs, in this process.  ``demo`` and ``broker`` with no arguments are a job and a
    server: see test_cli_signals.py and the test below."""
    missing_input = [(argv, code) for argv, code in WALK if len(argv) > 1 and "--help" not in argv]
    running = [(argv, code, TapProcess(*argv)) for argv, code in missing_input]
    try:
        _walk_in_process(missing_input, capsys)
        for argv, code, process in running:
            assert process.finish(120) == code, (argv, process.stdout[-2000:], process.stderr[-2000:])
            assert no_traceback(process), (argv, process.stderr)
            (line,) = process.lines["stderr"]  # one line, naming what is missing
            assert MISSING in line or "127.0.0.1:1" in line, (argv, line)
    finally:
        for _, _, process in running:
            process.stop()


def _walk_in_process(skip: list[tuple[list[str], int]], capsys: pytest.CaptureFixture[str]) -> None:
    for argv, code in WALK:
        if (argv, code) in skip:
            continue
        try:
            status = main(argv)
        except SystemExit as exc:
            status = int(exc.code or 0)
        out, err = capsys.readouterr()
        assert status == code, (argv, out, err)
        assert "Traceback" not in out + err, argv
        if code == 0:
            assert out.startswith("usage: pulsar-tap"), argv
            assert "exit status" in out or argv[0] == "analyze", argv  # analyze: the analytics engineer's
        elif argv:  # one line naming what is missing
            assert err.startswith(f"pulsar-tap {argv[0]}: error: ") and err.count("\n") == 1, (argv, err)
        else:  # plain pulsar-tap: the overview
            assert out.startswith("usage: pulsar-tap"), out


def test_every_help_has_a_description_examples_and_a_help_text_for_every_option() -> None:
    import argparse

    parser, _ = build_parser()
    seen = []

    def walk(sub: argparse.ArgumentParser, name: str) -> None:
        seen.append(name)
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child, child_parser in action.choices.items():
                    walk(child_parser, f"{name} {child}")
            elif action.option_strings and action.dest != "help":
                assert action.help, (name, action.option_strings)
        depth = name.count(" ")
        # every command, perf's modes and rules check carry examples and their exit statuses (analyze's help
        # is the analytics engineer's; rules list|add|rm|reset have theirs in `rules --help`)
        checked = depth == 1 or name in ("pulsar-tap rules check", *(f"pulsar-tap perf {m}" for m in PERF_MODES))
        if checked and name != "pulsar-tap analyze":
            assert "examples:" in (sub.description or ""), name
            assert sub.epilog and "exit status" in sub.epilog, name

    walk(parser, "pulsar-tap")
    assert "pulsar-tap perf consume" in seen and "pulsar-tap rules check" in seen


def test_every_rule_file_a_help_example_names_is_shipped() -> None:
    """A new user pastes the examples: the rules/*.yaml they name must be there."""
    import argparse
    import re

    parser, _ = build_parser()
    named: set[str] = set()

    def walk(sub: argparse.ArgumentParser) -> None:
        named.update(re.findall(r"rules/[\w.-]+\.yaml", sub.format_help()))
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child_parser in action.choices.values():
                    walk(child_parser)

    walk(parser)
    assert named, "no help example names a rule file"
    assert sorted(path for path in named if not (ROOT / path).is_file()) == []


def test_broker_with_no_arguments_serves_on_6650_or_names_the_busy_port() -> None:
    process = TapProcess("broker")
    try:
        deadline = time.monotonic() + 60
        while process.proc.poll() is None and not process.lines["stdout"] and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.proc.poll() is None:
            assert process.lines["stdout"] == ["ready: listening on 127.0.0.1:6650"]
            process.send(signal.SIGTERM)
            assert process.finish() == 0
        else:  # something else on this machine holds 6650
            assert process.finish() == 2
            assert process.lines["stderr"] == ["pulsar-tap broker: error: cannot listen on 127.0.0.1:6650 (--listen): "
                                               "Address already in use"]
        assert no_traceback(process)
    finally:
        process.stop()


def test_run_reports_every_error_of_a_config_each_with_file_line_and_key(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text("upstream: pulsar://127.0.0.1:6650\nrecorde: {dir: x}\nrecord:\n  max_segment_mb: -3\n"
                      "limits:\n  max_connections: many\n  speed: 3\n")
    assert main(["run", "-c", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{config}:2: recorde: unknown key (known keys: admin, advertise, allowed_brokers, broker_ports, limits, "
        "listen, lookup, record, rules, tls, tracing, upstream)",
        f"{config}:4: record.max_segment_mb: must be at least 1, not -3",
        f"{config}:6: limits.max_connections: must be an integer, not a string",
        f"{config}:7: limits.speed: unknown key (known keys: drain_seconds, keepalive_seconds, max_connections, "
        "max_frame_bytes, verify_checksums)",
    ]
    assert main(["run", "-c", str(config), "--listen", "nowhere"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "--listen: 'nowhere' is not HOST:PORT" and len(err) == 5


@pytest.mark.parametrize("text", ["", "# listen: 127.0.0.1:6650\n"], ids=["empty", "only-comments"])
def test_run_with_an_empty_config_names_its_first_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        text: str) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text(text)
    assert main(["run", "-c", str(config)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"{config}:1: upstream: is required"]  # was {config}:0


def test_rules_check_reports_a_repeated_name_with_the_other_errors_and_takes_several_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - name: a\n    action: drop\n  - name: a\n    match: {probability: 3}\n"
                   "    action: {delay: {ms: -1}}\n")
    good = ROOT / "rules" / "slow-broker.yaml"
    assert main(["rules", "check", str(good), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{good}: {out.split(': ')[1].split()[0]} rules OK"]
    assert err.splitlines() == [
        f"{bad}:4: rules[1].name: duplicate rule name 'a' (first used by rules[0])",
        f"{bad}:5: rules[1].match.probability: must be between 0 and 1, not 3",
        f"{bad}:6: rules[1].action.delay.ms: must be >= 0, not -1",
    ]
    assert main(["rules", "check", str(bad), str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"{tmp_path / 'absent.yaml'}: cannot read: " \
                                                       "No such file or directory"


@pytest.mark.parametrize(("where", "reason"), [
    ("missing-dir/out", "directory {tmp}/missing-dir does not exist"),
    ("a-file/out", "{tmp}/a-file is not a directory"),
    ("a-dir", "{tmp}/a-dir is a directory"),
])
def test_output_paths_are_checked_before_any_reading(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     where: str, reason: str) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    target = tmp_path / where
    expected = reason.format(tmp=tmp_path)
    assert main(["export", MISSING, "--pcap", str(target)]) == 2  # the output is refused before the input is read
    assert capsys.readouterr().err == f"pulsar-tap export: error: --pcap: {target}" + (
        f": {expected}\n" if "is a directory" not in expected else " is a directory\n")
    assert main(["show", SAMPLE, "--diagram", str(target)]) == 2
    assert "--diagram: " in capsys.readouterr().err


def test_an_interrupted_export_leaves_no_partial_file_and_keeps_the_old_one(tmp_path: Path) -> None:
    stats = write_synthetic_recording(tmp_path / "in", 16 * 1024 * 1024, connections=4)
    target = tmp_path / "out.pcapng"
    target.write_bytes(b"the previous capture")
    process = TapProcess("export", str(stats.path), "--pcap", str(target))
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.pcapng.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send(signal.SIGINT)
        assert process.finish() == 130 and no_traceback(process)
    finally:
        process.stop()
    assert process.lines["stderr"] == [f"pulsar-tap export: interrupted: {target} not written"]
    assert target.read_bytes() == b"the previous capture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out.pcapng"]


def test_show_filters_short_topic_names_time_range_and_ids(capsys: pytest.CaptureFixture[str]) -> None:
    def shown(*argv: str) -> list[dict[str, object]]:
        assert main(["show", SAMPLE, "--json", *argv]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    every = shown()
    full = shown("--topic", "persistent://public/default/sample-orders")
    assert full and shown("--topic", "sample-orders") == full == shown("--topic", "public/default/sample-orders")
    assert shown("--topic", "sample-*") == full
    first = int(str(every[0]["ts_ns"]))
    window = shown("--since", "+0.005s", "--until", str((first + 10_000_000) / 1e9))
    assert window and all(first + 5_000_000 <= int(str(f["ts_ns"])) < first + 10_000_000 for f in window)
    assert [f for f in every if first + 5_000_000 <= int(str(f["ts_ns"])) < first + 10_000_000] == window
    sends = shown("--sequence-id", "100")
    assert {f["command"] for f in sends} == {"SEND", "SEND_RECEIPT"}
    by_request = shown("--request-id", "1")
    assert by_request and all(dict(f["fields"])["request_id"] == 1 for f in by_request)  # type: ignore[call-overload]
    producer = shown("--producer-name", "standalone-0-*")
    assert {f["command"] for f in producer} >= {"PRODUCER_SUCCESS", "SEND", "SEND_RECEIPT", "MESSAGE"}
    assert main(["show", SAMPLE, "--since", "yesterday-ish"]) == 2
    assert "--since: bad time 'yesterday-ish'" in capsys.readouterr().err
