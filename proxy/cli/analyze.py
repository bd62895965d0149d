"""``pulsar-tap analyze``: recordings to Parquet tables and a report, on Spark.

Interrupts: the first SIGINT or SIGTERM cancels Spark's jobs; nothing half-written is
left in ``OUT`` (tables are moved into place only when complete), the command says
which tables were written and exits 130 (the result is incomplete).  A second signal
while it stops is ignored.  Exit status: 0 done, 2 bad arguments or an error, 130
interrupted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Final

from proxy.errors import PulsarTapError, UsageError

NAME = "analyze"
HELP = "analyse recordings on Spark: Parquet tables and a latency/throughput/error report"
DESCRIPTION = """\
Read one or many recordings (a recording directory, a parent of several, or a Hadoop
filesystem URL such as hdfs:// or s3a://), decode every frame with pulsar-tap's own
codec on Spark, and write Parquet tables under OUT/: frames, requests (request/
response pairs with latency_us, outcome and error_code), messages (batches split),
errors, throughput (per topic per second) and replication.  A report (latency
percentiles and CDFs, the slowest requests, top topics, errors and throughput over
time, replication lag) is printed and written to OUT/report.txt and OUT/report.html.
Spark runs locally (local[*]) unless --master names a cluster; it needs a Java runtime.
Damaged records are skipped and reported; Ctrl-C stops cleanly (exit 130).

examples:
  pulsar-tap analyze recordings/ --out analysis/
  pulsar-tap analyze rec-a/ rec-b/ --out out/ --since 2026-11-22T10:00:00Z --until 2026-11-22T11:00:00Z
  pulsar-tap analyze recordings/ --out /shared/analysis --master spark://spark-master:7077
  pulsar-tap analyze s3a://bucket/pulsar-tap/ --out s3a://bucket/analysis/ --master spark://spark-master:7077
  (S3 and HDFS need Hadoop's filesystem jars on Spark's classpath: see deploy/spark/README.md)

exit status: 0 done, 2 bad arguments, inputs or --out, or an error (Spark, the JVM, --strict
and a damaged segment), 130 interrupted (SIGINT/SIGTERM: no table is left half-written)
"""

#: Exit status when interrupted before every table was written (SPEC.md, "Interrupts").
EXIT_INTERRUPTED: Final = 130


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recordings", nargs="+", metavar="REC", help="recording directories, parents or URLs")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="where the tables and reports go (a directory; created if missing)")
    parser.add_argument("--master", metavar="URL",
                        help="Spark master (default: local[*], every core of this machine; under spark-submit, "
                             "the master spark-submit was given)")
    parser.add_argument("--since", metavar="T", help="only rows at or after T (ISO 8601 or Unix seconds)")
    parser.add_argument("--until", metavar="T", help="only rows before T (ISO 8601 or Unix seconds)")
    parser.add_argument("--strict", action="store_true",
                        help="fail on a damaged segment instead of skipping the damaged records and reporting them")
    parser.add_argument("--split-mb", type=_positive, default=8, metavar="MIB",
                        help="local segments are read in byte ranges of about this size, a task each (default: 8)")
    parser.add_argument("--quiet", action="store_true", help="print no progress and no warnings, only the report")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


class Interrupted(PulsarTapError):
    """SIGINT or SIGTERM arrived while the pipeline ran."""


class _Stopper:
    """Turns the first SIGINT/SIGTERM into a cancel of Spark's jobs; later ones are ignored."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._cancel: Callable[[], None] | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stopper:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def reinstall(self) -> None:
        """Take SIGINT back: creating a SparkContext installs PySpark's own handler (KeyboardInterrupt)."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def check(self) -> None:
        """Raise :class:`Interrupted` if a signal came (called between the pipeline's steps)."""
        if self.signal:
            raise Interrupted("interrupted")

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if self.signal is not None else handler)

    def cancel_with(self, cancel: Callable[[], None] | None) -> None:
        self._cancel = cancel

    def finishing(self) -> None:
        """Every table is written: a signal from now on is ignored (the reports take a moment)."""
        self.signal = self.signal or 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signal is not None:
            return  # already stopping, or finishing
        self.signal = signum
        cancel = self._cancel
        if cancel is not None:
            # Not from the handler itself: the main thread may be inside a Py4J call.
            threading.Thread(target=_quietly, args=(cancel,), name="cancel-spark-jobs", daemon=True).start()
        else:
            raise Interrupted("interrupted")


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception:  # the JVM may be going away at the same moment
        return


@contextmanager
def _muted(quiet: bool) -> Iterator[Any]:
    stream = open("/dev/null", "w") if quiet else sys.stderr  # noqa: SIM115 - closed below
    try:
        yield stream
    finally:
        if quiet:
            stream.close()


def run(args: argparse.Namespace) -> int:
    from proxy.analytics.connections import TimeWindow
    from proxy.analytics.inputs import AnalyticsError, check_output, resolve_inputs
    from proxy.analytics.pipeline import parse_time

    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until) if args.until else None
    if since is not None and until is not None and since >= until:
        raise UsageError("--since must be earlier than --until")
    try:  # bad inputs and outputs are found before any work starts
        inputs = resolve_inputs(args.recordings)
        out = check_output(args.out, inputs)
    except AnalyticsError as exc:
        raise UsageError(str(exc)) from None
    with _Stopper() as stopper:
        try:
            return _analyze(args, inputs, out, TimeWindow(since, until), stopper)
        except Exception:
            if stopper.signal is None:
                raise
            # whatever the cancelled job raised, the cause is the signal
        name = signal.Signals(stopper.signal).name if stopper.signal else "signal"
        print(f"pulsar-tap analyze: interrupted ({name}): no table written; "
              f"{out} holds no partial tables", file=sys.stderr)
        return EXIT_INTERRUPTED


