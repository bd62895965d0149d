"""``pulsar-tap analyze``: recordings to Parquet tables and a report, on Spark."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from proxy.errors import UsageError

NAME = "analyze"
HELP = "analyse recordings on Spark: Parquet tables and a latency/throughput/error report"
DESCRIPTION = """\
Read one or many recordings (a recording directory, a parent of several, or any
Hadoop filesystem URL Spark can read), decode every frame with pulsar-tap's own
codec on Spark, and write Parquet tables under OUT/: frames, requests (request/
response pairs with latency_us, outcome and error_code), messages (batches split),
errors, throughput (per topic per second) and replication.  A report with latency
percentiles, top topics, errors and throughput over time is printed and written to
OUT/report.txt and OUT/report.html.  Spark runs locally (local[*]) unless --master
names a cluster; it needs a Java runtime.

examples:
  pulsar-tap analyze recordings/ --out analysis/
  pulsar-tap analyze rec-a/ rec-b/ --out out/ --since 2026-11-22T10:00:00Z --until 2026-11-22T11:00:00Z
  pulsar-tap analyze hdfs://nn:8020/pulsar-tap/ --out hdfs://nn:8020/analysis/ --master spark://spark:7077
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recordings", nargs="+", metavar="REC", help="recording directories, parents or URLs")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the tables and reports go")
    parser.add_argument("--master", default="local[*]", metavar="URL",
                        help="Spark master (default: local[*], this machine)")
    parser.add_argument("--since", metavar="T", help="only frames at or after T (ISO 8601 or Unix seconds)")
    parser.add_argument("--until", metavar="T", help="only frames before T (ISO 8601 or Unix seconds)")
    parser.add_argument("--strict", action="store_true",
                        help="fail on an unreadable segment instead of reporting and skipping it")
    parser.add_argument("--quiet", action="store_true", help="print no progress, only the report")


def run(args: argparse.Namespace) -> int:
    from proxy.analytics.pipeline import parse_time, resolve_inputs, run_pipeline
    from proxy.analytics.report import html_report, text_report
    from proxy.analytics.spark import StageProgress, elapsed_since, spark_session

    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until) if args.until else None
    if since is not None and until is not None and since >= until:
        raise UsageError("--since must be earlier than --until")
    inputs = resolve_inputs(args.recordings)
    started = time.monotonic()
    with spark_session(args.master) as spark:
        stream = open("/dev/null", "w") if args.quiet else sys.stderr  # noqa: SIM115 - closed below
        try:
            with StageProgress(spark, stream) as progress:
                result = run_pipeline(spark, inputs, args.out, since_ns=since, until_ns=until, strict=args.strict,
                                      progress=progress)
        finally:
            if args.quiet:
                stream.close()
    text = text_report(result)
    sys.stdout.write(text)
    if "://" not in args.out or args.out.startswith("file://"):
        out = Path(args.out.removeprefix("file://"))
        (out / "report.txt").write_text(text, encoding="utf-8")
        (out / "report.html").write_text(html_report(result), encoding="utf-8")
        print(f"reports: {out / 'report.txt'}, {out / 'report.html'} ({elapsed_since(started)})")
    for problem in result.problems:
        print(f"pulsar-tap analyze: warning: skipped {problem}", file=sys.stderr)
    return 0
