"""``pulsar-tap broker`` as users run it: help, bad flags, ready lines, signals."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pulsar
import pytest

COMMAND = [sys.executable, "-m", "proxy", "broker"]


def test_help_documents_every_flag() -> None:
    result = subprocess.run([*COMMAND, "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0
    for flag in ("--listen", "--brokers", "--partitions", "--topic", "--cluster", "--admin", "--ready-file",
                 "--max-message-size", "--retention-mb", "--auth-token", "--keepalive", "--deduplication",
                 "--failover-delay-ms", "--namespaces"):
        assert flag in result.stdout
    assert "example" in result.stdout


def test_bad_flags_give_one_clear_line() -> None:
    for argv in (["--brokers", "x"], ["--listen", "nowhere"], ["--topic", "a=b"], ["--auth-token", "/nonexistent"],
                 ["--failover-delay-ms", "-1"], ["--namespaces", "public"]):
        result = subprocess.run([*COMMAND, *argv], capture_output=True, text=True, timeout=30, check=False)
        assert result.returncode == 2, argv
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "error" in lines[0], result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("argv", "delay_ms"), [([], 1000), (["--failover-delay-ms", "0"], 0),
                                                (["--failover-delay-ms", "250"], 250)])
def test_failover_delay_flag_reaches_the_cluster_config(argv: list[str], delay_ms: int) -> None:
    from proxy.cli.broker import build_config, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    config, _, _ = build_config(parser.parse_args(argv))
    assert config.failover_delay_ms == delay_ms  # type: ignore[attr-defined]


@pytest.mark.parametrize(("argv", "known"), [
    ([], None),
    (["--namespaces", "public/default, acme/orders"], frozenset({"public/default", "acme/orders"})),
])
def test_namespaces_flag_reaches_the_cluster_config(argv: list[str], known: frozenset[str] | None) -> None:
    from proxy.cli.broker import build_config, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    config, _, _ = build_config(parser.parse_args(argv))
    assert config.known_namespaces == known  # type: ignore[attr-defined]


def test_port_in_use_is_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*COMMAND, "--listen", f"127.0.0.1:{port}"], capture_output=True, text=True,
                                timeout=30, check=False)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "cannot listen" in result.stderr


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_ready_lines_ready_file_serving_and_clean_stop(tmp_path: Path, stop_signal: signal.Signals) -> None:
    ready_file = tmp_path / "ready.json"
    process = subprocess.Popen([*COMMAND, "--listen", "127.0.0.1:0", "--brokers", "2", "--topic", "orders=2",
                                "--admin", "127.0.0.1:0", "--ready-file", str(ready_file)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline().strip() for _ in range(3)]
        assert lines[0].startswith("ready: listening on 127.0.0.1:")
        assert lines[1].startswith("ready: listening on 127.0.0.1:")
        assert lines[2].startswith("admin: listening on http://127.0.0.1:")
        ready = json.loads(ready_file.read_text())
        assert sorted(ready["listen"]) == sorted(line.rsplit(" ", 1)[1] for line in lines[:2])
        assert ready["admin"].startswith("127.0.0.1:")
        client = pulsar.Client(f"pulsar://{ready['listen'][0]}", operation_timeout_seconds=5)
        try:
            assert len(client.get_topic_partitions("orders")) == 2
            consumer = client.subscribe("orders", "s")
            client.create_producer("orders").send(b"hi")
            assert consumer.receive(5000).data() == b"hi"
        finally:
            client.close()
        process.send_signal(stop_signal)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
