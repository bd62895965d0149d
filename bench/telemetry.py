"""Benchmark: what telemetry costs — off, metrics only, traces at 100 % and at 1 % sampling.

Two measurements:

- ``proxy``: passthrough throughput through the real proxy.  An embedded broker
  runs as a ``pulsar-tap broker`` subprocess; the proxy (``ProxyServer``, with the
  telemetry observer attached per mode) runs as a process of its own too, as it is
  deployed (this script with ``--serve-proxy``; ``--in-process``: on a Trio thread of
  this process instead, as until stop 47, where it shared the interpreter lock with
  the client's sends and the relay's time held them up) (``off-again``: off once
  more, its ratio to off the measurement's own spread; ``noop-observer``: an
  observer that takes runs, as telemetry does, and does nothing, which separates the
  relay's and the observer hub's cost from telemetry's own; ``noop-frames``: one that
  takes frames one by one, so the relay decodes every frame for it); the official
  client produces ``--messages`` messages of ``--size`` bytes with batching off (one
  SEND and one SEND_RECEIPT per message, the worst case for per-frame telemetry)
  through it.  Modes run in ``--repeat`` rounds; in a round every mode's broker,
  proxy and producer are up together and the messages go through them in bursts of
  ``--burst``, through each mode in turn, the order shuffled each time
  (:func:`interleave.in_bursts`: the machine's speed drifts by a third within a minute
  here, every process's CPU a message alike, so modes run a phase each were compared
  on different machines: off against off once more read 0.84 to 1.45 a round).  Printed
  per mode: the median messages/s, each round's ratio to ``off`` in that round, their median and
  minimum, and per round the events the observer queue dropped (telemetry falling
  behind shows there, never as slower traffic) and the request spans exported.  On
  two cores the proxy is not saturated at these rates: the broker, the client and
  the proxy share the CPU, so what telemetry spends per message is taken from all of
  them; the CPU time per message (median over the rounds) of the proxy's relay
  thread, of its other threads (the span exporter's), of the broker process and of
  the client (this process) is printed too, with the total as a ratio to
  ``off``'s: less noisy on a busy machine than the rates.
- ``observer``: the sans-IO core alone: a scripted session of SEND/SEND_RECEIPT
  frames fed straight into :class:`proxy.telemetry.Telemetry` one by one (the full
  path), and the same frames as the relay hands passed-through bytes over: runs of
  ``--run-frames`` frames (SENDs, then their receipts) into the observer's ``on_run``
  (the data path); printed as microseconds per frame.
- ``split`` (not part of ``both``): where the metrics observer's time per message goes while the relay reads
  frames as fast as they come (each SEND and each receipt a run of its own, the lanes
  ``passed_send`` / ``passed_receipt``): the same one-frame runs through ``on_run`` with one part made a no-op
  on the instance at a time (the histogram's record, the metrics of a SEND (``send_passed``), of a receipt
  (``receipt_passed``, the histogram's record in it), both), and the lanes called without ``on_run``; the
  variants are interleaved ``--repeat`` times and the least CPU time (``thread_time``) of each is printed per
  message, with what leaving the part out saved.  What both metrics calls save is the metrics' own share;
  the rest is the lane and the tracker's book, which traces need as well.

Spans go to a discarding exporter behind the real batch span processor, so the
SDK's work is counted but no collector is needed.

Usage: ``.venv/bin/python bench/telemetry.py [--messages 200000] [--size 100]
[--repeat 5] [--run-frames 200] [--mode proxy|observer|both|split] [--arms off,metrics,...] [--in-process]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final

# The checkout this script lives in is the one measured (as the other benches do): without it, ``proxy`` was
# whatever the virtualenv's editable install points at, whichever worktree the script was run from.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import structlog
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy.cli.heap import settle_heap
from proxy.config.proxy_config import HostPort, LimitsConfig, ProxyConfig, ServiceUrl
from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, Observer, RunEvent
from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import Frame, encode_command, encode_payload_command, frame_from_bytes
from proxy.protocol.session import Direction
from proxy.server.app import ProxyServer
from proxy.telemetry import ExportSettings, TelemetryPipeline, build_telemetry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import CpuParts, Lane, Round, in_bursts, report, rotated, tap_process  # (a module of bench/)

sys.path.pop(0)

MODES = ("off", "off-again", "noop-observer", "noop-frames", "metrics", "traces-100%", "traces-1%")
#: messages of a phase through the proxy, and of the scripted sessions, unless --messages says
PROXY_MESSAGES: Final = 200_000
SCRIPTED_MESSAGES: Final = 60_000
#: messages of one burst through an arm (about 0.7 s at ~30 k/s; see interleave.in_bursts)
BURST_MESSAGES: Final = 20_000


class NoopFrameObserver:
    """Receives every event frame by frame and does nothing: the relay's cost of decoding for observers."""

    needs_observation = False  # raw frames only, like the recorder

    def on_frame(self, event: FrameEvent) -> None:
        del event

    def on_connection(self, event: ConnectionEvent) -> None:
        del event


