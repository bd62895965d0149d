"""Benchmark: the embedded broker's publish and dispatch throughput with the official client.

Starts ``pulsar-tap broker`` in a subprocess (so the client's threads and the broker
do not share one interpreter lock), then for each message size publishes N
messages asynchronously and flushes (publish throughput: until every receipt is
back), then consumes the backlog with an Exclusive subscription created beforehand
(dispatch throughput: from SUBSCRIBE until the last message is received).  Prints msgs/s and MB/s.

    .venv/bin/python bench/broker.py                       # 100 B and 10 KiB, batching on
    .venv/bin/python bench/broker.py --no-batching --messages 20000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pulsar

SIZES = (100, 10 * 1024)


def start_broker(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = workdir / "ready.json"
    process = subprocess.Popen([sys.executable, "-m", "proxy", "broker", "--listen", "127.0.0.1:0",
                                "--ready-file", str(ready), "--log-level", "warning"],
                               stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists() or not ready.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the broker did not start")
        time.sleep(0.05)
    return process, json.loads(ready.read_text())["listen"][0]


def run_size(client: pulsar.Client, size: int, count: int, batching: bool) -> dict[str, float]:
    topic = f"bench-{size}-{'batch' if batching else 'single'}-{time.monotonic_ns()}"
    # create the durable subscription first, but consume only after publishing, so
    # dispatch is measured on its own (a backlog read as fast as permits allow)
    client.subscribe(topic, "bench").close()
    producer = client.create_producer(topic, batching_enabled=batching, block_if_queue_full=True,
                                      max_pending_messages=5000, batching_max_publish_delay_ms=5,
                                      batching_max_messages=1000, batching_max_allowed_size_in_bytes=1 << 20)
    payload = os.urandom(size)
    failures: list[pulsar.Result] = []

    def done(result: pulsar.Result, _msg_id: pulsar.MessageId) -> None:
        if result != pulsar.Result.Ok:
            failures.append(result)

    start = time.perf_counter()
    for _ in range(count):
        producer.send_async(payload, done)
    producer.flush()
    publish_s = time.perf_counter() - start
    if failures:
        raise SystemExit(f"{len(failures)} sends failed: {failures[0]}")
    start = time.perf_counter()
    consumer = client.subscribe(topic, "bench", receiver_queue_size=5000)
    for _ in range(count):
        consumer.acknowledge(consumer.receive(30_000))
    dispatch_s = time.perf_counter() - start
    producer.close()
    consumer.close()
    return {"publish_msgs": count / publish_s, "publish_mb": count * size / publish_s / 1e6,
            "dispatch_msgs": count / dispatch_s, "dispatch_mb": count * size / dispatch_s / 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=0, help="messages per size (default 100000 / 10000)")
    parser.add_argument("--no-batching", action="store_true", help="one entry per message")
    args = parser.parse_args()
    batching = not args.no_batching
    with tempfile.TemporaryDirectory() as tmp:
        process, address = start_broker(Path(tmp))
        try:
            client = pulsar.Client(f"pulsar://{address}", operation_timeout_seconds=30,
                                   logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
            print(f"embedded broker at {address}, batching {'on' if batching else 'off'}")
            print(f"{'size':>8} {'messages':>9} {'publish msg/s':>14} {'publish MB/s':>13} "
                  f"{'dispatch msg/s':>15} {'dispatch MB/s':>14}")
            for size in SIZES:
                count = args.messages or (100_000 if size <= 1024 else 10_000)
                r = run_size(client, size, count, batching)
                print(f"{size:>8} {count:>9} {r['publish_msgs']:>14,.0f} {r['publish_mb']:>13.1f} "
                      f"{r['dispatch_msgs']:>15,.0f} {r['dispatch_mb']:>14.1f}", flush=True)
            client.close()
        finally:
            process.terminate()
            process.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
