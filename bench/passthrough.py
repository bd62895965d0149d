"""Benchmark of the proxy's fast path: direct vs haproxy vs Apache Pulsar's proxy vs pulsar-tap, in one run.

Measures, through each path to the same stand-in broker:

- passthrough throughput, one way: SEND frames of 100 B, 1 KiB, 16 KiB and 512 KiB
  (whole-frame sizes) written in 1 MiB writes; MiB/s and frames/s, timed from the
  client's first write to the broker's last byte;
- round-trip latency: p50/p99 of sequential SEND -> SEND_RECEIPT on one connection per
  path, every path's round trips taken in turn (:func:`interleaved_latency`);
- concurrency: 200 connections each doing sequential round trips; round trips/s.

haproxy runs ``mode tcp`` with one thread (Debian's package; skipped with a note if
missing); Apache Pulsar's own proxy (``ProxyServiceStarter`` 4.0.8 of tests/peers/,
installed by scripts/setup.sh; skipped with a note if missing) runs twice, at
``proxyLogLevel`` 0 (zero-copy splice) and 2 (it parses every frame), its clients
naming the broker in CONNECT's ``proxy_to_broker_url`` as Pulsar's clients do through
it, after a warm-up for its JIT; pulsar-tap runs with no rules, no recording and
telemetry off.  The stand-in broker and the load client are plain ``selectors`` loops
in their own processes, identical for every path, so the ratios compare the proxies.

Every path is started first and stays up; throughput (each size) and concurrency then run
in ``--interleave`` rounds (10), each round running each phase through every path one after
another (their order rotated each round), a phase lasting ``--duration`` / rounds.  The
machine's speed swings (two cores shared by client, sink and proxy; other work on it), so
a ratio is taken round by round, between phases that ran seconds apart: the table shows
each path's median over the rounds and the median of the per-round ratios, and a section
after it each round's tap/haproxy (and tap/baseline) ratio with their median and min.
Latency runs after the rounds, path by path.

    .venv/bin/python bench/passthrough.py              # the full run (about a minute)
    .venv/bin/python bench/passthrough.py --quick      # shorter phases
    .venv/bin/python bench/passthrough.py --interleave 8 --duration 4   # more, longer rounds
    .venv/bin/python bench/passthrough.py --profile /tmp/tap.prof   # pulsar-tap under cProfile
    .venv/bin/python bench/passthrough.py --no-pulsar-proxy         # without the two JVM arms
    .venv/bin/python bench/passthrough.py --observers               # only the observer arms (below)
    .venv/bin/python bench/passthrough.py --interleaved --baseline /tmp/main   # latency only, every
        path's round trips taken in turn (a shared machine's load shifts between phases), with a
        "python floor" path: the least a relay in Python does (one recv_into and one send a hop), what
        no Python proxy's round trip gets under on the machine
    .venv/bin/python bench/passthrough.py --interleaved --baseline /tmp/main \\
        --latency-observers 'metrics,traces 1%,recording'    # and what watching adds to a round trip
        (--pin: the proxies on a core of their own, the client and the stand-in broker on the other;
        --one-cpu: every process on one CPU, what each proxy's code costs without wake-ups across CPUs)
    .venv/bin/python bench/passthrough.py --baseline /tmp/main      # also the pulsar-tap of another
        checkout (e.g. ``git archive main | tar -x -C /tmp/main``), measured in the same rounds:
        a before/after from the same run, as the ``tap/baseline`` column

Observer arms (``--observers`` runs only these; a full run ends with them): pulsar-tap plain,
then with each observer alone — recording (``record: {dir}``), metrics (``admin`` set, /metrics
scraped once at the end), traces sampled at 1 % and 100 % (``tracing: {exporter: otlp,
sample}`` posting to an OTLP/HTTP sink on loopback that answers 200), 100 rules that match
nothing, 10 rules of which one (``mark``) matches 1 % of SENDs, and a second plain pulsar-tap
("plain again": its ratio to plain is the noise of the machine and of the bench alone, the
floor to read the other arms' ratios against) — each as frames/s of 100 B and 1 KiB SEND frames
and as a fraction of plain in the same run.  Here every SEND carries its own sequence id and
the stand-in broker answers each with a SEND_RECEIPT (read and discarded by the load client),
so telemetry has requests to pair.  As the paths above, every arm's pulsar-tap is started first
(each in a directory of its own: the recording arm's recordings; the traces arms share the OTLP
sink) and stays up, and the arms run in ``--observer-rounds`` rounds (3), each running 100 B
then 1 KiB through every arm in turn (their order rotated each round), a phase lasting
``--duration`` / rounds.  Before each phase the bench waits until its pulsar-taps (every arm's,
with their child processes) and the OTLP sink are quiet (under 0.05 cores together): an arm's
work left over after its phase (the traces arms export their spans after telemetry counted the
frames, the recording's writer flushes) would otherwise run in the next arm's phase — and
rotating the order keeps the arms' cyclic order, so the same arm would follow it every round
(100 rules ran right after traces 100 % every round, while that arm's span exports still used
0.1-0.3 cores).  The CPU the other arms' processes still used during a phase is printed with
the other parts (``others``).  The table shows per arm and size the median frames/s of the
rounds, the median of the per-round ratios to plain and their min, and pulsar-tap's CPU per
frame (every thread and the recording's writer process, from the scheduler's nanoseconds; a
telemetry arm's phase ends once its observer queue delivered the phase's frames) and plain's
CPU per frame over the arm's: on a busy machine the steadier figure, and the minor page faults
of its main thread (the relays) per thousand frames.  With ``--baseline DIR`` every chosen arm
(plain included) runs a second time, as "ARM @base", with that checkout's pulsar-tap, in the
same rounds; its ratios are to the baseline's plain, and a section prints each arm over the
baseline's same arm, round by round, and their CPU per frame.  The recording arm also prints
the frames the recorder wrote and dropped, and what is left of the frames that passed the proxy
(as its two ends counted them: the SENDs the sink received, the receipts the load client
received — it waits for all of them before it closes — and CONNECT, CONNECTED and the closing
PING): 0 unless frames were lost without being counted.  The telemetry arms print what share of
the SENDs and receipts telemetry saw (coverage), the events it dropped and how long the
/metrics scrape took.

    .venv/bin/python bench/passthrough.py --observers --no-pulsar-proxy
    .venv/bin/python bench/passthrough.py --observers --no-pulsar-proxy --arms recording --duration 9 \\
        --baseline /tmp/main          # 3 s phases; each arm again with the other checkout's pulsar-tap
    .venv/bin/python bench/passthrough.py --observers --arms '100 rules,10 rules' --observer-rounds 9
    .venv/bin/python bench/passthrough.py --observers --arms recording --profile-arm recording \\
        --py-spy /tmp/recording.txt      # py-spy's stacks of that arm's pulsar-tap over the whole run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from interleave import children_of, process_cpu_seconds, threads_of  # (a module of bench/: the script's directory)

from proxy.pb import PulsarApi_pb2 as api
from proxy.protocol.frame import encode_command, encode_payload_command, frame_from_bytes

PULSAR_PROXY_0 = "pulsar-proxy0"  # proxyLogLevel 0
PULSAR_PROXY_2 = "pulsar-proxy2"  # proxyLogLevel 2
SIZES = [("100 B", 100), ("1 KiB", 1024), ("16 KiB", 16 * 1024), ("512 KiB", 512 * 1024)]
WRITE_SIZE = 1024 * 1024
CONCURRENT_CONNECTIONS = 200

CONNECTED = encode_command(api.CommandConnected(server_version="bench", protocol_version=21,
                                                max_message_size=5 * 1024 * 1024))
RECEIPT = encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=1))
#: ends a throughput stream: the sink reports what it received once the stream ends with it.  (A
#: half-close would do, but Apache Pulsar's proxy closes both sides on a client's FIN and drops
#: what it still had to write to the broker.)
END_OF_STREAM = encode_command(api.CommandPing())


def connect_frame(mode: str, proxy_to: str | None = None) -> bytes:
    """CONNECT; through Pulsar's proxy it names the broker (``proxy_to_broker_url``), as clients do there."""
    command = api.CommandConnect(client_version=f"bench-{mode}", protocol_version=21)
    if proxy_to is not None:
        command.proxy_to_broker_url = proxy_to
    return encode_command(command)


def send_frame(total: int, sequence_id: int = 1) -> bytes:
    """A SEND frame of exactly ``total`` bytes (size prefix included)."""
    def build(payload: int) -> bytes:
        return encode_payload_command(api.CommandSend(producer_id=1, sequence_id=sequence_id),
                                      api.MessageMetadata(producer_name="bench", sequence_id=1, publish_time=1),
                                      b"x" * payload)
    frame = build(total - len(build(0)))
    assert len(frame) == total, (len(frame), total)
    return frame


