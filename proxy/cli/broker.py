"""``pulsar-tap broker``: run the embedded in-memory Pulsar broker cluster.

N brokers listen on consecutive ports from the ``--listen`` port (or on ephemeral
ports when it is 0); each prints ``ready: listening on HOST:PORT`` once it accepts
connections, lowest port first; ``--ready-file`` also writes the addresses as
JSON.  SIGINT or SIGTERM stop the cluster cleanly with exit status 0 (a second
signal too, with no traceback).  A busy port is one line naming it (``--listen``
port, one of the consecutive broker ports, or ``--admin``), exit status 2.
``--replicate-to NAME=URL`` geo-replicates every topic to another cluster
(:mod:`proxy.broker.replicator`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.broker.replication import GeoSettings

NAME = "broker"
#: a server process: numpy's BLAS keeps to one thread (see proxy.native_threads)
ONE_THREAD = True
HELP = "run the embedded in-memory Pulsar broker (a cluster of N brokers)"
DESCRIPTION = """\
Run an in-memory Apache Pulsar broker cluster that the official clients accept.
N brokers listen on consecutive ports starting at the --listen port; every topic
is owned by one of them (a stable hash of its name) and lookups on the others
answer Redirect.  New topics are created on first use, as partitioned topics of
N partitions when --partitions is given.  Every message is kept in memory (up to
--retention-mb per topic, oldest dropped first).

examples:
  pulsar-tap broker --listen 127.0.0.1:6650
  pulsar-tap broker --listen 127.0.0.1:6650 --brokers 3 --partitions 4 --admin 127.0.0.1:8080
  pulsar-tap broker --topic orders=4 --topic persistent://acme/ns/audit --ready-file /tmp/ready.json
  pulsar-tap broker --auth-token token.txt --keepalive 10
  pulsar-tap broker --failover-delay-ms 0      # Failover consumers get messages at once
  pulsar-tap broker --namespaces public/default,acme/orders   # other namespaces do not exist

geo-replication (two clusters replicating to each other; put `pulsar-tap run` on a link
to delay, cut or drop what crosses it):
  pulsar-tap broker --cluster A --listen 127.0.0.1:6650 --replicate-to B=pulsar://127.0.0.1:6660
  pulsar-tap broker --cluster B --listen 127.0.0.1:6660 --replicate-to A=pulsar://127.0.0.1:6650

  Every topic is copied to every remote cluster by a producer named
  pulsar.repl.<local>--><remote> (messages carry replicated_from; messages that came
  from another cluster are never copied again, and replicate_to is honoured).
  Subscriptions created with replicate_subscription_state follow to the other
  clusters: a consumer moving to another cluster resumes at, or at most one snapshot
  period plus one replication round trip before, where it left.
  Backlog policy: a replicator that falls more than --replication-backlog messages
  behind (remote down, slow link) skips the oldest messages it has not sent yet; they
  are counted as evicted in the topic stats and never reach that cluster.  With
  --deduplication, what a replicator sends twice after a broken link is stored once.
"""
EPILOG = """\
exit status:
  0    stopped by SIGINT/SIGTERM
  2    bad arguments, a busy port (named in the one error line)
