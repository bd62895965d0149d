"""``pulsar-tap demo``: the main job on embedded defaults.

An embedded 2-broker cluster, the proxy in front of it with ``rules/demo.yaml``,
recording everything, and traffic from the built-in client: producers and a
Shared subscription of two consumers on a 4-partition topic, for about ten
seconds with a live progress line.  It ends with a summary — messages, per-command
latency through the proxy (paired from the recording by the session machine), rule
hits — and the commands to inspect, replay and analyse the recording it leaves.

``--sample`` instead decodes a bundled sample of frames the official Pulsar client
sent (``proxy/data/sample_client_frames.bin``) and prints them as a table.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.wording import counted

if TYPE_CHECKING:
    from proxy.protocol.frame import Frame

NAME = "demo"
#: a server process: numpy's BLAS keeps to one thread (see proxy.native_threads)
ONE_THREAD = True
HELP = "run the main job on embedded defaults: broker, proxy, rules, traffic, recording"
DESCRIPTION = """\
Start an embedded 2-broker Pulsar cluster, put the proxy in front of it with the
example rules of rules/demo.yaml, record everything, and drive producers and
consumers of the built-in client through it on a 4-partition topic for about ten
seconds.  Prints live progress, then the messages sent and received, the latency
of each command through the proxy, the rule hits, and what to try next with the
recording it leaves in --out.  SIGINT/SIGTERM stop the traffic early: the
consumers get a moment to receive what was sent (a second signal skips that), the
recording is finished, and the summary is printed as usual.

examples:
  pulsar-tap demo
  pulsar-tap demo --seconds 30 --rate 2000 --out /tmp/tap-demo
  pulsar-tap demo --sample        # just decode a bundled capture of the official client
  pulsar-tap demo --geo           # two geo-replicated clusters, pulsar-tap on the WAN link

