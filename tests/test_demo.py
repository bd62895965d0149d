"""``pulsar-tap demo``: broker, proxy, rules, built-in client traffic and a recording, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_the_whole_product_and_leaves_a_readable_recording(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "proxy", "demo", "--seconds", "3", "--rate", "300",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "lost 0" in out
    # (progress before the first receipt says so, not a latency of 0.0 ms)
    assert "p50 0.0 ms  p99 0.0 ms" not in out
    assert "latency through the proxy" in out
    for rule in ("flaky-producer-creation", "slow-receipts", "one-unload", "mark-lookups"):
        assert rule in out
    hits = {line.split()[0]: int(line.split()[1].replace(",", "")) for line in out.splitlines()
            if line.startswith("  ") and line.split()[0] in ("flaky-producer-creation", "one-unload")}
    assert hits == {"flaky-producer-creation": 1, "one-unload": 1}
    (recording,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert f"recording: {recording}" in out
    shown = subprocess.run([sys.executable, "-m", "proxy", "show", str(recording), "--json"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr[-2000:]
    commands = {json.loads(line)["command"] for line in shown.stdout.splitlines()}
    assert {"CONNECT", "LOOKUP", "PRODUCER", "SEND", "SEND_RECEIPT", "SUBSCRIBE", "FLOW", "MESSAGE",
            "CLOSE_PRODUCER", "ERROR"} <= commands
    # the "try next" replay: a fresh broker answers every request the recorded brokers answered
    cluster = ThreadedCluster(ClusterConfig(brokers=1)).start()
    try:
        replayed = subprocess.run([sys.executable, "-m", "proxy", "replay", str(recording), "--upstream",
                                   cluster.service_url, "--speed", "0"], capture_output=True, text=True,
                                  timeout=180, cwd=ROOT)
    finally:
        cluster.stop()
    assert replayed.returncode == 0, replayed.stdout[-2000:] + replayed.stderr[-2000:]
    assert "DIFF" not in replayed.stdout
    assert "answered or swallowed by the proxy" in replayed.stderr


def test_demo_sample_mode_and_bad_arguments() -> None:
    done = subprocess.run([sys.executable, "-m", "proxy", "demo", "--seconds", "0"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip() == "pulsar-tap demo: error: --seconds, --rate and --size must be positive"
