"""Arms of a benchmark measured in interleaved rounds, and where the CPU went in each.

On a shared two-core machine the rate of one arm swings from round to round with whatever else
runs; comparing the best round of each arm compared luck.  :func:`rotated` gives each round's
order of the arms (rotated by one a round, so no arm always runs first, right after a fresh
start, or last).  The machine's speed itself drifts within a minute (two phases of one arm read
25.9 and 39.4 k messages/s, every process's CPU a message alike), so the benchmarks with the official
client keep every arm up through a round and send through them in bursts, each in turn
(:func:`in_bursts`, :class:`Lane`): each arm then sees the same machine.  :func:`report` prints each
round's ratio of every arm to the baseline arm of the same round, their median and minimum, and the CPU
time per unit (message, frame) each part took
(:class:`CpuParts`: the proxy's relay thread, the proxy's other threads, the recording's writer
process, the broker, the client), with the arm's total as a ratio to the baseline's: the steadier
figure, since what an observer spends is taken from the client and the broker too when they share
the cores (the throughput ratio is roughly total CPU per unit over that plus the observer's).
A table that keeps its own rounds of costs (``rules.py``'s pipeline table) pairs them the same way with
:func:`paired_ratios` and summarises them with :func:`median_and_quartiles`.

Linux: thread and process CPU times come from ``/proc`` (``schedstat``); elsewhere they read 0.  The time
of threads of another process that ended during a run is not counted (the brokers', writers' and
proxies' threads live as long as they do).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

Arm = TypeVar("Arm")

#: the parts CPU time is split into, in the order printed
PARTS = ("proxy thread", "other proxy", "writer", "broker", "client")


def rotated(arms: Sequence[Arm], round_: int) -> list[Arm]:
    """The arms in the order round ``round_`` runs them (rotated by one each round)."""
    shift = round_ % len(arms)
    return [*arms[shift:], *arms[:shift]]


def paired_ratios(baseline: Sequence[float], arm: Sequence[float]) -> list[float]:
    """Each round's baseline cost over the arm's cost in the same round (index by index): above 1, the arm
    costs less.  Pairing by round cancels what the machine did that round to both."""
    if len(baseline) != len(arm):
        raise ValueError(f"{len(baseline)} baseline rounds against {len(arm)} of the arm")
    return [base / cost for base, cost in zip(baseline, arm, strict=True)]


def median_and_quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """The median of ``values`` and their first and third quartiles (inclusive: within the values' range;
    one value is its own quartiles)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    first, median, third = statistics.quantiles(values, n=4, method="inclusive")
    return median, first, third


def task_cpu_seconds(pid: int, tid: int) -> float:
    """CPU time one thread (``tid`` of process ``pid``) has used so far; 0 once it is gone."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    return 0.0


def process_cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads so far (in ns, from their ``schedstat``: ``/proc/PID/stat`` counts
    in clock ticks, 10 ms, too coarse for a short run); 0 when it is gone."""
    return sum(task_cpu_seconds(pid, tid) for tid in threads_of(pid))


def threads_of(pid: int) -> set[int]:
    """The thread ids of a process now."""
    with contextlib.suppress(OSError):
        return {int(task) for task in os.listdir(f"/proc/{pid}/task")}
    return set()


