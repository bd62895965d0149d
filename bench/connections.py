"""Benchmark of what a connection costs: a reconnect storm through each path, in one run.

Each of ``--connections`` connections (``--concurrency`` at a time) does CONNECT -> CONNECTED ->
(with ``--send``: one SEND -> its RECEIPT) -> close, with raw pre-encoded frames from a client that
costs little (one selector loop, non-blocking sockets), against passthrough.py's stand-in broker
(a selector loop in its own process).  Arms, interleaved round by round so the machine's noise falls
on each alike:

- ``direct``: the client straight to the stand-in (the client's and the stand-in's own ceiling);
- ``haproxy``: ``mode tcp``, one thread, as passthrough.py runs it (skipped with a note if absent);
- ``plain``: pulsar-tap with no observer;
- ``metrics``: pulsar-tap with the admin API on (so its metrics);
- with ``--baseline DIR``: ``plain`` and ``metrics`` again with that checkout's pulsar-tap
  (``baseline plain``, ``baseline metrics``).

For each arm: connections per second, and the proxy process's CPU per connection, user and system
(from ``/proc/PID/stat``, clock ticks: a few thousand connections make a few hundred ticks), and its
CPU as a share of one core while the round ran (near 100 % means the client saturates the proxy).
Then each arm's CPU per connection over the haproxy's and, with ``--baseline``, this tree's arms
over the baseline's same arm (below 1: this tree costs less), median over the rounds.

    .venv/bin/python bench/connections.py                           # 2000 connections, 50 at a time
    .venv/bin/python bench/connections.py --baseline /tmp/main      # also another checkout's pulsar-tap
    .venv/bin/python bench/connections.py --send --rounds 5         # also a SEND and its RECEIPT each

(Run benchmarks under ``flock /tmp/bench.lock`` on a shared machine.)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import selectors
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from passthrough import connect_frame, haproxy, pulsar_tap, send_frame, start_stand_in  # (a script of bench/)

CLOCK_TICK = os.sysconf("SC_CLK_TCK")
CONNECTED_SIZE_FIELD = 4
CONNECT = connect_frame("echo")
SEND = send_frame(100)


def proxy_ticks(pid: int) -> tuple[int, int]:
    """User and system clock ticks of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


@dataclass
class _Slot:
    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)
    frames: int = 0  # frames awaited before this connection closes


def _complete_frames(buf: bytearray) -> int:
    """Whole frames at the front of ``buf``, consumed."""
    count = 0
    while len(buf) >= CONNECTED_SIZE_FIELD:
        size = int.from_bytes(buf[:4], "big") + 4
        if len(buf) < size:
            break
        del buf[:size]
        count += 1
    return count


def storm(port: int, connections: int, concurrency: int, send: bool) -> float:
    """Open ``connections`` connections to ``port``, ``concurrency`` at a time, each CONNECT -> CONNECTED ->
    (SEND -> RECEIPT) -> close; the seconds it took.  A connection that fails raises: a storm that drops some
    would measure less work."""
    selector = selectors.DefaultSelector()
    opened = done = 0
    awaited = 2 if send else 1

    def open_one() -> None:
        nonlocal opened
        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        code = sock.connect_ex(("127.0.0.1", port))
        if code not in (0, errno.EINPROGRESS):
            raise OSError(code, os.strerror(code))
        selector.register(sock, selectors.EVENT_WRITE, _Slot(sock, frames=awaited))
        opened += 1

    begin = time.perf_counter()
    try:
        while opened < min(concurrency, connections):
            open_one()
        while done < connections:
            ready = selector.select(timeout=30)
            if not ready:
                raise TimeoutError(f"no connection moved for 30 s ({done} of {connections} done)")
            for key, events in ready:
                slot: _Slot = key.data
                if events & selectors.EVENT_WRITE:  # connected: everything it sends fits the socket's buffer
                    code = slot.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if code:
                        raise OSError(code, os.strerror(code))
                    slot.sock.send(CONNECT + SEND if send else CONNECT)
                    selector.modify(slot.sock, selectors.EVENT_READ, slot)
                    continue
                data = slot.sock.recv(65536)
                if not data:
                    raise ConnectionError("the path closed a connection before answering it")
                slot.buf += data
                slot.frames -= _complete_frames(slot.buf)
                if slot.frames > 0:
                    continue
                selector.unregister(slot.sock)
                slot.sock.close()
                done += 1
                if opened < connections:
                    open_one()
    finally:  # (a storm that failed closes what it opened)
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
    return time.perf_counter() - begin


@dataclass
class Row:
    rate: list[float] = field(default_factory=list)  # connections/s
    user_ms: list[float] = field(default_factory=list)  # per connection
    system_ms: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)  # the proxy's CPU over the round's wall time (1.0: one core)


