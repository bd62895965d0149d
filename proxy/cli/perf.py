"""``pulsar-tap perf``: a load generator on the built-in client.

``produce`` runs N producers spread over the given topics at a target rate (0: as
fast as the pending-message limit allows) and measures publish latency (send to
receipt).  ``consume`` runs N consumers and measures end-to-end latency from the
publish time.  ``roundtrip`` does both at once, stamping each payload with its
send time so end-to-end latency is exact.  Progress goes to stderr once a second,
with how many producers or consumers are reconnecting and why while any is (a chaos
rule's cut, a broker away); the summary, with the reconnections counted
(``reconnects``), goes to stdout, as JSON with ``--json``.  A message delivered
again (its consumer reconnected before acknowledging it) counts once, the
redeliveries apart (``redelivered``); ``roundtrip`` ends when every message was
received and every send acknowledged.  SIGINT/SIGTERM stop the run
and print the summary of what ran (``"interrupted": true`` in the JSON), exit 0; a
second signal also skips closing the producers and consumers gracefully (the sends it
leaves without a receipt are counted as ``unfinished``, not as errors).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from proxy.wording import counted

NAME = "perf"
HELP = "load generator on the built-in client"
DESCRIPTION = """\
Produce and/or consume messages with the built-in Pulsar client and report
throughput and latency (p50/p99/max).  MODE is produce, consume or roundtrip;
'pulsar-tap perf MODE --help' lists its options.  Through a pulsar-tap proxy whose
rules cut connections, the progress lines say while producers or consumers are
reconnecting and why, and the summary counts the reconnections.

examples:
  pulsar-tap perf produce --url pulsar://127.0.0.1:6650 --topic perf --messages 100000 --size 1024
  pulsar-tap perf produce --url pulsar://127.0.0.1:6650 --topic a --topic b --producers 4 \\
      --rate 20000 --duration 30 --compression LZ4
  pulsar-tap perf consume --url pulsar://127.0.0.1:6650 --topic perf --subscription s --type Shared \\
      --consumers 2 --duration 30
  pulsar-tap perf roundtrip --url pulsar://127.0.0.1:6650 --topic rt --messages 50000 --json
"""

EPILOG = """\
exit status:
  0    done, or stopped by SIGINT/SIGTERM (the summary covers what ran; sends a second
       signal left without a receipt are counted as unfinished, not as errors)
  1    some messages could not be published (the summary counts them, with the first error)
  2    bad arguments, a broker that cannot be reached
"""
_MODES = {
    "produce": ("publish messages and measure publish latency (send to receipt)", """\
Publish messages from N producers spread over the topics, at --rate messages per
second in total (0: as fast as --max-pending allows), and measure publish latency
(send to receipt).  Stops after --messages (default 10000) or --duration.

examples:
  pulsar-tap perf produce --url pulsar://127.0.0.1:6650 --topic perf --messages 100000 --size 1024
  pulsar-tap perf produce --topic a --topic b --producers 4 --rate 20000 --duration 30 --compression LZ4
"""),
    "consume": ("consume messages and measure end-to-end latency (from publish time)", """\
Receive and acknowledge messages with N consumers of one subscription and measure
end-to-end latency from each message's publish time.  A new subscription starts at
--initial-position: latest (the default) reads only what is published from now on,
earliest reads the backlog first; an existing subscription carries on where it is.
Runs until --messages, --duration, or SIGINT/SIGTERM.

examples:
  pulsar-tap perf consume --url pulsar://127.0.0.1:6650 --topic perf --subscription s --duration 30
  pulsar-tap perf consume --topic orders --subscription backlog --initial-position earliest --messages 3000
  pulsar-tap perf consume --topic perf --subscription s --type Shared --consumers 4 --json
"""),
    "roundtrip": ("publish and consume at once, measuring exact end-to-end latency", """\
Publish and consume at once; each payload carries its send time, so end-to-end
latency is exact.  The subscription (default perf-roundtrip) starts at earliest
unless --initial-position latest.  Stops after --messages (default 10000) or
--duration, once the consumers have received what was published.

