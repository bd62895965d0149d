"""Soak: N minutes of official-client traffic through the proxy, with its resources sampled.

The embedded broker and ``pulsar-tap run`` (with rules that fire on the hot path and
recording on) run as processes; the official client (``pulsar-client``) drives
producers at a fixed total rate and Shared consumers that receive and acknowledge
everything.  Every ``--interval`` seconds a row is printed: the proxy's resident
memory, open file descriptors and CPU, the messages sent and received in the window,
the send latency (p50 / p99 / max, from send to receipt) and the recording's size.
At the end the trend: the slope of memory and file descriptors over the run (after
the first window, which includes start-up) and whether every message arrived.

``--churn N`` adds N short-lived sessions a second beside that steady traffic, each a
client of its own: it connects, subscribes (Shared, under a FLOW throttle every churned
consumer shares), produces five messages (under a throttle per producer), receives them,
and closes.  Topics and subscriptions come from small pools, so what the proxy keeps per
connection, producer and consumer is all that churns: what it forgets too late shows as
a growing slope.  The proxy's admin API is then sampled too: its connections
(``GET /connections``) and the size of its ``/metrics`` page.

    .venv/bin/python bench/soak.py --minutes 30                 # the run reported in issue #12
    .venv/bin/python bench/soak.py --minutes 2 --interval 10    # a quick look
    .venv/bin/python bench/soak.py --minutes 10 --churn 5       # 3 000 client sessions come and go

Ctrl-C stops it early and prints what it has.  Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RULES = """\
seed: 12
rules:
  - name: slow-receipts
    match: {command: [SEND_RECEIPT], probability: 0.02}
    action: {delay: {ms: 5}}
  - name: mark-producers
    match: {command: [PRODUCER], topic: {regex: "persistent://public/default/soak-[0-9]+"}}
    action: mark
  - name: flow-watch
    match: {command: [FLOW], topic: "persistent://public/default/soak-*"}
    action: mark
"""

#: with --churn: every churned consumer shares one FLOW bucket, every churned producer has a bucket of its own
CHURN_RULES = """\
  - name: churn-consumers
    match: {command: [FLOW], topic: "persistent://public/default/churn-*"}
    action: {throttle: {messages_per_second: 5000}}
  - name: churn-producers
    match: {command: [SEND], topic: "persistent://public/default/churn-*"}
    action: {throttle: {messages_per_second: 5000, per: producer}}