#: sequence ids of the observer arms' SENDs: all of them three-byte varints, so every frame of a
#: size (and every receipt) has the same length
FIRST_SEQUENCE_ID = 1 << 14


def numbered_sends(total: int, count: int) -> bytes:
    """``count`` SEND frames of ``total`` bytes each, sequence ids FIRST_SEQUENCE_ID + 0, 1, ..."""
    return b"".join(send_frame(total, FIRST_SEQUENCE_ID + index) for index in range(count))


def numbered_receipts(count: int) -> bytes:
    """The SEND_RECEIPTs answering :func:`numbered_sends`, in order (all of one length)."""
    return b"".join(encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=FIRST_SEQUENCE_ID + index))
                    for index in range(count))


# -- the stand-in broker ---------------------------------------------------------------------
@dataclass
class _Peer:
    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)
    mode: str | None = None
    received: int = 0
    first_ns: int = 0
    last_ns: int = 0
    tail: bytes = b""
    reported: bool = False
    #: mode "sinkr-SIZE-COUNT": frames of SIZE bytes, answered in order from a ring of COUNT receipts
    frame_size: int = 0
    receipts: bytes = b""
    answered: int = 0


def _frames_in(buf: bytearray) -> int:
    """Count and remove the whole frames at the start of ``buf``."""
    pos, count, end = 0, 0, len(buf)
    while end - pos >= 4:
        size = int.from_bytes(buf[pos:pos + 4], "big") + 4
        if end - pos < size:
            break
        pos += size
        count += 1
    del buf[:pos]
    return count


def _write_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Write all of ``data`` to a non-blocking socket, waiting where it must (the stand-ins' loops stay simple)."""
    sock.setblocking(True)
    sock.sendall(data)
    sock.setblocking(False)


def start_stand_in() -> tuple[Any, int, Any]:
    """The stand-in broker in a process of its own: (the process, its port on loopback, the queue it reports on)."""
    context = multiprocessing.get_context("fork")
    reports = context.Queue()
    listen = socket.socket()
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("127.0.0.1", 0))
    listen.listen(4096)
    port = listen.getsockname()[1]
    broker = context.Process(target=broker_main, args=(listen, reports), daemon=True)
    broker.start()
    listen.close()
    return broker, port, reports


def broker_main(listen: socket.socket, reports: Any) -> None:
    """Answer CONNECT, then either swallow bytes (sink) or answer each frame with a receipt (echo)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    listen.setblocking(False)
    selector.register(listen, selectors.EVENT_READ, None)
    while True:
        for key, _ in selector.select():
            if key.data is None:
                sock, _ = listen.accept()
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                selector.register(sock, selectors.EVENT_READ, _Peer(sock))
                continue
            peer: _Peer = key.data
            try:
                data = peer.sock.recv(WRITE_SIZE)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            now = time.monotonic_ns()
            if not data:
                if peer.mode == "sink" and not peer.reported:
                    reports.put((peer.received, peer.first_ns, peer.last_ns))
                selector.unregister(peer.sock)
                peer.sock.close()
                continue
            if peer.mode == "sink":
                if not peer.first_ns:
                    peer.first_ns = now
                peer.received += len(data)
                peer.last_ns = now
                peer.tail = (peer.tail + data)[-len(END_OF_STREAM):]
                if peer.frame_size:
                    _answer_sends(peer)
                if peer.tail == END_OF_STREAM and not peer.reported:
                    peer.reported = True
                    reports.put((peer.received - len(END_OF_STREAM), peer.first_ns, peer.last_ns))
                continue
            peer.buf += data
            if peer.mode is None:
                if len(peer.buf) < 4 or len(peer.buf) < int.from_bytes(peer.buf[:4], "big") + 4:
                    continue
                size = int.from_bytes(peer.buf[:4], "big") + 4
                connect = frame_from_bytes(bytes(peer.buf[:size])).command.connect
                del peer.buf[:size]
                peer.mode = connect.client_version.removeprefix("bench-")
                if peer.mode.startswith("sinkr-"):
                    _, frame_size, count = peer.mode.split("-")
                    peer.mode, peer.frame_size = "sink", int(frame_size)
                    peer.receipts = numbered_receipts(int(count))
                _write_all(peer.sock, CONNECTED)
                if peer.mode == "sink":
                    peer.received = len(peer.buf)
                    peer.first_ns = now if peer.buf else 0
                    peer.last_ns = now
                    peer.tail = bytes(peer.buf[-len(END_OF_STREAM):])
                    peer.buf.clear()
                    if peer.frame_size:
                        _answer_sends(peer)
                    if peer.tail == END_OF_STREAM:
                        peer.reported = True
                        reports.put((peer.received - len(END_OF_STREAM), peer.first_ns, peer.last_ns))
                    continue
            count = _frames_in(peer.buf)
            if count:
                _write_all(peer.sock, RECEIPT * count)


def _answer_sends(peer: _Peer) -> None:
    """Write the receipts of the whole SENDs received since the last call (frames of one size)."""
    whole = peer.received // peer.frame_size
    if whole <= peer.answered:
        return
    ring = peer.receipts
    size = len(encode_command(api.CommandSendReceipt(producer_id=1, sequence_id=FIRST_SEQUENCE_ID)))
    count = len(ring) // size
    start, out = peer.answered % count, []
    left = whole - peer.answered
    while left:
        take = min(left, count - start)
        out.append(ring[start * size:(start + take) * size])
        left -= take
        start = 0
    peer.answered = whole
    _write_all(peer.sock, b"".join(out))


# -- the load client -------------------------------------------------------------------------
#: port -> the broker a connection to that port must name in CONNECT (Pulsar's proxy)
PROXY_TO: dict[int, str] = {}


def _read_frame(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        head += chunk
    body = b""
    size = int.from_bytes(head, "big")
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        body += chunk
    return head + body


def open_session(port: int, mode: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(connect_frame(mode, PROXY_TO.get(port)))
    # CONNECTED (Pulsar's proxy writes its own, of another length than the stand-in's)
    if frame_from_bytes(_read_frame(sock)).command.type != api.BaseCommand.CONNECTED:
        raise ConnectionError("the handshake was not answered with CONNECTED")
    return sock


class _ReceiptDrain:
    """Reads and discards the receipts on a thread of its own, counting their bytes, until the socket is shut down."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received_bytes = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while chunk := len(self.sock.recv(1 << 20)):
                self.received_bytes += chunk

    def wait_for(self, receipts: int, timeout: float) -> int:
        """Wait until ``receipts`` receipts came (all of one length), or ``timeout``; how many came."""
        deadline = time.monotonic() + timeout
        while self.received_bytes < receipts * RECEIPT_BYTES and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.received_bytes // RECEIPT_BYTES


#: the length of every receipt of the observer arms (see FIRST_SEQUENCE_ID)
RECEIPT_BYTES = len(numbered_receipts(1))
#: SEND frames the load client wrote, per throughput phase (the recording arm compares what was recorded)
SENT_FRAMES: list[int] = []
#: per throughput phase with receipts: the frames that passed the proxy, as its two ends counted them (the SENDs
#: the sink received, the receipts the load client received, CONNECT, CONNECTED and the closing PING)
PASSED_FRAMES: list[int] = []