examples:
  pulsar-tap perf roundtrip --url pulsar://127.0.0.1:6650 --topic rt --messages 50000 --json
  pulsar-tap perf roundtrip --topic rt --rate 1000 --duration 60 --type Shared --consumers 2
"""),
}

_STAMP = struct.Struct(">Q")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="pulsar://127.0.0.1:6650", help="service URL (default %(default)s)")
    parser.add_argument("--topic", action="append", required=True, metavar="NAME",
                        help="topic to use, full or short name; repeat for several (producers/consumers are "
                             "spread over them)")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--messages", type=int, default=0, metavar="N",
                       help="stop after N messages in total (default: 10000 for produce and roundtrip, "
                            "no limit for consume)")
    limit.add_argument("--duration", type=float, default=0.0, metavar="S",
                       help="stop after S seconds (default: no limit)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--token", metavar="TOKEN", help="auth token (default: none)")


def _add_produce(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, default=0.0, metavar="R",
                        help="messages per second in total (default 0: as fast as --max-pending allows)")
    parser.add_argument("--size", type=int, default=1024, metavar="BYTES", help="payload bytes (default %(default)s)")
    parser.add_argument("--producers", type=int, default=1, metavar="N", help="number of producers (default 1)")
    batching = parser.add_mutually_exclusive_group()
    batching.add_argument("--batching", dest="batching", action="store_true", default=True,
                          help="batch messages (default)")
    batching.add_argument("--no-batching", dest="batching", action="store_false", help="send one message per SEND")
    parser.add_argument("--compression", default="NONE", choices=["NONE", "LZ4", "ZLIB", "ZSTD", "SNAPPY"],
                        type=str.upper, help="payload compression (default NONE)")
    parser.add_argument("--max-pending", type=int, default=1000, metavar="N",
                        help="messages a producer may have awaiting their receipt; sends wait beyond it "
                             "(default 1000)")


def _add_consume(parser: argparse.ArgumentParser, *, roundtrip: bool) -> None:
    parser.add_argument("--subscription", required=not roundtrip, default="perf-roundtrip" if roundtrip else None,
                        metavar="NAME",
                        help="subscription name" + (" (default perf-roundtrip)" if roundtrip else ""))
    parser.add_argument("--type", dest="sub_type", default="Exclusive",
                        choices=["Exclusive", "Shared", "Failover", "Key_Shared"],
                        help="subscription type (default Exclusive)")
    parser.add_argument("--initial-position", choices=["earliest", "latest"], type=str.lower,
                        default="earliest" if roundtrip else "latest",
                        help="where a new subscription starts: earliest reads the backlog, latest only new "
                             f"messages (default {'earliest' if roundtrip else 'latest'})")
    parser.add_argument("--consumers", type=int, default=1, metavar="N", help="number of consumers (default 1)")
    parser.add_argument("--receiver-queue-size", type=int, default=1000, metavar="N",
                        help="messages each consumer lets the broker push ahead (FLOW permits, default 1000)")


def configure(parser: argparse.ArgumentParser) -> None:
    from proxy.cli import HelpFormatter

    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True, parser_class=type(parser))
    parsers = {name: modes.add_parser(name, help=help_text, description=description, epilog=EPILOG,
                                      formatter_class=HelpFormatter)
               for name, (help_text, description) in _MODES.items()}
    for name, sub in parsers.items():
        _add_common(sub)
        if name != "consume":
            _add_produce(sub)
        if name != "produce":
            _add_consume(sub, roundtrip=name == "roundtrip")


@dataclass
class _Totals:
    messages: int = 0
    bytes: int = 0
    errors: int = 0
    #: deliveries of a message received before (a consumer reconnected, a close rule): not counted as messages
    redelivered: int = 0
    #: sends an interrupt cut short (the client closed with their receipts outstanding): not errors
    unfinished: int = 0
    last_messages: int = 0
    histogram: Any = None
    window: Any = None
    first_error: str | None = None

    def __post_init__(self) -> None:
        from proxy.client.latency import LatencyHistogram

        self.histogram = LatencyHistogram()
        self.window = LatencyHistogram()

    def record(self, size: int, latency: float) -> None:
        self.messages += 1
        self.bytes += size
        self.histogram.record(latency)
        self.window.record(latency)

    def summary(self, elapsed: float) -> dict[str, Any]:
        hist = self.histogram
        return {
            "messages": self.messages, "bytes": self.bytes, "errors": self.errors,
            **({"redelivered": self.redelivered} if self.redelivered else {}),
            **({"unfinished": self.unfinished} if self.unfinished else {}),
            "seconds": round(elapsed, 3),
            "msg_per_sec": round(self.messages / elapsed, 1) if elapsed > 0 else 0.0,
            "mbit_per_sec": round(self.bytes * 8 / elapsed / 1e6, 2) if elapsed > 0 else 0.0,
            "latency_ms": {name: round(value * 1000, 3) for name, value in (
                ("mean", hist.mean), ("p50", hist.percentile(50)), ("p95", hist.percentile(95)),
                ("p99", hist.percentile(99)), ("p999", hist.percentile(99.9)), ("max", hist.max))},
        }


#: how many of the latest messages a consumer received are remembered to tell a redelivery from a new message
#: (a redelivery comes within the unacknowledged ones: the receiver queue and what is in flight)
RECENT_MESSAGES = 1 << 18


class _Seen:
    """The latest ``limit`` messages received, by the hash of (topic, ledger, entry, batch index): bounded
    memory (~60 B a message) however long the run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: set[int] = set()
        self._order: deque[int] = deque()

    def first_time(self, topic: str, where: Any) -> bool:
        """Whether this is the message's first delivery (remembering it)."""
        key = hash((topic, where.ledger_id, where.entry_id, where.batch_index))
        if key in self._keys:
            return False
        self._keys.add(key)
        self._order.append(key)
        if len(self._order) > self.limit:
            self._keys.discard(self._order.popleft())
        return True