"""

DEFAULT_LISTEN = "127.0.0.1:6650"


def _host_port(value: str, flag: str) -> tuple[str, int]:
    from proxy.errors import UsageError

    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{flag}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _topic(value: str) -> tuple[str, int]:
    from proxy.errors import UsageError

    name, sep, count = value.rpartition("=")
    if not sep:
        name, count = value, "0"
    if not name or not count.isdigit():
        raise UsageError(f"--topic: expected NAME or NAME=PARTITIONS, got {value!r}")
    return name, int(count)


def _namespaces(value: str) -> frozenset[str]:
    from proxy.errors import UsageError

    names = [name.strip() for name in value.split(",") if name.strip()]
    for name in names:
        parts = name.split("/")
        if len(parts) != 2 or not all(parts):
            raise UsageError(f"--namespaces: expected TENANT/NS, got {name!r}")
    return frozenset(names)


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return number


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", metavar="HOST:PORT", default=DEFAULT_LISTEN,
                        help=f"address of the first broker (default {DEFAULT_LISTEN}; port 0: ephemeral ports)")
    parser.add_argument("--brokers", metavar="N", type=_positive, default=1,
                        help="number of brokers, on consecutive ports (default 1)")
    parser.add_argument("--partitions", metavar="N", type=_positive, default=0,
                        help="auto-create new topics as partitioned topics of N partitions (default: not partitioned)")
    parser.add_argument("--topic", metavar="NAME[=PARTITIONS]", action="append", default=[],
                        help="pre-create a topic (full or short name), partitioned when PARTITIONS > 0; repeatable")
    parser.add_argument("--cluster", metavar="NAME", default="standalone",
                        help="cluster name, used in generated producer names (default standalone)")
    parser.add_argument("--admin", metavar="HOST:PORT",
                        help="serve the admin REST API (subset of Pulsar's admin API v2) here")
    parser.add_argument("--max-message-size", metavar="BYTES", type=_positive, default=5 * 1024 * 1024,
                        help="max_message_size advertised in CONNECTED (default 5 MiB)")
    parser.add_argument("--retention-mb", metavar="MB", type=_positive, default=1024,
                        help="messages kept per topic, oldest dropped first (default 1024)")
    parser.add_argument("--auth-token", metavar="FILE",
                        help="require token authentication with the token in FILE")
    parser.add_argument("--keepalive", metavar="SECONDS", type=float, default=30.0,
                        help="PING idle clients after this long and close them if the next PING gets no PONG "
                             "(default 30; 0 disables)")
    parser.add_argument("--failover-delay-ms", metavar="MS", type=_positive, default=1000,
                        help="a Failover subscription's newly active consumer (the first one too) gets its first "
                             "messages this long after it became active (default 1000, Pulsar's "
                             "activeConsumerFailoverDelayTimeMillis; 0: at once)")
    parser.add_argument("--namespaces", metavar="TENANT/NS,...",
                        help="only these namespaces exist (plus those of --topic and those created with PUT "
                             "/admin/v2/namespaces/TENANT/NS): a topic of another one is not found, as on a "
                             "real broker (default: every namespace exists)")
    parser.add_argument("--deduplication", action="store_true",
                        help="drop messages whose sequence id a producer name already stored")
    parser.add_argument("--replicate-to", metavar="NAME=URL", action="append", default=[],
                        help="geo-replicate every topic to cluster NAME at pulsar://HOST:PORT; repeatable")
    parser.add_argument("--snapshot-period", metavar="MS", type=_positive, default=1000,
                        help="replicated subscriptions: take a snapshot this often while data flows "
                             "(default 1000, Pulsar's replicatedSubscriptionsSnapshotFrequencyMillis)")
    parser.add_argument("--no-replicated-subscriptions", action="store_true",
                        help="ignore replicate_subscription_state (Pulsar's enableReplicatedSubscriptions=false)")
    parser.add_argument("--replication-backlog", metavar="MESSAGES", type=_positive, default=100_000,
                        help="most messages a replicator may fall behind; past it the oldest unsent are "
                             "skipped (default 100000)")
    parser.add_argument("--ready-file", metavar="PATH",
                        help='write {"listen": ["HOST:PORT", ...], "admin": "HOST:PORT"|null} once ready')
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log level (default info)")


def build_config(args: argparse.Namespace) -> tuple[object, list[int], tuple[str, int] | None]:
    """The ClusterConfig, broker ports and admin address for these arguments."""
    from proxy.broker.cluster import ClusterConfig
    from proxy.broker.naming import full_name
    from proxy.errors import BrokerError, UsageError

    host, port = _host_port(args.listen, "--listen")
    if args.brokers < 1:
        raise UsageError("--brokers: must be at least 1")
    if port and port + args.brokers - 1 > 65535:
        raise UsageError(f"--brokers: {args.brokers} ports from {port} run past 65535")
    ports = [port + i if port else 0 for i in range(args.brokers)]
    admin = _host_port(args.admin, "--admin") if args.admin else None
    topics: dict[str, int] = {}
    for value in args.topic:
        name, partitions = _topic(value)
        try:
            topics[full_name(name)] = partitions
        except BrokerError as exc:
            raise UsageError(f"--topic: {exc.message}") from None
    token = None
    if args.auth_token:
        try:
            token = Path(args.auth_token).read_text().strip()
        except OSError as exc:
            raise UsageError(f"--auth-token: cannot read {args.auth_token}: {exc.strerror or exc}") from None
        if not token:
            raise UsageError(f"--auth-token: {args.auth_token} is empty")
    if args.max_message_size < 1024:
        raise UsageError("--max-message-size: must be at least 1024 bytes")
    geo = _geo_settings(args)
    namespaces = _namespaces(args.namespaces) if args.namespaces is not None else None
    config = ClusterConfig(cluster_name=args.cluster, host=host, brokers=args.brokers,
                           auto_partitions=args.partitions, topics=topics,
                           max_message_size=args.max_message_size, retention_mb=args.retention_mb,
                           deduplication=args.deduplication, auth_token=token, keepalive_seconds=args.keepalive,
                           failover_delay_ms=args.failover_delay_ms, known_namespaces=namespaces, geo=geo)
    return config, ports, admin


def _geo_settings(args: argparse.Namespace) -> GeoSettings | None:
    """The GeoSettings of the replication flags, None without --replicate-to."""
    from proxy.broker.replicated_subscriptions import SnapshotSettings
    from proxy.broker.replication import GeoSettings
    from proxy.client.names import parse_service_url
    from proxy.errors import PulsarTapError, UsageError

    if not args.replicate_to:
        return None
    remotes: dict[str, str] = {}
    for value in args.replicate_to:
        name, sep, url = value.partition("=")
        if not sep or not name or not url:
            raise UsageError(f"--replicate-to: expected NAME=pulsar://HOST:PORT, got {value!r}")
        if name == args.cluster:
            raise UsageError(f"--replicate-to: {name} is this cluster's own name (--cluster)")
        if name in remotes:
            raise UsageError(f"--replicate-to: cluster {name} given twice")
        try:
            parse_service_url(url)
        except PulsarTapError as exc:
            raise UsageError(f"--replicate-to {name}: {exc}") from None
        remotes[name] = url
    if args.snapshot_period < 10:
        raise UsageError("--snapshot-period: must be at least 10 ms")
    if args.replication_backlog < 1:
        raise UsageError("--replication-backlog: must be at least 1")
    return GeoSettings(args.cluster, remotes, SnapshotSettings(period_ms=args.snapshot_period),
                       replicated_subscriptions=not args.no_replicated_subscriptions,
                       backlog_limit=args.replication_backlog)


def write_ready_file(path: str, listen: list[str], admin: str | None) -> None:
    Path(path).write_text(json.dumps({"listen": listen, "admin": admin}) + "\n")


def run(args: argparse.Namespace) -> int:
    import trio

    from proxy.broker.cluster import ClusterConfig
    from proxy.broker.embedded import ClusterRunner
    from proxy.cli.heap import settle_heap
    from proxy.cli.interrupt import on_signals
    from proxy.cli.ports import check_can_listen
    from proxy.errors import UsageError, find_error
    from proxy.telemetry.logs import configure_logging

    config, ports, admin = build_config(args)
    assert isinstance(config, ClusterConfig)
    for index, port in enumerate(ports):
        check_can_listen(config.host, port, "--listen" if index == 0 else f"broker {index + 1} of --brokers")
    if admin is not None:
        check_can_listen(admin[0], admin[1], "--admin")
    configure_logging("console", args.log_level)
    runner = ClusterRunner(config, ports, admin=admin)

    async def main() -> None:
        with trio.CancelScope() as everything, on_signals(lambda count: everything.cancel()):
            async with trio.open_nursery() as nursery:
                addresses: list[str] = await nursery.start(runner.run)
                if args.ready_file:
                    write_ready_file(args.ready_file, addresses, runner.admin_address)
                for address in sorted(addresses, key=lambda a: int(a.rpartition(":")[2])):
                    print(f"ready: listening on {address}", flush=True)
                if runner.admin_address is not None:
                    print(f"admin: listening on http://{runner.admin_address}", flush=True)
                settle_heap()  # (see proxy.cli.heap)
        print("stopped", file=sys.stderr, flush=True)

    try:
        trio.run(main)
    except (OSError, BaseExceptionGroup) as exc:
        os_error = find_error(exc, OSError)
        if os_error is None:
            raise
        # a port taken between the check and the bind
        raise UsageError(f"cannot listen: {os_error.strerror or os_error}") from None
    return 0