def throughput(port: int, reports: Any, frame_size: int, duration: float,
               receipts: bool = False) -> tuple[float, float]:
    """(MiB/s, frames/s) one way, timed from the first write to the broker's last byte.

    With ``receipts`` every SEND has its own sequence id and the broker answers each with a
    SEND_RECEIPT, which a thread of this process reads and throws away.
    """
    per_write = max(1, WRITE_SIZE // frame_size)
    if receipts:
        block = numbered_sends(frame_size, per_write)
        sock = open_session(port, f"sinkr-{frame_size}-{per_write}")
        sock.settimeout(None)
        drain = _ReceiptDrain(sock)
    else:
        block = send_frame(frame_size) * per_write
        sock = open_session(port, "sink")
    sent_frames = 0
    start = time.monotonic_ns()
    deadline = start + int(duration * 1e9)
    while time.monotonic_ns() < deadline:
        sock.sendall(block)
        sent_frames += per_write
    sock.sendall(END_OF_STREAM)
    received, _, last_ns = reports.get(timeout=60)
    if receipts:
        # The sink has answered every SEND, but its last receipts may still be on their way (in the socket
        # buffers on both sides of the proxy: megabytes of them): shut down now and they never pass the proxy.
        answered = drain.wait_for(sent_frames, 30.0)
        PASSED_FRAMES.append(received // frame_size + answered + 3)
        sock.shutdown(socket.SHUT_RDWR)
        drain.thread.join(10)
    sock.close()
    SENT_FRAMES.append(sent_frames)
    expected = sent_frames * frame_size
    if received != expected:
        raise RuntimeError(f"the broker received {received} bytes, {expected} were sent")
    seconds = (last_ns - start) / 1e9
    return received / seconds / (1024 * 1024), sent_frames / seconds


#: round trips each arm makes at each of its turns in :func:`interleaved_latency` (the last one timed), and
#: the warm-up rounds it runs first (not timed; the proxies' CPU counts them)
TRIPS_PER_TURN: Final = 2
WARM_UP_ROUNDS: Final = 200


def interleaved_latency(arms: dict[str, tuple[int, int | None]], rounds: int) -> dict[str, dict[str, float]]:
    """p50/p99 (us) and CPU us per round trip of each arm (name -> port, pid), measured together.

    Each arm's connection does one SEND -> SEND_RECEIPT in turn, so every arm meets the same
    machine: on a shared machine whose speed changes from second to second, phases one after
    another compare moments, not paths.  Each turn is two round trips, the second one timed: a
    proxy that serves one busy connection has its caches warm, and every arm is timed so (each
    round's order is shuffled, seeded).  With one round trip a turn, the order reversed each round,
    the first and the last arm ran back to back at every turn of a round, warm, the others after
    another process: with identical code on both sides, the last arm read 6-14 us faster.
    """
    frame = send_frame(100)
    socks = {name: open_session(port, "echo") for name, (port, _) in arms.items()}
    names = list(arms)
    samples: dict[str, list[int]] = {name: [] for name in names}
    order, shuffle = list(names), random.Random(1).shuffle
    cpu_before = {name: cpu_seconds(pid) for name, (_, pid) in arms.items()}
    for index in range(rounds + WARM_UP_ROUNDS):
        shuffle(order)
        for name in order:
            sock = socks[name]
            for _ in range(TRIPS_PER_TURN):  # (the last timed)
                begin = time.perf_counter_ns()
                sock.sendall(frame)
                got = 0
                while got < len(RECEIPT):
                    got += len(sock.recv(4096))
            if index >= WARM_UP_ROUNDS:
                samples[name].append(time.perf_counter_ns() - begin)
    results = {}
    trips = TRIPS_PER_TURN * (rounds + WARM_UP_ROUNDS)
    for name, (_, pid) in arms.items():
        socks[name].close()
        ordered = sorted(samples[name])
        results[name] = {"p50 us": ordered[len(ordered) // 2] / 1000,
                         "p99 us": ordered[int(len(ordered) * 0.99)] / 1000,
                         "proxy CPU us/rt seq": (cpu_seconds(pid) - cpu_before[name]) / trips * 1e6}
    return results


def print_interleaved(results: dict[str, dict[str, float]]) -> None:
    direct = results["direct"]
    print(f"{'interleaved':<18}{'p50 us':>10}{'added':>9}{'p99 us':>10}{'added':>9}{'CPU us/rt':>11}")
    for name, row in results.items():
        added_p50, added_p99 = row["p50 us"] - direct["p50 us"], row["p99 us"] - direct["p99 us"]
        print(f"{name:<18}{row['p50 us']:>10.1f}{added_p50:>+9.1f}{row['p99 us']:>10.1f}{added_p99:>+9.1f}"
              f"{row['proxy CPU us/rt seq']:>11.1f}")


def start_latency_observers(running: contextlib.ExitStack, target: int, workdir: Path, otlp_port: int,
                            args: argparse.Namespace) -> dict[str, tuple[int, int | None]]:
    """``--latency-observers``: a pulsar-tap with each of those observer arms (and the baseline's, with
    ``--baseline``) for the interleaved latency: what watching adds to a round trip."""
    chosen = [name.strip() for name in (args.latency_observers or "").split(",") if name.strip()]
    every = observer_arms(workdir, otlp_port) + (observer_arms(workdir, otlp_port, BASELINE_ARM)
                                                 if args.baseline is not None else [])
    unknown = sorted(set(chosen) - {arm_kind(name) for name, _ in every})
    if unknown:
        raise SystemExit(f"--latency-observers: no observer arm {', '.join(unknown)} (see --help)")
    arms: dict[str, tuple[int, int | None]] = {}
    for name, yaml_text in every:
        if arm_kind(name) in chosen:
            directory = arm_directory(workdir, name)
            directory.mkdir()
            (directory / "proxy.yaml").write_text(yaml_text, encoding="utf-8")
            arms[name] = running.enter_context(pulsar_tap(
                target, directory, None, args.baseline if name.endswith(BASELINE_ARM) else None,
                config=directory / "proxy.yaml"))
    return arms


def pin_proxies(proxies: list[int], broker: int | None) -> None:
    """``--pin``: every proxy (each thread, and child processes: a recording's writer) on the last CPU, this client
    and the stand-in broker on the others: a proxy with a core of its own, as a sidecar whose peers answer from
    elsewhere, instead of three processes taking turns on the same cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin: needs at least two CPUs")
    proxy_cpu, others = {cpus[-1]}, set(cpus[:-1])
    for pid in proxies:
        for process in (pid, *children_of(pid)):
            for thread in threads_of(process):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(thread, proxy_cpu)
    for thread in threads_of(broker) if broker is not None else []:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(thread, others)
    os.sched_setaffinity(0, others)
    print(f"pinned: the proxies on CPU {cpus[-1]}, the client and the stand-in broker on "
          f"{', '.join(map(str, sorted(others)))}", flush=True)


def pin_to_one_cpu(proxies: list[int], broker: int | None) -> None:
    """``--one-cpu``: every proxy (each thread, and child processes), the stand-in broker and this client on the
    first CPU: the processes take turns on it, and no round trip waits for a wake-up on another CPU."""
    cpu = {min(os.sched_getaffinity(0))}
    for pid in [*proxies, *([broker] if broker is not None else [])]:
        for process in (pid, *children_of(pid)):
            for thread in threads_of(process):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(thread, cpu)
    for thread in threads_of(os.getpid()):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(thread, cpu)
    print(f"pinned: every process on CPU {min(cpu)}", flush=True)


def print_observer_latency(results: dict[str, dict[str, float]]) -> None:
    """What each observer arm adds to a round trip over its own tree's plain pulsar-tap (p50, CPU)."""
    plains = {"": results.get("pulsar-tap"), BASELINE_ARM: results.get("baseline")}
    rows = [(name, row, plains[BASELINE_ARM if name.endswith(BASELINE_ARM) else ""]) for name, row in results.items()
            if name not in ("direct", "haproxy", "python floor", "baseline", "pulsar-tap")]
    if not rows:
        return
    print("\nwatching, over the same tree's plain pulsar-tap (p50 us added, proxy CPU us per round trip):")
    for name, row, plain in rows:
        if plain is not None:
            print(f"  {name:<22}{row['p50 us'] - plain['p50 us']:>+9.1f}"
                  f"{row['proxy CPU us/rt seq'] - plain['proxy CPU us/rt seq']:>+10.1f}")


def concurrency(port: int, connections: int, duration: float) -> float:
    """Round trips/s of ``connections`` connections each doing sequential round trips."""
    frame = send_frame(100)
    socks = [open_session(port, "echo") for _ in range(connections)]
    selector = selectors.DefaultSelector()
    pending = {}
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        pending[sock] = 0
        sock.send(frame)
    done = 0
    start = time.monotonic()
    deadline = start + duration
    while time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.5):
            sock = key.fileobj  # type: ignore[assignment]
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed during the concurrency test")
            pending[sock] += len(data)
            while pending[sock] >= len(RECEIPT):
                pending[sock] -= len(RECEIPT)
                done += 1
                sock.send(frame)
    elapsed = time.monotonic() - start
    for sock in socks:
        sock.close()
    return done / elapsed


# -- the paths under test --------------------------------------------------------------------
def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def haproxy(target: int, workdir: Path) -> Iterator[tuple[int, int] | None]:
    binary = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if binary is None:
        yield None
        return
    port = free_port()
    config = workdir / "haproxy.cfg"
    config.write_text(f"""global
    nbthread 1
    maxconn 5000
defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s
frontend bench
    bind 127.0.0.1:{port}
    default_backend broker
backend broker
    server stand_in 127.0.0.1:{target}
""")
    process = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def pulsar_proxy(target: int, workdir: Path, log_level: int) -> Iterator[tuple[int, int] | None]:
    """Apache Pulsar's proxy (tests/peers/) in front of the stand-in broker; None when it is not installed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "peers"))
    import real_pulsar  # type: ignore[import-not-found]  # (found on the path just made)

    try:
        proxy = real_pulsar.start_pulsar_proxy(f"pulsar://127.0.0.1:{target}", log_level=log_level,
                                               workdir=workdir / f"pulsar-proxy-{log_level}")
    except real_pulsar.PeersMissing:
        yield None
        return
    PROXY_TO[proxy.port] = f"127.0.0.1:{target}"
    try:
        yield proxy.port, proxy.pid
    finally:
        proxy.stop()


def floor_relay_main(listen: socket.socket, target: int) -> None:
    """The least a relay written in Python does: one epoll, per readable socket one ``recv_into``, one write to
    its peer (level-triggered; a write that would wait blocks).  No framing, no checks: a floor, not a proxy."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    poller = select.epoll()
    listen.setblocking(False)
    poller.register(listen.fileno(), select.EPOLLIN)
    peers: dict[int, tuple[socket.socket, socket.socket]] = {}
    buffer = bytearray(WRITE_SIZE)
    view = memoryview(buffer)
    while True:
        for fd, _ in poller.poll():
            if fd == listen.fileno():
                client, _ = listen.accept()
                upstream = socket.create_connection(("127.0.0.1", target))
                for sock, peer in ((client, upstream), (upstream, client)):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setblocking(False)
                    peers[sock.fileno()] = (sock, peer)
                    poller.register(sock.fileno(), select.EPOLLIN)
                continue
            sock, peer = peers[fd]
            try:
                size = sock.recv_into(buffer)
            except BlockingIOError:
                continue
            except OSError:
                size = 0
            if size:
                _write_all(peer, view[:size])
                continue
            for side in (sock, peer):
                poller.unregister(side.fileno())
                del peers[side.fileno()]
                side.close()


@contextlib.contextmanager
def python_floor(target: int) -> Iterator[tuple[int, int]]:
    """:func:`floor_relay_main` in its own process in front of the stand-in broker: (port, pid)."""
    listen = socket.create_server(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    process = multiprocessing.get_context("fork").Process(target=floor_relay_main, args=(listen, target), daemon=True)
    process.start()
    listen.close()  # (the relay's process holds it)
    try:
        assert process.pid is not None
        yield port, process.pid
    finally:
        process.terminate()
        process.join(10)


def warm_up(port: int, reports: Any) -> None:
    """A JVM's JIT compiles the hot paths in the first seconds: run each phase briefly first."""
    throughput(port, reports, 1024, 1.0)
    interleaved_latency({"warm-up": (port, None)}, 2000)
    concurrency(port, CONCURRENT_CONNECTIONS, 1.0)


@contextlib.contextmanager
def pulsar_tap(target: int, workdir: Path, profile: str | None,
               tree: Path | None = None, config: Path | None = None) -> Iterator[tuple[int, int]]:
    ready = workdir / "ready.json"
    ready.unlink(missing_ok=True)
    command = [sys.executable]
    if profile:
        command += ["-m", "cProfile", "-o", profile]
    command += ["-m", "proxy", "run", *(["-c", str(config)] if config else [])]
    command += ["--listen", "127.0.0.1:0", "--upstream", f"pulsar://127.0.0.1:{target}",
                "--ready-file", str(ready), "--log-level", "warning", "--keepalive-seconds", "3600",
                "--drain-seconds", "0"]
    tree = tree or Path(__file__).resolve().parents[1]
    # (run in the tree: ``-m`` puts the working directory before PYTHONPATH, so a baseline started
    # from inside another checkout would import that checkout's proxy)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("ready:"):
            raise RuntimeError("pulsar-tap did not start")
        yield int(line.rsplit(":", 1)[1]), process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


# -- the observer arms -----------------------------------------------------------------------
OBSERVER_SIZES = [("100 B", 100), ("1 KiB", 1024)]


def size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size % 1024 == 0 else f"{size} B"


def otlp_sink_main(listen: socket.socket) -> None:
    """Answer every OTLP/HTTP export with 200 and throw it away (the traces arms' collector)."""
    import http.server

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            del format, args

    server = http.server.ThreadingHTTPServer(listen.getsockname(), Sink, bind_and_activate=False)
    server.socket.close()
    server.socket = listen
    server.serve_forever()


def rules_file(path: Path, count: int, matching: bool) -> Path:
    """``count`` rules matching nothing (SEND / SEND_RECEIPT of topics nobody uses); with
    ``matching`` the last one instead marks 1 % of the SENDs."""
    lines = ["seed: 1", "rules:"]
    for index in range(count):
        lines.append(f"  - name: r{index}")
        if matching and index == count - 1:
            lines += ["    match: {command: [SEND], probability: 0.01}", "    action: {mark: {label: one-in-100}}"]
            continue
        command = "SEND" if index % 2 == 0 else "SEND_RECEIPT"
        lines += [f"    match: {{command: [{command}], topic: 'persistent://public/default/nomatch-{index}-*'}}",
                  "    action: {delay: {ms: 10}}" if command == "SEND" else "    action: mark"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


#: the suffix of an observer arm run by the ``--baseline`` checkout's pulsar-tap
BASELINE_ARM = " @base"


def observer_arms(workdir: Path, otlp_port: int, suffix: str = "") -> list[tuple[str, str]]:
    """(name, proxy.yaml) of each arm, plain first, each name ending with ``suffix`` (the baseline's arms); the
    recording arm records into its own directory."""
    otlp = f"{{exporter: otlp, endpoint: 'http://127.0.0.1:{otlp_port}', protocol: http"
    arms = [
        ("plain", ""),
        # (a second plain pulsar-tap: its ratio to plain is what the machine's noise alone gives)
        ("plain again", ""),
        ("recording", f"record: {{dir: '{arm_directory(workdir, 'recording' + suffix) / 'recordings'}'}}\n"),
        ("metrics", "admin: {listen: '127.0.0.1:0'}\n"),
        # (admin only to read /metrics at the end: with an OTLP exporter metrics are on anyway)
        ("traces 1%", f"tracing: {otlp}, sample: 0.01}}\nadmin: {{listen: '127.0.0.1:0'}}\n"),
        ("traces 100%", f"tracing: {otlp}, sample: 1.0}}\nadmin: {{listen: '127.0.0.1:0'}}\n"),
        ("100 rules, none match", f"rules: '{rules_file(workdir / 'rules-100.yaml', 100, False)}'\n"),
        ("10 rules, 1 at 1%", f"rules: '{rules_file(workdir / 'rules-10.yaml', 10, True)}'\n"),
    ]
    return [(name + suffix, text) for name, text in arms]


def plain_of(name: str) -> str:
    """The plain arm an arm is compared with: the baseline's for the baseline's arms."""
    return "plain" + BASELINE_ARM if name.endswith(BASELINE_ARM) else "plain"


def arm_kind(name: str) -> str:
    """The arm's name without the baseline's suffix (what it runs)."""
    return name.removesuffix(BASELINE_ARM)


def arm_directory(workdir: Path, name: str) -> Path:
    """The directory of an observer arm's pulsar-tap: its proxy.yaml, ready file and recordings."""
    return workdir / ("arm-" + "".join(char if char.isalnum() else "-" for char in name))


def _scrape_metrics(ready: Path) -> str:
    """/metrics of the running proxy (the admin address from its ready file)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            admin = json.loads(ready.read_text())["admin"]
            if admin:
                with urllib.request.urlopen(f"http://{admin}/metrics", timeout=30) as response:
                    return str(response.read().decode())
        time.sleep(0.05)
    raise RuntimeError("no /metrics to scrape")


TELEMETRY_ARMS = ("metrics", "traces 1%", "traces 100%")


def _telemetry_seen(text: str) -> float:
    """SENDs and SEND_RECEIPTs telemetry counted, from /metrics text."""
    return _metric_sum(text, "pulsar_tap_frames_total", 'command="SEND"') + \
        _metric_sum(text, "pulsar_tap_frames_total", 'command="SEND_RECEIPT"')


def _telemetry_settled(ready: Path, expected: float) -> float:
    """:func:`_telemetry_seen` once it reaches ``expected`` or stops growing (the observer queue delivered its
    backlog)."""
    seen = _telemetry_seen(_scrape_metrics(ready))
    deadline = time.monotonic() + 30
    while seen < expected and time.monotonic() < deadline:
        time.sleep(0.3)
        now = _telemetry_seen(_scrape_metrics(ready))
        if now == seen:
            break
        seen = now
    return seen


def _metric_sum(text: str, family: str, having: str) -> float:
    """The sum of a Prometheus family's samples whose labels contain ``having``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(family + "{") and having in line)


def _recorded(recordings: Path) -> tuple[int, int, list[int]]:
    """(frames recorded, frames dropped) of every recording under ``recordings``, and recorded + dropped
    per connection (in the order they were opened: one per phase)."""
    from proxy.pb import recording_pb2 as rpb

    recorded = dropped = 0
    per_connection: list[int] = []
    for index_file in recordings.glob("*/index.pb"):
        index = rpb.RecordingIndex.FromString(index_file.read_bytes())
        recorded += index.frames_recorded
        dropped += index.frames_dropped
        per_connection += [info.frames + info.frames_dropped
                           for info in sorted(index.connections, key=lambda info: info.conn_id)]
    return recorded, dropped, per_connection


def _ticks(stat: Path) -> int:
    """User + system clock ticks of a /proc stat file (a process's or a thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def relay_faults(proxy: int) -> int:
    """Minor page faults so far of pulsar-tap's main thread (the relays: a first write to a page costs one)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{proxy}/task/{proxy}/stat").read_text().rsplit(")", 1)[1].split()[7])
    return 0


def cpu_by_part(proxy: int, others: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of pulsar-tap's main thread (the relays and the hub), its other threads
    (OpenTelemetry's exporters, worker threads), its child processes (the recording's writer), and of
    each process of ``others`` (the bench's own: load client, sink)."""
    tick = os.sysconf("SC_CLK_TCK")
    parts = {"relay": 0.0, "threads": 0.0, "writer": 0.0}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{proxy}/task").iterdir():
            with contextlib.suppress(OSError):
                parts["relay" if int(task.name) == proxy else "threads"] += _ticks(task / "stat") / tick
        for child in children_of(proxy):
            with contextlib.suppress(OSError):
                parts["writer"] += _ticks(Path(f"/proc/{child}/stat")) / tick
    for name, pid in others.items():
        with contextlib.suppress(OSError):
            parts[name] = _ticks(Path(f"/proc/{pid}/stat")) / tick
    return parts


def proxy_cpu_seconds(pid: int) -> float:
    """CPU time so far of a pulsar-tap: every thread and its child processes' (the recording's writer)."""
    return cpu_seconds(pid) + sum(cpu_seconds(child) for child in children_of(pid))


#: the bench's own processes whose CPU the observer arms report (the sink broker's and the OTLP sink's pids are
#: added in main)
BENCH_PROCESSES: dict[str, int] = {"client": os.getpid()}
#: before an observer phase, the bench's pulsar-taps and the OTLP sink must together use fewer cores than this over
#: QUIET_WINDOW_S (idle, the nine of a full run use about 0.01 together); waiting at most QUIET_TIMEOUT_S
QUIET_CORES: Final = 0.05
QUIET_WINDOW_S: Final = 0.25
QUIET_TIMEOUT_S: Final = 30.0


def wait_for_quiet(pids: list[int]) -> float:
    """Wait until the processes ``pids`` (with their child processes) use fewer than QUIET_CORES together, so
    that what one arm left running (span exports, a writer's flush) does not run in the next arm's phase; returns
    the seconds waited (QUIET_TIMEOUT_S or more: they did not settle)."""
    began = time.perf_counter()
    while True:
        before = sum(proxy_cpu_seconds(pid) for pid in pids)
        time.sleep(QUIET_WINDOW_S)
        waited = time.perf_counter() - began
        if sum(proxy_cpu_seconds(pid) for pid in pids) - before < QUIET_CORES * QUIET_WINDOW_S \
                or waited >= QUIET_TIMEOUT_S:
            return waited


@dataclass
class ObserverRun:
    """The observer arms' figures: per arm, per measure, one sample per round (``samples``; frames/s, CPU
    seconds and frames per size, cores per part), and per arm the figures taken once (``notes``: the
    recording's accounting, telemetry's coverage, /metrics)."""
    phase: float
    samples: Samples = field(default_factory=dict)
    notes: dict[str, dict[str, float]] = field(default_factory=dict)


@contextlib.contextmanager
def py_spy(pid: int, output: str) -> Iterator[None]:
    """Sample the process ``pid`` (every thread, and its subprocesses: the recording's writer) with py-spy
    into ``output`` (collapsed stacks) until the block ends."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    # (with the recording's writer process: its stacks open with its own "process" line)
    sampler = subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", "--threads", "--subprocesses",
                                "--rate", "200", "-o", output], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        sampler.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        sampler.wait(30)


def measure_observers(target: int, reports: Any, workdir: Path, otlp_port: int,
                      args: argparse.Namespace) -> ObserverRun:
    """frames/s and pulsar-tap's CPU per frame at each observer size (receipts answered) through pulsar-tap
    with each observer arm, interleaved.

    Every arm's pulsar-tap is started first and stays up; each of ``args.observer_rounds`` rounds runs
    each size through every arm one after another (the arms' order rotated by one each round), a phase
    lasting ``args.duration / observer_rounds``: a slow stretch of the machine lowers one round's samples
    of every arm, and the per-round ratios to plain (:func:`round_ratios`) do not rest on it.  A telemetry
    arm's phase ends once its observer queue has delivered what the phase sent (its coverage), so that its
    backlog is not worked off in the next arm's phase; its CPU per frame includes that.
    """
    chosen = set(args.arms.split(",")) if args.arms else None
    every = observer_arms(workdir, otlp_port)
    if args.baseline is not None:  # (the same arms again, the baseline's pulsar-tap in each)
        every += observer_arms(workdir, otlp_port, BASELINE_ARM)
    arms = [(name, text) for name, text in every if chosen is None or arm_kind(name) == "plain"
            or any(arm_kind(name).startswith(prefix) for prefix in chosen)]
    run = ObserverRun(args.duration / args.observer_rounds, {name: {} for name, _ in arms},
                      {name: {} for name, _ in arms})
    passed: dict[str, list[int]] = {name: [] for name, _ in arms}
    with contextlib.ExitStack() as running:
        started: dict[str, tuple[int, int]] = {}
        for name, yaml_text in arms:
            directory = arm_directory(workdir, name)
            directory.mkdir()
            (directory / "proxy.yaml").write_text(yaml_text, encoding="utf-8")
            started[name] = running.enter_context(pulsar_tap(
                target, directory, args.profile if args.profile_arm == name else None,
                args.baseline if name.endswith(BASELINE_ARM) else None, config=directory / "proxy.yaml"))
        if args.py_spy and args.profile_arm in started:
            running.enter_context(py_spy(started[args.profile_arm][1], args.py_spy))
        print("observer arms started: " + ", ".join(started), flush=True)
        names = list(started)
        quiet = [pid for _, pid in started.values()] + ([BENCH_PROCESSES["otlp"]] if "otlp" in BENCH_PROCESSES else [])
        for round_index in range(args.observer_rounds):
            shift = round_index % len(names)
            for label, size in OBSERVER_SIZES:
                for name in names[shift:] + names[:shift]:
                    run.samples[name].setdefault(f"quiet s {label}", []).append(wait_for_quiet(quiet))
                    others = [pid for other, (_, pid) in started.items() if other != name]
                    _observer_phase(run, name, started[name][0], started[name][1], label, size, reports, workdir,
                                    others)
                    passed[name].append(PASSED_FRAMES[-1])
            print(f"observer round {round_index + 1} of {args.observer_rounds} done "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
        for name in started:
            if arm_kind(name) in TELEMETRY_ARMS:
                notes, ready = run.notes[name], arm_directory(workdir, name) / "ready.json"
                began = time.perf_counter()
                text = _scrape_metrics(ready)
                notes["scrape s"] = time.perf_counter() - began
                if "pulsar_tap_request_duration_seconds" not in text:
                    raise RuntimeError("/metrics has no request latency histogram")
                notes["observed"] = _telemetry_seen(text)
                notes["events dropped"] = _metric_sum(text, "pulsar_tap_dropped_events_total", 'source="observers"')
    for name in started:  # (the recordings' indexes are complete once their proxy stopped)
        if arm_kind(name) != "recording":
            continue
        notes = run.notes[name]
        notes["recorded"], notes["dropped"], per_connection = _recorded(arm_directory(workdir, name) / "recordings")
        notes["passed"] = sum(passed[name])
        by_phase = ", ".join(f"{frames - accounted:,}" for frames, accounted in
                             zip(passed[name], per_connection, strict=False))
        print(f"{name}: {_accounting(notes)}; not accounted for by phase: {by_phase}", flush=True)
    return run


def _observer_phase(run: ObserverRun, name: str, port: int, pid: int, label: str, size: int, reports: Any,
                    workdir: Path, others: list[int]) -> None:
    """One phase of one arm: frames of ``size`` through its pulsar-tap (port, pid) for ``run.phase`` seconds
    (``others``: the other arms' pulsar-taps, whose CPU meanwhile is noted)."""
    row, notes = run.samples[name], run.notes[name]
    proxy_before, faults_before = proxy_cpu_seconds(pid), relay_faults(pid)
    others_before = sum(proxy_cpu_seconds(other) for other in others)
    parts_before, wall_before = cpu_by_part(pid, BENCH_PROCESSES), time.perf_counter()
    row.setdefault(f"frames/s {label}", []).append(throughput(port, reports, size, run.phase, receipts=True)[1])
    wall = time.perf_counter() - wall_before
    for part, seconds in cpu_by_part(pid, BENCH_PROCESSES).items():
        row.setdefault(f"cpu {part} {label}", []).append((seconds - parts_before.get(part, 0.0)) / wall)
    row.setdefault(f"cpu others {label}", []).append(
        (sum(proxy_cpu_seconds(other) for other in others) - others_before) / wall)
    notes["sent"] = notes.get("sent", 0.0) + 2 * SENT_FRAMES[-1]
    if arm_kind(name) in TELEMETRY_ARMS:  # what telemetry saw of this phase's frames, once its queue drained
        seen = _telemetry_settled(arm_directory(workdir, name) / "ready.json", notes["sent"])
        notes[f"seen {label}"] = notes.get(f"seen {label}", 0.0) + seen - notes.get("seen", 0.0)
        notes[f"sent {label}"] = notes.get(f"sent {label}", 0.0) + 2 * SENT_FRAMES[-1]
        notes["seen"] = seen
    row.setdefault(f"CPU s {label}", []).append(proxy_cpu_seconds(pid) - proxy_before)
    row.setdefault(f"frames {label}", []).append(SENT_FRAMES[-1])
    row.setdefault(f"faults {label}", []).append(relay_faults(pid) - faults_before)


def _accounting(row: dict[str, float]) -> str:
    """What the recording arm's recorder wrote and dropped, of the frames that passed the proxy.

    Every frame that passed is either recorded or counted as dropped: "not accounted for" is 0
    unless the recorder lost frames without counting them (above 0) or counted some twice (below).
    """
    passed, recorded, dropped = row["passed"], row["recorded"], row["dropped"]
    return (f"recorded {recorded:,.0f} of {passed:,.0f} frames that passed ({recorded / passed:.0%}; "
            f"dropped {dropped:,.0f}, not accounted for {passed - recorded - dropped:,.0f})")


def cpu_per_frame(row: dict[str, list[float]], label: str) -> float:
    """pulsar-tap's CPU microseconds per SEND (and its receipt) of one size, over all rounds."""
    return sum(row[f"CPU s {label}"]) / sum(row[f"frames {label}"]) * 1e6


def print_observers(run: ObserverRun) -> None:
    samples = run.samples
    rounds = len(samples["plain"][f"frames/s {OBSERVER_SIZES[0][0]}"])
    print(f"observer arms: SEND frames in 1 MiB writes, each answered with a receipt; {rounds} interleaved rounds of "
          f"{run.phase:.2g}s phases.  f/s: the median of the rounds; x plain: the median of the per-round ratios "
          "to plain pulsar-tap (an arm of --baseline: to the baseline's plain), min: the smallest; CPU us/f: "
          "pulsar-tap's CPU (every thread and the writer process) per SEND and its receipt over all rounds, cpu x: "
          "plain's over the arm's (the steadier figure on a busy machine); flt/kf: minor page faults of pulsar-tap's "
          "main thread (the relays) per thousand SENDs and receipts, over all rounds")
    print(f"{'arm':<24}" + "".join(f"{label + ' f/s':>14}{'x plain':>8}{'min':>6}{'CPU us/f':>9}{'cpu x':>7}"
                                   f"{'flt/kf':>7}" for label, _ in OBSERVER_SIZES))
    for name, row in samples.items():
        line, plain = f"{name:<24}", plain_of(name)
        for label, _ in OBSERVER_SIZES:
            key = f"frames/s {label}"
            ratios = round_ratios(samples, name, plain, key) or [median(row[key]) / median(samples[plain][key])]
            cpu = cpu_per_frame(row, label)
            line += (f"{median(row[key]):>14,.0f}{median(ratios):>7.2f}x{min(ratios):>5.2f}x"
                     f"{cpu:>9.2f}{cpu_per_frame(samples[plain], label) / cpu:>6.2f}x"
                     f"{sum(row[f'faults {label}']) / sum(row[f'frames {label}']) * 1e3 / 2:>7.2f}")
        print(line)
    for name, notes in run.notes.items():
        if "recorded" in notes:
            print(f"  {name}: {_accounting(notes)}")
        if "observed" in notes:
            by_size = ", ".join(f"{label} {notes[f'seen {label}'] / notes[f'sent {label}']:.1%}"
                                for label, _ in OBSERVER_SIZES)
            print(f"  {name}: coverage {notes['observed'] / notes['sent']:.1%} ({by_size}): telemetry saw "
                  f"{notes['observed']:,.0f} of {notes['sent']:,.0f} SENDs + receipts ({notes['events dropped']:,.0f} "
                  f"events dropped); /metrics scraped in {notes['scrape s']:.2f}s")
    if rounds > 1:
        print("per-round ratios to plain (frames/s):")
        for name in samples:
            for label, _ in OBSERVER_SIZES:
                arm_ratios = round_ratios(samples, name, plain_of(name), f"frames/s {label}")
                if arm_kind(name) != "plain" and arm_ratios is not None:
                    print(f"  {name:<22}{label:<7}" + " ".join(f"{ratio:5.2f}" for ratio in arm_ratios)
                          + f"   median {median(arm_ratios):.2f}  min {min(arm_ratios):.2f}")
    compared = [name for name in samples if not name.endswith(BASELINE_ARM) and name + BASELINE_ARM in samples]
    if compared:
        print("this tree's arms over the baseline's same arm, round by round (frames/s), and CPU per frame "
              "(the baseline's over this tree's, over all rounds):")
        for name in compared:
            for label, _ in OBSERVER_SIZES:
                base = samples[name + BASELINE_ARM]
                ratios = round_ratios(samples, name, name + BASELINE_ARM, f"frames/s {label}") or \
                    [median(samples[name][f"frames/s {label}"]) / median(base[f"frames/s {label}"])]
                print(f"  {name:<22}{label:<7}" + " ".join(f"{ratio:5.2f}" for ratio in ratios)
                      + f"   median {median(ratios):.2f}  min {min(ratios):.2f}   cpu "
                      f"{cpu_per_frame(base, label) / cpu_per_frame(samples[name], label):.2f}x")
    waits = [wait for row in samples.values() for key, values in row.items() if key.startswith("quiet s ")
             for wait in values]
    print(f"waited for the pulsar-taps and the OTLP sink to be quiet before each phase: median {median(waits):.2f}s, "
          f"max {max(waits):.2f}s" + (f"; {sum(wait >= QUIET_TIMEOUT_S for wait in waits)} phases began after "
                                      f"{QUIET_TIMEOUT_S:g}s without" if max(waits) >= QUIET_TIMEOUT_S else ""))
    print("CPU per part while each size ran (cores, median of the rounds; relay = pulsar-tap's main thread, "
          "threads = its others, writer = its child processes, client/sink/otlp = the bench's load client, "
          "stand-in broker and OTLP sink, others = the other arms' pulsar-taps):")
    for name, row in samples.items():
        print(f"  {name:<22}" + "   ".join(
            f"{label}: " + " ".join(f"{key[4:-len(label) - 1]} {median(row[key]):.2f}" for key in row
                                    if key.startswith("cpu ") and key.endswith(label))
            for label, _ in OBSERVER_SIZES))


# -- the run ---------------------------------------------------------------------------------
def cpu_seconds(pid: int | None) -> float:
    """CPU time the threads of a process have used so far (0 without a process).

    (From the scheduler's nanoseconds per thread: the clock ticks of /proc/PID/stat, 10 ms,
    were 5 % of a short phase's CPU.)
    """
    return 0.0 if pid is None else process_cpu_seconds(pid)


def start_paths(stack: contextlib.ExitStack, target: int, workdir: Path, reports: Any,
                args: argparse.Namespace) -> dict[str, tuple[int, int | None] | None]:
    """Start every path to the stand-in broker at once (stopped when ``stack`` closes): name -> (port,
    proxy pid), in the table's order; None for a path that cannot run here."""
    paths: dict[str, tuple[int, int | None] | None] = {"direct": (target, None)}
    paths["haproxy"] = stack.enter_context(haproxy(target, workdir))
    if paths["haproxy"] is None:
        print("haproxy was not found: its column is left out (install Debian's haproxy)")
    for name, level in ((PULSAR_PROXY_0, 0), (PULSAR_PROXY_2, 2)):
        paths[name] = None
        if args.no_pulsar_proxy:
            continue
        paths[name] = stack.enter_context(pulsar_proxy(target, workdir, level))
        if paths[name] is None:
            print("Apache Pulsar's proxy is not installed (bash scripts/setup.sh): its columns are left out")
            paths[PULSAR_PROXY_2] = None
            break
        warm_up(paths[name][0], reports)  # type: ignore[index]
    # (each pulsar-tap in a directory of its own: its ready file)
    if args.baseline is not None:
        if not (args.baseline / "proxy" / "__init__.py").is_file():
            raise SystemExit(f"--baseline {args.baseline}: no proxy/ package there")
        (workdir / "baseline").mkdir()
        paths["baseline"] = stack.enter_context(pulsar_tap(target, workdir / "baseline", None, args.baseline))
    (workdir / "tap").mkdir()
    paths["pulsar-tap"] = stack.enter_context(pulsar_tap(target, workdir / "tap",
                                                         None if args.profile_arm else args.profile))
    print("paths started: " + ", ".join(name for name, path in paths.items() if path is not None), flush=True)
    return paths


#: the measures of the concurrency phase (after latency in the table)
CONCURRENCY = ("concurrent rt/s", "proxy CPU us/rt conc")
#: per path, per measure: one sample per interleaved round
Samples = dict[str, dict[str, list[float]]]


def measure_interleaved(paths: dict[str, tuple[int, int | None]], reports: Any,
                        args: argparse.Namespace) -> Samples:
    """Throughput (each size) and concurrency through every path, interleaved.

    Each of ``args.interleave`` rounds runs each phase through every path one after
    another (the paths' order rotated by one each round), a phase lasting ``duration /
    interleave`` seconds: the paths compared in a round ran seconds apart, so a slow
    stretch of the machine lowers one round's samples of all of them, and the median of
    the per-round ratios (:func:`round_ratios`) does not rest on it.
    """
    samples: Samples = {name: {} for name in paths}
    phase = args.duration / args.interleave
    names = list(paths)
    concurrent_cpu = dict.fromkeys(names, 0.0)
    concurrent_trips = dict.fromkeys(names, 0.0)
    for round_index in range(args.interleave):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        if args.only in (None, "throughput"):
            for label, size in SIZES:
                for name in order:
                    port, pid = paths[name]
                    cpu_before = cpu_seconds(pid)
                    mib, frames = throughput(port, reports, size, phase)
                    cpu = cpu_seconds(pid) - cpu_before
                    samples[name].setdefault(f"MiB/s {label}", []).append(mib)
                    samples[name].setdefault(f"frames/s {label}", []).append(frames)
                    samples[name].setdefault(f"CPU us/MiB {label}", []).append(
                        cpu / (SENT_FRAMES[-1] * size / (1024 * 1024)) * 1e6)
        if args.only in (None, "concurrency"):
            for name in order:
                port, pid = paths[name]
                cpu_before = cpu_seconds(pid)
                rate = concurrency(port, CONCURRENT_CONNECTIONS, phase)
                concurrent_cpu[name] += cpu_seconds(pid) - cpu_before
                concurrent_trips[name] += rate * phase
                samples[name].setdefault("concurrent rt/s", []).append(rate)
        print(f"round {round_index + 1} of {args.interleave} done (load average {os.getloadavg()[0]:.2f})", flush=True)
    if args.only in (None, "concurrency"):
        for name in names:
            # (one value: the CPU of every round over the round trips of every round)
            samples[name]["proxy CPU us/rt conc"] = [concurrent_cpu[name] / concurrent_trips[name] * 1e6]
    return samples


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def round_ratios(samples: Samples, top: str, bottom: str, key: str) -> list[float] | None:
    """``top``'s sample over ``bottom``'s, round by round (None unless both paths have one per round)."""
    tops, bottoms = samples.get(top, {}).get(key), samples.get(bottom, {}).get(key)
    if not tops or not bottoms or len(tops) != len(bottoms) or len(tops) < 2 or not all(bottoms):
        return None
    return [a / b for a, b in zip(tops, bottoms, strict=True)]


def ratio_of(columns: dict[str, dict[str, float] | None], samples: Samples, top: str, bottom: str,
             key: str) -> float | None:
    """``top`` over ``bottom`` for ``key``: the median of the per-round ratios where both ran it interleaved,
    else the ratio of their values (None where a path was not run)."""
    per_round = round_ratios(samples, top, bottom, key)
    if per_round is not None:
        return median(per_round)
    upper, lower = columns.get(top), columns.get(bottom)
    if upper is None or lower is None or not lower.get(key):
        return None
    return upper[key] / lower[key]


def targets(columns: dict[str, dict[str, float] | None], samples: Samples) -> list[tuple[str, str, bool | None]]:
    checks: list[tuple[str, str, bool | None]] = []
    direct, tap = columns["direct"], columns["pulsar-tap"]
    assert direct is not None and tap is not None

    def ratio_check(key: str, minimum: float) -> None:
        ratio = ratio_of(columns, samples, "pulsar-tap", "haproxy", key)
        checks.append((key, f">= {minimum}x haproxy", None if ratio is None else ratio >= minimum))

    ratio_check("MiB/s 1 KiB", 0.6)
    ratio_check("MiB/s 16 KiB", 0.9)
    ratio_check("MiB/s 512 KiB", 0.9)
    checks.append(("frames/s 100 B", ">= 1,000,000", tap["frames/s 100 B"] >= 1_000_000))
    checks.append(("p50 us", "<= direct + 80", tap["p50 us"] <= direct["p50 us"] + 80))
    checks.append(("p99 us", "<= direct + 400", tap["p99 us"] <= direct["p99 us"] + 400))
    ratio_check("concurrent rt/s", 0.4)
    return checks


RATIOS = (("tap/haproxy", "haproxy"), ("tap/pproxy0", PULSAR_PROXY_0), ("tap/pproxy2", PULSAR_PROXY_2),
          ("pproxy0/hap", None), ("tap/direct", "direct"))


def print_table(columns: dict[str, dict[str, float] | None], samples: Samples) -> None:
    """One row per measure, one column per path (the median of its rounds where interleaved), then the
    ratios (medians of the per-round ratios where interleaved; n/a where a path was not run)."""
    names = list(columns)
    keys = list(next(c for c in columns.values() if c is not None))
    baseline = columns.get("baseline")
    print(f"{'measure':<20}" + "".join(f"{n:>15}" for n in names) + "".join(f"{r:>13}" for r, _ in RATIOS)
          + (f"{'tap/baseline':>14}" if baseline else ""))
    for key in keys:
        row = f"{key:<20}"
        for name in names:
            column = columns[name]
            row += f"{column[key]:>15,.1f}" if column is not None else f"{'n/a':>15}"
        for _label, base in RATIOS:
            top, bottom = (PULSAR_PROXY_0, "haproxy") if base is None else ("pulsar-tap", base)
            ratio = ratio_of(columns, samples, top, bottom, key)
            row += f"{ratio:>12.2f}x" if ratio is not None else f"{'n/a':>13}"
        if baseline:
            ratio = ratio_of(columns, samples, "pulsar-tap", "baseline", key)
            row += f"{ratio:>13.2f}x" if ratio is not None else f"{'n/a':>14}"
        print(row)


def print_rounds(samples: Samples, phase: float) -> None:
    """pulsar-tap over haproxy (and over the baseline, and the baseline over haproxy) round by round, with
    their median and min."""
    pairs = [(f"{top}/{bottom}".replace("pulsar-tap", "tap"), top, bottom)
             for top, bottom in (("pulsar-tap", "haproxy"), ("pulsar-tap", "baseline"), ("baseline", "haproxy"))
             if top in samples and bottom in samples]
    if not pairs:
        return
    keys = [key for key in samples["pulsar-tap"] if len(samples["pulsar-tap"][key]) > 1
            and not key.startswith("frames/s")]  # (the same ratios as MiB/s)
    if not keys:
        return
    print(f"per-round ratios ({len(samples['pulsar-tap'][keys[0]])} interleaved rounds, phases of {phase:.2g}s; "
          "the table's ratios are their medians)")
    for label, top, bottom in pairs:
        for key in keys:
            ratios = round_ratios(samples, top, bottom, key)
            if ratios is not None:
                print(f"  {label:<17}{key:<20}" + " ".join(f"{ratio:5.2f}" for ratio in ratios)
                      + f"   median {median(ratios):.2f}  min {min(ratios):.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=2.0,
                        help="seconds of each throughput size and of concurrency per path, over all rounds; with "
                             "the observer arms, of each size per arm, over all --observer-rounds (a phase lasts "
                             "--duration / N: 0.67 s by default, 2-4 s for a 10 %% effect)")
    parser.add_argument("--interleave", type=int, metavar="N",
                        help="rounds the throughput and concurrency phases run in, every path in each (default 10; "
                             "3 with --quick)")
    parser.add_argument("--rounds", type=int, default=5000, help="sequential round trips for latency")
    parser.add_argument("--quick", action="store_true", help="0.7 s per phase and path, 2000 round trips")
    parser.add_argument("--profile", metavar="FILE", help="run pulsar-tap under cProfile, write stats to FILE")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--baseline", metavar="DIR", type=Path,
                        help="also measure the pulsar-tap of this checkout (its proxy/ package), in the same rounds; "
                             "with the observer arms, each chosen arm (plain included) again with its pulsar-tap, "
                             "named ARM @base")
    parser.add_argument("--only", choices=("throughput", "latency", "concurrency"), help="run one phase")
    parser.add_argument("--sizes", metavar="BYTES,...", help="throughput frame sizes (default 100,1024,16384,524288;"
                        " the targets need all four)")
    parser.add_argument("--observers", action="store_true",
                        help="run only the observer arms (pulsar-tap plain, recording, metrics, traces, rules)")
    parser.add_argument("--py-spy", metavar="FILE",
                        help="with --profile-arm: sample that arm's pulsar-tap (every thread, and its subprocesses: "
                             "the recording's writer) with py-spy into FILE (collapsed stacks)")
    parser.add_argument("--observer-sizes", metavar="BYTES,...", default="100,1024",
                        help="frame sizes of the observer arms (default 100,1024)")
    parser.add_argument("--observer-rounds", type=int, default=3, metavar="N",
                        help="rounds the observer arms run in, every arm and size in each (default 3; a phase "
                             "lasts --duration / N; each phase of a telemetry arm waits for its queue to drain, "
                             "most of the run's time)")
    parser.add_argument("--arms", metavar="NAME,...",
                        help="with --observers: only the arms whose names begin so (and plain), e.g. "
                             "recording,metrics or '100 rules,10 rules'")
    parser.add_argument("--no-observers", action="store_true", help="leave the observer arms out of a full run")
    parser.add_argument("--profile-arm", metavar="ARM", default=None,
                        help="with --profile: profile this observer arm (e.g. recording) instead of the plain run")
    parser.add_argument("--no-pulsar-proxy", action="store_true",
                        help="leave out Apache Pulsar's proxy (its two arms start a JVM each)")
    parser.add_argument("--latency-observers", metavar="ARM,...",
                        help="with --interleaved: also a pulsar-tap with each of these observer arms (recording, "
                             "metrics, 'traces 1%%', 'traces 100%%', ...; the baseline's too with --baseline), and "
                             "what each adds over plain, e.g. --latency-observers 'metrics,traces 1%%,recording'")
    parser.add_argument("--pin", action="store_true",
                        help="with --interleaved: the proxies (haproxy, the floor, every pulsar-tap) on the last CPU, "
                             "the client and the stand-in broker on the others (a proxy with a core of its own)")
    parser.add_argument("--one-cpu", action="store_true",
                        help="with --interleaved: every process (the client, the stand-in broker, every proxy) on "
                             "the first CPU: what each proxy's own code costs a round trip, without the wake-ups "
                             "across CPUs that decide most of a round trip's time on a 2-core VM (there, unpinned, "
                             "one proxy process of several identical ones could read 25-35 us faster than the "
                             "others for its whole life)")
    parser.add_argument("--interleaved", action="store_true",
                        help="only latency, of direct, haproxy, a Python floor relay (floor_relay_main: the least "
                             "a relay in Python does), --baseline and pulsar-tap together: their round trips taken "
                             "in turn, so that each meets the same load (see interleaved_latency)")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.rounds = 0.7, 2000
    if args.interleave is None:
        args.interleave = 3 if args.quick else 10
    if args.interleave < 1 or args.observer_rounds < 1:
        parser.error("--interleave and --observer-rounds must be at least 1")
    if args.baseline is not None and not (args.baseline / "proxy" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline}: no proxy/ package there")
    OBSERVER_SIZES[:] = [(size_label(int(size)), int(size)) for size in args.observer_sizes.split(",")]
    if args.sizes:
        SIZES[:] = [(size_label(int(size)), int(size)) for size in args.sizes.split(",")]

    broker, target, reports = start_stand_in()
    if broker.pid is not None:
        BENCH_PROCESSES["sink"] = broker.pid
    columns: dict[str, dict[str, float] | None] = {}
    observers: ObserverRun | None = None
    otlp_listen = socket.socket()
    otlp_listen.bind(("127.0.0.1", 0))
    otlp_listen.listen(64)
    otlp_sink = multiprocessing.get_context("fork").Process(target=otlp_sink_main, args=(otlp_listen,), daemon=True)
    otlp_sink.start()
    if otlp_sink.pid is not None:
        BENCH_PROCESSES["otlp"] = otlp_sink.pid
    try:
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            print(f"cpus: {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}; {args.duration:g}s per phase "
                  + (f"and arm in {args.observer_rounds} interleaved rounds" if args.observers else
                     f"and path in {args.interleave} interleaved rounds; {args.rounds} round trips"), flush=True)
            if args.interleaved:
                with contextlib.ExitStack() as running:
                    arms: dict[str, tuple[int, int | None]] = {"direct": (target, None)}
                    hap = running.enter_context(haproxy(target, workdir))
                    if hap is not None:
                        arms["haproxy"] = hap
                    arms["python floor"] = running.enter_context(python_floor(target))
                    if args.baseline is not None:
                        (workdir / "baseline").mkdir()
                        arms["baseline"] = running.enter_context(
                            pulsar_tap(target, workdir / "baseline", None, args.baseline))
                    (workdir / "tap").mkdir()
                    arms["pulsar-tap"] = running.enter_context(pulsar_tap(target, workdir / "tap", None))
                    arms |= start_latency_observers(running, target, workdir, otlp_listen.getsockname()[1], args)
                    if args.pin:
                        pin_proxies([pid for _, pid in arms.values() if pid is not None], broker.pid)
                    elif args.one_cpu:
                        pin_to_one_cpu([pid for _, pid in arms.values() if pid is not None], broker.pid)
                    results = interleaved_latency(arms, args.rounds)
                    print_interleaved(results)
                    print_observer_latency(results)
                return 0
            if args.observers:
                observers = measure_observers(target, reports, workdir, otlp_listen.getsockname()[1], args)
            if not args.observers:
                with contextlib.ExitStack() as running_paths:
                    paths = start_paths(running_paths, target, workdir, reports, args)
                    live = {name: path for name, path in paths.items() if path is not None}
                    samples = measure_interleaved(live, reports, args)
                    # (latency too with every path's round trips taken in turn: see interleaved_latency)
                    latency_rows = interleaved_latency(live, args.rounds) if args.only in (None, "latency") else {}
                    print("latency done", flush=True)
                    for name, path in paths.items():
                        if path is None:
                            columns[name] = None
                            continue
                        medians = {key: median(values) for key, values in samples[name].items()}
                        latency_row = latency_rows.get(name, {})
                        # (the rows in the table's order: throughput, latency, concurrency)
                        columns[name] = {key: value for key, value in medians.items() if key not in CONCURRENCY} | \
                            latency_row | {key: value for key, value in medians.items() if key in CONCURRENCY}
            if not args.observers and not args.no_observers and args.only in (None, "throughput"):
                observers = measure_observers(target, reports, workdir, otlp_listen.getsockname()[1], args)
    finally:
        broker.terminate()
        broker.join(5)
        otlp_sink.terminate()
        otlp_sink.join(5)
        otlp_listen.close()
    if not args.observers:
        print()
        print_table(columns, samples)
        print()
        print_rounds(samples, args.duration / args.interleave)
        print()
        for key, target_text, ok in (targets(columns, samples) if args.only is None and not args.sizes else []):
            verdict = "n/a (no haproxy)" if ok is None else ("met" if ok else "MISSED")
            print(f"target {key:<18} {target_text:<18} {verdict}")
    if observers is not None:
        print()
        print_observers(observers)
    if args.profile:
        import pstats

        print(f"\npulsar-tap profile ({args.profile}), top functions by own time:")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(15)
    if args.json:
        print(json.dumps(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