@dataclass
class _Run:
    args: argparse.Namespace
    produced: _Totals = field(default_factory=_Totals)
    consumed: _Totals = field(default_factory=_Totals)
    done_producing: bool = False
    #: the consumers have had --messages distinct messages
    done_consuming: bool = False
    #: the latest messages received (see _Seen): a second delivery of one is a redelivery
    received: _Seen = field(default_factory=lambda: _Seen(RECENT_MESSAGES))
    #: the producers and consumers once created (their connection state is reported as it changes)
    producers: list[Any] = field(default_factory=list)
    consumers: list[Any] = field(default_factory=list)
    #: stopped by SIGINT/SIGTERM
    interrupted: bool = False


def _validate(args: argparse.Namespace) -> None:
    from proxy.errors import UsageError

    for name in ("messages", "producers", "consumers", "size", "max_pending", "receiver_queue_size"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative")
    if getattr(args, "producers", 1) < 1 or getattr(args, "consumers", 1) < 1:
        raise UsageError("need at least one producer and one consumer")
    if args.duration < 0 or getattr(args, "rate", 0) < 0:
        raise UsageError("--duration and --rate must not be negative")
    if args.mode == "roundtrip" and args.size < _STAMP.size:
        raise UsageError(f"roundtrip needs --size of at least {_STAMP.size} bytes (the send time stamp)")
    if args.mode != "consume" and not args.messages and not args.duration:
        args.messages = 10_000


def run(args: argparse.Namespace) -> int:
    import trio

    from proxy.client.names import parse_service_url

    _validate(args)
    parse_service_url(args.url)
    state = _Run(args)
    summary = trio.run(_main, state)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    failed = summary.get("produce", {}).get("errors", 0)
    return 1 if failed else 0


async def _main(state: _Run) -> dict[str, Any]:
    import trio

    from proxy.cli.interrupt import on_signals
    from proxy.client import PulsarClient
    from proxy.errors import ClientError, ConnectionFailed

    args = state.args
    started = trio.current_time()
    stopped_at: float | None = None
    measuring = trio.CancelScope()

    def on_signal(count: int) -> None:
        nonlocal stopped_at
        state.interrupted = True
        stopped_at = stopped_at or trio.current_time()
        measuring.cancel()  # the first signal ends the measurement; the client still closes properly
        if count > 1:
            everything.cancel()

    with trio.CancelScope() as everything, on_signals(on_signal):
        try:
            async with PulsarClient(args.url, token=args.token, operation_timeout=30.0) as client:
                with measuring:
                    consumers = state.consumers
                    if args.mode in ("consume", "roundtrip"):
                        for index in range(args.consumers):
                            topic = args.topic[index % len(args.topic)]
                            consumers.append(await client.subscribe(
                                topic, args.subscription, subscription_type=args.sub_type,
                                initial_position=args.initial_position.capitalize(),
                                receiver_queue_size=args.receiver_queue_size))
                    producers = state.producers
                    if args.mode in ("produce", "roundtrip"):
                        for index in range(args.producers):
                            topic = args.topic[index % len(args.topic)]
                            producers.append(await client.create_producer(
                                topic, compression=args.compression, batching=args.batching,
                                max_pending_messages=args.max_pending))
                    started = trio.current_time()
                    async with trio.open_nursery() as nursery:
                        if not args.quiet:
                            nursery.start_soon(_report, state, started)
                        if args.duration:
                            nursery.cancel_scope.deadline = started + args.duration
                        async with trio.open_nursery() as workers:
                            for consumer in consumers:
                                workers.start_soon(_consume, state, consumer, workers.cancel_scope)
                            if producers:
                                workers.start_soon(_produce_all, state, producers, workers.cancel_scope,
                                                   bool(consumers))
                        nursery.cancel_scope.cancel()
                stopped_at = stopped_at or trio.current_time()
        except ConnectionFailed as exc:
            if not state.interrupted:
                raise ClientError(f"cannot reach {args.url}: {exc}") from None
    elapsed = max(0.0, (stopped_at or trio.current_time()) - started)
    summary: dict[str, Any] = {"mode": args.mode, "url": args.url, "topics": args.topic}
    if state.interrupted:
        summary["interrupted"] = True
    if args.mode in ("produce", "roundtrip"):
        summary["produce"] = state.produced.summary(elapsed)
        summary["produce"]["reconnects"] = sum(producer.reconnects for producer in state.producers)
        summary["produce"]["config"] = {"producers": args.producers, "size": args.size, "rate": args.rate,
                                        "batching": args.batching, "compression": args.compression}
        if state.produced.first_error:
            summary["produce"]["first_error"] = state.produced.first_error
    if args.mode in ("consume", "roundtrip"):
        summary["consume"] = state.consumed.summary(elapsed)
        summary["consume"]["reconnects"] = sum(consumer.reconnects for consumer in state.consumers)
        summary["consume"]["config"] = {"consumers": args.consumers, "subscription_type": args.sub_type,
                                        "initial_position": args.initial_position}
    return summary


async def _produce_all(state: _Run, producers: list[Any], scope: Any, wait_for_consumers: bool) -> None:
    import trio

    args = state.args
    per_producer = [args.messages // len(producers) + (1 if i < args.messages % len(producers) else 0)
                    for i in range(len(producers))] if args.messages else [0] * len(producers)
    async with trio.open_nursery() as nursery:
        for producer, count in zip(producers, per_producer, strict=True):
            nursery.start_soon(_produce, state, producer, count, args.rate / len(producers))
    state.done_producing = True
    if not wait_for_consumers or state.done_consuming:
        scope.cancel()


async def _produce(state: _Run, producer: Any, count: int, rate: float) -> None:
    import trio

    from proxy.client.receipt import Receipt
    from proxy.errors import ClientClosed, ClientError

    args = state.args
    totals = state.produced
    body = bytes(args.size)
    start = trio.current_time()
    sent = 0

    def on_done(receipt: Receipt, sent_at: float) -> None:
        if receipt.error is not None:
            if state.interrupted and isinstance(receipt.error, ClientClosed):
                # (a second signal skipped the wait for outstanding receipts: the send was cut short, not refused)
                totals.unfinished += 1
                return
            totals.errors += 1
            totals.first_error = totals.first_error or str(receipt.error)
        else:
            totals.record(args.size, trio.current_time() - sent_at)

    while not count or sent < count:
        if rate > 0:
            await trio.sleep_until(start + sent / rate)
        payload = _STAMP.pack(time.time_ns()) + body[_STAMP.size:] if args.mode == "roundtrip" else body
        sent_at = trio.current_time()
        try:
            receipt = await producer.send_async(payload)
        except ClientError as exc:
            totals.errors += 1
            totals.first_error = totals.first_error or str(exc)
            continue
        receipt.add_done_callback(lambda r, t=sent_at: on_done(r, t))
        sent += 1
        if rate <= 0 and sent % 256 == 0:
            await trio.lowlevel.checkpoint()
    await producer.flush()


async def _consume(state: _Run, consumer: Any, scope: Any) -> None:
    args = state.args
    totals = state.consumed
    target = args.messages
    while True:
        message = await consumer.receive()
        now_ns = time.time_ns()
        if not state.received.first_time(message.topic, message.message_id):
            totals.redelivered += 1  # (its latency was taken at its first delivery)
            consumer.acknowledge(message)
            continue
        if args.mode == "roundtrip" and len(message.payload) >= _STAMP.size:
            latency = (now_ns - _STAMP.unpack_from(message.payload)[0]) / 1e9
        else:
            latency = max(0.0, now_ns / 1e9 - message.publish_time / 1000)
        totals.record(len(message.payload), latency)
        consumer.acknowledge(message)
        if target and totals.messages >= target:
            state.done_consuming = True
            if state.done_producing or not state.producers:
                scope.cancel()  # every consumer stops once the total is reached
            # (roundtrip: the producers still wait for receipts; the last of them to finish ends the run)
            return


async def _report(state: _Run, started: float) -> None:
    import trio

    last = started
    while True:
        await trio.sleep(1)
        now = trio.current_time()
        parts = [f"{now - started:7.1f}s"]
        for label, totals in (("produced", state.produced), ("consumed", state.consumed)):
            if totals.messages or totals.errors or (label == "produced" and state.args.mode != "consume") or (
                    label == "consumed" and state.args.mode != "produce"):
                rate = (totals.messages - totals.last_messages) / (now - last)
                totals.last_messages = totals.messages
                parts.append(f"{label} {rate:10.1f} msg/s  p50 {totals.window.percentile(50) * 1000:7.2f} ms  "
                             f"p99 {totals.window.percentile(99) * 1000:7.2f} ms  total {totals.messages}"
                             + (f"  errors {totals.errors}" if totals.errors else "")
                             + (f"  redelivered {totals.redelivered}" if totals.redelivered else ""))
                totals.window.reset()
        last = now
        for kind, handles in (("producer", state.producers), ("consumer", state.consumers)):
            waiting = [handle for handle in handles if not handle.is_connected]
            if waiting:  # (the messages stop meanwhile: say why)
                problem = next((handle.problem for handle in waiting if handle.problem), "connecting")
                parts.append(f"{len(waiting)} of {counted(len(handles), kind)} reconnecting: {problem}")
        print(" | ".join(parts), file=sys.stderr, flush=True)


def _print_summary(summary: dict[str, Any]) -> None:
    if summary.get("interrupted"):
        print("stopped by a signal: the figures cover what ran until then")
    for label in ("produce", "consume"):
        part = summary.get(label)
        if part is None:
            continue
        lat = part["latency_ms"]
        kind = "publish" if label == "produce" else "end-to-end"
        print(f"{label}: {counted(part['messages'], 'message')} in {part['seconds']} s = {part['msg_per_sec']} msg/s "
              f"({part['mbit_per_sec']} Mbit/s), errors {part['errors']}"
              + (f", redelivered {part['redelivered']}" if part.get("redelivered") else "")
              + (f", reconnects {part['reconnects']}" if part.get("reconnects") else "")
              + (f", {counted(part['unfinished'], 'send')} cut short by the signal" if part.get("unfinished") else ""))
        print(f"  {kind} latency ms: mean {lat['mean']} p50 {lat['p50']} p95 {lat['p95']} p99 {lat['p99']} "
              f"p99.9 {lat['p999']} max {lat['max']}")
        if part.get("first_error"):
            print(f"  first error: {part['first_error']}")
