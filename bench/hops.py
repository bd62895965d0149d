"""What a sequential round trip asks of the kernel and of the interpreter: haproxy against pulsar-tap.

The round trips of bench/passthrough.py's latency phase (one connection per path, SEND ->
SEND_RECEIPT in turn through direct, haproxy and pulsar-tap; its stand-in broker), measured
three ways in one run:

- p50/p99 and CPU per round trip of each proxy from ``/proc/PID/schedstat`` (exact, not
  tick-sampled), and its user/system split from ``/proc/PID/stat`` (tick-sampled: a rough split);
- then as many round trips again with ``perf stat`` on the kernel's syscall tracepoints attached
  to haproxy and pulsar-tap: syscalls per round trip by kind (a syscall a proxy makes beyond
  haproxy's is a candidate to cut; vDSO clock reads are not syscalls and are not counted).
  Needs ``perf`` and tracepoint access (root);
- with ``--bytecodes``: Python bytecodes and calls per round trip in pulsar-tap, by function
  (``sys.settrace`` with opcode events, switched on and off by signals in a proxy started
  for it; ``N`` round trips subtracted from ``2 N``, so what does not grow with round trips
  — timers, the tracer's own switching — drops out).  Tracing makes the proxy ~50x slower:
  those round trips are not timed.

    .venv/bin/python bench/hops.py                   # 5 000 round trips
    .venv/bin/python bench/hops.py --bytecodes       # and the interpreter's share
    .venv/bin/python bench/hops.py --baseline /tmp/main   # also another checkout's CPU per round trip
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import passthrough as pt  # (its stand-in broker, paths and round trips)

TREE = Path(__file__).resolve().parents[1]
SYSCALLS = ("epoll_wait", "epoll_pwait", "epoll_ctl", "poll", "select", "recvfrom", "recvmsg", "read",
            "sendto", "sendmsg", "write", "writev", "futex", "clock_gettime", "getsockopt", "setsockopt", "ioctl")

#: run in the traced proxy: SIGUSR1 starts counting bytecodes and calls, SIGUSR2 writes them to $HOPS_TRACE_OUT
TRACER = """
import collections, json, os, runpy, signal, sys
ops, calls = collections.Counter(), collections.Counter()
def name(code):
    return f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
def trace(frame, event, arg):
    frame.f_trace_opcodes = True
    if event == "opcode":
        ops[name(frame.f_code)] += 1
    return trace
def profile(frame, event, arg):
    if event == "call":
        calls[name(frame.f_code)] += 1
