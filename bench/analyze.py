"""Benchmark: ``pulsar-tap analyze`` on local Spark against the same work in one process.

Writes a synthetic recording (default 100 MiB, many connections, 32 MiB segments),
then, in one run and on the same recording:

1. **today's decoder** (``proxy.analytics.reference``): the sequential pass the pipeline
   was before it scaled — every connection's frames through the session machine — in
   this process; the per-core baseline;
2. **one process**: the pipeline's three steps one after the other in this process
   (``analyze_in_process``: decode every split, finish the connections, resolve and
   write every table as Parquet) — the same code the executors run, with no Spark;
   once without writing (every row made, as today's decoder makes them: the per-core
   comparison) and once writing every table (the baseline Spark is measured against);
3. **Spark** on ``--master`` (default ``local[2]``): the same steps as Spark tasks (one
   job of a barrier task per core on a local master), every table written (Spark's
   start-up — the JVM, and the Python workers importing the decoder — shown apart, not
   counted).

Before the first run each pass runs once on a small recording of its own (shown apart,
not counted): a process's first pass pays for lazy imports and first calls, which the
runs after it do not.

In each run the passes compared with each other alternate (today's decoder and the new
one, then one process and Spark), each ``--repeat`` times (default 2) in the order
A B B A ...; a pass's figures are its best attempt (fewest seconds), and every attempt's
seconds are printed too.  One attempt each let a load spike from elsewhere on the
machine decide a run's ratio; alternating and taking the best of each arm treats both
arms alike and does not lighten the baseline's work.

Prints which decoder ran, in this process and in Spark's Python workers (``decode
compiled``: the mypyc build ``scripts/setup.sh`` makes; otherwise its source), then
seconds, frames/s and MiB/s of each, the CPU seconds each used (for Spark: the driver,
its JVM and the Python workers; on a machine others are using too, the CPU seconds say
more about the work than the wall-clock seconds), and the ratios the goals are stated
in: Spark against one process (both write every table), and per-core decoding (the
one-process pass without writing) against today's decoder.  Run it when the machine is quiet.

    .venv/bin/python bench/analyze.py [--mib 100] [--master local[2]] [--runs 1] [--repeat 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# run from any checkout: import its own package, not the one the virtualenv's editable install points at
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy import compiled
from proxy.analytics.pipeline import run_pipeline
from proxy.analytics.reference import reference_tables
from proxy.analytics.spark import spark_session
from proxy.analytics.steps import AnalyzeResult, analyze_in_process
from proxy.analytics.synthetic import write_synthetic_recording


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--runs", type=int, default=1, help="repeat the three passes (the figures of each run)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="attempts per pass in each run, alternating with the pass it is compared with")
    parser.add_argument("--skip-reference", action="store_true", help="leave out today's decoder (slow)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pulsar-tap-bench-"))
    try:
        stats = write_synthetic_recording(work / "in", args.mib * 2**20, connections=max(8, args.mib // 2),
                                          segment_bytes=32 * 2**20)
        mib = stats.bytes / 2**20
        print(f"input: {mib:,.1f} MiB, {stats.frames:,} frames, {stats.messages:,} messages, "
              f"{stats.connections} connections; load average {os.getloadavg()[0]:.2f}")
        warm = write_synthetic_recording(work / "warm", 4 * 2**20, connections=8, segment_bytes=2**20)
        start = time.perf_counter()
        with spark_session(args.master) as spark:
            _warm_up(spark)
            startup = time.perf_counter() - start
            print(f"decoder: this process {_decoder()}; Spark's Python workers "
                  + ", ".join(sorted(_worker_decoders(spark))))
            first_use = _first_use(spark, warm.path, work)
            print(f"(first use of each pass, on a 4 MiB recording, not included: {first_use:.1f} s)")
            for run in range(1, args.runs + 1):
                _one_run(run, args, spark, stats.path, stats.frames, mib, work, startup)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class TreeCpu:
    """CPU seconds (user + system) a process tree uses while it is watched, processes that end meanwhile included.

    Spark's Python workers are children of PySpark's daemon, which ignores SIGCHLD: a worker
    that ends is reaped by the kernel and its CPU time is added to no one's (not to the
    daemon's ``cutime``).  Summing the tree at the start and at the end therefore lost the
    CPU of every worker that ended in between (a pass once showed ``cpu -0.0 s``).  A
    thread reads the tree's processes every ``interval`` seconds instead, and keeps each
    one's last reading: a process that ends loses at most its last interval.  Looking for
    new processes means reading every process's stat (2 ms here), so that is done every
    ``scan_every`` readings only (a process born and ended between two looks is missed:
    Spark's workers live for many tasks); the thread used ~0.7 % of a core.  Its own CPU
    is kept apart (:attr:`sampler_cpu`): it runs in the process measured with ``time.process_time``.
    """

    def __init__(self, root: int, interval: float = 0.05, scan_every: int = 10) -> None:
        self.root = root
        self.interval = interval
        self.scan_every = scan_every
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.sampler_cpu = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tree-cpu", daemon=True)

    def __enter__(self) -> TreeCpu:
        self.first = self._scan()
        self.last = dict(self.first)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def used(self) -> float:
        """CPU seconds of the tree since :meth:`__enter__` (a process that started since: all of its own)."""
        return sum(seconds - self.first.get(pid, 0.0) for pid, seconds in self.last.items())

    def _watch(self) -> None:
        start = time.thread_time()
        readings = 0
        while not self._stop.wait(self.interval):
            readings += 1
            self.last.update(self._scan() if readings % self.scan_every == 0 else self._read(self.last))
        self.last.update(self._scan())
        self.sampler_cpu = time.thread_time() - start

    @staticmethod
    def _stat(pid: int) -> tuple[int, float] | None:
        """``(parent pid, CPU seconds of the process itself)``, or None when it is gone."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK

    def _read(self, pids: dict[int, float]) -> dict[int, float]:
        """The CPU seconds of ``pids`` that are still there."""
        return {pid: stat[1] for pid in pids if (stat := self._stat(pid)) is not None}

    def _scan(self) -> dict[int, float]:
        """The CPU seconds so far of ``root`` and of every process under it."""
        parents: dict[int, int] = {}
        used: dict[int, float] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (stat := self._stat(int(entry.name))) is not None:
                parents[int(entry.name)], used[int(entry.name)] = stat
        children: dict[int, list[int]] = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        tree, stack = {}, [self.root]
        while stack:
            pid = stack.pop()
            if pid in used:
                tree[pid] = used[pid]
            stack += children.get(pid, [])
        return tree


_TICK = os.sysconf("SC_CLK_TCK")


def _import_decoder(batches: Iterator[Any]) -> Iterator[Any]:
    # what the pipeline's tasks import: the decoder, the parts of Arrow they read and write with, and
    # pandas (pyarrow imports it on its first conversion from Python objects)
    import pandas  # noqa: F401
    import pyarrow.acero
    import pyarrow.compute
    import pyarrow.feather
    import pyarrow.parquet  # noqa: F401

    import proxy.analytics.pipeline  # noqa: F401

    yield from batches


def _decoder() -> str:
    """What the decoder's modules run as here: compiled (mypyc, built by scripts/setup.sh), or their source."""
    import proxy.analytics.decode  # noqa: F401  (the modules of proxy.analytics.COMPILED_MODULES)

    return "; ".join(f"{name.rsplit('.', 1)[1]} {state}"
                     for name, state in sorted(compiled.states_of("proxy.analytics").items()))


def _worker_decoders(spark: Any) -> set[str]:
    cores = spark.sparkContext.defaultParallelism
    return set(spark.sparkContext.parallelize(range(cores * 2), cores * 2)
               .mapPartitions(lambda _: iter([_decoder()])).collect())


def _warm_up(spark: Any) -> None:
    """Start the Python workers and import the decoder in them: part of Spark's start-up, not of the work.

    Plain tasks (what the pipeline runs for local recordings) and Arrow tasks (for URLs)
    are served by different pools of workers: both are started.  A barrier stage (the
    pipeline's one job on a local master) is run once too: the JVM's first one took
    ~50 ms longer than the next (its classes loaded).
    """
    cores = spark.sparkContext.defaultParallelism
    spark.sparkContext.parallelize(range(cores * 4), cores * 2).mapPartitions(_import_decoder).count()
    spark.sparkContext.parallelize(range(cores), cores).barrier().mapPartitions(_import_decoder).count()
    spark.range(cores * 4, numPartitions=cores * 2).mapInArrow(_import_decoder, "id bigint").count()


def _first_use(spark: Any, path: Path, work: Path) -> float:
    """Each pass once on a small recording: what a process pays the first time it runs one, not throughput.

    The first run of an invocation was slower in every pass but today's decoder (run here
    too, for symmetry): the new decoder alone took 2.1-2.3 s against 1.8-1.9 s later, Spark
    1.5-1.6 s against 1.2-1.4 s (lazy imports and first calls in the driver, the JVM's
    first job over real files).
    """
    start = time.perf_counter()
    reference_tables([path])
    analyze_in_process([str(path.parent)], None)
    analyze_in_process([str(path.parent)], str(work / "warm-one"))
    run_pipeline(spark, [str(path.parent)], str(work / "warm-spark"))
    return time.perf_counter() - start


Attempt = tuple[float, float, object]


def _measured(work: Callable[[], object], jvm: int | None = None) -> Attempt:
    """Wall-clock and CPU seconds of ``work()``, and what it returned.

    With ``jvm``, the CPU seconds include that process's tree (:class:`TreeCpu`).
    """
    if jvm is None:
        start, cpu = time.perf_counter(), time.process_time()
        result = work()
        return time.perf_counter() - start, time.process_time() - cpu, result
    with TreeCpu(jvm) as tree:
        start, cpu = time.perf_counter(), time.process_time()
        result = work()
        wall, used = time.perf_counter() - start, time.process_time() - cpu
    return wall, used - tree.sampler_cpu + tree.used, result


def _best_of(arms: dict[str, Callable[[], Attempt]], repeat: int) -> dict[str, list[Attempt]]:
    """Each arm ``repeat`` times, interleaved A B B A ... so that drift in the machine's load hits both alike."""
    attempts: dict[str, list[Attempt]] = {name: [] for name in arms}
    names = list(arms)
    for attempt in range(repeat):
        for name in names if attempt % 2 == 0 else reversed(names):
            attempts[name].append(arms[name]())
    return attempts


def _one_run(run: int, args: argparse.Namespace, spark: object, path: Path, frames: int, mib: float, work: Path,
             startup: float) -> None:
    """One run: the per-core pair (today's decoder, the new one) and then the scaling pair (one process, Spark).

    Each pair's arms alternate ``--repeat`` times; a pass's figures are its best attempt
    (least wall-clock seconds, and its CPU seconds), every attempt's seconds are shown too.
    """

    def one_process() -> AnalyzeResult:
        shutil.rmtree(work / "one", ignore_errors=True)
        return analyze_in_process([str(path.parent)], str(work / "one"))

    def on_spark() -> AnalyzeResult:
        shutil.rmtree(work / "spark", ignore_errors=True)
        return run_pipeline(spark, [str(path.parent)], str(work / "spark"))  # type: ignore[arg-type]

    jvm = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[attr-defined]
    per_core: dict[str, Callable[[], Attempt]] = {
        # every step, every row, nothing written: today's pass's work
        "new": lambda: _measured(lambda: analyze_in_process([str(path.parent)], None))}
    if not args.skip_reference:
        per_core = {"today": lambda: _measured(lambda: reference_tables([path])), **per_core}
    attempts = _best_of(per_core, args.repeat)
    attempts.update(_best_of({"one": lambda: _measured(one_process),
                              "spark": lambda: _measured(on_spark, jvm)}, args.repeat))
    best = {name: min(values, key=lambda attempt: attempt[0]) for name, values in attempts.items()}
    print(f"\nrun {run} (load average {os.getloadavg()[0]:.2f}; best of {args.repeat}, alternating; attempts: "
          + "; ".join(f"{name} " + " ".join(f"{attempt[0]:.2f}" for attempt in values)
                      for name, values in attempts.items())
          + " s)")
    print(f"{'pass':<40}{'seconds':>9}{'frames/s':>12}{'MiB/s':>9}{'ratio':>8}")
    decode, decode_cpu, _ = best["new"]
    if "today" in best:
        reference, reference_cpu, _ = best["today"]
        print(f"{'today decoder, 1 process (baseline)':<40}{reference:>9.1f}{frames / reference:>12,.0f}"
              f"{mib / reference:>9.1f}{1.0:>8.2f}   cpu {reference_cpu:.1f} s")
        print(f"{'new decoder, 1 process, no writing':<40}{decode:>9.1f}{frames / decode:>12,.0f}"
              f"{mib / decode:>9.1f}{reference / decode:>8.2f}   cpu {decode_cpu:.1f} s "
              f"({reference_cpu / decode_cpu:.2f}x less than today's)")
    single_time, single_cpu, _ = best["one"]
    spark_time, spark_cpu, spark_result = best["spark"]
    print(f"{'one process, all tables (baseline)':<40}{single_time:>9.1f}{frames / single_time:>12,.0f}"
          f"{mib / single_time:>9.1f}{1.0:>8.2f}   cpu {single_cpu:.1f} s")
    print(f"{'spark ' + args.master + ', all tables':<40}{spark_time:>9.1f}{frames / spark_time:>12,.0f}"
          f"{mib / spark_time:>9.1f}{single_time / spark_time:>8.2f}   cpu {spark_cpu:.1f} s (driver, JVM, "
          f"Python workers: {spark_cpu / single_cpu:.2f}x one process)")
    print(f"(spark start-up {startup:.1f} s, not included; per-core decoding "
          + (f"{best['today'][0] / decode:.2f}x today's" if "today" in best else "not compared") + ")")
    assert isinstance(spark_result, AnalyzeResult)
    _print_timeline(spark_result)


def _print_timeline(result: AnalyzeResult) -> None:
    """Where the best Spark attempt's time went, per barrier task: each phase's end, its seconds and CPU seconds."""
    if not result.timeline:
        return
    print(f"spark timeline (seconds since the job was submitted; the job took {result.timings['job']:.3f} s):")
    for task, marks in enumerate(result.timeline):
        phases = []
        for (_, before, cpu_before), (phase, moment, cpu) in itertools.pairwise(marks):
            phases.append(f"{phase} {moment:.3f} (+{moment - before:.3f}, cpu {cpu - cpu_before:.3f})")
        print(f"  task {task}: start {marks[0][1]:.3f}; " + "; ".join(phases))


if __name__ == "__main__":
    main()
