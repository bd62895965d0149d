"""Recording and replay throughput, with the official client and the embedded broker.

    .venv/bin/python bench/replay.py [--messages N] [--burst N] [--size BYTES] [--rounds 5]

1. Proxy passthrough with recording off vs on: the official client produces messages
   (batching on, LZ4) through a pulsar-tap proxy and consumes them back, through a plain
   proxy (twice: ``off`` and ``off-again``, whose ratio to off is the measurement's own
   spread) and through a recording one (``pulsar-tap run`` with and without ``--record
   DIR``, each a process of its own, as the proxy is deployed, beside a fresh ``pulsar-tap
   broker`` process each).  In each of ``--rounds`` rounds every arm's processes, consumer
   and producer are up together and ``--messages`` go through each arm in bursts of
   ``--burst`` (produced, flushed, consumed), through each arm in turn, the order shuffled
   each time (:func:`interleave.in_bursts`: the machine's speed drifts, so arms run a phase
   each were compared on different machines).  Prints messages/s and MB/s of each arm a
   round and the CPU seconds of each part from its bursts' first sends to their last
   arrivals (the proxy's relay thread, its other threads, the recording's writer process,
   the embedded broker, the client: this process); then each round's ratio to off, their
   median and minimum, and the CPU per message of each part (median of the rounds) with
   the total's ratio to off's.
2. Broker-side replay: a fresh official consumer receives the last recording's messages
   from ``replay --serve`` (in-process); messages/s.
3. Client-side replay at ``--speed 0`` into a fresh embedded broker; messages/s.

On loopback; every number includes the official client's own costs.  (Until stop 47 the proxy and
the broker ran on threads of this process: the three shared one interpreter lock, and what the proxy
spent held up the broker's Python and the client's sends as well.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

# run from a checkout without an install: import the repository's own package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from interleave import CpuParts, Lane, Round, in_bursts, report, rotated, tap_process  # (a module of bench/)

from proxy.broker.cluster import ClusterConfig
from proxy.broker.embedded import ThreadedCluster
from proxy.recording.reader import open_recordings
from proxy.replay.conversation import build_conversations
from proxy.replay.matcher import AnswerBook
from proxy.replay.replayer import replay_recording
from proxy.testing.rig import ThreadedReplayServer

#: recording off, off once more (its ratio to off: the measurement's own spread), on
ARMS = ("off", "off-again", "on")


def open_lane(stack: contextlib.ExitStack, record_dir: Path | None, topic: str, burst: int, size: int) -> Lane:
    """A fresh broker, ``pulsar-tap run`` in front of it (recording into ``record_dir`` when given), each a
    process of its own as deployed, and an official client's consumer and producer (batching on, LZ4) on
    ``topic`` through it, each to be closed by ``stack``: the arm's :class:`Lane`, a burst ``burst`` messages
    produced, flushed and consumed (acknowledged one by one)."""
    import pulsar

    broker, upstream = stack.enter_context(tap_process("broker", "--listen", "127.0.0.1:0"))
    record = ["--record", str(record_dir)] if record_dir is not None else []
    proxy, listen = stack.enter_context(tap_process("run", "--listen", "127.0.0.1:0", "--upstream",
                                                    f"pulsar://{upstream}", "--drain-seconds", "0.5", *record))
    # (the proxy's Trio loop runs in its main thread; the writer is its child process)
    parts = CpuParts(proxy.pid, proxy_pid=proxy.pid, broker_pid=broker.pid)
    client = pulsar.Client(f"pulsar://{listen}", operation_timeout_seconds=30)
    stack.callback(client.close)
    consumer = client.subscribe(topic, "bench", receiver_queue_size=1000)
    producer = client.create_producer(topic, batching_enabled=True, batching_max_messages=500,
                                      compression_type=pulsar.CompressionType.LZ4, block_if_queue_full=True)
    payload = b"x" * size

    def produce_and_consume() -> int:
        for _ in range(burst):
            producer.send_async(payload, None)
        producer.flush()
        received, _ = receive_all(consumer, burst)
        if received < burst:
            raise RuntimeError(f"{received} of {burst} messages arrived")
        return received

    return Lane(parts, produce_and_consume)


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
    parser.add_argument("--messages", type=int, default=600_000,
                        help="messages through each arm a round (default 600000, in bursts of --burst through each "
                             "arm in turn: arms a phase each swung by up to a third against one another on two shared "
                             "cores, the machine's speed drifting)")
    parser.add_argument("--burst", type=int, default=60_000,
                        help="messages of a burst through one arm (default 60000: about half a second)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the arms (default 5)")
    args = parser.parse_args()
    if min(args.messages, args.burst, args.rounds) < 1:
        parser.error("--messages, --burst and --rounds take 1 at least")
    size, burst = args.size, min(args.burst, args.messages)
    cycles = max(1, round(args.messages / burst))
    n = cycles * burst  # (each arm's messages a round)
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as directory:
        rounds: list[dict[str, Round]] = []
        path = Path(directory) / "round-1"
        topic = ""
        for round_ in range(args.rounds):
            with contextlib.ExitStack() as stack:
                opened: dict[str, Lane] = {}
                # (opened in a rotated order too: no arm's processes are always the oldest of the round)
                for arm in rotated(ARMS, round_):
                    arm_topic = f"persistent://public/default/bench-{arm}-{round_ + 1}"
                    arm_dir = Path(directory) / f"round-{round_ + 1}" if arm == "on" else None
                    if arm_dir is not None:
                        path, topic = arm_dir, arm_topic
                    opened[arm] = open_lane(stack, arm_dir, arm_topic, burst, size)
                runs = in_bursts({arm: opened[arm] for arm in ARMS}, cycles, round_)
            for arm, run in runs.items():
                per_second = run.rate
                print(f"round {round_ + 1}: proxy passthrough, {arm + ':':<10} {per_second:>10,.0f} msg/s "
                      f"{per_second * size / 1e6:>8.1f} MB/s ({run.units} messages in {run.units / per_second:.2f} s); "
                      "CPU s: " + ", ".join(f"{part} {seconds:.2f}" for part, seconds in run.cpu.items()), flush=True)
            rounds.append(runs)
        print(f"{n} messages an arm a round, in {cycles} bursts of {burst} through each arm in turn; the proxy "
              "(pulsar-tap run), the broker (pulsar-tap broker) and the client each a process")
        report(rounds, ARMS, baseline="off")
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
