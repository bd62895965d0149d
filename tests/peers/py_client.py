"""The official Python client (``pulsar-client``, its C++ core) as a command the tests drive as a subprocess.

Same options and same one-line JSON report as the Java client (``java-client/PeerClient.java``)
and the Go client (``go-client/main.go``): it subscribes, produces N messages whose payloads
carry their index, consumes them at the same time, and prints which indices the broker
acknowledged and which arrived, per partition and in order::

    python tests/peers/py_client.py --url pulsar://127.0.0.1:6650 --topic T --messages 10000 \\
        [--batching | --no-batching] [--compression LZ4] [--subscription S] [--tls-ca CA.pem] \\
        [--rate R] [--timeout S] [--send-timeout S] [--latencies] [--mode roundtrip|consume]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import pulsar


def payload(index: int) -> bytes:
    return f"{index:08d}|peer-message".encode()


def index_of(data: bytes) -> int:
    return int(data.split(b"|", 1)[0])


def id_text(message_id: Any) -> str:
    """LEDGER:ENTRY:BATCH_INDEX, the same text the Java and Go clients report."""
    return f"{message_id.ledger_id()}:{message_id.entry_id()}:{message_id.batch_index()}"


class Tally:
    """What was acknowledged and received, per partition, in order; shared by the producer and consumer threads."""

    def __init__(self, messages: int, latencies: bool) -> None:
        self.lock = threading.Lock()
        self.acked: dict[int, list[int]] = {}
        self.acked_ids: dict[int, list[str]] = {}
        self.acked_all: list[int] = []
        self.received: dict[int, list[int]] = {}
        self.received_ids: dict[int, list[str]] = {}
        self.seen: set[int] = set()
        self.latency_ms: list[float] | None = [0.0] * messages if latencies else None
        self.send_errors = 0
        self.first_send_error: str | None = None
        self.sent = 0
        self.produce_seconds = 0.0

    def on_receipt(self, index: int, sent_at: float, result: Any, message_id: Any) -> None:
        with self.lock:
            if result != pulsar.Result.Ok:
                self.send_errors += 1
                self.first_send_error = self.first_send_error or str(result)
                return
            self.acked.setdefault(message_id.partition(), []).append(index)
            self.acked_ids.setdefault(message_id.partition(), []).append(id_text(message_id))
            self.acked_all.append(index)
            if self.latency_ms is not None:
                self.latency_ms[index] = (time.monotonic() - sent_at) * 1000

    def on_message(self, index: int, message_id: Any) -> None:
        with self.lock:
            self.received.setdefault(message_id.partition(), []).append(index)
            self.received_ids.setdefault(message_id.partition(), []).append(id_text(message_id))
            self.seen.add(index)

    def all_acked_received(self, mode: str, messages: int) -> bool:
        with self.lock:
            if mode == "consume":
                return len(self.seen) >= messages
            return len(self.seen) >= len(self.acked_all) and self.seen.issuperset(self.acked_all)


def produce(client: pulsar.Client, args: argparse.Namespace, tally: Tally) -> None:
    producer = client.create_producer(
        args.topic, batching_enabled=args.batching,
        compression_type=getattr(pulsar.CompressionType, args.compression),
        block_if_queue_full=True, max_pending_messages=1000,
        send_timeout_millis=int(args.send_timeout * 1000))
    start = time.monotonic()
    for index in range(args.messages):
        if args.rate > 0:
            delay = start + index / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        sent_at = time.monotonic()
        producer.send_async(payload(index), lambda result, msg_id, i=index, at=sent_at:
                            tally.on_receipt(i, at, result, msg_id))
        tally.sent = index + 1
    producer.flush()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with tally.lock:
            if len(tally.acked_all) + tally.send_errors >= tally.sent:
                break
        time.sleep(0.01)
    tally.produce_seconds = time.monotonic() - start
    producer.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + args.timeout
    tally = Tally(args.messages, args.latencies)
    report: dict[str, Any] = {"client": "python", "topic": args.topic, "mode": args.mode}
    error: str | None = None
    tls = {"tls_trust_certs_file_path": args.tls_ca, "tls_validate_hostname": True} if args.tls_ca else {}
    logger = logging.getLogger("pulsar")
    logger.setLevel(logging.WARNING)
    client = pulsar.Client(args.url, operation_timeout_seconds=30, logger=logger, **tls)
    try:
        consumer = client.subscribe(args.topic, args.subscription, consumer_type=pulsar.ConsumerType.Exclusive,
                                    initial_position=pulsar.InitialPosition.Earliest)
        produce_error: list[BaseException] = []

        def producer_main() -> None:
            try:
                produce(client, args, tally)
            except Exception as exc:
                produce_error.append(exc)

        producer_thread = threading.Thread(target=producer_main, name="producer", daemon=True)
        if args.mode == "roundtrip":
            producer_thread.start()
        last_message = time.monotonic()
        while time.monotonic() < deadline:
            producing = producer_thread.is_alive()
            if not producing and tally.all_acked_received(args.mode, args.messages):
                break
            if not producing and time.monotonic() - last_message > args.idle:
                break
            try:
                message = consumer.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            last_message = time.monotonic()
            tally.on_message(index_of(message.data()), message.message_id())
            consumer.acknowledge(message)
        if args.mode == "roundtrip":
            producer_thread.join(max(0.0, deadline - time.monotonic()))
        if produce_error:
            error = f"producer: {produce_error[0]!r}"
        consumer.close()
    except Exception as exc:
        error = repr(exc)
    finally:
        client.close()
    with tally.lock:
        report.update(sent=tally.sent, send_errors=tally.send_errors, first_send_error=tally.first_send_error,
                      acked={str(p): v for p, v in sorted(tally.acked.items())},
                      acked_ids={str(p): v for p, v in sorted(tally.acked_ids.items())},
                      received={str(p): v for p, v in sorted(tally.received.items())},
                      received_ids={str(p): v for p, v in sorted(tally.received_ids.items())})
        if tally.latency_ms is not None:
            report["latency_ms"] = [round(v, 3) for v in tally.latency_ms]
        report.update(produce_seconds=round(tally.produce_seconds, 3),
                      elapsed_seconds=round(time.monotonic() - started, 3), error=error)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="py_client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compression", default="NONE", choices=["NONE", "LZ4", "ZLib", "ZSTD", "SNAPPY"],
                        type=lambda s: {"ZLIB": "ZLib"}.get(s.upper(), s.upper()))
    parser.add_argument("--subscription", default="peers")
    parser.add_argument("--tls-ca")
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--send-timeout", type=float, default=30.0,
                        help="a send not acknowledged in this many seconds fails")
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--latencies", action="store_true")
    parser.add_argument("--mode", choices=["roundtrip", "consume"], default="roundtrip")
    args = parser.parse_args(argv)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stderr.flush()
    # the C++ core's threads can abort a normal interpreter exit ("terminate called without an
    # active exception") after the client was closed; the report is out, so leave at once
    os._exit(status)
