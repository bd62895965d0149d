"""Built-in client vs the official client, against the same embedded broker, in the same run.

Starts ``pulsar-tap broker`` on a free loopback port (its own process), then for each
scenario runs ``pulsar-tap perf`` (the built-in client, its own process) and the
official ``pulsar-client`` doing the same work from this process, and prints one
table.  Publish latency is send to receipt; end-to-end latency is send to receive.

    .venv/bin/python bench/perf.py [--messages 20000] [--size 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pulsar

ROOT = Path(__file__).resolve().parent.parent
PULSAR_TAP = [sys.executable, "-m", "proxy"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_broker(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*PULSAR_TAP, "broker", "--listen", f"127.0.0.1:{port}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready:"):
        proc.kill()
        raise SystemExit(f"the embedded broker did not start: {line!r}")
    return proc


def builtin(url: str, mode: str, topic: str, messages: int, size: int, batching: bool) -> dict[str, Any]:
    cmd = [*PULSAR_TAP, "perf", mode, "--url", url, "--topic", topic, "--messages", str(messages),
           "--size", str(size), "--json", "--quiet", "--batching" if batching else "--no-batching"]
    if mode == "roundtrip":
        cmd += ["--subscription", "bench"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}

    def pick(q: float) -> float:
        return round(values[min(len(values) - 1, int(len(values) * q / 100))] * 1000, 3)

    return {"p50": pick(50), "p99": pick(99), "max": round(values[-1] * 1000, 3)}


def official(url: str, mode: str, topic: str, messages: int, size: int, batching: bool) -> dict[str, Any]:
    client = pulsar.Client(url, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    try:
        consumer = None
        if mode == "roundtrip":
            consumer = client.subscribe(topic, "bench", receiver_queue_size=1000)
        producer = client.create_producer(topic, batching_enabled=batching, max_pending_messages=1000,
                                          block_if_queue_full=True)
        body = bytes(size)
        latencies: list[float] = []
        lock = threading.Lock()
        done = threading.Event()
        e2e: list[float] = []

        def receive_all() -> None:
            assert consumer is not None
            for _ in range(messages):
                msg = consumer.receive(timeout_millis=30_000)
                e2e.append(time.time() - int.from_bytes(msg.data()[:8], "big") / 1e9)
                consumer.acknowledge(msg)

        reader = threading.Thread(target=receive_all) if consumer is not None else None
        start = time.perf_counter()
        if reader is not None:
            reader.start()
        for _ in range(messages):
            sent_at = time.perf_counter()
            payload = time.time_ns().to_bytes(8, "big") + body[8:]

            def callback(res: Any, msg_id: Any, sent_at: float = sent_at) -> None:
                with lock:
                    latencies.append(time.perf_counter() - sent_at)
                    if len(latencies) == messages:
                        done.set()

            producer.send_async(payload, callback)
        producer.flush()
        done.wait(60)
        produce_seconds = time.perf_counter() - start
        if reader is not None:
            reader.join(120)
        total_seconds = time.perf_counter() - start
        result: dict[str, Any] = {"produce": {"messages": len(latencies),
                                              "msg_per_sec": round(len(latencies) / produce_seconds, 1),
                                              "latency_ms": _percentiles(latencies)}}
        if consumer is not None:
            result["consume"] = {"messages": len(e2e), "msg_per_sec": round(len(e2e) / total_seconds, 1),
                                 "latency_ms": _percentiles(e2e)}
        return result
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    port = free_port()
    broker = start_broker(port)
    url = f"pulsar://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        for mode in ("produce", "roundtrip"):
            for batching in (True, False):
                for name, runner in (("built-in", builtin), ("official", official)):
                    topic = f"bench-{mode}-{'b' if batching else 'nb'}-{name}-{os.getpid()}"
                    result = runner(url, mode, topic, args.messages, args.size, batching)
                    rows.append({"client": name, "mode": mode, "batching": batching, **{
                        part: {k: result[part][k] for k in ("messages", "msg_per_sec", "latency_ms")}
                        for part in ("produce", "consume") if part in result}})
    finally:
        broker.terminate()
        broker.wait(10)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.messages} messages of {args.size} bytes, embedded broker at {url}")
    print(f"{'client':9} {'mode':9} {'batch':5} {'pub msg/s':>10} {'pub p50':>8} {'pub p99':>8} "
          f"{'e2e msg/s':>10} {'e2e p50':>8} {'e2e p99':>8}")
    for row in rows:
        pub, e2e = row["produce"], row.get("consume")
        line = (f"{row['client']:9} {row['mode']:9} {'on' if row['batching'] else 'off':5} "
                f"{pub['msg_per_sec']:>10} {pub['latency_ms']['p50']:>8} {pub['latency_ms']['p99']:>8}")
        if e2e:
            line += f" {e2e['msg_per_sec']:>10} {e2e['latency_ms']['p50']:>8} {e2e['latency_ms']['p99']:>8}"
        print(line)
    print("latencies in ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
