"""``pulsar-tap demo --geo``: two clusters, pulsar-tap on the replication link, a consumer failing over.

:func:`open_geo_pair` is the rig (the demo's and the geo-replication tests'): two
embedded clusters, A and B, each replicating every topic to the other, and each
replicator going through a pulsar-tap proxy of its own — ``link A->B`` carries A's
replicator to B, ``link B->A`` the other way — with the same rules on both, each
recording what crosses it and serving the admin API (so rules can be added live).

The demo then drives the built-in client: a producer on A at ``--rate`` for
``--seconds``; a consumer of a replicated subscription (``replicate_subscription_state``)
on A that consumes ``--fail-over-after`` of the messages, acknowledges them and
disappears; once replication has caught up, the same subscription on B, whose first
message shows where B believed the consumer was.  It prints live progress (sent,
replicated, backlog, lag), then the lag table of link A->B from its recording (per
second of publish time: messages, p50 and max lag), the markers seen on each link,
the snapshots A completed, the rule hits, and the failover position error: how many
messages (and how many ms of traffic) the consumer is given again on B, or — if B
starts past where A stopped — how many it would have lost.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from proxy.wording import counted

if TYPE_CHECKING:
    from proxy.broker.embedded import ClusterRunner
    from proxy.broker.replication import ReplicatorCursor
    from proxy.client.consumer import Consumer
    from proxy.recording.replication import ReplicatedSend
    from proxy.server.stack import ProxyStack

TOPIC = "persistent://public/default/geo-orders"
SUBSCRIPTION = "geo-sub"
#: how long the demo waits for replication to drain and the last subscription update to land
SETTLE_TIMEOUT = 60.0
#: markers link B->A may still have in flight at the end without being stuck (a few, under the delay rule)
STALL_BACKLOG = 10


@dataclass
class GeoPair:
    """Two clusters replicating to each other, a proxy on each replication link."""

    a: ClusterRunner
    b: ClusterRunner
    #: the proxy A's replicator goes through to reach B, and the one B's goes through to reach A
    link_ab: ProxyStack | None
    link_ba: ProxyStack | None

    @property
    def url_a(self) -> str:
        return f"pulsar://{self.a.addresses[0]}"

    @property
    def url_b(self) -> str:
        return f"pulsar://{self.b.addresses[0]}"


@contextlib.asynccontextmanager
async def open_geo_pair(*, rules: str | list[Any] | None = None, record_dir: Path | None = None,
                        snapshot_period_ms: int = 1000, deduplication: bool = True, proxied: bool = True,
                        backlog_limit: int | None = None) -> AsyncIterator[GeoPair]:
    """Clusters A and B replicating to each other (through proxies unless ``proxied=False``)."""
    from proxy.broker.cluster import ClusterConfig
    from proxy.broker.embedded import open_cluster
    from proxy.broker.replicated_subscriptions import SnapshotSettings
    from proxy.broker.replication import DEFAULT_BACKLOG_LIMIT, GeoSettings
    from proxy.config.proxy_config import AdminConfig, HostPort, LimitsConfig, ProxyConfig, RecordConfig, ServiceUrl
    from proxy.server.stack import running_proxy

    def link(upstream: str, name: str) -> ProxyConfig:
        record = RecordConfig(dir=str(record_dir / name)) if record_dir is not None else None
        return ProxyConfig(upstream=ServiceUrl.parse(upstream), listen=HostPort("127.0.0.1", 0),
                           admin=AdminConfig(listen=HostPort("127.0.0.1", 0)), rules=rules, record=record,
                           limits=LimitsConfig(drain_seconds=0.5))

    snapshots = SnapshotSettings(period_ms=snapshot_period_ms)
    limit = backlog_limit if backlog_limit is not None else DEFAULT_BACKLOG_LIMIT
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(open_cluster(ClusterConfig(cluster_name="A", deduplication=deduplication)))
        b = await stack.enter_async_context(open_cluster(ClusterConfig(cluster_name="B", deduplication=deduplication)))
        link_ab = link_ba = None
        to_b, to_a = f"pulsar://{b.addresses[0]}", f"pulsar://{a.addresses[0]}"
        if proxied:
            link_ab = await stack.enter_async_context(running_proxy(link(to_b, "link-a-to-b")))
            link_ba = await stack.enter_async_context(running_proxy(link(to_a, "link-b-to-a")))
            to_b, to_a = f"pulsar://{link_ab.address}", f"pulsar://{link_ba.address}"
        await a.start_replication(GeoSettings("A", {"B": to_b}, snapshots, backlog_limit=limit))
        await b.start_replication(GeoSettings("B", {"A": to_a}, snapshots, backlog_limit=limit))
        yield GeoPair(a, b, link_ab, link_ba)


def replicator_of(cluster: ClusterRunner, remote: str, topic: str = TOPIC) -> ReplicatorCursor | None:
    """The replication cursor of ``topic`` towards ``remote`` (None until the topic exists)."""
    found = cluster.cluster.topics.get(topic)
    if found is None or found.geo is None:
        return None
    return found.geo.replicators.get(remote)


def caught_up(cluster: ClusterRunner, remote: str, topic: str = TOPIC) -> bool:
    """Everything written to ``topic`` so far has reached ``remote`` (or was not for it)."""
    replicator = replicator_of(cluster, remote, topic)
    return replicator is not None and replicator.backlog() == 0 and not replicator.in_flight


async def wait_caught_up(cluster: ClusterRunner, remote: str, topic: str = TOPIC) -> None:
    """Return once :func:`caught_up` (bound it with a cancel scope)."""
    while not caught_up(cluster, remote, topic):  # noqa: ASYNC110 - polls the cluster's counters
        await trio.sleep(0.1)


# -- the demo ------------------------------------------------------------------------------------------

@dataclass
class FailoverResult:
    """Where the consumer left A, and where B resumed it."""

    acknowledged_on_a: int = 0
    #: index of the first message the subscription gave on B (None: nothing came)
    first_on_b: int | None = None
    received_on_b: int = 0
    distinct_on_b: int = 0
    #: publish times (ms) of every message sent, by index
    publish_ms: dict[int, int] = field(default_factory=dict)

    @property
    def position_error(self) -> int | None:
        """Messages given again on B (negative: messages B skipped, which would be lost)."""
        return None if self.first_on_b is None else self.acknowledged_on_a - self.first_on_b

    @property
    def time_error_ms(self) -> int | None:
        if self.first_on_b is None:
            return None
        resume = self.publish_ms.get(self.acknowledged_on_a)
        first = self.publish_ms.get(self.first_on_b)
        return None if resume is None or first is None else resume - first


@dataclass
class Traffic:
    sent: int = 0
    failover: FailoverResult = field(default_factory=FailoverResult)
    drained_ab: bool = False
    #: what B's replicator still had to send to A at the end (markers only, in this demo)
    backlog_ba: int = 0
    seconds: float = 0.0


class _Stop:
    """SIGINT/SIGTERM: the first stops sending (the demo then settles and reports), the second stops waiting."""

    def __init__(self) -> None:
        self.signals = 0
        self.sending = trio.Event()
        self.waiting = trio.CancelScope()

    def __call__(self, count: int) -> None:
        self.signals = count
        self.sending.set()
        if count > 1:
            self.waiting.cancel()


async def run_demo(args: argparse.Namespace, rules: Path) -> int:
    """``pulsar-tap demo --geo``; returns the exit status (0 done or stopped, 1 messages never reached B)."""
    from proxy.cli.interrupt import on_signals

    stop = _Stop()
    with on_signals(stop):
        return await _run_demo(args, rules, stop)


async def _run_demo(args: argparse.Namespace, rules: Path, stop: _Stop) -> int:
    from proxy.telemetry.logs import configure_logging

    configure_logging("console", "warning")
    out = Path(args.out)
    print(f"demo --geo: clusters A and B replicating to each other, pulsar-tap on both links with {rules}, "
          f"recording under {out}/")
    async with open_geo_pair(rules=str(rules), record_dir=out, snapshot_period_ms=args.snapshot_period) as pair:
        assert pair.link_ab is not None and pair.link_ba is not None
        print(f"demo --geo: A {pair.url_a}, B {pair.url_b}; A->B via pulsar://{pair.link_ab.address} "
              f"(admin http://{pair.link_ab.admin_address}), B->A via pulsar://{pair.link_ba.address} "
              f"(admin http://{pair.link_ba.admin_address})")
        traffic = await _traffic(pair, args, stop)
        hits = {name: stack.engine.hits() if stack.engine is not None else {}
                for name, stack in (("A->B", pair.link_ab), ("B->A", pair.link_ba))}
        snapshots = _snapshot_summary(pair)
        recordings = {"A->B": pair.link_ab.recording_path, "B->A": pair.link_ba.recording_path}
    if stop.signals:
        print("\ndemo --geo: stopped by a signal: the figures and the recordings cover what ran until then")
    _summary(traffic, hits, snapshots, recordings, args)
    return 0 if traffic.drained_ab or stop.signals else 1


async def _traffic(pair: GeoPair, args: argparse.Namespace, stop: _Stop) -> Traffic:
    from proxy.client.client import PulsarClient

    traffic = Traffic()
    total = int(args.seconds * args.rate)
    stop_after = max(1, min(total, round(total * args.fail_over_after)))
    started = time.monotonic()
    tty = sys.stdout.isatty()
    notes: list[str] = []

    def progress(final: bool = False) -> None:
        replicator = replicator_of(pair.a, "B")
        elapsed = time.monotonic() - started
        if replicator is None:
            return
        state = "up" if replicator.connected() else "DOWN"
        lag = replicator.stats.last_lag_ms
        line = (f"[{elapsed:5.1f}s] sent {traffic.sent:,}  on B {replicator.stats.messages_out:,}  "
                f"backlog {replicator.backlog():,}  lag {'-' if lag is None else f'{lag / 1000:.1f} s'}  "
                f"link A->B {state}")
        if tty:
            print(f"\r\033[K{line}", end="\n" if final else "", flush=True)
        elif final or int(elapsed * 2) % 4 == 0:
            print(line, flush=True)
        for note in notes:
            print(("\r\033[K" if tty else "") + note, flush=True)
        notes.clear()

    async with PulsarClient(pair.url_a) as client_a, PulsarClient(pair.url_b) as client_b:
        consumer = await client_a.subscribe(TOPIC, SUBSCRIPTION, initial_position="Earliest",
                                            replicate_subscription_state=True)
        producer = await client_a.create_producer(TOPIC, batching=False)

        async def consume_on_a() -> None:
            while traffic.failover.acknowledged_on_a < stop_after:
                message = await consumer.receive()
                consumer.acknowledge(message)
                traffic.failover.acknowledged_on_a += 1
            await consumer.close()
            stopped = counted(stop_after, 'message', grouped=True)
            notes.append(f"demo --geo: the consumer stops on A after {stopped} (A is lost to it); "
                         "its subscription follows to B through the snapshots")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume_on_a)
            next_report = started
            for index in range(total):
                if stop.sending.is_set():
                    break
                await producer.send_async(f"{index:08d}".encode())
                traffic.failover.publish_ms[index] = int(time.time() * 1000)
                traffic.sent += 1
                now = time.monotonic()
                if now >= next_report:
                    progress()
                    next_report = now + 0.5
                with trio.move_on_at(trio.current_time() + max(0.0, started + (index + 1) / args.rate - now)):
                    await stop.sending.wait()
            await producer.flush()
            if stop.sending.is_set() and traffic.failover.acknowledged_on_a < stop_after:
                nursery.cancel_scope.cancel()  # stopped early: the consumer leaves A where it is now
        if not consumer.closed:
            await consumer.close()
        with stop.waiting:
            deadline = time.monotonic() + SETTLE_TIMEOUT
            while time.monotonic() < deadline and not _all_data_on_b(pair, traffic.sent):
                progress()
                await trio.sleep(0.5)
            with trio.move_on_after(5.0):
                await wait_caught_up(pair.b, "A")
            progress(final=True)
            await _resume_on_b(client_b, traffic.failover, traffic.sent)
        traffic.drained_ab = _all_data_on_b(pair, traffic.sent)
        back = replicator_of(pair.b, "A")
        traffic.backlog_ba = back.backlog() if back is not None else 0
    traffic.seconds = time.monotonic() - started
    return traffic


def _all_data_on_b(pair: GeoPair, sent: int) -> bool:
    replicator = replicator_of(pair.a, "B")
    return replicator is not None and replicator.stats.messages_out >= sent


async def _resume_on_b(client: Any, failover: FailoverResult, total: int) -> None:
    """Subscribe on B as the failed-over consumer: the first message says where B resumed it."""
    consumer: Consumer = await client.subscribe(TOPIC, SUBSCRIPTION, initial_position="Earliest",
                                                replicate_subscription_state=True)
    seen: set[int] = set()
    with trio.move_on_after(30.0):
        while failover.first_on_b is None or len(seen) < total - failover.first_on_b:
            with trio.move_on_after(3.0) as idle:
                message = await consumer.receive()
            if idle.cancelled_caught:
                break
            index = int(message.payload)
            failover.publish_ms[index] = message.publish_time  # as B stored it: A's publish time
            if failover.first_on_b is None:
                failover.first_on_b = index
            failover.received_on_b += 1
            seen.add(index)
            consumer.acknowledge(message)
    failover.distinct_on_b = len(seen)
    await consumer.close()


def _snapshot_summary(pair: GeoPair) -> dict[str, Any]:
    topic = pair.a.cluster.topics.get(TOPIC)
    controller = topic.geo.controller if topic is not None and topic.geo is not None else None
    if controller is None:
        return {}
    durations = sorted(controller.stats.durations_ms)
    return {"started": controller.stats.started, "completed": controller.stats.completed,
            "timed_out": controller.stats.timed_out, "pending": len(controller.pending),
            "updates": controller.stats.updates_written,
            "p50_ms": durations[len(durations) // 2] if durations else None,
            "max_ms": durations[-1] if durations else None}


def _summary(traffic: Traffic, hits: dict[str, dict[str, int]], snapshots: dict[str, Any],
             recordings: dict[str, Path | None], args: argparse.Namespace) -> None:
    from proxy.recording.reader import open_recordings
    from proxy.recording.replication import lag_table, replicated_sends

    sends: dict[str, list[ReplicatedSend]] = {}
    for name, path in recordings.items():
        sends[name] = replicated_sends(open_recordings(path).frames()) if path is not None else []
    print()
    print("replication lag on link A->B (from its recording: publish on A -> stored on B, per second)")
    print(f"  {'second':>6}{'messages':>10}{'stored':>8}{'p50 lag':>10}{'max lag':>10}")
    rows = lag_table(sends["A->B"])
    origin = rows[0].start_ms if rows else 0
    for row in rows:
        p50 = "-" if row.p50_ms is None else f"{row.p50_ms / 1000:.2f} s"
        worst = "-" if row.max_ms is None else f"{row.max_ms / 1000:.2f} s"
        print(f"  {(row.start_ms - origin) // 1000:>6}{row.messages:>10,}{row.confirmed:>8,}{p50:>10}{worst:>10}")
    print()
    print("replication markers on the links (SENDs of the replicators)")
    for name, rows_sent in sends.items():
        kinds = Counter(send.marker for send in rows_sent if send.marker is not None)
        text = ", ".join(f"{kind.removeprefix('REPLICATED_SUBSCRIPTION_')} {count}"
                         for kind, count in sorted(kinds.items())) or "none"
        print(f"  {name}: {text}")
    if snapshots:
        timing = "" if snapshots["p50_ms"] is None else \
            f"; round trip p50 {snapshots['p50_ms'] / 1000:.2f} s, max {snapshots['max_ms'] / 1000:.2f} s"
        print(f"  snapshots taken by A: {snapshots['completed']} completed of {snapshots['started']} started, "
              f"{snapshots['timed_out']} timed out, {snapshots['pending']} pending{timing}; "
              f"{snapshots['updates']} subscription updates sent")
    print()
    _print_failover(traffic)
    if not traffic.drained_ab:
        print("  (A->B replication had not caught up when the demo stopped waiting)")
    if traffic.backlog_ba > STALL_BACKLOG:
        print(f"  (link B->A still had {traffic.backlog_ba:,} markers waiting: see its rule hits)")
    print()
    print("rule hits")
    for link, counts in hits.items():
        print(f"  {link}: " + (", ".join(f"{name} {count:,}" for name, count in counts.items()) or "no rules"))
    print()
    print("recordings: " + ", ".join(f"{name} {path}" for name, path in recordings.items()))
    ab = recordings["A->B"]
    print("try next:")
    print(f"  pulsar-tap show {ab} --command SEND | grep marker      # the snapshot protocol, step by step")
    print(f"  pulsar-tap show {recordings['B->A']} --command SEND,SEND_RECEIPT")
    other = "wan-degradation" if "lost-snapshots" in str(args.rules or "") else "wan-lost-snapshots"
    print(f"  pulsar-tap demo --geo --rules rules/{other}.yaml --out {args.out}-{other}")


def _print_failover(traffic: Traffic) -> None:
    failover = traffic.failover
    acked = failover.acknowledged_on_a
    print(f"failover: the consumer acknowledged {counted(acked, 'message', grouped=True)} on A "
          f"(#0..#{acked - 1:,}) and moved to B")
    error = failover.position_error
    if error is None:
        print("  B gave the subscription nothing: position unknown")
        return
    seconds = failover.time_error_ms
    span = "" if seconds is None else f" ({abs(seconds) / 1000:.2f} s of traffic)"
    given = counted(abs(error), "message", grouped=True)
    if error > 0:
        print(f"  B resumed it at #{failover.first_on_b:,}: {given}{span} delivered again, none lost")
    elif error == 0:
        print(f"  B resumed it at #{failover.first_on_b:,}: exactly where it left A")
    else:
        print(f"  B resumed it at #{failover.first_on_b:,}: {given}{span} skipped (lost to it)")
    if failover.first_on_b == 0 and acked > 0:
        print("  (no subscription update reached B: it started the subscription from the earliest message)")
    print(f"  on B it received {counted(failover.received_on_b, 'message', grouped=True)} "
          f"({failover.distinct_on_b:,} distinct)")


__all__ = ["GeoPair", "open_geo_pair", "run_demo"]
