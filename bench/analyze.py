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
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from proxy.analytics import compiled
from proxy.analytics.pipeline import run_pipeline
from proxy.analytics.reference import reference_tables
from proxy.analytics.spark import spark_session
from proxy.analytics.steps import analyze_in_process
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


def _tree_cpu(root: int) -> float:
    """CPU seconds (user + system) used so far by process ``root`` and every process under it."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        used[pid] = (int(fields[11]) + int(fields[12])) / tick
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += used.get(pid, 0.0)
        stack += [child for child, parent in parents.items() if parent == pid]
    return total


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

    return "; ".join(f"{name.rsplit('.', 1)[1]} {state}" for name, state in sorted(compiled.STATES.items()))


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


def _measured(work: Callable[[], object], jvm: int | None = None) -> tuple[float, float]:
    """Wall-clock and CPU seconds of ``work()`` (with ``jvm``: that process's tree's CPU seconds too)."""
    start, cpu, jvm_cpu = time.perf_counter(), time.process_time(), _tree_cpu(jvm) if jvm is not None else 0.0
    work()
    used = time.process_time() - cpu + (_tree_cpu(jvm) - jvm_cpu if jvm is not None else 0.0)
    return time.perf_counter() - start, used


def _best_of(arms: dict[str, Callable[[], tuple[float, float]]], repeat: int) -> dict[str, list[tuple[float, float]]]:
    """Each arm ``repeat`` times, interleaved A B B A ... so that drift in the machine's load hits both alike."""
    attempts: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
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

    def one_process() -> None:
        shutil.rmtree(work / "one", ignore_errors=True)
        analyze_in_process([str(path.parent)], str(work / "one"))

    def on_spark() -> None:
        shutil.rmtree(work / "spark", ignore_errors=True)
        run_pipeline(spark, [str(path.parent)], str(work / "spark"))  # type: ignore[arg-type]

    jvm = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[attr-defined]
    per_core: dict[str, Callable[[], tuple[float, float]]] = {
        # every step, every row, nothing written: today's pass's work
        "new": lambda: _measured(lambda: analyze_in_process([str(path.parent)], None))}
    if not args.skip_reference:
        per_core = {"today": lambda: _measured(lambda: reference_tables([path])), **per_core}
    attempts = _best_of(per_core, args.repeat)
    attempts.update(_best_of({"one": lambda: _measured(one_process),
                              "spark": lambda: _measured(on_spark, jvm)}, args.repeat))
    best = {name: min(values) for name, values in attempts.items()}
    print(f"\nrun {run} (load average {os.getloadavg()[0]:.2f}; best of {args.repeat}, alternating; attempts: "
          + "; ".join(f"{name} " + " ".join(f"{wall:.2f}" for wall, _ in values) for name, values in attempts.items())
          + " s)")
    print(f"{'pass':<40}{'seconds':>9}{'frames/s':>12}{'MiB/s':>9}{'ratio':>8}")
    decode, decode_cpu = best["new"]
    if "today" in best:
        reference, reference_cpu = best["today"]
        print(f"{'today decoder, 1 process (baseline)':<40}{reference:>9.1f}{frames / reference:>12,.0f}"
              f"{mib / reference:>9.1f}{1.0:>8.2f}   cpu {reference_cpu:.1f} s")
        print(f"{'new decoder, 1 process, no writing':<40}{decode:>9.1f}{frames / decode:>12,.0f}"
              f"{mib / decode:>9.1f}{reference / decode:>8.2f}   cpu {decode_cpu:.1f} s "
              f"({reference_cpu / decode_cpu:.2f}x less than today's)")
    single_time, single_cpu = best["one"]
    spark_time, spark_cpu = best["spark"]
    print(f"{'one process, all tables (baseline)':<40}{single_time:>9.1f}{frames / single_time:>12,.0f}"
          f"{mib / single_time:>9.1f}{1.0:>8.2f}   cpu {single_cpu:.1f} s")
    print(f"{'spark ' + args.master + ', all tables':<40}{spark_time:>9.1f}{frames / spark_time:>12,.0f}"
          f"{mib / spark_time:>9.1f}{single_time / spark_time:>8.2f}   cpu {spark_cpu:.1f} s (driver, JVM, "
          f"Python workers: {spark_cpu / single_cpu:.2f}x one process)")
    print(f"(spark start-up {startup:.1f} s, not included; per-core decoding "
          + (f"{best['today'][0] / decode:.2f}x today's" if "today" in best else "not compared") + ")")


if __name__ == "__main__":
    main()
