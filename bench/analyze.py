"""Benchmark: ``pulsar-tap analyze`` on local Spark against a single-process pass.

Writes a synthetic recording (default 200 MiB, many connections), then in one run:
1. the single-process baseline: the same decoding (segment_columns +
   connection_tables, the functions the executors run) in this Python process;
2. the Spark pipeline on local[2] (plus Spark's start-up, shown apart), writing
   every table.
Prints frames/s and MiB/s for both and their ratio.

    .venv/bin/python bench/analyze.py [--mib 200] [--master local[2]]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from pathlib import Path

from proxy.analytics.decode import connection_tables, segment_columns
from proxy.analytics.pipeline import run_pipeline
from proxy.analytics.spark import spark_session
from proxy.analytics.synthetic import write_synthetic_recording


def single_process(path: Path) -> int:
    by_conn: dict[int, list[tuple[int, tuple[object, ...]]]] = collections.defaultdict(list)
    for index, segment in enumerate(sorted(path.glob("segment-*.ptap")), start=1):
        cols = segment_columns(path.name, segment.name, index, segment.read_bytes())
        for i, conn in enumerate(cols["conn_id"]):
            if cols["problem"][i] is None:
                by_conn[conn].append((cols["seq"][i], (
                    cols["ts_ns"][i], cols["direction"][i], cols["origin"][i], cols["size"][i], cols["data"][i],
                    cols["payload_stripped"][i], cols["rules"][i])))
    rows = 0
    for conn, frames in by_conn.items():
        frames.sort(key=lambda item: item[0])
        tables = connection_tables(path.name, conn, [f for _, f in frames]).tables
        rows += sum(len(next(iter(t.values()))) for t in tables.values())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pulsar-tap-bench-"))
    try:
        stats = write_synthetic_recording(work / "in", args.mib * 2**20, connections=max(8, args.mib // 2),
                                          segment_bytes=32 * 2**20)
        mib = stats.bytes / 2**20
        print(f"input: {mib:,.1f} MiB, {stats.frames:,} frames, {stats.messages:,} messages, "
              f"{stats.connections} connections")
        start = time.perf_counter()
        single_process(stats.path)
        single = time.perf_counter() - start
        start = time.perf_counter()
        with spark_session(args.master) as spark:
            startup = time.perf_counter() - start
            start = time.perf_counter()
            run_pipeline(spark, [str(stats.path)], str(work / "out"))
            spark_time = time.perf_counter() - start
        print(f"{'pass':<28}{'seconds':>9}{'frames/s':>12}{'MiB/s':>9}{'ratio':>8}")
        print(f"{'single process (baseline)':<28}{single:>9.1f}{stats.frames / single:>12,.0f}"
              f"{mib / single:>9.1f}{1.0:>8.2f}")
        print(f"{'spark ' + args.master + ', all tables':<28}{spark_time:>9.1f}{stats.frames / spark_time:>12,.0f}"
              f"{mib / spark_time:>9.1f}{single / spark_time:>8.2f}")
        print(f"(spark start-up {startup:.1f} s, not included)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