def measure(row: Row, port: int, pid: int | None, args: argparse.Namespace) -> None:
    before = proxy_ticks(pid) if pid is not None else (0, 0)
    seconds = storm(port, args.connections, args.concurrency, args.send)
    row.rate.append(args.connections / seconds)
    if pid is None:
        return
    time.sleep(0.2)  # (the last connections' teardown)
    after = proxy_ticks(pid)
    user, system = ((a - b) / CLOCK_TICK for a, b in zip(after, before, strict=True))
    row.user_ms.append(user * 1000 / args.connections)
    row.system_ms.append(system * 1000 / args.connections)
    row.busy.append((user + system) / seconds)


def cpu_ms(row: Row) -> float:
    return statistics.median(u + s for u, s in zip(row.user_ms, row.system_ms, strict=True))


def report(rows: dict[str, Row], args: argparse.Namespace) -> None:
    print(f"\n{args.connections} connections, {args.concurrency} at a time, {args.rounds} rounds"
          f"{', each with a SEND and its RECEIPT' if args.send else ''}; medians over the rounds")
    print(f"{'arm':<18}{'conn/s':>10}{'user ms/c':>11}{'sys ms/c':>10}{'CPU ms/c':>10}{'busy':>7}"
          f"{'/haproxy':>10}")
    reference = rows.get("haproxy")
    for name, row in rows.items():
        line = f"{name:<18}{statistics.median(row.rate):>10.0f}"
        if row.user_ms:
            line += (f"{statistics.median(row.user_ms):>11.3f}{statistics.median(row.system_ms):>10.3f}"
                     f"{cpu_ms(row):>10.3f}{statistics.median(row.busy):>6.0%}")
            if reference is not None and reference.user_ms and cpu_ms(reference) > 0:
                line += f"{cpu_ms(row) / cpu_ms(reference):>10.2f}"
        print(line)
    pairs = [(name, f"baseline {name}") for name in ("plain", "metrics") if f"baseline {name}" in rows]
    if pairs:
        print("\nthis tree over the baseline, per round (CPU per connection; connections/s):")
        for name, base in pairs:
            cpu = [(u + s) / (bu + bs) for u, s, bu, bs in zip(rows[name].user_ms, rows[name].system_ms,
                                                            rows[base].user_ms, rows[base].system_ms, strict=True)]
            rate = [a / b for a, b in zip(rows[name].rate, rows[base].rate, strict=True)]
            print(f"  {name:<10} CPU {' '.join(f'{r:.2f}' for r in cpu)} (median {statistics.median(cpu):.2f})"
                  f"   conn/s {' '.join(f'{r:.2f}' for r in rate)} (median {statistics.median(rate):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=2000, help="connections per arm and round")
    parser.add_argument("--concurrency", type=int, default=50, help="connections open at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--send", action="store_true", help="each connection also sends a SEND and awaits its receipt")
    parser.add_argument("--baseline", type=Path, help="another checkout whose pulsar-tap runs the same arms")
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "proxy" / "__init__.py").is_file():
        parser.error(f"--baseline {args.baseline}: no proxy/ package there")

    broker, target, _reports = start_stand_in()  # (it reports only its sink streams: none here)

    with tempfile.TemporaryDirectory(prefix="bench-connections-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        paths: dict[str, tuple[int, int | None]] = {"direct": (target, None)}
        found = stack.enter_context(haproxy(target, workdir))
        if found is None:
            print("haproxy was not found: its arm is left out (install Debian's haproxy)")
        else:
            paths["haproxy"] = found
        trees: list[tuple[str, Path | None]] = [("", None)]
        if args.baseline is not None:
            trees.append(("baseline ", args.baseline.resolve()))
        for prefix, tree in trees:
            for name, text in (("plain", ""), ("metrics", "admin: {listen: '127.0.0.1:0'}\n")):
                directory = workdir / f"{prefix}{name}".replace(" ", "-")
                directory.mkdir()
                (directory / "proxy.yaml").write_text(text)
                paths[prefix + name] = stack.enter_context(
                    pulsar_tap(target, directory, None, tree, config=directory / "proxy.yaml"))
        for port, _ in paths.values():  # (warm up each path: imports, first allocations)
            storm(port, min(200, args.connections), args.concurrency, args.send)
        rows = {name: Row() for name in paths}
        for round_ in range(args.rounds):
            names = list(paths)
            names = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in names:
                measure(rows[name], *paths[name], args)
            print(f"round {round_ + 1}: " + ", ".join(f"{name} {rows[name].rate[-1]:.0f}/s" for name in paths),
                  flush=True)
        report(rows, args)
    broker.terminate()


if __name__ == "__main__":
    main()