class NoopObserver(NoopFrameObserver):
    """Takes passed-through bytes in runs, as telemetry does, and does nothing: the relay's and the hub's cost."""

    #: as telemetry's (``TelemetryObserver``): given the relay's views, and for the queue the hub's run ring's,
    #: not a copy of each run (without it the hub copied every run for this arm alone)
    run_views = True
    #: as telemetry's: a long run comes in pieces
    runs_in_pieces = True

    def on_run(self, event: RunEvent) -> None:
        del event


class DiscardingExporter(SpanExporter):
    """Counts spans and throws them away."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def pipeline_for(mode: str) -> TelemetryPipeline | None:
    if mode in ("off", "off-again", "noop-observer", "noop-frames"):
        return None
    if mode == "metrics":
        return build_telemetry(ExportSettings(), metrics=True)
    sample = 1.0 if mode == "traces-100%" else 0.01
    return build_telemetry(ExportSettings(sample=sample), metrics=True, span_exporter=DiscardingExporter(), seed=1)


# -- through the proxy ------------------------------------------------------------------------
class ProxyThread:
    def __init__(self, server: ProxyServer) -> None:
        self.server = server
        self.token: trio.lowlevel.TrioToken | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def main() -> None:
            self.token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.server.run)
                self.ready.set()
        trio.run(main)

    def __enter__(self) -> str:
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError("proxy did not start")
        return f"pulsar://{self.server.main_address}"

    def __exit__(self, *exc: object) -> None:
        assert self.token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(self.server.request_shutdown)
        self.thread.join(30)


def observers_for(mode: str, pipeline: TelemetryPipeline | None) -> list[Observer]:
    if mode == "noop-observer":
        return [NoopObserver()]
    if mode == "noop-frames":
        return [NoopFrameObserver()]
    return [pipeline.observer] if pipeline is not None else []


def proxy_config(service_url: str) -> ProxyConfig:
    return ProxyConfig(upstream=ServiceUrl.parse(service_url), listen=HostPort("127.0.0.1", 0),
                       limits=LimitsConfig(drain_seconds=0.5))


def spans_written(pipeline: TelemetryPipeline | None) -> int:
    """Flushes and shuts ``pipeline`` down; the request spans it exported."""
    if pipeline is None:
        return 0
    pipeline.force_flush()
    pipeline.shutdown()
    return pipeline.telemetry.spans.spans_written if pipeline.telemetry.spans else 0


def serve_proxy(mode: str, service_url: str, ready_file: Path, stats_file: Path) -> int:
    """The proxy of ``mode`` as a process of its own (the bench's ``--serve-proxy``): writes its address into
    ``ready_file`` once it listens, serves until SIGTERM or SIGINT, then writes the events its hub dropped and
    the spans exported into ``stats_file`` (JSON)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    pipeline = pipeline_for(mode)
    server = ProxyServer(proxy_config(service_url), observers=observers_for(mode, pipeline))

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                written = ready_file.with_name(ready_file.name + ".part")
                written.write_text(str(server.main_address), encoding="utf-8")
                written.replace(ready_file)
                settle_heap()  # (as pulsar-tap run does once it serves)
                async for _ in signals:
                    server.request_shutdown()
                    break

    trio.run(main)
    dropped = server.observers.dropped
    stats_file.write_text(json.dumps({"dropped": dropped, "spans": spans_written(pipeline)}), encoding="utf-8")
    return 0


@contextlib.contextmanager
def proxy_process(service_url: str, mode: str) -> Iterator[tuple[subprocess.Popen[bytes], str, dict[str, int]]]:
    """:func:`serve_proxy` in a child process: (the process, its service URL, its stats: filled in once it has
    ended)."""
    with tempfile.TemporaryDirectory() as tmp:
        ready, stats = Path(tmp) / "ready", Path(tmp) / "stats.json"
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-proxy", mode,
                                  "--upstream", service_url, "--ready-file", str(ready), "--stats-file", str(stats)],
                                 stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {mode} proxy did not start (exit {child.poll()})")
                time.sleep(0.02)
            ended: dict[str, int] = {}
            yield child, f"pulsar://{ready.read_text(encoding='utf-8')}", ended
            child.send_signal(signal.SIGTERM)
            child.wait(30)
            if stats.exists():
                ended.update(json.loads(stats.read_text(encoding="utf-8")))
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def open_lane(stack: contextlib.ExitStack, mode: str, size: int, round_: int, burst: int,
              in_process: bool) -> tuple[Lane, Callable[[], tuple[int, int]]]:
    """A fresh broker, the proxy of ``mode`` in front of it and an official client's producer through it, each
    to be closed by ``stack``: the arm's :class:`Lane` (a burst: ``burst`` messages sent and flushed) and what
    tells, once the proxy has ended, the events its hub dropped and the spans it exported.  The proxy runs as a
    process of its own, as it is deployed, or (``in_process``) on a thread of this one, sharing its interpreter
    lock with the client's sends."""
    import pulsar

    # a fresh broker per arm and round: no run inherits another's topics, memory or trouble
    broker, listen = stack.enter_context(tap_process("broker", "--listen", "127.0.0.1:0"))
    upstream = f"pulsar://{listen}"
    stats: Callable[[], tuple[int, int]]
    if in_process:
        pipeline = pipeline_for(mode)
        server = ProxyServer(proxy_config(upstream), observers=observers_for(mode, pipeline))
        proxy = ProxyThread(server)
        url = stack.enter_context(proxy)
        assert proxy.thread.native_id is not None
        parts = CpuParts(proxy.thread.native_id, broker_pid=broker.pid)

        def stats() -> tuple[int, int]:
            return server.observers.dropped, spans_written(pipeline)
    else:
        child, url, ended = stack.enter_context(proxy_process(upstream, mode))
        # (the proxy's Trio loop runs in its main thread)
        parts = CpuParts(child.pid, proxy_pid=child.pid, broker_pid=broker.pid)

        def stats() -> tuple[int, int]:
            return int(ended.get("dropped", -1)), int(ended.get("spans", -1))
    client = pulsar.Client(url, operation_timeout_seconds=30, log_conf_file_path=None,
                           logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    stack.callback(client.close)
    producer = client.create_producer(f"persistent://public/default/bench-{mode}-{round_}",
                                      batching_enabled=False, max_pending_messages=2000,
                                      block_if_queue_full=True, send_timeout_millis=20_000)
    payload = b"x" * size
    producer.send(payload)  # warm-up: lookup, connection, producer

    def send_burst() -> int:
        for _ in range(burst):
            producer.send_async(payload, None)
        producer.flush()
        return burst

    return Lane(parts, send_burst), stats


def bench_proxy(messages: int, size: int, repeat: int, modes: Sequence[str] = MODES, in_process: bool = False,
                burst: int = BURST_MESSAGES) -> None:
    burst = min(burst, messages)
    cycles = max(1, round(messages / burst))
    rounds: list[dict[str, Round]] = []
    notes: dict[str, list[tuple[int, int]]] = {}
    for round_ in range(repeat):
        tellers: dict[str, Callable[[], tuple[int, int]]] = {}
        with contextlib.ExitStack() as stack:
            opened: dict[str, Lane] = {}
            # (opened in a rotated order too: no mode's processes are always the oldest of the round)
            for mode in rotated(modes, round_):
                opened[mode], tellers[mode] = open_lane(stack, mode, size, round_, burst, in_process)
            rounds.append(in_bursts({mode: opened[mode] for mode in modes}, cycles, round_))
        for mode in rounds[-1]:
            notes.setdefault(mode, []).append(tellers[mode]())
    layout = ("the proxy on a thread of the client's process" if in_process
              else "the proxy, the broker and the client each a process")
    print(f"through the proxy: {cycles * burst} messages of {size} B an arm a round, in {cycles} bursts of {burst} "
          f"through each arm in turn, batching off (CPU count {os.cpu_count()}; {layout}); "
          "dropped: observer events the queue dropped, spans: request spans exported (per round)")
    report(rounds, modes, baseline="off", parts=("proxy thread", "other proxy", "broker", "client"),
           extra={mode: f"  dropped {' '.join(str(d) for d, _ in runs)} spans {' '.join(str(s) for _, s in runs)}"
                  for mode, runs in notes.items()})


# -- the observer alone -----------------------------------------------------------------------
def scripted_frames(count: int, size: int) -> list[tuple[Direction, Frame]]:
    topic = "persistent://public/default/bench"
    frames = [
        (Direction.TO_BROKER, frame_from_bytes(encode_command(api.CommandConnect(client_version="b",
                                                                                 protocol_version=21)))),
        (Direction.TO_CLIENT, frame_from_bytes(encode_command(api.CommandConnected(server_version="b",
                                                                                   protocol_version=21)))),
        (Direction.TO_BROKER, frame_from_bytes(encode_command(api.CommandProducer(topic=topic, producer_id=1,
                                                                                  request_id=1)))),
        (Direction.TO_CLIENT, frame_from_bytes(encode_command(api.CommandProducerSuccess(request_id=1,
                                                                                         producer_name="p")))),
    ]
    payload = b"x" * size
    for sequence_id in range(count):
        metadata = api.MessageMetadata(producer_name="p", sequence_id=sequence_id, publish_time=1,
                                       uncompressed_size=size)
        send = api.CommandSend(producer_id=1, sequence_id=sequence_id, num_messages=1)
        frames.append((Direction.TO_BROKER, frame_from_bytes(encode_payload_command(send, metadata, payload))))
        receipt = api.CommandSendReceipt(producer_id=1, sequence_id=sequence_id,
                                         message_id=api.MessageIdData(ledgerId=1, entryId=sequence_id))
        frames.append((Direction.TO_CLIENT, frame_from_bytes(encode_command(receipt))))
    return frames


def bench_observer(messages: int, size: int, repeat: int) -> None:
    print(f"observer alone: {messages} SEND + {messages} SEND_RECEIPT frames, best of {repeat}")
    print(f"{'mode':<14}{'us/frame':>10}{'frames/s':>12}")
    for mode in ("metrics", "traces-100%", "traces-1%"):
        best = float("inf")
        for _ in range(repeat):
            frames = scripted_frames(messages, size)  # fresh frames: lazily decoded parts are not cached
            pipeline = pipeline_for(mode)
            assert pipeline is not None
            telemetry = pipeline.telemetry
            telemetry.connection_opened(1, 0, "127.0.0.1:1", "pulsar://127.0.0.1:6650")
            ts = 1
            started = time.perf_counter()
            for direction, frame in frames:
                telemetry.frame(1, direction, frame, ts, forwarded_ns=ts)
                ts += 1000
            best = min(best, time.perf_counter() - started)
            pipeline.shutdown()
        per_frame = best / len(frames)
        print(f"{mode:<14}{per_frame * 1e6:>10.2f}{1 / per_frame:>12.0f}")


def bench_observer_runs(messages: int, size: int, repeat: int, run_frames: int) -> None:
    """The same frames in runs through ``on_run``, as the relay hands over bytes it passed through."""
    print(f"observer alone, in runs of {run_frames} frames (the relay's way): {messages} SEND + {messages} "
          f"SEND_RECEIPT frames, best of {repeat}")
    print(f"{'mode':<14}{'us/frame':>10}{'frames/s':>12}{'frames seen':>13}")
    info = ConnectionInfo(1, "127.0.0.1:1", "127.0.0.1:6650", "pulsar://127.0.0.1:6650")
    for mode in ("metrics", "traces-100%", "traces-1%"):
        best, seen = float("inf"), 0
        for _ in range(repeat):
            frames = scripted_frames(messages, size)
            handshake, data = frames[:4], frames[4:]
            sends = [frame.raw for direction, frame in data if direction is Direction.TO_BROKER]
            receipts = [frame.raw for direction, frame in data if direction is Direction.TO_CLIENT]
            events, ts, positions = [], 1, {Direction.TO_BROKER: 0, Direction.TO_CLIENT: 0}
            for start in range(0, messages, run_frames):
                for direction, raws in ((Direction.TO_BROKER, sends), (Direction.TO_CLIENT, receipts)):
                    run = b"".join(raws[start:start + run_frames])
                    events.append(RunEvent(info, direction, ts, run, 0, positions[direction], ts))
                    positions[direction] += len(run)
                    ts += 50_000
            pipeline = pipeline_for(mode)
            assert pipeline is not None
            telemetry, observer = pipeline.telemetry, pipeline.observer
            observer.on_connection(ConnectionEvent(info, 0, closed=False))
            for direction, frame in handshake:
                telemetry.frame(1, direction, frame, 0, forwarded_ns=0)
            started = time.perf_counter()
            for event in events:
                observer.on_run(event)
            best = min(best, time.perf_counter() - started)
            seen = telemetry.frames_seen - len(handshake)
            pipeline.shutdown()
        per_frame = best / (2 * messages)
        print(f"{mode:<14}{per_frame * 1e6:>10.2f}{1 / per_frame:>12.0f}{seen:>13}")


def _noop(*args: object) -> None:
    del args


#: the split's variants: the parts made no-ops (``metrics.``: on the ProxyMetrics; ``histogram.``: on its
#: latency histogram), or ``direct``: the lanes called without ``on_run``
SPLIT_VARIANTS: dict[str, tuple[str, ...]] = {
    "all of it": (),
    "lanes called directly": ("direct",),
    "histogram record": ("histogram.record",),
    "a SEND's metrics (send_passed)": ("metrics.send_passed",),
    "a receipt's (receipt_passed)": ("metrics.receipt_passed",),
    "both metrics calls": ("metrics.send_passed", "metrics.receipt_passed"),
}


def split_once(events: list[RunEvent], handshake: list[tuple[Direction, Frame]], left_out: tuple[str, ...]) -> float:
    """CPU seconds of one pass of ``events`` through a fresh metrics observer with ``left_out`` made no-ops."""
    pipeline = pipeline_for("metrics")
    assert pipeline is not None and pipeline.telemetry.metrics is not None
    telemetry, observer, metrics = pipeline.telemetry, pipeline.observer, pipeline.telemetry.metrics
    observer.on_connection(ConnectionEvent(events[0].connection, 0, closed=False))
    for direction, frame in handshake:
        telemetry.frame(1, direction, frame, 0, forwarded_ns=0)
    for part in left_out:
        owner, _, name = part.partition(".")
        if owner == "direct":
            continue
        target = metrics if owner == "metrics" else metrics.request_duration
        getattr(target, name)  # (a part that is no longer there raises here, rather than leaving nothing out)
        setattr(target, name, _noop)
    send, receipt = telemetry.passed_send, telemetry.passed_receipt
    started = time.thread_time()
    if "direct" in left_out:
        for event in events:
            lane = send if event.direction is Direction.TO_BROKER else receipt
            lane(1, event.data, event.ts_ns, event.forwarded_ns, event.connection.broker_url)
    else:
        for event in events:
            observer.on_run(event)
    spent = time.thread_time() - started
    pipeline.shutdown()
    return spent


def bench_metrics_split(messages: int, size: int, repeat: int) -> None:
    """See the module docstring (``split``)."""
    info = ConnectionInfo(1, "127.0.0.1:1", "127.0.0.1:6650", "pulsar://127.0.0.1:6650")
    frames = scripted_frames(messages, size)
    handshake, events, ts = frames[:4], [], 1
    positions = {Direction.TO_BROKER: 0, Direction.TO_CLIENT: 0}
    for direction, frame in frames[4:]:
        # (a view, as the hub's run ring hands runs over)
        events.append(RunEvent(info, direction, ts, memoryview(frame.raw), 0, positions[direction], ts))
        positions[direction] += len(frame.raw)
        ts += 50_000
    least = dict.fromkeys(SPLIT_VARIANTS, float("inf"))
    for _ in range(repeat):
        for variant, left_out in SPLIT_VARIANTS.items():
            least[variant] = min(least[variant], split_once(events, handshake, left_out))
    whole = least["all of it"] / messages * 1e6
    print(f"metrics observer, each SEND and receipt a run of one frame: {messages} messages of {size} B, "
          f"least CPU of {repeat} interleaved passes; us per message")
    print(f"{'without':<32}{'us/msg':>8}{'saves':>8}")
    for variant in SPLIT_VARIANTS:
        spent = least[variant] / messages * 1e6
        print(f"{variant:<32}{spent:>8.2f}{whole - spent:>8.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=None,
                        help="messages through each arm a round (default 200000, in bursts: see --burst; arms a phase "
                             "each of 60000 swung by up to a third against one another on two shared cores, two "
                             "phases of off alike: the machine's speed drifts), and of the observer's and the "
                             "split's scripted sessions (default 60000)")
    parser.add_argument("--burst", type=int, default=BURST_MESSAGES,
                        help=f"messages of a burst through one arm: a round sends --messages through each arm in "
                             f"bursts, through each in turn (default {BURST_MESSAGES})")
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--run-frames", type=int, default=200,
                        help="frames per run in the observer's runs measurement (default 200)")
    parser.add_argument("--mode", choices=("proxy", "observer", "both", "split"), default="both")
    parser.add_argument("--arms", default=",".join(MODES),
                        help=f"the modes measured through the proxy, comma-separated, off among them (default: all: "
                             f"{','.join(MODES)})".replace("%", "%%"))  # (argparse expands % in help)
    parser.add_argument("--in-process", action="store_true",
                        help="run the proxy on a thread of this process, beside the client's sends (its interpreter "
                             "lock shared with them), instead of as a process of its own as it is deployed")
    # (the proxy's side of a run: see serve_proxy)
    parser.add_argument("--serve-proxy", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stats-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_proxy:
        if not (args.upstream and args.ready_file and args.stats_file):
            parser.error("--serve-proxy needs --upstream, --ready-file and --stats-file")
        return serve_proxy(args.serve_proxy, args.upstream, args.ready_file, args.stats_file)
    if args.burst < 1 or args.repeat < 1 or (args.messages is not None and args.messages < 1):
        parser.error("--messages, --burst and --repeat take 1 at least")
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    if "off" not in arms or not set(arms) <= set(MODES):
        parser.error(f"--arms: some of {', '.join(MODES)}, off among them")
    print(f"load average at the start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    scripted = args.messages or SCRIPTED_MESSAGES
    if args.mode in ("observer", "both"):
        bench_observer(scripted, args.size, args.repeat)
        bench_observer_runs(scripted, args.size, args.repeat, args.run_frames)
    if args.mode in ("proxy", "both"):
        bench_proxy(args.messages or PROXY_MESSAGES, args.size, args.repeat, arms, args.in_process, args.burst)
    if args.mode == "split":
        bench_metrics_split(scripted, args.size, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
