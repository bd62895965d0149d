"""Recording and replay throughput, with the official client and the embedded broker.

    .venv/bin/python bench/replay.py [--messages N] [--size BYTES]

1. Proxy passthrough with recording off vs on: the official client produces N
   messages (batching on, LZ4) through a pulsar-tap proxy and consumes them back,
   through a plain proxy and through a recording one in turn, ``--rounds`` times (each set up as
   ``pulsar-tap run`` sets it up, with and without ``record: {dir}``); prints
   messages/s and MB/s of each run, its ratio on/off, and the CPU seconds each arm
   took: this process (the client's threads, the broker and the proxy) and the
   recording's writer process; then the ratio of the best run of each arm.
2. Broker-side replay: a fresh official consumer receives the last recording's messages
   from ``replay --serve`` (in-process); messages/s.
3. Client-side replay at ``--speed 0`` into a fresh embedded broker; messages/s.

On loopback; every number includes the official client's own costs.
The default of 300 000 messages gives arms of a few seconds (with 50 000, under one
second each, ratios swung from 0.8 to 1.2 on a loaded machine).
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
from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, RecordConfig, ServiceUrl
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations
from proxy.replay.matcher import AnswerBook
from proxy.replay.replayer import replay_recording
from proxy.server.threaded import ThreadedStack
from proxy.testing.rig import ThreadedReplayServer


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


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process so far, and of its children reaped so far."""
    times = os.times()
    return times.user + times.system, times.children_user + times.children_system


def proxied_run(upstream: str, record_dir: str | None, topic: str, messages: int,
                size: int) -> tuple[tuple[float, tuple[int, float]], tuple[float, float], Path | None]:
    """:func:`produce_and_consume` through a proxy stack (recording into ``record_dir`` when given): the run,
    the CPU seconds of this process and of the recording's writer process, and the recording's path."""
    config = ProxyConfig(upstream=ServiceUrl.parse(upstream), listen=HostPort("127.0.0.1", 0),
                         limits=LimitsConfig(drain_seconds=0.5),
                         record=None if record_dir is None else RecordConfig(dir=record_dir))
    before = cpu_seconds()
    with ThreadedStack(config, name="pulsar-tap-bench-proxy") as proxy:
        assert proxy.stack is not None
        path = proxy.stack.recording_path
        run = produce_and_consume(proxy.service_url, topic, messages, size)
    after = cpu_seconds()  # (the writer process has ended: its time is in the children's)
    return run, (after[0] - before[0], after[1] - before[1]), path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each arm, off and on in turn (default 3); the ratio compares the best of each")
    args = parser.parse_args()
    n, size = args.messages, args.size
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    cluster = ThreadedCluster(ClusterConfig(brokers=1)).start()
    try:
        with tempfile.TemporaryDirectory() as directory:
            off_rates, on_rates = [], []
            path: Path | None = None
            topic = ""
            for round_number in range(1, args.rounds + 1):
                off, off_cpu, _ = proxied_run(cluster.service_url, None,
                                              f"persistent://public/default/bench-off-{round_number}", n, size)
                topic = f"persistent://public/default/bench-on-{round_number}"
                on, on_cpu, path = proxied_run(cluster.service_url, directory, topic, n, size)
                off_text, off_rate = rate(off, size)
                on_text, on_rate = rate(on, size)
                off_rates.append(off_rate)
                on_rates.append(on_rate)
                print(f"round {round_number}: proxy passthrough, recording off: {off_text}; "
                      f"CPU s: {off_cpu[0]:.2f} this process")
                print(f"round {round_number}: proxy passthrough, recording on:  {on_text}; "
                      f"CPU s: {on_cpu[0]:.2f} this process, {on_cpu[1]:.2f} writer process")
                print(f"round {round_number}: ratio on/off: {on_rate / off_rate:.2f}", flush=True)
            assert path is not None
            # best of the rounds per arm: other load on the machine, and the slow runs both arms have now and
            # then (more CPU seconds in this process for the same messages), slow a run down, never speed one up
            print(f"ratio on/off (best of {args.rounds} rounds each): {max(on_rates) / max(off_rates):.2f}")
            book = AnswerBook.from_conversations(build_conversations(open_recordings(path).frames()).values())
            with ThreadedReplayServer(book) as server:
                served = consume(server.service_url, topic, "bench", n)
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
