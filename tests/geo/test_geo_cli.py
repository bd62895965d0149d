"""Geo-replication as users run it: two ``pulsar-tap broker`` processes, flag errors, ``demo --geo``."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pulsar
import pytest

from proxy.cli import main

BROKER = [sys.executable, "-m", "proxy", "broker"]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_broker(name: str, port: int, remote: str, remote_port: int) -> subprocess.Popen[str]:
    process = subprocess.Popen([*BROKER, "--cluster", name, "--listen", f"127.0.0.1:{port}", "--deduplication",
                                "--replicate-to", f"{remote}=pulsar://127.0.0.1:{remote_port}",
                                "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().startswith("ready: listening on 127.0.0.1:")
    return process


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        _, errors = process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    assert process.returncode == 0, errors


def test_two_broker_processes_replicate_to_each_other() -> None:
    port_a, port_b = free_ports(2)
    a = start_broker("A", port_a, "B", port_b)
    b = start_broker("B", port_b, "A", port_a)
    client_a = pulsar.Client(f"pulsar://127.0.0.1:{port_a}")
    client_b = pulsar.Client(f"pulsar://127.0.0.1:{port_b}")
    try:
        topic = "persistent://public/default/cli-geo"
        on_a = client_a.subscribe(topic, "s", initial_position=pulsar.InitialPosition.Earliest)
        on_b = client_b.subscribe(topic, "s", initial_position=pulsar.InitialPosition.Earliest)
        for client, origin in ((client_a, "A"), (client_b, "B")):
            producer = client.create_producer(topic)
            for index in range(50):
                producer.send(f"{origin}{index}".encode())
            producer.close()
        for consumer in (on_a, on_b):
            got = []
            while len(got) < 100:
                message = consumer.receive(30_000)
                got.append(message.data().decode())
                consumer.acknowledge(message)
            assert sorted(got) == sorted([f"A{i}" for i in range(50)] + [f"B{i}" for i in range(50)])
            with pytest.raises(pulsar.Timeout):
                consumer.receive(500)
            assert [m for m in got if m[0] == "A"] == [f"A{i}" for i in range(50)]
    finally:
        client_a.close()
        client_b.close()
        stop(a)
        stop(b)


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicate-to", "B"], "--replicate-to: expected NAME=pulsar://HOST:PORT, got 'B'"),
    (["--cluster", "A", "--replicate-to", "A=pulsar://127.0.0.1:1"], "A is this cluster's own name"),
    (["--replicate-to", "B=http://x:1"], "bad service URL"),
    (["--replicate-to", "B=pulsar://x:1", "--replicate-to", "B=pulsar://y:1"], "cluster B given twice"),
    (["--replicate-to", "B=pulsar://x:1", "--snapshot-period", "1"], "--snapshot-period: must be at least 10 ms"),
])
def test_bad_replication_flags_give_one_clear_line(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["broker", *argv]) == 2
    errors = capsys.readouterr().err
    assert errors.count("\n") == 1 and message in errors


def test_help_documents_replication_and_its_backlog_policy() -> None:
    result = subprocess.run([*BROKER, "--help"], capture_output=True, text=True, timeout=30, check=False)
    for flag in ("--replicate-to", "--snapshot-period", "--replication-backlog", "--no-replicated-subscriptions"):
        assert flag in result.stdout
    assert "Backlog policy" in result.stdout and "pulsar.repl.<local>--><remote>" in result.stdout


def test_demo_geo_prints_the_lag_table_and_the_failover_position_error(tmp_path: Path) -> None:
    rules = tmp_path / "latency.yaml"
    rules.write_text("seed: 1\nrules:\n  - name: wan-latency\n    match: {command: [SEND], producer_name: "
                     "\"pulsar.repl.*\"}\n    action: {delay: {ms: 1000}}\n")
    done = subprocess.run([sys.executable, "-m", "proxy", "demo", "--geo", "--seconds", "6", "--rate", "100",
                           "--snapshot-period", "300", "--rules", str(rules), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=180, check=False)
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    table = out.split("replication lag on link A->B", 1)[1].split("\n\n", 1)[0]
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows and all(float(row[3]) >= 1.0 for row in rows), table  # p50 lag >= the 1 s delay
    assert sum(int(row[1].replace(",", "")) for row in rows) == 600
    assert "SNAPSHOT_REQUEST" in out and "SNAPSHOT_RESPONSE" in out
    failover = re.search(r"B resumed it at #([\d,]+): ([\d,]+) messages \(([\d.]+) s of traffic\) delivered again, "
                         r"none lost", out)
    assert failover is not None, out
    assert "rule hits" in out and "wan-latency" in out
    assert (tmp_path / "out" / "link-a-to-b").is_dir() and (tmp_path / "out" / "link-b-to-a").is_dir()


def test_demo_geo_stopped_by_a_signal_settles_and_reports_what_ran(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-m", "proxy", "demo", "--geo", "--seconds", "60", "--rate", "50",
                                "--snapshot-period", "200", "--out", str(tmp_path / "out")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("[") and "sent" in line and int(line.split("sent ")[1].split()[0]) > 100:
                break
        process.send_signal(signal.SIGINT)
        rest, errors = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, errors[-2000:]
    assert "Traceback" not in errors
    assert "stopped by a signal" in rest and "replication lag on link A->B" in rest and "failover:" in rest