"""
CHURN_TOPICS = 16
CHURN_MESSAGES = 5


@contextlib.contextmanager
def pulsar_tap(workdir: Path, name: str, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], str, str | None]]:
    """Run ``pulsar-tap ARGS`` in ``workdir``: (process, listening address, admin address or None)."""
    ready = workdir / f"{name}.json"
    log = (workdir / f"{name}.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "proxy", *args, "--ready-file", str(ready), "--log-level",
                                "warning"], stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                addresses = json.loads(ready.read_text())
                address, admin = addresses["listen"][0], addresses.get("admin")
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {(workdir / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield process, address, admin
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


# -- what is sampled -------------------------------------------------------------------------
def proc_status(pid: int) -> tuple[int, int, float]:
    """RSS (bytes), open fds, CPU seconds (user + system) of a process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, fds, cpu


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass
class Traffic:
    """Counters the client threads update; the sampler takes them window by window."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies: list[float] = field(default_factory=list)
    sent: int = 0
    acked: int = 0
    failed: int = 0
    received: int = 0
    received_ids: set[bytes] = field(default_factory=set)
    churned: int = 0
    churn_failed: int = 0
    churn_errors: list[str] = field(default_factory=list)

    def take(self) -> tuple[list[float], int, int, int, int]:
        with self.lock:
            window = self.latencies
            self.latencies = []
            return window, self.sent, self.acked, self.failed, self.received


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


# -- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import pulsar

    print(f"uptime at start: {Path('/proc/loadavg').read_text().split()[:3]} (load 1/5/15 min); "
          f"cpus {os.cpu_count()}", flush=True)
    parts = [name for name, off in (("rules", args.no_rules), ("recording", args.no_record)) if not off]
    print(f"soak: {args.minutes:g} min, {args.rate} msg/s over {args.producers} producers, {args.consumers} "
          f"Shared consumers, {args.size} B messages, {' + '.join(parts) or 'nothing'} on"
          + (f", {args.churn:g} client sessions a second come and go" if args.churn else "")
          + f"; a row every {args.interval:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="pulsar-tap-soak-") as tmp:
        workdir = Path(tmp)
        (workdir / "rules.yaml").write_text(RULES + (CHURN_RULES if args.churn else ""))
        recordings = workdir / "recordings"
        recordings.mkdir()
        extra = ([] if args.no_rules else ["--rules", "rules.yaml"]) + ([] if args.no_record else
                                                                        ["--record", str(recordings)])
        extra += ["--admin", "127.0.0.1:0"] if args.churn else []
        with pulsar_tap(workdir, "broker", "broker", "--listen", "127.0.0.1:0") as (_, broker, _), \
                pulsar_tap(workdir, "proxy", "run", "--upstream", f"pulsar://{broker}", "--listen", "127.0.0.1:0",
                           *extra) as (proxy, listen, admin):
            traffic = Traffic()
            client = pulsar.Client(f"pulsar://{listen}", operation_timeout_seconds=30,
                                   logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
            topics = [f"persistent://public/default/soak-{i}" for i in range(args.producers)]
            consumers = [client.subscribe(topics, "soak", consumer_type=pulsar.ConsumerType.Shared,
                                          receiver_queue_size=1000) for _ in range(args.consumers)]
            producers = [client.create_producer(topic, batching_enabled=True, batching_max_publish_delay_ms=5,
                                                block_if_queue_full=True, send_timeout_millis=60_000)
                         for topic in topics]
            stop, drained = threading.Event(), threading.Event()
            threads = [threading.Thread(target=produce, args=(producers, traffic, args, stop), daemon=True)]
            threads += [threading.Thread(target=consume, args=(c, traffic, drained), daemon=True) for c in consumers]
            if args.churn:
                threads.append(threading.Thread(target=churn, args=(f"pulsar://{listen}", traffic, args, stop),
                                                daemon=True))
            for thread in threads:
                thread.start()
            rows = sample(proxy.pid, recordings, traffic, args, admin)
            stop.set()
            for producer in producers:
                with contextlib.suppress(Exception):
                    producer.flush()
            drain_until = time.monotonic() + 60
            while traffic.received < traffic.acked and time.monotonic() < drain_until:
                time.sleep(0.2)
            drained.set()
            for thread in threads:
                thread.join(10)
            with contextlib.suppress(Exception):
                client.close()
            warnings = [line for line in (workdir / "proxy.log").read_text(errors="replace").splitlines()
                        if "warning" in line or "error" in line]
    report(rows, traffic, warnings)
    return 0


def produce(producers: list, traffic: Traffic, args: argparse.Namespace, stop: threading.Event) -> None:  # type: ignore[type-arg]
    import pulsar

    payload = b"s" * args.size
    for index in paced(args.rate, stop):
        started = time.monotonic()

        def done(result: object, _msg_id: object, started: float = started) -> None:
            with traffic.lock:
                if result == pulsar.Result.Ok:
                    traffic.acked += 1
                    traffic.latencies.append(time.monotonic() - started)
                else:
                    traffic.failed += 1

        producers[index % len(producers)].send_async(payload + b"%d" % index, done)
        with traffic.lock:
            traffic.sent += 1


def paced(rate: float, stop: threading.Event, most_behind: float = math.inf) -> Iterator[int]:
    """0, 1, 2, ... at ``rate`` a second until ``stop``; turns missed while the caller was slow are made up
    for at once, up to ``most_behind`` seconds' worth."""
    interval = 1.0 / rate
    next_at = time.monotonic()
    index = 0
    while not stop.is_set():
        now = time.monotonic()
        if now < next_at:
            time.sleep(min(next_at - now, 0.01))
            continue
        next_at = max(next_at + interval, now - most_behind)
        yield index
        index += 1


