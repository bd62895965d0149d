"""``pulsar-tap run --record DIR`` (a subprocess) records the official client; the result replays cleanly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pulsar

from proxy.broker.embedded import BrokerClusterFactory
from proxy.recording.reader import find_recordings, open_recordings

ROOT = Path(__file__).resolve().parents[2]


def test_run_with_record_flag_writes_a_recording_that_show_and_replay_read(
        broker_cluster: BrokerClusterFactory, tmp_path: Path) -> None:
    cluster = broker_cluster()
    ready = tmp_path / "ready.json"
    records = tmp_path / "records"
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "run", "--listen", "127.0.0.1:0", "--upstream", cluster.service_url,
         "--record", str(records), "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while not (ready.exists() and ready.read_text().endswith("\n")):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the proxy did not become ready"
            time.sleep(0.05)
        [address] = json.loads(ready.read_text())["listen"]
        client = pulsar.Client(f"pulsar://{address}", operation_timeout_seconds=10)
        try:
            producer = client.create_producer("persistent://public/default/run-record", batching_enabled=False)
            for i in range(5):
                producer.send(b"recorded %d" % i)
        finally:
            client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    [recording] = find_recordings(records)
    commands = [f.frame.type_name for f in open_recordings(recording).frames()]
    assert commands.count("SEND") == 5 and commands.count("SEND_RECEIPT") == 5
    replay = subprocess.run([sys.executable, "-m", "proxy", "replay", str(recording), "--upstream",
                             cluster.service_url, "--speed", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert replay.returncode == 0 and replay.stdout == "", replay.stdout + replay.stderr