def children_of(pid: int) -> set[int]:
    """The child processes of a process now."""
    children: set[int] = set()
    for tid in threads_of(pid):
        with contextlib.suppress(OSError, ValueError):
            children.update(int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return children


@dataclass
class CpuParts:
    """Samples where the CPU went, between :meth:`start` and :meth:`stop`.

    ``proxy_pid`` / ``proxy_tid``: the proxy's process and its relay (Trio) thread; the proxy's
    other threads are the rest of that process's threads, or, when the proxy runs in this process,
    the Python threads (``threading``) that are neither the main thread, the relay thread nor the
    broker's.  ``broker_pid`` or ``broker_tids``: the broker as a process or as threads of this
    one.  The writer: the proxy process's child processes that are not the broker.  The client:
    this process's CPU less what was counted to the other parts in it.  Time of a thread that ended
    during the window lands in the client's (when the proxy is in this process) or is lost.
    """

    proxy_tid: int
    proxy_pid: int = field(default_factory=os.getpid)
    broker_pid: int | None = None
    broker_tids: frozenset[int] = frozenset()
    _before: dict[tuple[str, int, int], float] = field(default_factory=dict, repr=False)
    _process_before: float = 0.0

    def _samples(self) -> dict[tuple[str, int, int], float]:
        """(part, pid, tid) -> CPU seconds so far, for every thread or process that belongs to a part."""
        own = os.getpid()
        samples = {("proxy thread", self.proxy_pid, self.proxy_tid): task_cpu_seconds(self.proxy_pid, self.proxy_tid)}
        if self.proxy_pid == own:
            others = {thread.native_id for thread in threading.enumerate() if thread.native_id is not None} - {
                threading.main_thread().native_id, self.proxy_tid, *self.broker_tids}
        else:
            others = threads_of(self.proxy_pid) - {self.proxy_tid}
        for tid in others:
            samples[("other proxy", self.proxy_pid, tid)] = task_cpu_seconds(self.proxy_pid, tid)
        for child in children_of(self.proxy_pid) - {self.broker_pid}:
            samples[("writer", child, 0)] = process_cpu_seconds(child)
        if self.broker_pid is not None:
            samples[("broker", self.broker_pid, 0)] = process_cpu_seconds(self.broker_pid)
        for tid in self.broker_tids:
            samples[("broker", own, tid)] = task_cpu_seconds(own, tid)
        return samples

    def start(self) -> None:
        self._before = self._samples()
        self._process_before = time.process_time()

    def stop(self) -> dict[str, float]:
        """CPU seconds per part (see :data:`PARTS`) since :meth:`start`."""
        spent = time.process_time() - self._process_before
        parts = dict.fromkeys(PARTS, 0.0)
        own = os.getpid()
        in_process = 0.0
        # (a thread or child seen only at the end started during the window: from 0; one seen only at the
        # start ended during it: its time is lost, or, in this process, the client's)
        for key, seconds in self._samples().items():
            used = max(seconds - self._before.get(key, 0.0), 0.0)
            parts[key[0]] += used
            if key[1] == own and key[0] != "writer":
                in_process += used
        parts["client"] = max(spent - in_process, 0.0)
        return parts


@dataclass
class Lane:
    """One arm's side of a round measured in bursts (:func:`in_bursts`): ``burst`` sends one burst through the
    arm and returns the units it took (messages), once they are through; the time and each part's CPU
    (``parts``) of its bursts are added up."""

    parts: CpuParts
    burst: Callable[[], int]
    seconds: float = 0.0
    units: int = 0
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    failed: BaseException | None = None

    def measure(self) -> None:
        self.parts.start()
        started = time.perf_counter()
        units = self.burst()
        self.seconds += time.perf_counter() - started
        for part, seconds in self.parts.stop().items():
            self.cpu[part] += seconds
        self.units += units

    def result(self) -> Round:
        return Round(self.units / self.seconds, self.cpu, self.units)


def in_bursts(lanes: dict[Arm, Lane], cycles: int, round_: int, seed: int = 1) -> dict[Arm, Round]:
    """One round of arms whose processes all stay up for it: ``cycles`` times a burst through each arm in turn,
    each cycle in an order of its own (shuffled, seeded by ``seed`` and the round); each arm's :class:`Round`
    from its bursts together.  The machine's speed drifts (here two runs of one arm a minute apart differed by
    a third, every process's CPU a message alike): arms a phase each saw different machines, bursts a second
    long in turn see the same one.  Shuffled, not rotated: rotated, each arm always ran right after the same
    other one and took on whatever that one left running (an exporter finishing its spans).  An arm whose
    burst fails (a client's flush timing out) is reported and left out of the round."""
    arms = list(lanes)
    order = random.Random(seed * 1_000_003 + round_)
    for _ in range(cycles):
        turn = list(arms)
        order.shuffle(turn)
        for arm in turn:
            lane = lanes[arm]
            if lane.failed is not None:
                continue
            try:
                lane.measure()
            except Exception as exc:
                lane.failed = exc
                print(f"{arm}: round {round_ + 1} failed: {exc!r}", file=sys.stderr, flush=True)
    return {arm: lane.result() for arm, lane in lanes.items() if lane.failed is None and lane.units}


@contextlib.contextmanager
def tap_process(*args: str, timeout_s: float = 30.0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``pulsar-tap ARGS`` (``broker``, ``run``) as a child process of this interpreter: (the process, the
    first address its ready file names: where it listens) once it serves; terminated (killed if it must) at
    the end.  Its log goes nowhere: ``--log-level error`` is added.  Run from the checkout this script is in, so
    that it is the package measured."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        child = subprocess.Popen([sys.executable, "-m", "proxy", *args, "--ready-file", str(ready), "--log-level",
                                  "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 cwd=Path(__file__).resolve().parents[1])  # (-m proxy: this checkout's)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                with contextlib.suppress(OSError, ValueError):
                    listen = json.loads(ready.read_text(encoding="utf-8"))["listen"]
                    if listen:
                        break
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"pulsar-tap {args[0]} did not start (exit {child.poll()})")
                time.sleep(0.02)
            yield child, str(listen[0])
        finally:
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


@dataclass
class Round:
    """One arm's run in one round: its rate (units per second) and CPU seconds per part."""

    rate: float
    cpu: dict[str, float]
    units: int


def report(rounds: Sequence[dict[Arm, Round]], arms: Iterable[Arm], *, baseline: Arm, unit: str = "message",
           parts: Sequence[str] = PARTS, extra: dict[Arm, str] | None = None) -> None:
    """Prints the rounds' ratios to ``baseline`` per arm (each round's own), their median and minimum, the
    median rate, and the median CPU microseconds per ``unit`` of each part, with the total's ratio baseline/arm.
    ``extra``: text appended to an arm's line of the first table.  An arm missing from a round (it failed)
    is skipped there; a round without the baseline gives no ratios."""
    arms = list(arms)
    print(f"{len(rounds)} rounds, the arms in bursts in turn; ratio: the arm's rate over {baseline}'s in the same "
          "round")
    print(f"{'arm':<14}{'rate/s':>10}{'median':>8}{'min':>7}  per round")
    for arm in arms:
        runs = [round_[arm] for round_ in rounds if arm in round_]
        if not runs:
            print(f"{arm!s:<14}{'failed':>10}")
            continue
        ratios = [round_[arm].rate / round_[baseline].rate for round_ in rounds
                  if arm in round_ and baseline in round_]
        rate = statistics.median(run.rate for run in runs)
        median = f"{statistics.median(ratios):>8.2f}{min(ratios):>7.2f}" if ratios else f"{'-':>8}{'-':>7}"
        print(f"{arm!s:<14}{rate:>10.0f}{median}  {' '.join(f'{r:.2f}' for r in ratios)}"
              f"{(extra or {}).get(arm, '')}")
    print(f"CPU us per {unit}, median of the rounds; cpu ratio: {baseline}'s total over the arm's "
          "(below 1: the arm costs more)")
    print(f"{'arm':<14}" + "".join(f"{part:>14}" for part in parts) + f"{'total':>10}{'cpu ratio':>11}")
    totals: dict[Arm, float] = {}
    for arm in [baseline, *[a for a in arms if a != baseline]]:
        runs = [round_[arm] for round_ in rounds if arm in round_]
        if runs:
            totals[arm] = statistics.median(sum(run.cpu[p] for p in parts) / run.units * 1e6 for run in runs)
    for arm in arms:
        runs = [round_[arm] for round_ in rounds if arm in round_]
        if not runs:
            continue
        per_part = [statistics.median(run.cpu[part] / run.units * 1e6 for run in runs) for part in parts]
        ratio = totals[baseline] / totals[arm] if baseline in totals and totals[arm] else float("nan")
        print(f"{arm!s:<14}" + "".join(f"{value:>14.2f}" for value in per_part)
              + f"{totals[arm]:>10.2f}{ratio:>11.2f}")