def churn(url: str, traffic: Traffic, args: argparse.Namespace, stop: threading.Event) -> None:
    """``args.churn`` client sessions a second, one after another: each a client of its own (see the docstring)."""
    import pulsar

    for index in paced(args.churn, stop, most_behind=1.0):  # (slow sessions are not made up for with a burst)
        topic = f"persistent://public/default/churn-{index % CHURN_TOPICS}"
        client = pulsar.Client(url, operation_timeout_seconds=10, logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
        try:
            consumer = client.subscribe(topic, f"churn-{index % 4}", consumer_type=pulsar.ConsumerType.Shared,
                                        receiver_queue_size=100)
            producer = client.create_producer(topic)
            for number in range(CHURN_MESSAGES):
                producer.send(b"churn %d %d" % (index, number))
            for _ in range(CHURN_MESSAGES):  # (five of the subscription's: a session's, or one before's left over)
                consumer.acknowledge(consumer.receive(10_000))
            outcome = None
        except Exception as exc:  # (counted and named in the report: the soak goes on)
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                client.close()
        with traffic.lock:
            traffic.churned += 1
            if outcome is not None:
                traffic.churn_failed += 1
                if len(traffic.churn_errors) < 5:
                    traffic.churn_errors.append(outcome)


def admin_sample(admin: str) -> tuple[int, int]:
    """Connections the proxy serves (``GET /connections``) and its ``/metrics`` page's size in bytes."""
    with urllib.request.urlopen(f"http://{admin}/connections", timeout=10) as answer:
        connections = len(json.loads(answer.read())["connections"])
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as answer:
        metrics = len(answer.read())
    return connections, metrics


def consume(consumer: object, traffic: Traffic, drained: threading.Event) -> None:
    """Receive and acknowledge until the producers stopped and everything acknowledged arrived."""
    import pulsar

    while not drained.is_set():
        try:
            message = consumer.receive(500)  # type: ignore[attr-defined]
        except pulsar.Timeout:
            continue
        consumer.acknowledge(message)  # type: ignore[attr-defined]
        with traffic.lock:
            traffic.received += 1


@dataclass
class Row:
    minute: float
    rss: int
    fds: int
    cpu_percent: float
    sent: int
    received: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    recording: int
    #: with --churn: sessions begun in the window, connections served at its end, /metrics' size (bytes)
    churned: int = 0
    connections: int = 0
    metrics: int = 0


HEADER = (f"{'min':>6} {'RSS MiB':>8} {'fds':>5} {'CPU %':>6} {'sent':>8} {'recv':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'max ms':>7} {'rec MiB':>8}")
CHURN_HEADER = f" {'churned':>8} {'conns':>6} {'metrics KiB':>12}"


def sample(pid: int, recordings: Path, traffic: Traffic, args: argparse.Namespace, admin: str | None) -> list[Row]:
    rows: list[Row] = []
    started = time.monotonic()
    _, _, cpu_before = proc_status(pid)
    sent_before = received_before = churned_before = 0
    print(HEADER + (CHURN_HEADER if args.churn else ""), flush=True)
    interrupted = False
    try:
        while time.monotonic() - started < args.minutes * 60:
            window_end = min(started + (len(rows) + 1) * args.interval, started + args.minutes * 60)
            time.sleep(max(0.0, window_end - time.monotonic()))
            elapsed = time.monotonic() - started
            rss, fds, cpu = proc_status(pid)
            latencies, sent, _, _, received = traffic.take()
            churned = traffic.churned
            connections, metrics = admin_sample(admin) if args.churn and admin else (0, 0)
            window_s = args.interval if not rows else elapsed - rows[-1].minute * 60
            row = Row(elapsed / 60, rss, fds, 100 * (cpu - cpu_before) / max(window_s, 1e-9),
                      sent - sent_before, received - received_before, 1000 * percentile(latencies, 0.5),
                      1000 * percentile(latencies, 0.99), 1000 * max(latencies, default=float("nan")),
                      dir_size(recordings), churned - churned_before, connections, metrics)
            cpu_before, sent_before, received_before, churned_before = cpu, sent, received, churned
            rows.append(row)
            print(f"{row.minute:>6.1f} {row.rss / 2**20:>8.1f} {row.fds:>5} {row.cpu_percent:>6.1f} {row.sent:>8} "
                  f"{row.received:>8} {row.p50_ms:>7.1f} {row.p99_ms:>7.1f} {row.max_ms:>7.1f} "
                  f"{row.recording / 2**20:>8.1f}"
                  + (f" {row.churned:>8} {row.connections:>6} {row.metrics / 1024:>12.1f}" if args.churn else ""),
                  flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: the rows so far", flush=True)
    if interrupted and not rows:
        raise SystemExit(130)
    return rows


def report(rows: list[Row], traffic: Traffic, warnings: list[str]) -> None:
    steady = rows[1:] if len(rows) > 2 else rows
    minutes = [r.minute for r in steady]
    rss_slope = slope(minutes, [r.rss / 2**20 for r in steady])
    fd_slope = slope(minutes, [float(r.fds) for r in steady])
    print("\ntrend (after the first window):")
    if steady:
        print(f"  RSS {steady[0].rss / 2**20:.1f} -> {steady[-1].rss / 2**20:.1f} MiB, slope {rss_slope:+.2f} MiB/min "
              f"({'flat' if abs(rss_slope) < 0.5 else 'GROWING' if rss_slope > 0 else 'shrinking'})")
        print(f"  fds {steady[0].fds} -> {steady[-1].fds}, slope {fd_slope:+.2f}/min "
              f"({'flat' if abs(fd_slope) < 0.5 else 'GROWING' if fd_slope > 0 else 'shrinking'})")
        print(f"  CPU {statistics.fmean(r.cpu_percent for r in steady):.1f} % on average; send p99 "
              f"{statistics.fmean(r.p99_ms for r in steady):.1f} ms on average, worst send "
              f"{max(r.max_ms for r in steady):.1f} ms")
    print(f"  messages: {traffic.sent:,} sent, {traffic.acked:,} acknowledged, {traffic.failed:,} failed, "
          f"{traffic.received:,} received ({'all' if traffic.received >= traffic.acked else 'MISSING some'})")
    if traffic.churned:
        print(f"  churn: {traffic.churned:,} client sessions, {traffic.churn_failed:,} failed; connections served "
              f"{steady[0].connections} -> {steady[-1].connections}, /metrics {steady[0].metrics / 1024:.1f} -> "
              f"{steady[-1].metrics / 1024:.1f} KiB")
        for error in traffic.churn_errors:
            print(f"    {error[:200]}")
    print(f"  proxy warnings/errors in its log: {len(warnings)}")
    for line in warnings[:5]:
        print(f"    {line[:200]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="how long (default 5)")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds per row (default 30)")
    parser.add_argument("--rate", type=int, default=2000, help="messages per second in total (default 2000)")
    parser.add_argument("--producers", type=int, default=4, help="producers, one topic each (default 4)")
    parser.add_argument("--consumers", type=int, default=2, help="Shared consumers on all topics (default 2)")
    parser.add_argument("--size", type=int, default=200, help="message size in bytes (default 200)")
    parser.add_argument("--no-rules", action="store_true", help="run the proxy without rules")
    parser.add_argument("--no-record", action="store_true", help="run the proxy without recording")
    parser.add_argument("--churn", type=float, default=0.0, metavar="N",
                        help="N short-lived client sessions a second beside the steady traffic (default 0: none)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
