"""SIGINT and SIGTERM, sent to real ``pulsar-tap`` processes: the first stops the work and the command prints
what it has, a second one during shutdown changes nothing but speed, and no traceback ever shows (SPEC.md,
"Interrupts").  Also busy ports (one line naming the address), the upstream probe of ``run`` and
``perf consume --initial-position``."""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tap_process import ROOT, TapProcess, no_traceback

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.cli import main
from proxy.recording.reader import open_recordings
from proxy.testing import Tap, drop
from proxy.testing.rig import RecordingProxy

SIGINT, SIGTERM = signal.SIGINT, signal.SIGTERM
SAMPLE = str(ROOT / "recordings" / "sample")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port held by a listener here, whose port below is free: both below the kernel's ephemeral range
    (``ip_local_port_range``), so no process's ``--listen 127.0.0.1:0`` or outgoing connection can take the free one
    while the test's processes start side by side."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10_001, low), 200):
        with socket.socket() as below, socket.socket() as sock:
            try:
                below.bind(("127.0.0.1", port - 1))
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            below.close()
            sock.listen()
            yield port
            return
    raise AssertionError(f"no two free ports side by side below {low}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def started(*argv: str, ready: str = "^ready: listening on ", stream: str = "stdout") -> TapProcess:
    process = TapProcess(*argv)
    try:
        process.wait_for(ready, stream=stream)
    except BaseException:
        process.stop()
        raise
    return process


def stopped(process: TapProcess, *signals: int, timeout: float = 60.0) -> int:
    try:
        process.send(*signals)
        return process.finish(timeout)
    finally:
        process.stop()


@pytest.mark.parametrize("signals", [(SIGINT, SIGINT), (SIGTERM, SIGINT), (SIGTERM, SIGTERM)],
                         ids=["int-int", "term-int", "term-term"])
def test_run_stops_with_0_even_when_a_second_signal_arrives_during_the_drain(broker: ThreadedCluster,
                                                                            signals: tuple[int, int]) -> None:
    """An idle client keeps the drain waiting; the second signal (10 ms later, as `timeout` sends) cuts it."""
    process = started("run", "--listen", "127.0.0.1:0", "--upstream", broker.service_url)
    address = process.wait_for("^ready: listening on ").split()[-1]
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))):
        time.sleep(0.2)
        code = stopped(process, *signals)
    assert code == 0 and no_traceback(process)
    assert "signal received: draining" in process.stderr and "stopped:" in process.stderr


def test_run_says_when_stopped_what_it_served_each_rules_hits_and_what_it_recorded(broker: ThreadedCluster,
                                                                                 tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: slow-five\n    match: {command: [SEND], times: 5}\n"
                     "    action: {delay: {ms: 1}}\n  - name: never\n    match: {command: [SEEK]}\n"
                     "    action: drop\n")
    process = started("run", "--listen", "127.0.0.1:0", "--upstream", broker.service_url, "--rules", str(rules),
                      "--record", str(tmp_path / "rec"))
    address = process.wait_for("^ready: listening on ").split()[-1]
    assert main(["perf", "produce", "--url", f"pulsar://{address}", "--topic", "served", "--messages", "300",
                 "--no-batching", "--quiet"]) == 0
    assert stopped(process, SIGINT) == 0 and no_traceback(process)
    lines = process.stderr.splitlines()
    assert any(re.fullmatch(r"stopped: \d+ connections served", line) for line in lines), process.stderr
    assert "rule hits: slow-five 5, never 0" in lines, process.stderr
    recorded = next(line for line in lines if line.startswith("recorded: "))
    (path,) = (tmp_path / "rec").iterdir()
    frames = sum(1 for _ in open_recordings(path).frames())
    assert recorded == f"recorded: {frames} frames in {path}" and frames >= 600, (recorded, frames)


def test_broker_and_replay_serve_stop_with_0_on_two_quick_signals() -> None:
    broker = started("broker", "--listen", "127.0.0.1:0", "--brokers", "2")
    served = started("replay", SAMPLE, "--serve", "--listen", "127.0.0.1:0")
    assert stopped(broker, SIGINT, SIGINT) == 0 and no_traceback(broker)
    assert stopped(served, SIGTERM, SIGINT) == 0 and no_traceback(served)
    assert "replay: served 0 connections" in served.stderr


