"""``pulsar-tap perf`` against the embedded broker, and its one-line errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.broker import ThreadedCluster
from proxy.cli import main


def test_perf_roundtrip_reports_throughput_and_latency_as_json(cluster: ThreadedCluster,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["perf", "roundtrip", "--url", cluster.service_url, "--topic", "perf-a", "--topic", "perf-b",
                   "--producers", "2", "--consumers", "2", "--messages", "3000", "--size", "200",
                   "--compression", "lz4", "--json", "--quiet"])
    out = capsys.readouterr().out
    assert status == 0
    summary = json.loads(out.splitlines()[-1])  # (the last line: the in-process broker's log lines may come first)
    assert summary["produce"]["messages"] == 3000 and summary["produce"]["errors"] == 0
    assert summary["consume"]["messages"] == 3000
    for part in ("produce", "consume"):
        latency = summary[part]["latency_ms"]
        assert 0 < latency["p50"] <= latency["p99"] <= latency["max"]
        assert summary[part]["msg_per_sec"] > 0


def test_perf_produce_prints_progress_and_a_summary_at_a_target_rate(cluster: ThreadedCluster,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["perf", "produce", "--url", cluster.service_url, "--topic", "perf-rate", "--rate", "1000",
                   "--duration", "1.5", "--no-batching"])
    captured = capsys.readouterr()
    assert status == 0
    assert "produced" in captured.err  # the live progress line
    assert "produce: " in captured.out and "publish latency ms" in captured.out
    count = int(captured.out.split("produce: ")[1].split()[0])
    assert 1000 <= count <= 1600


def test_perf_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["perf", "produce", "--url", "http://nowhere", "--topic", "t"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert main(["perf", "produce", "--url", "pulsar://127.0.0.1:1", "--topic", "t", "--messages", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pulsar-tap perf: error: cannot reach") and err.count("\n") == 1


def test_perf_says_while_its_producer_reconnects_and_counts_the_reconnections(
        cluster: ThreadedCluster, proxy_process: Callable[..., str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Through the proxy, a rule cuts the producer's connection mid-stream and refuses its re-creation four
    times (~1.5 s of backoff): the progress lines say the producer is reconnecting and why, the summary counts
    the reconnection, and nothing sent is lost."""
    rules = tmp_path / "cut.yaml"
    rules.write_text("rules:\n"
                     "  - name: cut\n    match: {command: [SEND], after: 300, times: 1}\n"
                     "    action: {disconnect: {how: reset}}\n"
                     "  - name: refuse\n    match: {command: [PRODUCER], after: 1, times: 4}\n"
                     "    action: {error: {code: ServiceNotReady, message: still loading}}\n")
    url = f"pulsar://{proxy_process(cluster.service_url, '--rules', str(rules))}"
    status = main(["perf", "produce", "--url", url, "--topic", "perf-cut", "--rate", "400", "--messages", "1600",
                   "--no-batching"])
    captured = capsys.readouterr()
    assert status == 0, captured
    reconnecting = [line for line in captured.err.splitlines() if "reconnecting:" in line]
    assert reconnecting and all("1 of 1 producer reconnecting: " in line for line in reconnecting), captured.err
    assert any("still loading" in line or "ServiceNotReady" in line for line in reconnecting), captured.err
    assert "produce: 1600 messages" in captured.out and "errors 0, reconnects 1" in captured.out, captured.out


def test_perf_roundtrip_counts_a_redelivery_once_and_waits_for_every_receipt(
        cluster: ThreadedCluster, proxy_process: Callable[..., str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A reset mid-stream cuts the connection the producer and the consumer share: the messages the consumer had
    received but not yet acknowledged come again.  They are counted as redelivered, not as messages, so the run
    ends with every message received once and every send acknowledged (it ended at the 2 000th delivery,
    duplicates included, with receipts outstanding)."""
    rules = tmp_path / "reset.yaml"
    rules.write_text("rules:\n  - name: reset\n    match: {command: [SEND], after: 300, times: 1}\n"
                     "    action: {disconnect: {how: reset}}\n")
    url = f"pulsar://{proxy_process(cluster.service_url, '--rules', str(rules))}"
    status = main(["perf", "roundtrip", "--url", url, "--topic", "perf-redelivered", "--subscription", "s",
                   "--rate", "1000", "--messages", "2000", "--no-batching", "--json", "--quiet"])
    # (the summary is the last line: the embedded broker runs in this process, and its log lines may come first)
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert status == 0
    produced, consumed = summary["produce"], summary["consume"]
    assert produced["messages"] == 2000 and produced["errors"] == 0 and produced["reconnects"] == 1, produced
    assert consumed["messages"] == 2000 and consumed["reconnects"] == 1, consumed
    assert consumed["redelivered"] > 0, consumed
