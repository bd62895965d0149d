"""Recording and replay throughput, with the official client and the embedded broker.

    .venv/bin/python bench/replay.py [--messages N] [--size BYTES]

1. Proxy passthrough with recording off vs on: the official client produces N
   messages (batching on, LZ4) through a pulsar-tap proxy and consumes them back,
   once through a plain proxy and once through a recording one; prints messages/s
   and MB/s of each run and the ratio on/off.
2. Broker-side replay: a fresh official consumer receives the recorded messages
   from ``replay --serve`` (in-process); messages/s.
3. Client-side replay at ``--speed 0`` into a fresh embedded broker; messages/s.

One run each, on loopback; every number includes the official client's own costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

# run from a checkout without an install: import the repository's own package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations
from proxy.replay.matcher import AnswerBook
from proxy.replay.replayer import replay_recording
from proxy.testing.rig import RecordingProxy, ThreadedReplayServer


def produce_and_consume(url: str, topic: str, messages: int, size: int) -> tuple[float, tuple[int, float]]:
    """The official client produces ``messages`` and consumes them: (start, (received, last arrival))."""
    import pulsar

    payload = b"x" * size
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "bench", receiver_queue_size=1000)
        producer = client.create_producer(topic, batching_enabled=True, batching_max_messages=500,
                                          compression_type=pulsar.CompressionType.LZ4, block_if_queue_full=True)
        start = time.perf_counter()
        for _ in range(messages):
            producer.send_async(payload, None)
        producer.flush()
        return start, receive_all(consumer, messages)
    finally:
        client.close()


def receive_all(consumer: Any, messages: int) -> tuple[int, float]:
    """Receive up to ``messages``; returns how many came and when the last one did."""
    received, last = 0, time.perf_counter()
    try:
        while received < messages:
            consumer.acknowledge(consumer.receive(timeout_millis=5_000))
            received, last = received + 1, time.perf_counter()
    except Exception as exc:  # the official client's Timeout: report what arrived
        print(f"  (stopped after {received} of {messages} messages: {exc})")
    return received, last


def consume(url: str, topic: str, subscription: str, messages: int) -> tuple[float, tuple[int, float]]:
    import pulsar

    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        start = time.perf_counter()
        consumer = client.subscribe(topic, subscription, receiver_queue_size=1000)
        return start, receive_all(consumer, messages)
    finally:
        client.close()


def rate(run: tuple[float, tuple[int, float]], size: int) -> tuple[str, float]:
    start, (messages, last) = run
    seconds = max(last - start, 1e-9)
    per_second = messages / seconds
    return (f"{per_second:>10,.0f} msg/s {per_second * size / 1e6:>8.1f} MB/s "
            f"({messages} messages in {seconds:.2f} s)"), per_second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()
    n, size = args.messages, args.size
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    cluster = ThreadedCluster(ClusterConfig(brokers=1)).start()
    try:
        with tempfile.TemporaryDirectory() as directory:
            with RecordingProxy(cluster.service_url) as plain:
                off = produce_and_consume(plain.service_url, "persistent://public/default/bench-off", n, size)
            with RecordingProxy(cluster.service_url, directory) as recording:
                on = produce_and_consume(recording.service_url, "persistent://public/default/bench-on", n, size)
                path = recording.recording_path
            off_text, off_rate = rate(off, size)
            on_text, on_rate = rate(on, size)
            print(f"proxy passthrough, recording off: {off_text}")
            print(f"proxy passthrough, recording on:  {on_text}")
            print(f"ratio on/off: {on_rate / off_rate:.2f}")
            book = AnswerBook.from_conversations(build_conversations(open_recordings(path).frames()).values())
            with ThreadedReplayServer(book) as server:
                served = consume(server.service_url, "persistent://public/default/bench-on", "bench", n)
            print(f"broker-side replay (served):      {rate(served, size)[0]}")
            target = ThreadedCluster(ClusterConfig(brokers=1)).start()
            try:
                start = time.perf_counter()
                result = trio.run(lambda: replay_recording(str(path), target.service_url, speed=0))
                replayed = (start, (n, time.perf_counter()))
            finally:
                target.stop()
            print(f"client-side replay (--speed 0):   {rate(replayed, size)[0]}; {len(result.diffs)} diffs")
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