def frames(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back
def start(signum, frame):
    ops.clear(); calls.clear()
    for each in frames(frame):
        each.f_trace, each.f_trace_opcodes = trace, True
    sys.settrace(trace); sys.setprofile(profile)
def stop(signum, frame):
    sys.settrace(None); sys.setprofile(None)
    for each in frames(frame):
        each.f_trace, each.f_trace_opcodes = None, False
    with open(os.environ["HOPS_TRACE_OUT"], "w") as out:
        json.dump({"ops": ops, "calls": calls}, out)
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
sys.argv = ["proxy", *sys.argv[1:]]
runpy.run_module("proxy", run_name="__main__")
"""


def schedstat_ns(pid: int) -> int:
    """CPU time the process's main thread has run, ns (exact)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def user_system_ticks(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


@contextlib.contextmanager
def perf_stat(pid: int, out: Path) -> Any:
    """``perf stat`` of ``pid``'s syscalls (by kind) and context switches while the block runs; None without perf."""
    if shutil.which("perf") is None:
        yield None
        return
    events = ",".join(["raw_syscalls:sys_enter", "context-switches",
                       *(f"syscalls:sys_enter_{name}" for name in SYSCALLS)])
    process = subprocess.Popen(["perf", "stat", "-x", ",", "-e", events, "-p", str(pid), "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # (attached before the first round trip)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(10)


def perf_counts(out: Path) -> dict[str, float]:
    counts = {}
    for line in out.read_text().splitlines() if out.exists() else []:
        parts = line.split(",")
        if len(parts) > 2 and parts[0].replace(".", "").isdigit():
            counts[parts[2].removeprefix("syscalls:sys_enter_")] = float(parts[0])
    return counts


def measure_kernel(target: int, workdir: Path, rounds: int, baseline: Path | None) -> None:
    with contextlib.ExitStack() as running:
        arms: dict[str, tuple[int, int | None]] = {"direct": (target, None)}
        hap = running.enter_context(pt.haproxy(target, workdir))
        if hap is not None:
            arms["haproxy"] = hap
        if baseline is not None:
            (workdir / "baseline").mkdir()
            arms["baseline"] = running.enter_context(pt.pulsar_tap(target, workdir / "baseline", None, baseline))
        (workdir / "tap").mkdir()
        arms["pulsar-tap"] = running.enter_context(pt.pulsar_tap(target, workdir / "tap", None))
        pt.interleaved_latency(arms, 500)  # warm-up
        proxies = {name: pid for name, (_, pid) in arms.items() if pid is not None}
        # first untraced (latency, CPU), then again with perf attached (syscalls: perf slows what it watches)
        cpu = {name: schedstat_ns(pid) for name, pid in proxies.items()}
        ticks = {name: user_system_ticks(pid) for name, pid in proxies.items()}
        latency = pt.interleaved_latency(arms, rounds)
        cpu = {name: schedstat_ns(pid) - cpu[name] for name, pid in proxies.items()}
        ticks = {name: (user_system_ticks(pid)[0] - ticks[name][0], user_system_ticks(pid)[1] - ticks[name][1])
                 for name, pid in proxies.items()}
        traced: list[str] = [name for name in ("haproxy", "pulsar-tap") if name in proxies]
        with contextlib.ExitStack() as perf:
            for name in traced:
                perf.enter_context(perf_stat(proxies[name], workdir / f"{name}.perf"))
            pt.interleaved_latency(arms, rounds)
    # (interleaved_latency's warm-up round trips, and all of each turn's, are counted by the kernel too)
    trips = pt.TRIPS_PER_TURN * (rounds + pt.WARM_UP_ROUNDS)
    hz = os.sysconf("SC_CLK_TCK")
    print(f"{trips} round trips per path, interleaved; load average {os.getloadavg()[0]:.2f}")
    print(f"{'path':<12}{'p50 us':>9}{'p99 us':>9}{'CPU us/rt':>11}{'user':>8}{'system':>8}")
    for name, row in latency.items():
        extra = ""
        if name in cpu:
            user, system = ticks[name]
            extra = f"{cpu[name] / trips / 1000:>11.1f}{user / hz / trips * 1e6:>8.1f}{system / hz / trips * 1e6:>8.1f}"
        print(f"{name:<12}{row['p50 us']:>9.1f}{row['p99 us']:>9.1f}{extra}")
    counts = {name: perf_counts(workdir / f"{name}.perf") for name in traced}
    kinds = sorted({kind for each in counts.values() for kind, value in each.items() if value / trips >= 0.001})
    if not kinds:
        print("no syscall counts (perf missing, or no access to tracepoints)")
        return
    print(f"\nper round trip{''.join(f'{name:>12}' for name in traced)}")
    for kind in kinds:
        print(f"{kind:<26}{''.join(f'{counts[name].get(kind, 0.0) / trips:>12.3f}' for name in traced)}")


def measure_bytecodes(target: int, workdir: Path, rounds: int) -> None:
    out, ready = workdir / "trace.json", workdir / "trace-ready.json"
    command = [sys.executable, "-c", TRACER, "run", "--listen", "127.0.0.1:0", "--upstream",
               f"pulsar://127.0.0.1:{target}", "--ready-file", str(ready), "--log-level", "warning",
               "--keepalive-seconds", "3600", "--drain-seconds", "0"]
    process = subprocess.Popen(command, cwd=TREE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(TREE), "HOPS_TRACE_OUT": str(out)})
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline().rsplit(":", 1)[1])
        sock = pt.open_session(port, "echo")
        frame = pt.send_frame(100)

        def round_trips(count: int) -> None:
            for _ in range(count):
                sock.sendall(frame)
                got = 0
                while got < len(pt.RECEIPT):
                    got += len(sock.recv(4096))

        round_trips(300)
        counted = {}
        for count in (rounds, 2 * rounds):
            process.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            round_trips(count)
            process.send_signal(signal.SIGUSR2)
            time.sleep(0.5)
            counted[count] = json.loads(out.read_text())
        sock.close()
    finally:
        process.terminate()
        process.wait(20)
        if process.stdout is not None:
            process.stdout.close()
    for kind in ("ops", "calls"):
        few, many = counted[rounds][kind], counted[2 * rounds][kind]
        per_trip = {key: (many.get(key, 0) - few.get(key, 0)) / rounds for key in set(few) | set(many)}
        label = "bytecodes" if kind == "ops" else "Python calls"
        print(f"\n{label} per round trip in pulsar-tap: {sum(per_trip.values()):.1f}")
        for key, value in sorted(per_trip.items(), key=lambda item: -item[1]):
            if value >= 0.5:
                print(f"{value:10.1f}  {key}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5000, help="round trips measured per path")
    parser.add_argument("--baseline", metavar="DIR", type=Path, help="also the pulsar-tap of this checkout (CPU only)")
    parser.add_argument("--bytecodes", action="store_true", help="also count pulsar-tap's bytecodes per round trip")
    parser.add_argument("--bytecode-rounds", type=int, default=2000, metavar="N", help="traced round trips (N and 2N)")
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("fork")
    listen = socket.socket()
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind(("127.0.0.1", 0))
    listen.listen(64)
    target = listen.getsockname()[1]
    broker = context.Process(target=pt.broker_main, args=(listen, context.Queue()), daemon=True)
    broker.start()
    listen.close()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            measure_kernel(target, Path(tmp), args.rounds, args.baseline)
            if args.bytecodes:
                measure_bytecodes(target, Path(tmp), args.bytecode_rounds)
    finally:
        broker.terminate()
        broker.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
