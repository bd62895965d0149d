"""``pulsar-tap perf`` against the embedded broker, and its one-line errors."""

from __future__ import annotations

import json

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
    summary = json.loads(out)
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
