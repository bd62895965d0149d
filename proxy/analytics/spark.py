"""Starting Spark for the analytics pipeline, and showing its progress.

Spark runs on a JVM: without a Java runtime the pipeline stops with one clear
line instead of a Py4J traceback.  Executors run this same Python (so they can
import the project's codec).  A daemon thread polls Spark's status tracker and
draws one progress line per running stage on a terminal, or prints a line per
finished stage otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

from proxy.analytics.inputs import AnalyticsError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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


#: log4j2 configuration for the driver: Spark's own INFO/WARN chatter off, errors kept.
_LOG4J: Final = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


@contextmanager
def _jvm_stderr(log: Path) -> Iterator[None]:
    """While the JVM starts (it inherits file descriptor 2), point stderr at ``log``.

    The JVM then writes its start-up notes and log lines there, not on the terminal;
    Python's own stderr is restored as soon as the JVM is up.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


@contextmanager
def spark_session(master: str | None = None, app_name: str = "pulsar-tap analyze",
                  shuffle_partitions: int | None = None, log_dir: Path | None = None) -> Iterator[SparkSession]:
    """A SparkSession for the pipeline, stopped on exit.

    ``master`` None means: the one ``spark-submit`` was given when it runs us (its
    gateway is already up), else ``local[*]``.

    The JVM's own output (start-up warnings, Spark's log at level ERROR) goes to
    ``log_dir/spark.log`` (a temporary directory unless given), never to the terminal.
    Memory is Spark's default unless ``PULSAR_TAP_SPARK_DRIVER_MEMORY`` or
    ``PULSAR_TAP_SPARK_EXECUTOR_MEMORY`` say otherwise.
    """
    import tempfile

    find_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # launched by spark-submit, which set the master
    if master is None and not submitted:
        master = "local[*]"
    with tempfile.TemporaryDirectory(prefix="pulsar-tap-spark-") as scratch:
        logs = log_dir or Path(scratch)
        (logs / "log4j2.properties").write_text(_LOG4J, encoding="utf-8")
        java_options = f"-Dlog4j.configurationFile=file:{logs / 'log4j2.properties'}"
        # The driver only plans and schedules (the work is in Python, and on one machine the driver is the
        # executor too): the JIT's first tier is enough, and the second tier's compiling cost more CPU
        # than the jobs it would speed up (bench/analyze.py: 2.5 of 3.7 JVM CPU seconds per pass, and
        # half of the start-up).
        driver_options = f"{java_options} -XX:TieredStopAtLevel=1"
        builder = SparkSession.builder if master is None else SparkSession.builder.master(master)
        builder = (
            builder.appName(app_name)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.driver.extraJavaOptions", driver_options)
            .config("spark.executor.extraJavaOptions", java_options)
            .config("spark.local.dir", str(Path(scratch) / "local"))
        )
        for setting, variable in (("spark.driver.memory", "PULSAR_TAP_SPARK_DRIVER_MEMORY"),
                                  ("spark.executor.memory", "PULSAR_TAP_SPARK_EXECUTOR_MEMORY")):
            if os.environ.get(variable):
                builder = builder.config(setting, os.environ[variable])
        # Few shuffle partitions: only narrow rows are shuffled, and the default 200 costs more in
        # task overhead than it gains on a laptop-sized master.
        builder = builder.config("spark.sql.shuffle.partitions",
                                 str(shuffle_partitions or _default_partitions(master or "")))
        try:
            with _jvm_stderr(logs / "spark.log"):
                spark = builder.getOrCreate()
        except Exception as exc:  # Py4J and JVM start-up failures come in many types
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AnalyticsError(f"Spark did not start on master {master or 'given to spark-submit'!r}: "
                                 f"{reason}") from None
        spark.sparkContext.setLogLevel("ERROR")
        try:
            yield spark
        finally:
            with contextlib.suppress(Exception):  # the JVM may already be gone (interrupted)
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

    def __init__(self, spark: SparkSession, stream: TextIO = sys.stderr, interval: float = 0.5,
                 before_step: Callable[[], None] | None = None) -> None:
        self._before_step = before_step
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
        """Name the work that the next Spark jobs do (``before_step`` may refuse to go on: it raises)."""
        if self._before_step is not None:
            self._before_step()
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