def test_replay_serve_counts_one_connection_in_the_singular() -> None:
    served = started("replay", SAMPLE, "--serve", "--listen", "127.0.0.1:0")
    host, port = served.wait_for("^ready: listening on ").split()[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.shutdown(socket.SHUT_WR)
        client.recv(1)  # the server closes it in turn: counted by then
    assert stopped(served, SIGINT) == 0 and no_traceback(served)
    assert "replay: served 1 connection: 0 requests answered from the recording" in served.stderr, served.stderr


@pytest.mark.parametrize("mode", ["produce", "consume", "roundtrip"])
def test_perf_prints_the_figures_so_far_on_a_signal(broker: ThreadedCluster, mode: str) -> None:
    argv = ["perf", mode, "--url", broker.service_url, "--topic", f"perf-{mode}", "--duration", "120", "--json"]
    if mode != "consume":
        argv += ["--rate", "200"]
    if mode != "produce":
        argv += ["--subscription", "s"]
    # a progress line: it is measuring (and, where it produces, has had a message acknowledged: under load the
    # first second may end before the first receipt)
    ready = r"^\s+\d+\.\ds \| " if mode == "consume" else r"^\s+\d+\.\ds \| produced .* total [1-9]"
    process = started(*argv, ready=ready, stream="stderr")
    assert stopped(process, SIGINT, SIGTERM) == 0 and no_traceback(process)
    summary = json.loads(process.stdout)
    assert summary["interrupted"] is True and summary["mode"] == mode
    part = summary["consume" if mode == "consume" else "produce"]
    assert 0 < part["seconds"] < 120 and (mode == "consume" or part["messages"] > 0)


def test_perf_counts_the_sends_a_second_signal_cuts_short_as_unfinished_not_as_errors(broker: ThreadedCluster) -> None:
    """The first signal waits for outstanding receipts; a second one (as `timeout` sends it) closes at once: the sends
    left without a receipt were cut short by the user, and the exit status stays 0."""
    with Tap(broker.service_url) as tap, tap.inject(drop().on("SEND_RECEIPT").after(5)):
        process = started("perf", "produce", "--url", tap.service_url, "--topic", "perf-cut", "--rate", "200",
                          "--duration", "120", "--json", ready=r"^\s+\d+\.\ds \| produced .* total [1-9]",
                          stream="stderr")
        time.sleep(0.3)  # (more sends waiting for the receipts the tap drops)
        assert stopped(process, SIGINT, SIGTERM) == 0 and no_traceback(process)
    part = json.loads(process.stdout)["produce"]
    assert part["errors"] == 0 and part["unfinished"] > 0 and part["messages"] >= 1


def test_perf_consume_reads_a_backlog_from_earliest_and_says_latest_is_the_default(broker: ThreadedCluster) -> None:
    produce = TapProcess("perf", "produce", "--url", broker.service_url, "--topic", "backlog", "--messages", "3000",
                         "--quiet", "--json")
    assert produce.finish() == 0 and json.loads(produce.stdout)["produce"]["messages"] == 3000
    latest = TapProcess("perf", "consume", "--url", broker.service_url, "--topic", "backlog", "--subscription",
                        "late", "--duration", "1", "--quiet", "--json")
    earliest = TapProcess("perf", "consume", "--url", broker.service_url, "--topic", "backlog", "--subscription",
                          "all", "--initial-position", "earliest", "--messages", "3000", "--quiet", "--json")
    assert latest.finish() == 0 and earliest.finish() == 0
    assert json.loads(latest.stdout)["consume"]["messages"] == 0
    assert json.loads(latest.stdout)["consume"]["config"]["initial_position"] == "latest"
    assert json.loads(earliest.stdout)["consume"]["messages"] == 3000
    helped = TapProcess("perf", "consume", "--help")
    assert helped.finish() == 0 and "(default latest)" in " ".join(helped.stdout.split())


@pytest.fixture
def paced_recording(broker: ThreadedCluster, tmp_path: Path) -> Path:
    """An official client publishing 30 messages 100 ms apart through the recording proxy (3 s of traffic)."""
    import pulsar

    with RecordingProxy(broker.service_url, tmp_path) as proxy:
        client = pulsar.Client(proxy.service_url, operation_timeout_seconds=10)
        try:
            producer = client.create_producer("paced", batching_enabled=False)
            for i in range(30):
                producer.send(b"paced %d" % i)
                time.sleep(0.1)
            producer.close()
        finally:
            client.close()
    return Path(proxy.recording_path)


def test_client_side_replay_shows_progress_and_prints_the_diff_so_far_on_a_signal(
        paced_recording: Path, broker_cluster: object) -> None:
    fresh = ThreadedCluster(ClusterConfig(brokers=1)).start()
    try:
        process = TapProcess("replay", str(paced_recording), "--upstream", fresh.service_url, "--speed", "0.2")
        process.wait_for(r"^replay: \[ *\d+\.\ds\] recorded time .* of .* requests replayed", stream="stderr")
        assert stopped(process, SIGINT) == 130 and no_traceback(process)
    finally:
        fresh.stop()
    assert "replay: stopping" in process.stderr
    process.wait_for(r"^replay: stopped by a signal after \d+ of \d+ requests: 0 differ so far", stream="stderr")


def test_demo_stops_its_traffic_on_a_signal_and_still_prints_its_summary_and_finishes_the_recording(
        tmp_path: Path) -> None:
    """``pulsar-tap demo`` with no arguments, stopped by SIGINT twice once traffic flows."""
    process = TapProcess("demo", cwd=tmp_path)
    try:
        process.wait_for(r"sent [1-9][\d,]*  received")
    except BaseException:
        process.stop()
        raise
    assert stopped(process, SIGINT, SIGINT, timeout=120) == 0 and no_traceback(process)
    assert "demo: stopped by a signal" in process.stdout and "latency through the proxy" in process.stdout
    (recording,) = (tmp_path / "pulsar-tap-demo").iterdir()
    assert f"recording: {recording.relative_to(tmp_path)}" in process.stdout
    assert open_recordings(recording).recordings[0].finished


def test_a_busy_port_is_one_line_naming_it(busy_port: int) -> None:
    busy = f"127.0.0.1:{busy_port}"
    cases = {  # argv, and the flag the error names
        "run --admin": (["run", "--listen", "127.0.0.1:0", "--upstream", "pulsar://127.0.0.1:1", "--admin", busy],
                        " (--admin)"),
        "run --listen": (["run", "--listen", busy, "--upstream", "pulsar://127.0.0.1:1"], ""),
        "broker --admin": (["broker", "--listen", "127.0.0.1:0", "--admin", busy], " (--admin)"),
        "broker --brokers": (["broker", "--listen", f"127.0.0.1:{busy_port - 1}", "--brokers", "2"],
                             " (broker 2 of --brokers)"),
        "replay --serve": (["replay", SAMPLE, "--serve", "--listen", busy], " (--listen)"),
    }
    processes = {name: (TapProcess(*argv), flag) for name, (argv, flag) in cases.items()}
    try:
        for name, (process, flag) in processes.items():
            code = process.finish()
            (line,) = process.lines["stderr"]
            assert code == 2 and no_traceback(process), (name, process.stderr)
            assert line.endswith(f"error: cannot listen on {busy}{flag}: Address already in use"), (name, line)
    finally:
        for process, _ in processes.values():
            process.stop()


def test_run_warns_of_an_unreachable_upstream_serves_anyway_and_reports_it_until_it_comes(tmp_path: Path) -> None:
    port = free_port()
    ready_file = tmp_path / "ready.json"
    process = started("run", "--listen", "127.0.0.1:0", "--upstream", f"pulsar://127.0.0.1:{port}", "--admin",
                      "127.0.0.1:0", "--ready-file", str(ready_file))
    try:
        warning = process.wait_for("upstream unreachable: serving anyway", stream="stderr")
        assert f"127.0.0.1:{port}" in warning and "Connection refused" in warning
        admin = json.loads(ready_file.read_text())["admin"]
        health = json.loads(urllib.request.urlopen(f"http://{admin}/healthz", timeout=10).read())
        assert health["status"] == "ok" and health["upstream"] == "unreachable"
        broker = ThreadedCluster(ClusterConfig(brokers=1), ports=[port]).start()
        try:
            process.wait_for("upstream reachable again", stream="stderr", timeout=30)
            health = json.loads(urllib.request.urlopen(f"http://{admin}/healthz", timeout=10).read())
            assert health["upstream"] == "reachable" and "upstream_error" not in health
        finally:
            broker.stop()
        assert stopped(process, SIGTERM) == 0 and no_traceback(process)
    finally:
        process.stop()


def test_pulsar_ssl_at_a_plaintext_broker_is_reported_as_a_tls_failure(broker: ThreadedCluster) -> None:
    address = broker.addresses[0]
    process = started("run", "--listen", "127.0.0.1:0", "--upstream", f"pulsar+ssl://{address}")
    warning = process.wait_for("upstream unreachable", stream="stderr", timeout=30)
    assert stopped(process, SIGINT) == 0 and no_traceback(process)
    assert "TLS" in warning and "is it a TLS port?" in warning, warning