def _analyze(args: argparse.Namespace, inputs: list[str], out: str, window: Any, stopper: _Stopper) -> int:
    from proxy.analytics.inputs import is_url
    from proxy.analytics.pipeline import run_pipeline
    from proxy.analytics.report import html_report, text_report
    from proxy.analytics.spark import StageProgress, elapsed_since, spark_session

    started = time.monotonic()
    with spark_session(args.master) as spark, _muted(args.quiet) as stream:
        stopper.reinstall()
        stopper.cancel_with(spark.sparkContext.cancelAllJobs)
        stopper.check()
        with StageProgress(spark, stream, before_step=stopper.check) as progress:
            result = run_pipeline(spark, inputs, out, window=window, strict=args.strict, progress=progress,
                                  split_bytes=args.split_mb * 2**20)
        stopper.finishing()
    text = text_report(result)
    sys.stdout.write(text)
    if not is_url(out):
        (Path(out) / "report.txt").write_text(text, encoding="utf-8")
        (Path(out) / "report.html").write_text(html_report(result), encoding="utf-8")
        print(f"tables: {', '.join(result.written)}; reports: {Path(out) / 'report.txt'}, "
              f"{Path(out) / 'report.html'} ({elapsed_since(started)})")
    if not args.quiet:
        report = "the report printed above" if is_url(out) else str(Path(out) / "report.txt")
        for line in skipped_warnings(result.figures.skipped, report):
            print(f"pulsar-tap analyze: warning: {line}", file=sys.stderr)
    return 0


#: the skipped ranges named one per line on stderr; the rest are counted (the report lists them all)
WARNINGS_NAMED: Final = 3


def skipped_warnings(problems: list[str], report: str) -> list[str]:
    """What analyze warns of on stderr: the first few skipped ranges, then how many more ``report`` names
    (a recording damaged in a thousand places is a few lines, as ``show`` and ``export`` say it in one)."""
    lines = problems[:WARNINGS_NAMED]
    if len(problems) > WARNINGS_NAMED:
        more = len(problems) - WARNINGS_NAMED
        lines.append(f"and {more} more problem{'s' if more != 1 else ''} with the input: all in {report}")
    return lines