--geo: clusters A and B replicate every topic to each other; each replicator goes
through a pulsar-tap proxy with the rules of rules/wan-degradation.yaml (2 s of
latency, then the link cut and kept down for >= 10 s).  A producer on A sends at
--rate for --seconds; a consumer of a replicated subscription on A stops after
--fail-over-after of the messages, and the same subscription is then opened on B.
Prints the replication lag per second (from the link's recording), the snapshot
markers on each link, and the failover position error: how many messages B gives
the consumer again.  Try --rules rules/wan-lost-snapshots.yaml to see what losing
the snapshot responses costs.
"""

EPILOG = """\
exit status:
  0    done, or stopped by SIGINT/SIGTERM (the summary and the recording cover what ran)
  1    messages were lost (sent but never received)
  2    bad arguments, rules/demo.yaml (--geo: rules/wan-degradation.yaml) not found
"""

SAMPLE_RESOURCE = "sample_client_frames.bin"
TOPIC = "persistent://public/default/demo-orders"
SUBSCRIPTION = "demo-sub"
PARTITIONS = 4


def configure(parser: argparse.ArgumentParser) -> None:
    # --seconds, --rate and --out default differently with --geo (see run)
    parser.add_argument("--seconds", type=float, help="how long to send (default 10; --geo: 20)")
    parser.add_argument("--rate", type=int, help="messages per second in total (default 500; --geo: 200)")
    parser.add_argument("--size", type=int, default=256, help="message size in bytes (default 256)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the recording goes (default ./pulsar-tap-demo, --geo: ./pulsar-tap-geo-demo; "
                             "created if missing)")
    parser.add_argument("--rules", metavar="FILE",
                        help="rule file (default rules/demo.yaml of the checkout, --geo: rules/wan-degradation.yaml)")
    parser.add_argument("--sample", action="store_true", help="only decode the bundled sample of client frames")
    parser.add_argument("--geo", action="store_true",
                        help="two geo-replicated clusters with pulsar-tap on the link (default --seconds 20 "
                             "--rate 200, rules/wan-degradation.yaml)")
    parser.add_argument("--snapshot-period", metavar="MS", type=int, default=1000,
                        help="--geo: replicated-subscription snapshot period (default 1000)")
    parser.add_argument("--fail-over-after", metavar="FRACTION", type=float, default=0.6,
                        help="--geo: the consumer leaves A after this share of the messages (default 0.6)")


def run(args: argparse.Namespace) -> int:
    from proxy.errors import UsageError

    if args.sample:
        print_sample()
        return 0
    if args.geo:
        return _geo(args)
    args.seconds = 10.0 if args.seconds is None else args.seconds
    args.rate = 500 if args.rate is None else args.rate
    args.out = "pulsar-tap-demo" if args.out is None else args.out
    if args.seconds <= 0 or args.rate <= 0 or args.size <= 0:
        raise UsageError("--seconds, --rate and --size must be positive")
    import trio

    from proxy.rules.loader import load_rules_file

    rules = Path(args.rules) if args.rules else _default_rules()
    load_rules_file(rules)  # a rule file it cannot use is refused before anything starts
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} is not a directory")
    return trio.run(_demo, args, rules)


def _geo(args: argparse.Namespace) -> int:
    import trio

    from proxy.cli.demo_geo import run_demo
    from proxy.errors import UsageError

    args.seconds = 20.0 if args.seconds is None else args.seconds
    args.rate = 200 if args.rate is None else args.rate
    args.out = "pulsar-tap-geo-demo" if args.out is None else args.out
    if args.seconds <= 0 or args.rate <= 0:
        raise UsageError("--seconds and --rate must be positive")
    if not 0 < args.fail_over_after <= 1:
        raise UsageError("--fail-over-after must be a fraction in (0, 1]")
    if args.snapshot_period < 10:
        raise UsageError("--snapshot-period must be at least 10 ms")
    rules = Path(args.rules) if args.rules else _default_rules("wan-degradation.yaml")
    return trio.run(run_demo, args, rules)


def _default_rules(name: str = "demo.yaml") -> Path:
    from proxy.errors import UsageError

    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base / "rules" / name
        if candidate.is_file():
            return candidate
    raise UsageError(f"rules/{name} not found: run the demo from a pulsar-tap checkout, or pass --rules FILE")


class _Stop:
    """What SIGINT/SIGTERM asked of the demo: stop sending (first), stop waiting for the consumers (second)."""

    def __init__(self) -> None:
        import trio

        self.signals = 0
        self.sending = trio.Event()
        self.waiting = trio.CancelScope()

    def __call__(self, count: int) -> None:
        self.signals = count
        self.sending.set()
        if count > 1:
            self.waiting.cancel()


async def _demo(args: argparse.Namespace, rules: Path) -> int:
    from proxy.cli.interrupt import on_signals

    stop = _Stop()
    with on_signals(stop):
        return await _run_demo(args, rules, stop)


async def _run_demo(args: argparse.Namespace, rules: Path, stop: _Stop) -> int:
    from proxy.broker.cluster import ClusterConfig
    from proxy.broker.embedded import open_cluster
    from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, RecordConfig, ServiceUrl
    from proxy.server.stack import running_proxy
    from proxy.telemetry.logs import configure_logging

    configure_logging("console", "warning")
    out = Path(args.out)
    print(f"demo: starting a 2-broker embedded cluster, the proxy with {rules}, recording under {out}/")
    async with open_cluster(ClusterConfig(brokers=2, topics={TOPIC: PARTITIONS})) as cluster:
        brokers = ", ".join(cluster.addresses)
        config = ProxyConfig(upstream=ServiceUrl.parse(f"pulsar://{cluster.addresses[0]}"),
                             listen=HostPort("127.0.0.1", 0),
                             rules=str(rules), record=RecordConfig(dir=str(out)),
                             limits=LimitsConfig(drain_seconds=1.0))
        async with running_proxy(config) as stack:
            print(f"demo: brokers {brokers}; proxy pulsar://{stack.address}; "
                  f"rules seed {stack.engine.seed if stack.engine else '-'}")
            traffic = await _traffic(f"pulsar://{stack.address}", args, stop)
            hits = stack.engine.hits() if stack.engine is not None else {}
            recording = stack.recording_path
    assert recording is not None
    if stop.signals:
        print("\ndemo: stopped by a signal: the figures and the recording cover what ran until then")
    _summary(traffic, hits, recording, args)
    return 0 if traffic["lost"] == 0 or stop.signals else 1


async def _traffic(url: str, args: argparse.Namespace, stop: _Stop) -> dict[str, Any]:
    """Produce at ``--rate`` for ``--seconds`` through the proxy while two consumers receive and ack."""
    import time

    import trio

    from proxy.client.client import PulsarClient
    from proxy.client.latency import LatencyHistogram

    latency = LatencyHistogram()
    sent: set[bytes] = set()
    received: Counter[bytes] = Counter()
    payload_pad = b"." * max(0, args.size - 16)
    started = time.monotonic()
    tty = sys.stdout.isatty()

    async with PulsarClient(url, operation_timeout=30.0) as client:
        consumers = [await client.subscribe(TOPIC, SUBSCRIPTION, subscription_type="Shared",
                                            initial_position="Earliest", consumer_name=f"demo-consumer-{i}")
                     for i in range(2)]
        producer = await client.create_producer(TOPIC, compression="LZ4", batching_max_delay=0.005)

        async def consume(consumer: Any) -> None:
            while True:
                message = await consumer.receive()
                received[message.payload[:16]] += 1
                consumer.acknowledge(message)

        async def send_one(index: int, nursery: trio.Nursery) -> None:
            key = f"{index:016d}".encode()
            sent.add(key)
            start = time.monotonic()
            await producer.send(key + payload_pad, key=f"customer-{index % 50}",
                                properties={"demo": "true"})
            latency.record(time.monotonic() - start)

        def progress(final: bool = False) -> None:
            elapsed = time.monotonic() - started
            publish = (f"p50 {latency.percentile(50) * 1000:.1f} ms  p99 {latency.percentile(99) * 1000:.1f} ms"
                       if latency.count else "latency: no receipt yet")
            line = f"[{elapsed:5.1f}s] sent {len(sent):,}  received {sum(received.values()):,}  publish {publish}"
            if tty:
                print(f"\r\033[K{line}", end="\n" if final else "", flush=True)
            elif final or int(elapsed * 2) % 4 == 0:
                print(line, flush=True)

        async with trio.open_nursery() as receivers:
            for consumer in consumers:
                receivers.start_soon(consume, consumer)
            async with trio.open_nursery() as senders:
                interval = 1.0 / args.rate
                index = 0
                next_report = started
                while time.monotonic() - started < args.seconds and not stop.sending.is_set():
                    senders.start_soon(send_one, index, senders)
                    index += 1
                    now = time.monotonic()
                    if now >= next_report:
                        progress()
                        next_report = now + 0.5
                    await trio.sleep(max(0.0, started + index * interval - now))
            with stop.waiting, trio.move_on_after(15):
                while len(set(received) & sent) < len(sent):  # noqa: ASYNC110 - polls counters, no event to wait on
                    await trio.sleep(0.05)
            progress(final=True)
            receivers.cancel_scope.cancel()
        await producer.close()
        for consumer in consumers:
            await consumer.close()
    missing = len(sent - set(received))
    return {"sent": len(sent), "received": sum(received.values()), "unique": len(set(received) & sent),
            "lost": missing, "redelivered": sum(received.values()) - len(set(received)),
            "p50_ms": latency.percentile(50) * 1000, "p99_ms": latency.percentile(99) * 1000,
            "seconds": time.monotonic() - started}


def request_latencies(recording: Path) -> dict[str, list[float]]:
    """Latency (µs) of every request/response pair in a recording, by request command."""
    from proxy.protocol.session import Direction, SessionTracker
    from proxy.recording.reader import open_recordings

    trackers: dict[int, SessionTracker] = {}
    result: dict[str, list[float]] = {}
    for recorded in open_recordings(recording).frames():
        if recorded.origin == "proxy":
            continue  # what the proxy changed is recorded again; pair what crossed the wire once
        tracker = trackers.setdefault(recorded.conn, SessionTracker(strict=False))
        observation = tracker.observe(recorded.frame, Direction(recorded.direction), recorded.ts_ns)
        pair = observation.completed
        if pair is not None and pair.outcome != "unanswered":
            result.setdefault(pair.request_command, []).append(pair.latency_ns / 1000)
    return result


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(traffic: dict[str, Any], hits: dict[str, int], recording: Path, args: argparse.Namespace) -> None:
    print()
    print(f"messages: sent {traffic['sent']:,}, received {traffic['received']:,} "
          f"({traffic['unique']:,} distinct, {traffic['redelivered']:,} redelivered), lost {traffic['lost']:,}; "
          f"publish latency p50 {traffic['p50_ms']:.1f} ms, p99 {traffic['p99_ms']:.1f} ms")
    print()
    print("latency through the proxy (from the recording, µs)")
    print(f"  {'command':<22}{'count':>8}{'p50':>10}{'p99':>10}{'max':>10}")
    for command, values in sorted(request_latencies(recording).items(), key=lambda item: -len(item[1])):
        print(f"  {command:<22}{len(values):>8,}{_percentile(values, 0.5):>10.0f}{_percentile(values, 0.99):>10.0f}"
              f"{max(values):>10.0f}")
    print()
    print("rule hits")
    for name, count in hits.items():
        print(f"  {name:<28}{count:>6,}")
    print()
    print(f"recording: {recording}")
    print("try next:")
    print(f"  pulsar-tap show {recording} --command PRODUCER,SEND_RECEIPT | less -R")
    print(f"  pulsar-tap show {recording} --diagram {Path(args.out) / 'diagram.html'}")
    print("  pulsar-tap broker --listen 127.0.0.1:6650 &   # a fresh broker to replay into")
    print(f"  pulsar-tap replay {recording} --upstream pulsar://127.0.0.1:6650 --speed 0")
    print(f"  pulsar-tap replay {recording} --serve --listen 127.0.0.1:6651")
    print(f"  pulsar-tap analyze {recording} --out {Path(args.out) / 'analysis'}")
    print(f"  pulsar-tap export {recording} --pcap {Path(args.out) / 'demo.pcapng'}")


# -- the bundled sample of client frames (``--sample``) -------------------------------------------------

def load_sample() -> bytes:
    """The bundled sample stream, read from the installed package."""
    from importlib import resources

    return resources.files("proxy").joinpath("data", SAMPLE_RESOURCE).read_bytes()
def describe(frame: Frame) -> str:
    """The key fields of one frame, as ``name=value`` pairs."""
    from proxy.protocol.compression import compression_name

    cmd = frame.command
    kind = frame.type_name
    if kind == "CONNECT":
        return f"client={cmd.connect.client_version} protocol_version={cmd.connect.protocol_version}"
    if kind == "PARTITIONED_METADATA":
        return f"topic={cmd.partitionMetadata.topic} request_id={cmd.partitionMetadata.request_id}"
    if kind == "LOOKUP":
        return f"topic={cmd.lookupTopic.topic} request_id={cmd.lookupTopic.request_id}"
    if kind == "PRODUCER":
        p = cmd.producer
        return f"topic={p.topic} producer_id={p.producer_id} producer_name={p.producer_name} request_id={p.request_id}"
    if kind == "SEND" and frame.payload is not None:
        meta = frame.payload.metadata
        num = cmd.send.num_messages if cmd.send.HasField("num_messages") else 1
        return (f"producer_id={cmd.send.producer_id} sequence_id={cmd.send.sequence_id} num_messages={num} "
                f"compression={compression_name(meta.compression)} payload={len(frame.payload.payload)} B")
    if kind == "CLOSE_PRODUCER":
        return f"producer_id={cmd.close_producer.producer_id} request_id={cmd.close_producer.request_id}"
    if kind == "SUBSCRIBE":
        s = cmd.subscribe
        return (f"topic={s.topic} subscription={s.subscription} consumer_id={s.consumer_id} "
                f"request_id={s.request_id}")
    if kind == "FLOW":
        return f"consumer_id={cmd.flow.consumer_id} permits={cmd.flow.messagePermits}"
    if kind == "ACK":
        ids = ", ".join(f"{m.ledgerId}:{m.entryId}" for m in cmd.ack.message_id)
        return f"consumer_id={cmd.ack.consumer_id} message_ids={ids}"
    if kind == "CLOSE_CONSUMER":
        return f"consumer_id={cmd.close_consumer.consumer_id} request_id={cmd.close_consumer.request_id}"
    return ""


def render(stream: bytes) -> list[str]:
    """The table lines (and the summary line) for a stream of client frames."""
    from proxy.protocol.frame import FrameDecoder
    from proxy.protocol.message import decode_messages

    decoder = FrameDecoder()
    frames = decoder.receive(stream)
    decoder.close()
    lines = [f"{'#':>3}  {'command':<20} {'bytes':>6}  details", f"{'-' * 3}  {'-' * 20} {'-' * 6}  {'-' * 40}"]
    counts: Counter[str] = Counter()
    messages = sends = 0
    for index, frame in enumerate(frames):
        counts[frame.type_name] += 1
        lines.append(f"{index:>3}  {frame.type_name:<20} {frame.size:>6}  {describe(frame)}")
        if frame.payload is not None:
            frame.payload.verify_checksum()
            sends += 1
            for message in decode_messages(frame.payload.metadata, frame.payload.payload):
                messages += 1
                props = ",".join(f"{k}={v}" for k, v in sorted(message.properties.items()))
                lines.append(f"{'':>3}  {'':<20} {'':>6}    message key={message.key} "
                             f"sequence_id={message.sequence_id} payload={message.size} B properties={props}")
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    lines.append(f"{counted(len(frames), 'frame')}, {counted(len(stream), 'byte')}, {counted(messages, 'message')} "
                 f"in {counted(sends, 'SEND')}, "
                 f"all checksums valid: {kinds}")
    return lines



def print_sample() -> None:
    for line in render(load_sample()):
        print(line)
