"""Recording and replay throughput, with the official client and the embedded broker.

    .venv/bin/python bench/replay.py [--messages N] [--size BYTES] [--rounds 5]

1. Proxy passthrough with recording off vs on: the official client produces N
   messages (batching on, LZ4) through a pulsar-tap proxy and consumes them back,
   through a plain proxy and through a recording one (``pulsar-tap run`` with and without
   ``--record DIR``, each a process of its own, as the proxy is deployed, beside a
   ``pulsar-tap broker`` process), in ``--rounds`` rounds, the arms'
   order rotated each round (:mod:`interleave`); prints messages/s and MB/s of each
   run and the CPU seconds of each part from the first send to the last arrival (the
   proxy's relay thread, its other threads, the recording's writer process, the
   embedded broker, the client: this process); then each round's
   ratio on/off, their median and minimum, and the CPU per message of each part
   (median of the rounds) with the total's ratio off/on, the steadier figure.
2. Broker-side replay: a fresh official consumer receives the last recording's messages
   from ``replay --serve`` (in-process); messages/s.
3. Client-side replay at ``--speed 0`` into a fresh embedded broker; messages/s.

On loopback; every number includes the official client's own costs.  (Until stop 47 the proxy and
the broker ran on threads of this process: the three shared one interpreter lock, and what the proxy
spent held up the broker's Python and the client's sends as well.)
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

from interleave import CpuParts, Round, report, rotated, tap_process  # (a module of bench/: the script's directory)

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations
from proxy.replay.matcher import AnswerBook
from proxy.replay.replayer import replay_recording
from proxy.testing.rig import ThreadedReplayServer


def produce_and_consume(url: str, topic: str, messages: int, size: int,
                        parts: CpuParts) -> tuple[tuple[float, tuple[int, float]], dict[str, float]]:
    """The official client produces ``messages`` and consumes them: ((start, (received, last arrival)), CPU
    seconds per part from the first send to the last arrival)."""
    import pulsar

    payload = b"x" * size
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "bench", receiver_queue_size=1000)
        producer = client.create_producer(topic, batching_enabled=True, batching_max_messages=500,
                                          compression_type=pulsar.CompressionType.LZ4, block_if_queue_full=True)
        parts.start()
        start = time.perf_counter()
        for _ in range(messages):
            producer.send_async(payload, None)
        producer.flush()
        received = receive_all(consumer, messages)
        return (start, received), parts.stop()
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


def proxied_run(upstream: str, record_dir: Path | None, topic: str, messages: int, size: int,
                broker_pid: int) -> tuple[tuple[float, tuple[int, float]], dict[str, float]]:
    """:func:`produce_and_consume` through ``pulsar-tap run`` (recording into ``record_dir`` when given), a
    process of its own as the proxy is deployed: the run and the CPU seconds per part from its first send to
    its last arrival (see :class:`interleave.CpuParts`)."""
    record = ["--record", str(record_dir)] if record_dir is not None else []
    with tap_process("run", "--listen", "127.0.0.1:0", "--upstream", upstream, "--drain-seconds", "0.5",
                     *record) as (proxy, listen):
        # (the proxy's Trio loop runs in its main thread; the writer is its child process)
        parts = CpuParts(proxy.pid, proxy_pid=proxy.pid, broker_pid=broker_pid)
        return produce_and_consume(f"pulsar://{listen}", topic, messages, size, parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the two arms, their order rotated each round (default 5: single rounds "
                             "swing by 0.7-1.1 on two shared cores; the median of five steadies)")
    args = parser.parse_args()
    n, size = args.messages, args.size
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as directory, \
            tap_process("broker", "--listen", "127.0.0.1:0") as (broker, listen):
        upstream = f"pulsar://{listen}"
        rounds: list[dict[str, Round]] = []
        path: Path | None = None
        topic = ""
        for round_number in range(1, args.rounds + 1):
            runs: dict[str, Round] = {}
            for arm in rotated(("off", "on"), round_number - 1):
                arm_topic = f"persistent://public/default/bench-{arm}-{round_number}"
                arm_dir = Path(directory) / f"round-{round_number}" if arm == "on" else None
                run, cpu = proxied_run(upstream, arm_dir, arm_topic, n, size, broker.pid)
                if arm_dir is not None:
                    path, topic = arm_dir, arm_topic
                text, per_second = rate(run, size)
                runs[arm] = Round(per_second, cpu, run[1][0])
                print(f"round {round_number}: proxy passthrough, recording {arm + ':':<4} {text}; CPU s: "
                      + ", ".join(f"{part} {seconds:.2f}" for part, seconds in cpu.items()), flush=True)
            rounds.append(runs)
        assert path is not None
        print("the proxy (pulsar-tap run), the broker (pulsar-tap broker) and the client each a process")
        report(rounds, ("off", "on"), baseline="off")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
