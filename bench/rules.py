"""Benchmark of rule evaluation: passthrough throughput with 0, 10 and 100 non-matching rules.

Through the proxy there is one more arm, ``10+1%``: ten rules of which one (``mark``)
matches 1 % of the SENDs (``probability: 0.01``), the rest as above.

Three tables, each with every arm's ratio to the arm without rules (0 rules, or no rules hook at all):

1. **through the proxy**: ``pulsar-tap broker`` and ``pulsar-tap run --rules FILE``
   in their own processes on loopback (a fresh pair per arm and round); the official client in
   this process publishes unbatched 100-byte messages with ``send_async`` (up to 1000 in
   flight).  In each of ``--rounds`` rounds every arm's processes and producer are up together
   and ``--messages`` go through each arm in bursts of ``--burst`` (each flushed), through each
   arm in turn, the order shuffled each time (:func:`interleave.in_bursts`: the machine's speed
   drifts, so arms run a phase each were compared on different machines).  Printed are each
   round's ratio to 0 rules (``0-again``: no rules once more, the measurement's own spread),
   their median and minimum, and the CPU per
   message (median of the rounds) of the proxy's Trio thread, its other threads, the
   broker and the client, with the total's ratio to 0 rules', the steadier figure.  The
   rules name SEND and SEND_RECEIPT but topics the producer is not on, so the relay
   passes that connection's SENDs and receipts through undecoded (the engine's
   per-connection interest), and of the 1 % rule's SENDs decodes only those it fires on;
2. **relay pipeline alone**: the CPU time per frame of
   :class:`~proxy.core.pipeline.ConnectionPipeline` (scanner, session tracker, rules
   hook; no sockets) reading pre-encoded SENDs from the client and
   their receipts from the broker, with no hook (the plain proxy), the non-matching
   rules and ``10+1%``; at 100 B and 1 KiB SENDs, in reads of ``--read-kib``; process
   CPU time per direction (the receipts' with the rules on SEND_RECEIPT), so a busy
   machine disturbs it less than the throughput tables.  The arms run in
   ``--pipeline-rounds`` rounds, the arms' order shuffled every round (seeded,
   ``--pipeline-seed``: no arm always runs after the same other one, or at the same point
   of a round).  Printed per arm and size: the best round's ns per frame and the ratio
   of the best rounds (none's over the arm's; earlier figures were read from these), the
   minor page faults per 1000 frames; then each round's own ratio, none's cost over the
   arm's in that round, as their median and interquartile range: the figure to hold
   against a goal (the range is how far single rounds stray, so 0.95 is met beyond the
   noise when the whole range is above it, within it when the range straddles it; the
   median itself moved by about 0.03 between runs of 15 rounds, 0.01 of 150 or more);
3. **engine alone**: each frame of a producer/consumer mix (SEND, SEND_RECEIPT,
   MESSAGE, FLOW, ACK) decoded, attributed by the real SessionTracker and evaluated
   by :class:`~proxy.rules.engine.RulesEngine`, in a loop.

The non-matching rules name commands these frames are, but topics they are not (the
expensive case: the topic has to be resolved and the glob tried), alternating
delay/drop/error/mark actions.

Usage: ``.venv/bin/python bench/rules.py [--seconds 1.0] [--messages 200000] [--burst 20000] [--rounds 5]
[--engine-only]
[--pipeline-rounds 15] [--pipeline-seed 1] [--read-kib 64]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# bench/ holds a proxy.py of its own: the repository root must come first
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (interleave: a module of bench/, the script's directory)
from interleave import (
    CpuParts,
    Lane,
    Round,
    in_bursts,
    median_and_quartiles,
    paired_ratios,
    report,
    rotated,
    tap_process,
)

from proxy.config.proxy_config import ServiceUrl
from proxy.core.hooks import ConnectionInfo
from proxy.core.lookup import BrokerDirectory
from proxy.core.pipeline import ConnectionPipeline, PipelineSettings
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import Direction, SessionTracker
from proxy.rules.engine import RulesEngine
from proxy.rules.hook import RulesHook
from proxy.rules.loader import load_rules_text

TOPIC = "persistent://public/default/orders"
#: messages of one burst through an arm (about 1 s at ~20 k/s; see interleave.in_bursts)
BURST_MESSAGES = 20_000
#: the arm with no rules, once more: its ratio to the first is the measurement's own spread
AGAIN = "0-again"
ACTIONS = ["{delay: {ms: 10}}", "drop", "{error: {code: ServiceNotReady}}", "mark"]
COMMANDS = ["[SEND]", "[SEND_RECEIPT]", "[MESSAGE]", "[FLOW, ACK]"]


def rules_text(count: int) -> str:
    lines = ["seed: 1", "rules:" if count else "rules: []"]
    for index in range(count):
        lines += [f"  - name: r{index}",
                  f"    match: {{command: {COMMANDS[index % 4]}, topic: 'persistent://public/default/nomatch-{index}-*'}}",
                  f"    action: {ACTIONS[index % 4] if COMMANDS[index % 4] == '[SEND]' else 'mark'}"]
    return "\n".join(lines) + "\n"


def one_matching(count: int) -> str:
    """``count`` rules as :func:`rules_text`, the last of which marks 1 % of the SENDs."""
    text = rules_text(count - 1)
    return text + ("  - name: one-in-100\n"
                   "    match: {command: [SEND], probability: 0.01}\n"
                   "    action: {mark: {label: one-in-100}}\n")


def traffic() -> list[tuple[bytes, Direction]]:
    metadata = api.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    frames: list[tuple[bytes, Direction]] = []
    for seq in range(200):
        frames.append((encode_payload_command(api.CommandSend(producer_id=1, sequence_id=seq), metadata, b"x" * 100),
                       Direction.TO_BROKER))
        frames.append((encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=seq)), Direction.TO_CLIENT))
        frames.append((encode_payload_command(api.CommandMessage(
            consumer_id=2, message_id=api.MessageIdData(ledgerId=1, entryId=seq)), metadata, b"x" * 100),
            Direction.TO_CLIENT))
        frames.append((encode_command(api.CommandAck(consumer_id=2, ack_type=api.CommandAck.Individual,
                                                     message_id=[api.MessageIdData(ledgerId=1, entryId=seq)])),
                       Direction.TO_BROKER))
        if seq % 50 == 0:
            frames.append((encode_command(api.CommandFlow(consumer_id=2, messagePermits=50)), Direction.TO_BROKER))
    return frames


def prepared_tracker() -> SessionTracker:
    tracker = SessionTracker(strict=False)
    for sub, direction in [
        (api.CommandConnect(client_version="bench", protocol_version=21), Direction.TO_BROKER),
        (api.CommandConnected(server_version="bench", protocol_version=21), Direction.TO_CLIENT),
        (api.CommandProducer(topic=TOPIC, producer_id=1, request_id=1), Direction.TO_BROKER),
        (api.CommandProducerSuccess(request_id=1, producer_name="p"), Direction.TO_CLIENT),
        (api.CommandSubscribe(topic=TOPIC, subscription="s", consumer_id=2, request_id=2,
                              subType=api.CommandSubscribe.Shared), Direction.TO_BROKER),
        (api.CommandSuccess(request_id=2), Direction.TO_CLIENT),
    ]:
        tracker.observe(frame_from_bytes(encode_command(sub)), direction, 0)
    return tracker


def measure(count: int, seconds: float) -> float:
    engine = RulesEngine(load_rules_text(rules_text(count)))
    tracker = prepared_tracker()
    frames = traffic()
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    now_ns = 0
    while time.perf_counter() < deadline:
        for raw, direction in frames:
            frame = frame_from_bytes(raw)
            observation = tracker.observe(frame, direction, now_ns)
            decision = engine.evaluate(frame, direction, now_ns, conn_id=1, client="127.0.0.1:1",
                                       observation=observation)
            if decision.changes_traffic:
                raise AssertionError(f"a non-matching rule changed traffic: {decision}")
            now_ns += 1000
        done += len(frames)
    return done / (time.perf_counter() - start)


@dataclass
class PipelineCost:
    """One arm's cost in the pipeline table: CPU ns per frame of each round (in the order the rounds ran), per
    direction, and the minor page faults per 1000 frames over all rounds."""

    sends: list[float]
    receipts: list[float]
    faults: float


def pipeline_cost(arms: tuple[int | str, ...], size: int = 100, read_bytes: int = 65536, rounds: int = 15,
                  seed: int = 1) -> dict[int | str, PipelineCost]:
    """CPU ns per frame of the relay's pipeline per arm (``"none"``: no hook) in each of ``rounds`` rounds:
    SENDs of ``size`` bytes and their receipts, ``read_bytes`` of SENDs per read.  Per arm and round: the
    SENDs' cost and the receipts' cost (each direction alone: a rule on SEND_RECEIPT costs in the broker's);
    and the minor page faults per 1000 frames over all rounds (memory the allocator gave back to the system
    and faulted in again: what made 100 rules cost 15 % through the proxy, see proxy.core.scanner).

    Each round runs the arms in an order shuffled with ``random.Random(seed)``: rotating them would leave
    each arm after the same other arm every round (what the one before left in the allocator is what the
    page faults count), and a disturbance that recurs with the round's period on the same arm."""
    # the frames of passthrough.py's observer arms
    from passthrough import CONNECTED, connect_frame, numbered_receipts, numbered_sends

    count = read_bytes // size
    sends, receipts = numbered_sends(size, count), numbered_receipts(count)
    pipelines = {}
    for arm in arms:
        text = None if arm == "none" else one_matching(10) if arm == "10+1%" else rules_text(int(arm))
        pipeline = ConnectionPipeline(
            ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None), settings=PipelineSettings(),
            directory=BrokerDirectory("127.0.0.1", upstream_tls=False, open_listener=lambda broker: 1),
            default_broker=ServiceUrl.parse("pulsar://127.0.0.1:6650"), now_ns=0,
            hook=RulesHook(RulesEngine(load_rules_text(text))) if text is not None else None)
        pipeline.receive(Direction.TO_BROKER, connect_frame("rules"), 0)
        pipeline.receive(Direction.TO_CLIENT, CONNECTED, 0)
        pipelines[arm] = pipeline
    spent_per_round: dict[int | str, tuple[list[float], list[float]]] = {arm: ([], []) for arm in arms}
    faults = dict.fromkeys(arms, 0)
    reads = max(2, 1_300_000 // read_bytes)  # about 1.3 MB of SENDs per arm and round, whatever the sizes
    order, shuffle = list(arms), random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        for arm in order:
            pipeline, spent = pipelines[arm], [0.0, 0.0]
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(reads):
                for side, (direction, data) in enumerate(((Direction.TO_BROKER, sends),
                                                          (Direction.TO_CLIENT, receipts))):
                    start = time.process_time()
                    pipeline.receive(direction, data, 0)
                    spent[side] += time.process_time() - start
            faults[arm] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
            for side in (0, 1):
                spent_per_round[arm][side].append(spent[side] / (reads * count) * 1e9)
    return {arm: PipelineCost(*spent_per_round[arm], faults[arm] / (2 * rounds * reads * count) * 1000)
            for arm in arms}


def print_pipeline_table(costs: dict[int, dict[int | str, PipelineCost]], arms: tuple[int | str, ...]) -> None:
    """The pipeline table: per arm and SEND size (``costs``' keys), the best round's ns per frame of each
    direction with the ratio of the best rounds (none's over the arm's) and the page faults; then the
    rounds' own ratios, none's cost over the arm's in the same round, as median and interquartile range."""
    print(f"{'rules':>6}" + "".join(f"{f'{size} B SEND ns':>15} {'ratio':>6} {'receipt ns':>11} {'ratio':>6} "
                                    f"{'faults':>7}" for size in costs))
    for arm in arms:
        print(f"{arm:>6}" + "".join(
            f"{min(cost[arm].sends):>15,.1f} {min(cost['none'].sends) / min(cost[arm].sends):>6.2f} "
            f"{min(cost[arm].receipts):>11,.1f} {min(cost['none'].receipts) / min(cost[arm].receipts):>6.2f} "
            f"{cost[arm].faults:>7.2f}" for cost in costs.values()))
    print("each round's ratio (none's cost over the arm's in the same round): median [first - third quartile]")
    print(f"{'rules':>6}" + "".join(f"{f'{size} B SEND':>24}{'receipt':>24}" for size in costs))
    for arm in arms:
        cells = []
        for cost in costs.values():
            for side in ("sends", "receipts"):
                median, first, third = median_and_quartiles(
                    paired_ratios(getattr(cost["none"], side), getattr(cost[arm], side)))
                cells.append(f"{median:>10.3f} [{first:.3f} - {third:.3f}]")
        print(f"{arm:>6}" + "".join(cells))


def open_lane(stack: contextlib.ExitStack, arm: int | str, rules_dir: Path, burst: int) -> Lane:
    """A fresh broker, ``pulsar-tap run --rules`` with ``arm``'s rules in front of it and an official client's
    producer through it (unbatched, async, up to 1000 in flight), each to be closed by ``stack``: the arm's
    :class:`Lane`, a burst ``burst`` messages sent, flushed and their callbacks run."""
    import pulsar

    rule_file = rules_dir / f"rules-{arm}.yaml"
    text = one_matching(10) if arm == "10+1%" else rules_text(0 if arm == AGAIN else int(arm))
    rule_file.write_text(text.replace("[FLOW, ACK]", "[SEND_RECEIPT]"), encoding="utf-8")
    broker, upstream = stack.enter_context(tap_process("broker", "--listen", "127.0.0.1:0"))
    proxy, listen = stack.enter_context(tap_process("run", "--listen", "127.0.0.1:0", "--upstream",
                                                    f"pulsar://{upstream}", "--rules", str(rule_file)))
    # (the proxy's Trio loop runs in its main thread)
    parts = CpuParts(proxy.pid, proxy_pid=proxy.pid, broker_pid=broker.pid)
    client = pulsar.Client(f"pulsar://{listen}", operation_timeout_seconds=15,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    stack.callback(client.close)
    producer = client.create_producer(f"persistent://public/default/bench-{os.getpid()}-{time.time_ns()}",
                                      batching_enabled=False, max_pending_messages=1000,
                                      block_if_queue_full=True, send_timeout_millis=30_000)
    producer.send(b"warm-up")
    done = threading.Semaphore(0)
    payload = b"x" * 100

    def send_burst() -> int:
        for _ in range(burst):
            producer.send_async(payload, lambda result, _id: done.release())
        producer.flush()
        for _ in range(burst):
            if not done.acquire(timeout=30):
                raise RuntimeError("a send did not complete")
        return burst

    return Lane(parts, send_burst)


def measure_through_proxy(arms: tuple[int | str, ...], messages: int, rounds: int,
                          burst: int = BURST_MESSAGES) -> list[dict[int | str, Round]]:
    """Per round, each arm's messages: a number of non-matching rules, or ``"10+1%"`` (see :func:`one_matching`);
    a fresh broker and proxy process per arm and round, all up through the round, the messages in bursts of
    ``burst`` through each arm in turn (:func:`interleave.in_bursts`)."""
    burst = min(burst, messages)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            with contextlib.ExitStack() as stack:
                # (opened in a rotated order too: no arm's processes are always the oldest of the round)
                opened = {arm: open_lane(stack, arm, Path(tmp), burst) for arm in rotated(arms, round_)}
                lanes = {arm: opened[arm] for arm in arms}
                results.append(in_bursts(lanes, max(1, round(messages / burst)), round_))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per engine measurement (default 1.0)")
    parser.add_argument("--messages", type=int, default=200_000,
                        help="messages through each arm a round (default 200000, in bursts of --burst through each "
                             "arm in turn: arms a phase each of 60000 swung by a third against one another on two "
                             "shared cores, the machine's speed drifting)")
    parser.add_argument("--burst", type=int, default=BURST_MESSAGES,
                        help=f"messages of a burst through one arm (default {BURST_MESSAGES})")
    parser.add_argument("--engine-only", action="store_true", help="skip the measurement through the proxy")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the arms through the proxy (default 5; in bursts, a round's ratio of 0-again "
                             "to 0 read 0.96-1.05 on two shared cores)")
    parser.add_argument("--read-kib", type=int, default=64,
                        help="KiB of SENDs per read in the pipeline table (default 64; the relay reads up to 256)")
    parser.add_argument("--pipeline-rounds", type=int, default=15,
                        help="rounds of the pipeline table, each about 1.3 MB of SENDs per arm and size (default 15: "
                             "about 0.5 s on an idle core, 150: 3 s; the median ratio steadies with more rounds, "
                             "the quartiles, single rounds' spread, do not narrow)")
    parser.add_argument("--pipeline-seed", type=int, default=1,
                        help="seed of the pipeline table's shuffled order of the arms (default 1)")
    args = parser.parse_args()
    if args.pipeline_rounds < 1:
        parser.error("--pipeline-rounds takes at least one round")
    if min(args.messages, args.burst, args.rounds) < 1:
        parser.error("--messages, --burst and --rounds take 1 at least")
    if not args.engine_only:
        load = os.getloadavg()[0]
        proxy_arms: tuple[int | str, ...] = (0, AGAIN, 10, 100, "10+1%")
        rounds = measure_through_proxy(proxy_arms, args.messages, args.rounds, args.burst)
        print(f"through the proxy (official client, unbatched 100 B sends), non-matching rules "
              f"(load average {load:.2f} at the start); 10+1%: one of 10 rules marks 1 % of the SENDs")
        report(rounds, proxy_arms, baseline=0, parts=("proxy thread", "other proxy", "broker", "client"))
        print()
    print(f"relay pipeline alone (CPU per frame: SENDs and their receipts in {args.read_kib} KiB reads, each "
          f"direction alone; load average {os.getloadavg()[0]:.2f}); {args.pipeline_rounds} rounds, the arms' order "
          f"shuffled each round (seed {args.pipeline_seed}); ns: the best round; ratio: the plain proxy's best over "
          "the arm's; faults: minor page faults per 1000 frames")
    arms: tuple[int | str, ...] = ("none", 0, 10, 100, "10+1%")
    costs = {size: pipeline_cost(arms, size, args.read_kib * 1024, args.pipeline_rounds, args.pipeline_seed)
             for size in (100, 1024)}
    print_pipeline_table(costs, arms)
    print()
    baseline = measure(0, args.seconds)
    print("engine alone (decode + evaluate), non-matching rules")
    print(f"{'rules':>6} {'frames/s':>12} {'ratio':>7}")
    for count in (0, 10, 100):
        rate = baseline if count == 0 else measure(count, args.seconds)
        print(f"{count:>6} {rate:>12,.0f} {rate / baseline:>7.2f}")


if __name__ == "__main__":
    main()
