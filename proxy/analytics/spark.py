"""Starting Spark for the analytics pipeline, and showing its progress.

Spark runs on a JVM: without a Java runtime the pipeline stops with one clear
line instead of a Py4J traceback.  Executors run this same Python (so they can
import the project's codec).  A daemon thread polls Spark's status tracker and
draws one progress line per running stage on a terminal, or prints a line per
finished stage otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from proxy.errors import PulsarTapError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class AnalyticsError(PulsarTapError):
    """The analytics pipeline cannot run or its input cannot be read."""


def find_java() -> str:
    """The ``java`` executable Spark will use; AnalyticsError when there is none that runs."""
    home = os.environ.get("JAVA_HOME")
    candidate = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not candidate or not Path(candidate).exists():
        raise AnalyticsError("no Java runtime found: Spark needs one (install a JDK 17+, e.g. with "
                             "'bash scripts/setup.sh', or set JAVA_HOME)")
    try:
        subprocess.run([candidate, "-version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise AnalyticsError(f"the Java runtime at {candidate} does not run: {exc}") from None
    return candidate


@contextmanager
def spark_session(master: str = "local[*]", app_name: str = "pulsar-tap analyze",
                  shuffle_partitions: int | None = None) -> Iterator[SparkSession]:
    """A SparkSession for the pipeline, stopped on exit."""
    find_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master).appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", os.environ.get("PULSAR_TAP_SPARK_DRIVER_MEMORY", "4g"))
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
    )
    # Few, larger shuffle partitions: the default 200 costs more in task overhead than it
    # gains on a laptop-sized master; a cluster can raise it with --conf-like env.
    builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions or _default_partitions(master)))
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Py4J and JVM start-up failures come in many types
        raise AnalyticsError(f"Spark did not start on master {master!r}: {str(exc).splitlines()[0]}") from None
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()


def _default_partitions(master: str) -> int:
    match = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]", master)
    if master == "local":
        return 2
    if match:
        cores = os.cpu_count() or 2 if match.group(1) == "*" else int(match.group(1))
        return max(2, cores * 2)
    return 200


class StageProgress:
    """Shows Spark stage progress on ``stream`` while a job runs (a daemon thread polls)."""

    def __init__(self, spark: SparkSession, stream: TextIO = sys.stderr, interval: float = 0.5) -> None:
        self._tracker: Any = spark.sparkContext.statusTracker()
        self._stream = stream
        self._interval = interval
        self._tty = stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spark-progress", daemon=True)
        self._seen: dict[int, tuple[str, int]] = {}
        self._label = ""

    def __enter__(self) -> StageProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._flush_finished(final=True)
        if self._tty:
            self._stream.write("\r\033[K")
            self._stream.flush()

    def step(self, label: str) -> None:
        """Name the work that the next Spark jobs do."""
        self._label = label
        if not self._tty:
            self._stream.write(f"analyze: {label}\n")
            self._stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._draw()
            except Exception:
                return

    def _draw(self) -> None:
        active = []
        for stage_id in self._tracker.getActiveStageIds():
            info = self._tracker.getStageInfo(stage_id)
            if info is None:
                continue
            self._seen[stage_id] = (info.name, info.numTasks)
            active.append((stage_id, info.numCompletedTasks, info.numActiveTasks, info.numTasks))
        self._flush_finished(final=False)
        if self._tty and active:
            parts = []
            for stage_id, done, running, total in active:
                width = 20
                filled = int(width * done / total) if total else width
                parts.append(f"[stage {stage_id} {'#' * filled}{'.' * (width - filled)} {done}+{running}/{total}]")
            self._stream.write(f"\r\033[K{self._label}: {' '.join(parts)}")
            self._stream.flush()

    def _flush_finished(self, *, final: bool) -> None:
        active = set(self._tracker.getActiveStageIds()) if not final else set()
        for stage_id in sorted(set(self._seen) - active):
            _name, tasks = self._seen.pop(stage_id)
            if not self._tty:
                self._stream.write(f"analyze:   stage {stage_id} done ({tasks} tasks)\n")
                self._stream.flush()


def elapsed_since(start: float) -> str:
    return f"{time.monotonic() - start:.1f} s"
